"""The executor's checks of what a run is given: the output names asked for and the feeds (names,
dtypes, ranks, fixed and symbolic dims), each fault in one :class:`ExecutorError` naming the input.

Feeds come back as arrays of the backend: a device array (or a CUDA DLPack tensor, adopted without
a copy) is taken as it is; a host array is uploaded when the backend is not the host's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError
from convpass.kernels.backends import Backend
from convpass.runtime.model_graph import ModelGraph, NodeArg


def check_output_names(output_names: Sequence[str] | None, model_outputs: Sequence[str]) -> tuple[str, ...]:
    """The outputs asked for (None: all of ``model_outputs``; a string: that one)."""
    if output_names is None:
        return tuple(model_outputs)
    if isinstance(output_names, str):
        output_names = [output_names]
    unknown = [n for n in output_names if n not in model_outputs]
    if unknown:
        raise ExecutorError(
            f"unknown output name(s) {', '.join(map(repr, unknown))}; the model's outputs are: {', '.join(map(repr, model_outputs))}"
        )
    return tuple(output_names)


def check_feeds(feeds: Mapping[str, Any], graph: ModelGraph, backend: Backend) -> dict[str, Any]:
    """Input name -> array on ``backend``, for each of ``graph``'s inputs (those with initializers
    are constants here: they cannot be fed)."""
    if not isinstance(feeds, Mapping):
        raise ExecutorError(f"feeds must be a dict of input name -> array, not {type(feeds).__name__}")
    inputs = graph.inputs
    unknown = [k for k in feeds if k not in graph.input_map]
    if unknown:
        over = [k for k in unknown if k in graph.overridable]
        if over:
            raise ExecutorError(
                f"input(s) {', '.join(map(repr, over))} have initializers, which the convpass executor treats as constants; "
                "they cannot be fed"
            )
        raise ExecutorError(f"unknown input name(s) {', '.join(map(repr, unknown))}; the model's inputs are: {_describe(inputs)}")
    missing = [a.name for a in inputs if a.name not in feeds]
    if missing:
        raise ExecutorError(f"missing input(s) {', '.join(map(repr, missing))}; the model's inputs are: {_describe(inputs)}")
    arrays: dict[str, Any] = {}
    symbols: dict[str, tuple[int, str, int]] = {}
    xp = backend.xp
    for arg in inputs:
        value = feeds[arg.name]
        if not isinstance(value, (np.ndarray, xp.ndarray)) and xp is not np:
            adopted = backend.adopt(value)
            if adopted is not None:
                value = adopted
        if not isinstance(value, (np.ndarray, xp.ndarray)):
            try:
                value = np.asarray(value)
            except Exception as e:  # noqa: BLE001
                raise ExecutorError(f"input {arg.name!r}: cannot convert {type(value).__name__} to an array: {e}") from None
        if value.dtype != arg.dtype:
            raise ExecutorError(
                f"input {arg.name!r} has dtype {value.dtype}; the model expects {arg.dtype} ({arg.type})"
            )
        shape = tuple(int(d) for d in value.shape)
        if arg.shape is not None and len(arg.shape) != len(shape):
            raise ExecutorError(
                f"input {arg.name!r} has rank {len(shape)} (shape {shape}); the model expects rank {len(arg.shape)} "
                f"(shape {_fmt_shape(arg.shape)})"
            )
        for i, (want, got) in enumerate(zip(arg.shape or [], shape)):
            if isinstance(want, int) and want != got:
                raise ExecutorError(
                    f"input {arg.name!r} dim {i} is {got}; the model expects {want} (shape {_fmt_shape(arg.shape)}, got {shape})"
                )
            if isinstance(want, str) and want:
                seen = symbols.get(want)
                if seen is not None and seen[2] != got:
                    raise ExecutorError(
                        f"input {arg.name!r} dim {i} ({want!r}) is {got}, but input {seen[1]!r} dim {seen[0]} ({want!r}) is {seen[2]}"
                    )
                symbols.setdefault(want, (i, arg.name, got))
        if xp is np or not isinstance(value, np.ndarray):
            arrays[arg.name] = value
        else:
            arrays[arg.name] = backend.upload_input(value)
    return arrays


def on_device(value: Any, xp: Any) -> bool:
    """Whether a feed is a device array: an ``xp`` array or a CUDA DLPack tensor."""
    if isinstance(value, np.ndarray):
        return False
    if isinstance(value, xp.ndarray):
        return True
    probe = getattr(value, "__dlpack_device__", None)
    if probe is None:
        return False
    try:
        return int(probe()[0]) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
    except Exception:  # noqa: BLE001
        return False


def _describe(inputs: Sequence[NodeArg]) -> str:
    return ", ".join(f"{a.name!r} ({a.type} {_fmt_shape(a.shape)})" for a in inputs) or "(none)"


def _fmt_shape(shape: Sequence[Any] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
