"""Shared builders for hand-made test models."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import shutil
import subprocess
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64}


def benchmark_script(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` loaded as the module ``name``, registered in ``sys.modules`` (a dataclass
    there looks its module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def conv_model(
    op_type: str,
    x_shape: Sequence,
    w_shape: Sequence[int],
    *,
    bias: bool = True,
    elem_type: int = TensorProto.FLOAT,
    opset: int = 17,
    ir_version: int = 8,
    seed: int = 0,
    **attrs,
) -> onnx.ModelProto:
    """One Conv / ConvTranspose followed by Relu, with random weights; output shape left to inference."""
    rng = np.random.default_rng(seed)
    dtype = _NP[elem_type]
    w = rng.standard_normal(w_shape).astype(dtype)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = ["x", "w"]
    if bias:
        out_channels = w_shape[0] if op_type == "Conv" else w_shape[1] * attrs.get("group", 1)
        inits.append(numpy_helper.from_array(rng.standard_normal(out_channels).astype(dtype), "b"))
        inputs.append("b")
    nodes = [
        helper.make_node(op_type, inputs, ["y"], name="conv", **attrs),
        helper.make_node("Relu", ["y"], ["out"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info("x", elem_type, list(x_shape))],
        [helper.make_tensor_value_info("out", elem_type, None)],
        inits,
    )
    # Infer the output shape at a modern opset (old opsets infer less), then build at the requested one.
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out_type = onnx.shape_inference.infer_shapes(probe).graph.output[0].type
    graph.output[0].type.CopyFrom(out_type)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def random_input(shape: Sequence[int], elem_type: int = TensorProto.FLOAT, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(_NP[elem_type])


def silu_model(x_shape: Sequence[int] = (2, 16, 12, 12), seed: int = 0) -> onnx.ModelProto:
    """EfficientNet's pattern: a 1x1 Conv and a depthwise 3x3 Conv, each with bias and SiLU
    (``Mul(y, Sigmoid(y))``, as torch exports it), then a plain Conv whose output is the graph's."""
    rng = np.random.default_rng(seed)
    c = x_shape[1]

    def init(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [init("w1", 2 * c, c, 1, 1, scale=c ** -0.5), init("b1", 2 * c), init("w2", 2 * c, 1, 3, 3, scale=1 / 3),
             init("b2", 2 * c), init("w3", c, 2 * c, 1, 1, scale=(2 * c) ** -0.5), init("b3", c)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="expand"),
        helper.make_node("Sigmoid", ["y1"], ["s1"], name="sig1"),
        helper.make_node("Mul", ["y1", "s1"], ["a1"], name="silu1"),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["y2"], name="dw", group=2 * c, pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["y2"], ["s2"], name="sig2"),
        helper.make_node("Mul", ["s2", "y2"], ["a2"], name="silu2"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["out"], name="project"),
    ]
    return _x_to_out_model(nodes, "silu", x_shape, inits)


def leaky_model(x_shape: Sequence[int] = (2, 8, 12, 12), alphas: Sequence[float | None] = (0.2, 0.1), seed: int = 0,
                join: str = "Add") -> onnx.ModelProto:
    """Conv 3x3 (bias) -> LeakyRelu(alphas[0]) ("c1" -> "l1"), Conv 3x3 of that (bias) ->
    LeakyRelu(alphas[1]) ("c2" -> "l2"; None: no alpha attribute, ONNX's 0.01), both activations
    joined by ``join`` ("j"; the first one read twice): ``"Add"``, or ``"Concat"`` (ESRGAN's dense
    block, where each conv's fused step writes its LeakyRelu's Concat slice), then a 1x1
    Conv whose output is the graph's. Weights scaled so about half of each conv's outputs are negative."""
    rng = np.random.default_rng(seed)
    c = x_shape[1]

    def init(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    def leaky(i, alpha):
        extra = {} if alpha is None else {"alpha": alpha}
        return helper.make_node("LeakyRelu", [f"y{i}"], [f"a{i}"], name=f"l{i}", **extra)

    inits = [init("w1", c, c, 3, 3, scale=(9 * c) ** -0.5), init("b1", c, scale=0.1), init("w2", c, c, 3, 3, scale=(9 * c) ** -0.5),
             init("b2", c, scale=0.1), init("w3", c, (2 if join == "Concat" else 1) * c, 1, 1, scale=(2 * c) ** -0.5), init("b3", c, scale=0.1)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="c1", pads=[1, 1, 1, 1]), leaky(1, alphas[0]),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["y2"], name="c2", pads=[1, 1, 1, 1]), leaky(2, alphas[1]),
        helper.make_node("Concat", ["a1", "a2"], ["cat"], name="j", axis=1) if join == "Concat" else helper.make_node("Add", ["a1", "a2"], ["cat"], name="j"),
        helper.make_node("Conv", ["cat", "w3", "b3"], ["out"], name="c3"),
    ]
    return _x_to_out_model(nodes, "leaky", x_shape, inits)



def csp_block_model(x_shape: Sequence[int] = (2, 16, 12, 12), alpha: float | None = 0.01, *, seed: int = 0, swish: bool = False,
                    residual_first: bool = False, readers: int = 0, stage: bool = False) -> onnx.ModelProto:
    """timm's CSPDarknet residual block (DarkBlock) once its BatchNorms are folded: Conv 1x1 (bias)
    "c1" -> activation "l1" (C -> C/2), Conv 3x3 (bias) "c2" -> activation "l2" (C/2 -> C), then
    the residual ``Add(a2, x)`` "add" (``residual_first``: ``Add(x, a2)``). The activation is a
    LeakyRelu of ``alpha`` (None: no attribute, ONNX's 0.01), or with ``swish`` a SiLU as torch
    exports it (``Mul(y, Sigmoid(y))``). ``readers``: 0, the Add's output is the graph's output
    "out"; 2, a 1x1 Conv "c3" and a Relu "r" read it, joined by an Add into "out". Weights scaled so
    about half of each conv's outputs are negative.

    ``stage`` (``readers`` 0): the block as the first of a CSP stage (timm's CrossStage): the
    expansion Conv 1x1 "exp" -> activation "le" (C -> 2C), a Split "split" of it in two halves
    "xs" and "xb", the block on "xb" (its residual: that half, a channel slice of the expansion's
    output), the transition Conv 1x1 "ctb" -> activation "ltb" of the block's output, a Concat
    "cat" of "xs" and that, and the transition Conv 1x1 "ct" (2C -> C) into "out"."""
    rng = np.random.default_rng(seed)
    c, mid = x_shape[1], x_shape[1] // 2

    def init(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    def act(i):
        if swish:
            return [helper.make_node("Sigmoid", [f"y{i}"], [f"s{i}"], name=f"sig{i}"), helper.make_node("Mul", [f"y{i}", f"s{i}"], [f"a{i}"], name=f"l{i}")]
        return [helper.make_node("LeakyRelu", [f"y{i}"], [f"a{i}"], name=f"l{i}", **({} if alpha is None else {"alpha": alpha}))]

    inits = [init("w1", mid, c, 1, 1, scale=c ** -0.5), init("b1", mid, scale=0.1), init("w2", c, mid, 3, 3, scale=(9 * mid) ** -0.5),
             init("b2", c, scale=0.1), init("w3", c, c, 1, 1, scale=c ** -0.5), init("b3", c, scale=0.1)]
    s = "s" if readers or stage else "out"
    xb = "xb" if stage else "x"
    nodes = [helper.make_node("Conv", [xb, "w1", "b1"], ["y1"], name="c1"), *act(1),
             helper.make_node("Conv", ["a1", "w2", "b2"], ["y2"], name="c2", pads=[1, 1, 1, 1]), *act(2),
             helper.make_node("Add", [xb, "a2"] if residual_first else ["a2", xb], [s], name="add")]
    if stage:
        inits = inits[:4] + [init("we", 2 * c, c, 1, 1, scale=c ** -0.5), init("be", 2 * c, scale=0.1), init("wtb", c, c, 1, 1, scale=c ** -0.5),
                             init("btb", c, scale=0.1), init("wt", c, 2 * c, 1, 1, scale=(2 * c) ** -0.5), init("bt", c, scale=0.1),
                             numpy_helper.from_array(np.array([c, c], np.int64), "halves")]
        nodes = [helper.make_node("Conv", ["x", "we", "be"], ["ye"], name="exp"), *act("e"),
                 helper.make_node("Split", ["ae", "halves"], ["xs", "xb"], name="split", axis=1), *nodes,
                 helper.make_node("Conv", [s, "wtb", "btb"], ["ytb"], name="ctb"), *act("tb"),
                 helper.make_node("Concat", ["xs", "atb"], ["cat"], name="cat", axis=1),
                 helper.make_node("Conv", ["cat", "wt", "bt"], ["out"], name="ct")]
    elif readers:
        nodes += [helper.make_node("Relu", [s], ["r"], name="r"), helper.make_node("Conv", [s, "w3", "b3"], ["y3"], name="c3"),
                  helper.make_node("Add", ["y3", "r"], ["out"], name="join")]
    else:
        inits = inits[:4]
    return _x_to_out_model(nodes, "csp_block", x_shape, inits)


def _x_to_out_model(nodes: list, name: str, x_shape: Sequence[int], inits: list) -> onnx.ModelProto:
    """An opset-17 model of ``nodes``: float input ``x`` and output ``out``, both of ``x_shape``."""
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(x_shape))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model

def residual_block_model() -> onnx.ModelProto:
    """x -> Conv -> Relu -> Conv -> Add(x) -> Relu, biases as initializers (as torch exports it)."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "x"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu2"),
    ]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 14, 14])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 14, 14])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def epilogue_block_model(x_shape: Sequence[int] = (2, 16, 12, 12), seed: int = 0) -> onnx.ModelProto:
    """One conv step per legacy epilogue, as a ResNet stem and basic block export: Conv 3x3 "c0"
    (its output "s" read by "c1" and the Add: ``bias``), Conv 3x3 "c1" -> Relu "r1"
    (``bias+relu``), Conv 3x3 "c2" -> Add(y2, s) "add" -> Relu "r2" (``bias+add+relu``, ResNet's
    order: the residual before the ReLU); C channels throughout, weights scaled so about half of
    each conv's outputs are negative."""
    rng = np.random.default_rng(seed)
    c = x_shape[1]

    def init(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [t for i in range(3) for t in (init(f"w{i}", c, c, 3, 3, scale=(9 * c) ** -0.5), init(f"b{i}", c, scale=0.1))]
    pads = {"pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["s"], name="c0", **pads),
             helper.make_node("Conv", ["s", "w1", "b1"], ["y1"], name="c1", **pads), helper.make_node("Relu", ["y1"], ["a1"], name="r1"),
             helper.make_node("Conv", ["a1", "w2", "b2"], ["y2"], name="c2", **pads),
             helper.make_node("Add", ["y2", "s"], ["sum"], name="add"), helper.make_node("Relu", ["sum"], ["out"], name="r2")]
    return _x_to_out_model(nodes, "epilogue_block", x_shape, inits)


def prepared(model: onnx.ModelProto, shapes: Sequence[str]):
    """``model`` as an onnx-ir model after the optimize pipeline's passes before any decision
    (folding, shapes for ``shapes`` such as ``"x=2x3x8x8"``, the rewrites), on the CPU."""
    from convpass.compiler import pipeline
    from convpass.core.model_io import load_model

    m = load_model(model)
    pipeline.prepare_model(m, pipeline.build_options({}), list(shapes), pipeline.OptimizeReport())
    return m


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def as_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same float16 model computing in float32: its float16 weights, constants, inputs, outputs
    and Casts widened (exactly), intermediate types dropped. ONNX Runtime CPU runs it as the
    reference of a float16 run: the weights are the ones the float16 model computes with, so what
    is left is the float16 arithmetic's error alone."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    graph = wide.graph
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT16:
            graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    del graph.value_info[:]
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.FLOAT
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT16:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
    return wide


@functools.cache
def _gpu_usable() -> bool:
    from convpass.native import device

    return device.detect() is not None


@pytest.fixture(autouse=True)
def _need_gpu(request):
    """A test marked ``gpu`` is skipped, saying why, where no GPU / cuDNN is usable."""
    if request.node.get_closest_marker("gpu") is not None and not _gpu_usable():
        pytest.skip("no usable GPU / cuDNN")


@dataclasses.dataclass(frozen=True)
class CallGeometry:
    """What the executor reads of a ConvGeometry, for tests of its choice with cuDNN stood in for."""

    op_type: str
    spatial_rank: int
    shapes: tuple


def recorded_call(node: str, shape, key, fusion: str, engine: str = "eng5_k2=1"):
    """A ConvCall of the 2-D Conv ``node`` whose recorded decision runs ``engine`` with ``fusion``
    for problem ``key`` (NHWC), as the executor resolves it."""
    from convpass.core import annotation
    from convpass.ops.conv import ConvCall

    d = annotation.ConvDecision(algo="implicit_gemm", engine=engine, fusion=fusion, memory_format="NHWC",
                                math_mode="default", problem_key=str(key))
    return ConvCall(node, CallGeometry("Conv", 2, (shape,)), d)  # type: ignore[arg-type]


def annotated(model: onnx.ModelProto, decisions: dict[str, list], profiles=()) -> onnx.ModelProto:
    """``model`` with its conv nodes annotated by hand (``decisions``: node name -> its
    :class:`~convpass.core.annotation.ConvDecision` s), the way the annotate pass does, through
    convpass.core.annotation (a model tuned on an H200)."""
    from convpass.core import annotation

    model = onnx.ModelProto.FromString(model.SerializeToString())
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    used = set()
    for node in model.graph.node:
        if node.name in decisions:
            node.domain = annotation.DOMAIN
            for name, value in annotation.decision_attributes(decisions[node.name]).items():
                node.attribute.append(helper.make_attribute(name, value))
            used.add(node.op_type)
    for op in sorted(used):
        model.functions.append(annotation.conv_function(op, opset))
    model.opset_import.append(helper.make_opsetid(annotation.DOMAIN, annotation.DOMAIN_VERSION))
    info = annotation.ModelInfo(
        schema_version=annotation.SCHEMA_VERSION,
        convpass_version="test",
        device="NVIDIA H200|sm_9.0|132sm|cudnn91900",
        cudnn_version="9.19.0",
        mode="measure",
        profiles=tuple(profiles),
        matmul_allow_tf32=False,
        options={},
    )
    helper.set_model_props(model, annotation.metadata_entries(info))
    return model


def steady_run(tuned: onnx.ModelProto, feeds: dict) -> tuple[list, dict[str, int]]:
    """``tuned`` on the cuda backend without a CUDA graph, run op by op, then as the compiled
    plan's first run (the refusals it meets learned), then once more: that run's outputs and what
    it added to each of the backend's counters (GPU tests of what a steady run launches and copies)."""
    import warnings

    from convpass.runtime import Executor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kernels compiled at start-up: no side-car here
        ex = Executor(tuned, device="cuda", cuda_graph=False)
        for _ in range(2):
            ex.run(None, feeds)
        counters = ex.backend.counters
        before = dict(counters)
        outputs = ex.run(None, feeds)
    return outputs, {name: counters[name] - before.get(name, 0) for name in counters}


@pytest.fixture
def need_graph_api():
    """For GPU tests of cuDNN's graph-API engines: skipped, saying why, where the frontend is
    unusable (``pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_graph_api")]``)."""
    from convpass.native.cudnn import graph_api

    why = graph_api.unavailable()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def need_cuda_backend():
    """For GPU tests that run the executor's cuda backend: skipped, saying why, where it is unusable
    (``pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]``)."""
    from convpass.runtime import cuda

    reason = cuda.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuda backend unusable: {reason}")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own tuning cache; nobody's real cache is touched."""
    monkeypatch.setenv("CONVPASS_CACHE", str(tmp_path / "tuning.db"))


def panel_models() -> list[str]:
    """The benchmark panel's model names, in panel order, read from ``models/export_panel.py``
    (importing it needs only the standard library), so the tests never drift from the exporter."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_export_panel_names", MODELS / "export_panel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.panel_names()


# ---------------------------------------------------------------------------------------------
# cuDNN's graph API on the CPU (tests/test_graph_api.py, tests/test_fused_epilogues.py)

class _FakeFrontend:
    """Offers plans per heuristic mode, by name, as cuDNN's frontend does; records every call."""

    def __init__(self, offers):
        import types

        self.offers = offers  # mode -> plan names
        self.calls = []
        self.heur_mode = types.SimpleNamespace(A="A", B="B", FALLBACK="FALLBACK")
        self.data_type = types.SimpleNamespace(FLOAT="f32", HALF="f16", BFLOAT16="bf16")
        fe = self

        class Graph:
            def __init__(self, **kw):
                self.plans = []
                fe.calls.append(("graph", kw.get("io_data_type")))

            def tensor(self, name, dim, stride, data_type):
                fe.calls.append(("tensor", name, tuple(dim), tuple(stride)))
                return _FakeTensor({"x": 1, "w": 2, "b": 4, "z": 8}[name])

            def conv_fprop(self, image, weight, padding, stride, dilation, compute_data_type, name):
                fe.calls.append(("conv", tuple(padding), tuple(stride), tuple(dilation)))
                return _FakeTensor(3)

            def bias(self, input, bias, name):
                fe.calls.append(("bias", bias.uid))
                return _FakeTensor(5)

            def swish(self, input, name):
                fe.calls.append(("swish",))
                return _FakeTensor(6)

            def leaky_relu(self, input, negative_slope, name):
                fe.calls.append(("leaky_relu", negative_slope))
                return _FakeTensor(6)

            def relu(self, input, name):
                fe.calls.append(("relu", input.uid))
                return _FakeTensor(6)

            def add(self, a, b, name):
                fe.calls.append(("add", a.uid, b.uid))
                return _FakeTensor(7)

            def validate(self):
                pass

            def build_operation_graph(self):
                pass

            def create_execution_plans(self, modes):
                fe.calls.append(("plans", tuple(modes)))
                self.plans = [n for m in modes for n in fe.offers.get(m, [])]
                if not self.plans:
                    raise RuntimeError("cudnnGraphNotSupportedError: no engine")

            def get_execution_plan_count(self):
                return len(self.plans)

            def get_plan_name_at_index(self, i):
                return self.plans[i]

            def build_plan_at_index(self, i):
                if self.plans[i].startswith("eng13"):
                    raise RuntimeError("Finalizing the engine config failed: CUDNN_STATUS_NOT_SUPPORTED")
                fe.calls.append(("build", self.plans[i]))

            def get_workspace_size_plan_at_index(self, i):
                return 1024

            def execute_plan_at_index(self, pack, ws, index, handle):
                fe.calls.append(("execute", self.plans[index], tuple(sorted(pack.values())), ws))

            def serialize(self):  # the last plan built, as the frontend stores its candidate
                built = [c[1] for c in fe.calls if c[0] == "build"]
                return list(("stored " + built[-1]).encode())

            def deserialize(self, handle, data):
                if not bytes(data).startswith(b"stored "):
                    raise RuntimeError("CUDNN_STATUS_BAD_PARAM: not a plan")
                self.loaded = bytes(data).decode().removeprefix("stored ")
                fe.calls.append(("deserialize", self.loaded))

            def execute(self, pack, ws, handle):
                fe.calls.append(("execute", self.loaded, tuple(sorted(pack.values())), ws))

        self.pygraph = Graph

    __version__ = "fake"

    def backend_version(self):
        return 91900

    def create_handle(self):
        return "handle"

    def set_stream(self, handle, stream):
        self.calls.append(("stream", stream))


class _FakeTensor:
    def __init__(self, uid):
        self.uid = uid

    def get_uid(self):
        return self.uid

    def set_output(self, flag):
        return self

    def set_dim(self, dim):
        return self

    def set_stride(self, stride):
        return self

    def set_data_type(self, dt):
        return self


def no_plan_side_car(monkeypatch, stored=None, recorded=None):
    """The executor's stored cuDNN plans stood in for: ``stored`` (plan id -> KernelEntry) is the
    side-car in use, ``recorded`` (a list) collects what a recording side-car would store."""
    from convpass.native import prebuilt
    from convpass.native.cudnn import graph_api

    monkeypatch.setattr(graph_api, "plan_id", lambda key, config: f"plan-{config.algo}")
    monkeypatch.setattr(prebuilt, "stored", lambda ident: (stored or {}).get(ident))
    monkeypatch.setattr(prebuilt, "recording_active", lambda: recorded is not None)
    monkeypatch.setattr(prebuilt, "record_entry", lambda ident, name, payload: recorded.append((ident, name, payload)) if recorded is not None else None)


@pytest.fixture
def frontend(monkeypatch):
    """nvidia-cudnn-frontend and CuPy's device / stream calls, stood in for on the CPU."""
    import sys
    import types

    from convpass.native.cudnn import graph_api

    fe = _FakeFrontend({"A": ["eng5", "eng67_k2=16_k13=0"], "B": ["eng67_k2=16_k13=0", "eng20001", "eng13_k3=1"],
                        "FALLBACK": ["eng0", "eng28_k2=4_k3=0"]})
    fake_cp = types.ModuleType("cupy")
    fake_cp.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0),
                                         get_current_stream=lambda: types.SimpleNamespace(ptr=77))
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(graph_api, "_frontend", lambda: fe)
    monkeypatch.setattr(graph_api, "unavailable", lambda: None)
    monkeypatch.setattr(graph_api._handles, "by_device", {}, raising=False)
    return fe


def plans_stood_in(monkeypatch, plan_class):
    """``graph_api.EnginePlan`` replaced by ``plan_class`` (a test's stand-in with class lists
    ``seen`` and counters ``refusals``), both reset; returns it."""
    from convpass.native.cudnn import graph_api

    monkeypatch.setattr(graph_api, "EnginePlan", plan_class)
    monkeypatch.setattr(plan_class, "seen", [])
    monkeypatch.setattr(plan_class, "refusals", 0)
    return plan_class


def offer_configs(monkeypatch, configs) -> None:
    """cuDNN's graph API stood in for: ``configs(key, fusion)`` gives the engine configurations
    the tuner enumerates for a key (or raises as enumeration would)."""
    import types

    from convpass.native.cudnn import graph_api

    def enumerate_configs(key, fusion=""):
        found = configs(key, fusion)
        return types.SimpleNamespace(key=key, fusion=fusion, configs=lambda: list(found))

    monkeypatch.setattr(graph_api, "enumerate_configs", enumerate_configs)


def numpy_shape_bench(monkeypatch, shape, fill: float = 0.5, x_value: float = 1.0, **cupy_functions):
    """The tuner's :class:`~convpass.tuning.shape_bench.ShapeBench` for ``shape`` over NumPy
    stand-ins for CuPy and the harness's arrays (no timing: a test sets ``harness.time_launches``).
    Inputs are filled with ``fill``, ``x`` with ``x_value``; the reference is what a conv of
    all-ones weights gives (``x.sum()``); ``cupy_functions``: what the fake ``cupy`` module offers
    besides ``empty`` and ``uint8``. The epilogue pass of the execution objects
    (:func:`convpass.kernels.conv_exec.apply_epilogue`) runs NumPy arithmetic in place of its CuPy kernel."""
    import sys
    import types

    from convpass.kernels import conv_exec
    from convpass.tuning import harness, shape_bench

    fake_cp = types.ModuleType("cupy")
    fake_cp.empty, fake_cp.uint8 = np.empty, np.uint8
    for name, fn in cupy_functions.items():
        setattr(fake_cp, name, fn)
    fake_cp.cuda = fake_cuda([])
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(harness, "rotation_sets", lambda nbytes: 1)
    monkeypatch.setattr(harness, "random_array", lambda dims, dtype, layout, seed: np.full(dims, fill, np.float32))
    monkeypatch.setattr(harness, "to_float32", lambda a, dtype: np.asarray(a, np.float32))
    monkeypatch.setattr(harness, "first_launch_ms", lambda launch: (launch(), 0.0)[1])
    monkeypatch.setattr(harness, "relative_error",
                        lambda out, ref: float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else float("inf"))
    monkeypatch.setattr(conv_exec, "epilogue_kernel", numpy_epilogue_kernel)
    x = np.full(shape.x_shape, x_value, np.float32)
    bench = object.__new__(shape_bench.ShapeBench)
    bench._groups, bench._sets = {}, {}
    bench.shape, bench.x_slice, bench.y_slice, bench.z_slice = shape, None, None, None
    bench._base = {"x": x, "w": np.ones(shape.w_shape, np.float32), "y": np.empty(shape.y_shape, np.float32)}
    bench.reference = lambda: np.full(shape.y_shape, x.sum(), np.float32)
    sets = [dict(bench._base)]
    bench.buffers = lambda layout, count: sets
    return bench


def fake_cuda(log: list, capturing: list | None = None) -> Any:
    """``cupy.cuda`` stood in for: what :func:`convpass.native.cuda.stream_fence` calls, each memset
    of a fence appended to ``log`` as ``("fence", nbytes)``; the current stream is capturing while
    ``capturing`` (a one-item list the test flips) holds True."""
    runtime = types.SimpleNamespace(getDevice=lambda: 0, malloc=lambda nbytes: 4096,
                                    memsetAsync=lambda ptr, value, nbytes, stream: log.append(("fence", nbytes)))
    state = capturing if capturing is not None else [False]
    return types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=MemoryError), runtime=runtime,
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=0, is_capturing=lambda: state[0]))


def numpy_candidates(monkeypatch, shape, fill: float = 0.5, x_value: float = 1.0, **cupy_functions):
    """The tuner's per-family :class:`~convpass.tuning.candidates.Candidates` over
    :func:`numpy_shape_bench`."""
    from convpass.tuning.candidates import Candidates

    return Candidates(numpy_shape_bench(monkeypatch, shape, fill, x_value, **cupy_functions))


def numpy_epilogue_kernel(cp, bias: bool, residual: bool, relu: bool):
    """:func:`convpass.kernels.conv_exec.epilogue_kernel` in NumPy: ``y = act(y + b + z)`` in place
    over the operands given (broadcast to ``y``), a ReLU that keeps NaN."""

    def run(*args):
        *operands, y = args
        v = y + sum(operands) if operands else y.copy()
        y[...] = np.where(v < 0, 0, v) if relu else v

    return run


CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")

_SHIM = r"""
#include <cmath>
#include <cstring>
#include <algorithm>
using std::min; using std::max;
struct Dim3 { unsigned x, y, z; };
static Dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
static inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
#define __shfl_xor_sync(mask, v, o) (v)
#define __syncthreads()
#define __launch_bounds__(...)
"""


def host_library(tmp_path, code: str, name: str) -> ctypes.CDLL:
    """A CUDA kernel source whose kernels need no warp or block cooperation, compiled as host C++
    (``__global__`` and friends defined away; launch it as one thread that strides over all work)."""
    if CXX is None:
        pytest.fail("no C++ compiler (g++, c++ or clang++) to check the kernel code with")
    src = tmp_path / f"{name}.cpp"
    src.write_text(_SHIM + code.replace('extern "C"', 'extern "C"').replace("#include <cuda_fp16.h>", _HOST_HALF))
    lib = tmp_path / f"lib{name}.so"
    subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def host_args(args) -> list:
    """A kernel launch's arguments as ctypes values for the host-compiled kernel (:func:`host_library`):
    arrays as pointers, numpy uint32 / int32 / float32 as such, anything else as a 64-bit integer."""
    out = []
    for a in args:
        if isinstance(a, np.ndarray):
            out.append(ctypes.c_void_p(a.ctypes.data))
        elif isinstance(a, np.uint32):
            out.append(ctypes.c_uint(int(a)))
        elif isinstance(a, np.int32):
            out.append(ctypes.c_int(int(a)))
        elif isinstance(a, np.float32):
            out.append(ctypes.c_float(float(a)))
        else:
            out.append(ctypes.c_longlong(int(a)))
    return out


_SETTER = ('\nextern "C" void set_index(unsigned bx, unsigned by, unsigned tx, unsigned ty, unsigned bdx, unsigned bdy, unsigned gdx, '
           'unsigned gdy) { blockIdx.x = bx; blockIdx.y = by; threadIdx.x = tx; threadIdx.y = ty; blockDim.x = bdx; blockDim.y = bdy; '
           'gridDim.x = gdx; gridDim.y = gdy; }\n')


@pytest.fixture(scope="module")
def host_entry(tmp_path_factory):
    """``entry(source, name)`` for the fused normalization kernels (convpass.kernels.group_norm and
    group_norm_apply): the source compiled as host C++, launched block by block and thread by thread
    (the statistics kernels in blocks of one thread: their block cooperation is trivial then; the
    element-wise ones at any block size)."""
    libs = {}
    d = tmp_path_factory.mktemp("group_norm")

    def lib_for(src):
        if src.name not in libs:
            libs[src.name] = host_library(d, "using namespace std;\n" + src.code + _SETTER, src.name)
        return libs[src.name]

    def entry(src, name):
        lib = lib_for(src)
        kernel = getattr(lib, name)

        def launch(grid, block_, args):
            conv = host_args(args)
            gx, gy = (*grid, 1)[:2]
            bx, by = (*block_, 1)[:2]
            assert bx * by == 1 or name.startswith(("convpass_broadcast", "gn_apply")), "threads of one block run in turn"
            for j in range(gy):
                for i in range(gx):
                    for ty in range(by):
                        for tx in range(bx):
                            lib.set_index(i, j, tx, ty, bx, by, gx, gy)
                            kernel(*conv)
        return launch

    return entry


_BLOCK_SHIM = r"""
#include <cmath>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
using std::min; using std::max;
struct Dim3 { unsigned x, y, z; };
static Dim3 blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static thread_local Dim3 threadIdx = {0, 0, 0};
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
static std::mutex bar_mutex;
static std::condition_variable bar_cv;
static unsigned bar_waiting = 0, bar_size = 1, bar_generation = 0;
static int bar_broken = 0;
static void host_syncthreads() {  // a block barrier; one that times out marks the launch broken
    std::unique_lock<std::mutex> lock(bar_mutex);
    const unsigned generation = bar_generation;
    if (++bar_waiting == bar_size) { bar_waiting = 0; ++bar_generation; bar_cv.notify_all(); return; }
    if (!bar_cv.wait_for(lock, std::chrono::seconds(20), [&] { return generation != bar_generation; })) bar_broken = 1;
}
#define __syncthreads() host_syncthreads()
"""

# cuda_fp16.h's __half for host builds: float16 storage (_Float16, round to nearest even), float math
_HOST_HALF = r"""
struct __half {
    _Float16 h;
    __half() = default;
    __half(float f) : h((_Float16)f) {}
    operator float() const { return (float)h; }
};
static inline float __half2float(__half v) { return (float)v; }
static inline __half __float2half_rn(float f) { return __half(f); }
"""

_BLOCK_SETTERS = ('\nextern "C" void set_block(unsigned bx, unsigned by, unsigned bdx, unsigned bdy, unsigned gdx, unsigned gdy) { '
                  'blockIdx.x = bx; blockIdx.y = by; blockDim.x = bdx; blockDim.y = bdy; gridDim.x = gdx; gridDim.y = gdy; '
                  'bar_size = bdx * bdy; bar_waiting = 0; }\n'
                  'extern "C" void set_thread(unsigned tx, unsigned ty) { threadIdx.x = tx; threadIdx.y = ty; }\n'
                  'extern "C" int barrier_broken() { return bar_broken; }\n')


def host_block_library(tmp_path, code: str, name: str) -> ctypes.CDLL:
    """A CUDA kernel source compiled as host C++ whose blocks run as real threads: ``threadIdx``
    per thread, ``__syncthreads`` a barrier of the block's threads, ``__shared__`` one array the
    block's threads share (blocks run one at a time), ``__half`` a host float16. Launch it with
    :func:`host_block_launch`."""
    if CXX is None:
        pytest.fail("no C++ compiler (g++, c++ or clang++) to check the kernel code with")
    src = tmp_path / f"{name}.cpp"
    src.write_text(_BLOCK_SHIM + "using namespace std;\n" + code.replace("#include <cuda_fp16.h>", _HOST_HALF) + _BLOCK_SETTERS)
    lib = tmp_path / f"lib{name}.so"
    subprocess.run([CXX, "-O1", "-std=c++17", "-pthread", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def host_block_launch(lib: ctypes.CDLL, name: str, grid, block_, args) -> None:
    """Launch entry ``name`` of a :func:`host_block_library` build: block by block, each block's
    threads at once (ctypes lets go of the GIL during the calls), so its barriers are real."""
    import threading

    kernel = getattr(lib, name)
    conv = host_args(args)
    gx, gy = (*grid, 1)[:2]
    bx, by = (*block_, 1)[:2]

    def thread(tx: int, ty: int) -> None:
        lib.set_thread(tx, ty)
        kernel(*conv)

    for j in range(gy):
        for i in range(gx):
            lib.set_block(i, j, bx, by, gx, gy)
            threads = [threading.Thread(target=thread, args=(tx, ty)) for ty in range(by) for tx in range(bx)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    assert not lib.barrier_broken(), f"{name}: a block barrier timed out (a thread never reached it)"


@pytest.fixture(scope="module")
def host_block_entry(tmp_path_factory):
    """``entry(source, name)`` like :func:`host_entry`, each block's threads run at once with real
    barriers (:func:`host_block_library`): cooperative kernels at their real block sizes."""
    libs = {}
    d = tmp_path_factory.mktemp("blocks")

    def entry(src, name):
        if src.name not in libs:
            libs[src.name] = host_block_library(d, src.code, src.name)
        lib = libs[src.name]
        return lambda grid, block_, args: host_block_launch(lib, name, grid, block_, args)

    return entry


def newer_schema_cache(path: Path) -> Path:
    """A tuning cache at ``path`` whose schema version says a newer convpass wrote it (checkpointed:
    the database file alone holds it)."""
    import sqlite3

    from convpass.tuning.cache import TuningCache

    with TuningCache(path):
        pass
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value = '99' WHERE name = 'schema_version'")
    c.close()
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    return path


def channels_last_array(shape, rng) -> np.ndarray:
    """A float32 array of logical shape ``shape`` (``(n, c, *spatial)``) stored channels-last: a
    transposed view of a packed ``(n, *spatial, c)`` array."""
    phys = (shape[0], *shape[2:], shape[1])
    data = rng.standard_normal(phys).astype(np.float32)
    return data.transpose(0, len(shape) - 1, *range(1, len(shape) - 1))


class _StandInPlan:  # a graph-API engine plan, built without cuDNN
    def __init__(self, key, config, enumerated=None):
        self.config, self.workspace_bytes = config, 0


@pytest.fixture
def convs(monkeypatch):
    """The executor's :class:`~convpass.kernels.convolution.Convolutions` with cuDNN stood in for (no
    GPU): engine plans, descriptors and workspace sizes faked, warnings collected in ``.warned``."""
    import types

    from convpass.kernels import conv_resources, convolution
    from convpass.native import cudnn
    from convpass.native.cudnn import graph_api

    warned: list[str] = []
    rt = types.SimpleNamespace(cp=None, recorded_device="", current_device=None, warn_node=lambda node, message: warned.append(message))
    monkeypatch.setattr(graph_api, "EnginePlan", _StandInPlan)
    no_plan_side_car(monkeypatch)
    monkeypatch.setattr(conv_resources.ConvResources, "descriptors", lambda self, key: "descs")
    monkeypatch.setattr(cudnn, "workspace_size", lambda descs, direction, algo, **strides: 0)
    c = convolution.Convolutions(rt)
    c.warned = warned  # type: ignore[attr-defined]
    return c


class FakeLibcuda:
    """libcuda's graph functions (``cuX`` implemented as ``_cuX``) over graphs held here: handle ->
    [(from, to, (from_port, to_port, type))]; a clone's nodes are the original's plus 1000. Functions
    in ``missing`` are absent, those in ``failing`` return CUDA_ERROR_INVALID_VALUE; ``calls`` lists
    the calls made."""

    def __init__(self, edge_list, missing=(), failing=()) -> None:
        self.graphs = {1: list(edge_list)}
        self.missing, self.failing = set(missing), set(failing)
        self.calls: list[str] = []
        self.execs: dict[int, list] = {}
        self.destroyed: list[int] = []
        self.launched: list[tuple[int, int]] = []

    def __getattr__(self, name):
        impl = getattr(type(self), f"_{name}", None)
        if impl is None or name in self.missing:
            raise AttributeError(name)
        lib = self

        class Fn:
            def __call__(self, *args):
                lib.calls.append(name)
                return 1 if name in lib.failing else impl(lib, *args)

        return Fn()

    def _cuGraphGetEdges_v2(self, g, frm, to, data, count):
        graph = self.graphs[g.value]
        if frm is not None and not count._obj.value:
            return 1  # as the driver: arrays given for no edges is CUDA_ERROR_INVALID_VALUE
        if frm is not None:
            for i, (a, b, d) in enumerate(graph[:count._obj.value]):
                frm[i], to[i] = a, b
                data[i].from_port, data[i].to_port, data[i].type = d
        count._obj.value = len(graph)
        return 0

    def _cuGraphClone(self, out, g):
        out._obj.value = 2
        self.graphs[2] = [(a + 1000, b + 1000, d) for a, b, d in self.graphs[g.value]]
        return 0

    def _cuGraphRemoveDependencies_v2(self, g, frm, to, data, n):
        for i in range(n.value):
            self.graphs[g.value].remove((frm[i], to[i], (data[i].from_port, data[i].to_port, data[i].type)))
        return 0

    def _cuGraphAddDependencies_v2(self, g, frm, to, data, n):
        assert data is None  # no edge data: default edges
        self.graphs[g.value] += [(frm[i], to[i], (0, 0, 0)) for i in range(n.value)]  # default edges
        return 0

    def _cuGraphInstantiateWithFlags(self, out, g, flags):
        out._obj.value = 100 + len(self.execs)
        self.execs[out._obj.value] = sorted(self.graphs[g.value])
        return 0

    def _cuGraphLaunch(self, exec_, stream):
        self.launched.append((exec_.value, stream.value))
        return 0

    def _cuGraphUpload(self, exec_, stream):
        return 0

    def _cuGraphExecDestroy(self, e):
        self.destroyed.append(e.value)
        return 0

    def _cuGraphDestroy(self, g):
        self.destroyed.append(g.value)
        return 0

    def _cuGetErrorName(self, status, text):
        text._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0
