"""An ``onnx.backend.base.Backend`` over the convpass executor.

Lets ONNX's backend test suite (and anything written against the ONNX backend API) run models
with convpass::

    from convpass.runtime.onnx_backend import ConvpassBackend
    rep = ConvpassBackend.prepare(model, device="CPU")
    outputs = rep.run([x])                 # or a dict {input name: array}

Devices: ``"CPU"`` always; ``"CUDA"`` when the cuda backend is usable on this machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep, namedtupledict

from convpass.core.errors import ExecutorError
from convpass.runtime import devices as _devices
from convpass.runtime.executor import Executor, is_supported


def _device_name(device: str) -> str:
    d = str(device).upper()
    if d.startswith("CUDA"):
        return "cuda"
    if d == "CPU":
        return "cpu"
    raise ExecutorError(f"unknown device {device!r}; the convpass backend knows CPU and CUDA")


class ConvpassBackendRep(BackendRep):
    """A prepared model: ``run(inputs)`` with a list (graph input order) or a dict."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._input_names = [a.name for a in executor.get_inputs()]
        self._output_names = [a.name for a in executor.get_outputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, Mapping):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            inputs = list(inputs)
            if len(inputs) > len(self._input_names):
                raise ExecutorError(f"{len(inputs)} inputs given; the model has {len(self._input_names)}: {self._input_names}")
            feeds = dict(zip(self._input_names, inputs))
        outputs = self.executor.run(None, feeds)
        return namedtupledict("Outputs", self._output_names)(*outputs)


class ConvpassBackend(Backend):
    """ONNX backend API over :class:`convpass.runtime.Executor`."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device) and is_supported(model)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> ConvpassBackendRep:
        super().prepare(model, device, **kwargs)
        options = {k: kwargs[k] for k in ("cuda_graph", "fold_batchnorm", "check_model") if k in kwargs}
        return ConvpassBackendRep(Executor(model, device=_device_name(device), **options))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Any,
        device: str = "CPU",
        outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """Run one node on ``inputs`` (a list in the node's input order, or a dict by input name)."""
        super().run_node(node, inputs, device=device, outputs_info=outputs_info, **kwargs)
        names = [n for n in node.input if n]
        if isinstance(inputs, Mapping):
            arrays = {n: np.asarray(inputs[n]) for n in names}
        else:
            arrays = dict(zip(names, (np.asarray(a) for a in inputs)))
        graph_inputs = [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in arrays.items()
        ]
        outputs = []
        for i, name in enumerate(o for o in node.output if o):
            if outputs_info is not None and i < len(outputs_info):
                dtype, shape = outputs_info[i]
                outputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape))
            else:
                outputs.append(helper.make_empty_tensor_value_info(name))
        graph = helper.make_graph([node], f"run_node_{node.op_type}", graph_inputs, outputs)
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        opsets = [helper.make_opsetid("", opset)]
        if node.domain not in ("", "ai.onnx"):
            opsets.append(helper.make_opsetid(node.domain, 1))
        model = helper.make_model(graph, opset_imports=opsets)
        executor = Executor(model, device=_device_name(device), check_model=False)
        return tuple(executor.run(None, arrays))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            name = _device_name(device)
        except ExecutorError:
            return False
        return name == "cpu" or _devices.cuda_available()


prepare = ConvpassBackend.prepare
run_model = ConvpassBackend.run_model
run_node = ConvpassBackend.run_node
supports_device = ConvpassBackend.supports_device
