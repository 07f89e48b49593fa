"""Shape profiles: the concrete input shapes a model is tuned and run at.

A profile is one ``--shape`` (``input=1x3x224x224,mask=1x10``): every named input at one set of
dimensions. ``--batch N[,N]`` is shorthand for one profile per batch size, the batch set on a
symbolic (or matching) first dimension of every input; a model whose first dimension is fixed at
another size leaves that batch out (:class:`CaseSkipped`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from convpass.core.errors import ConvpassError, ShapeError

__all__ = ["DEFAULT_BATCHES", "CaseSkipped", "input_shapes", "model_inputs", "parse_batches", "parse_shape_spec",
           "profiles_for_batches", "shape_spec"]

DEFAULT_BATCHES = (1, 32)
MAX_DIM = 2**31 - 1  # the largest dimension a profile may give (cuDNN's tensor descriptors take int)


def parse_shape_spec(text: str, option: str = "--shape") -> dict[str, tuple[int, ...]]:
    """``"input=1x3x224x224,mask=1x10"`` -> ``{"input": (1, 3, 224, 224), "mask": (1, 10)}``;
    ``option``: how messages name the option (``--shape``, ``shapes[0]``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([^=\s]+)\s*=\s*(\d+(?:\s*[xX]\s*\d+)*)\s*", part)
        if not m:
            raise ShapeError(f"{option} {text!r}: expected NAME=DIMS such as input=1x3x224x224")
        dims = tuple(int(d) for d in re.split(r"\s*[xX]\s*", m[2]))
        if any(not 1 <= d <= MAX_DIM for d in dims):
            raise ShapeError(f"{option} {text[:200]!r}: dimensions must be between 1 and {MAX_DIM}")
        if m[1] in shapes:
            raise ShapeError(f"{option} {text!r}: input {m[1]!r} given twice")
        shapes[m[1]] = dims
    return shapes


class CaseSkipped(Exception):
    """This model cannot run at this batch (e.g. a fixed batch dimension)."""


def model_inputs(model: onnx.ModelProto) -> list[tuple[str, list[int | str | None], np.dtype]]:
    """(name, dims, dtype) of every graph input that is not an initializer."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims: list[int | str | None] = []
        for d in tt.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
        out.append((vi.name, dims, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))))
    return out


def input_shapes(model: onnx.ModelProto, batch: int) -> dict[str, tuple[int, ...]]:
    """Concrete input shapes at ``batch``: a symbolic first dim becomes the batch.

    Raises :class:`CaseSkipped` for a fixed first dim other than ``batch``, ValueError for other
    symbolic dims (the benchmark only sets the batch axis).
    """
    shapes = {}
    for name, dims, _ in model_inputs(model):
        if not dims:
            raise ValueError(f"input {name!r} has no shape; the benchmark needs ranked inputs")
        first = dims[0]
        if isinstance(first, int) and first > 0 and first != batch:
            raise CaseSkipped(f"input {name!r} has a fixed batch of {first}, not {batch}")
        rest = []
        for i, d in enumerate(dims[1:], start=1):
            if not isinstance(d, int) or d <= 0:
                raise ValueError(f"input {name!r} dim {i} is symbolic ({d!r}); the benchmark only sets the batch axis")
            rest.append(d)
        shapes[name] = (batch, *rest)
    return shapes


def shape_spec(shapes: Mapping[str, Sequence[int]]) -> str:
    """The ``--shape`` profile string for ``optimize``: ``input=32x3x224x224``."""
    return ",".join(f"{n}={'x'.join(map(str, s))}" for n, s in shapes.items())


def parse_batches(specs: list[str]) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    """``["1,32", "r3d_18=1,8"]`` -> ((1, 32), {"r3d_18": (1, 8)})."""
    default: tuple[int, ...] | None = None
    per_model: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, values = spec.rpartition("=")
        try:
            batches = tuple(dict.fromkeys(int(v) for v in values.split(",") if v.strip()))
        except ValueError:
            raise ConvpassError(f"--batch {spec!r}: expected N[,N] or NAME=N[,N] with integers") from None
        if not batches or min(batches) < 1:
            raise ConvpassError(f"--batch {spec!r}: batch sizes must be positive integers")
        if sep:
            if not name:
                raise ConvpassError(f"--batch {spec!r}: empty model name before '='")
            per_model[name] = batches
        else:
            default = batches
    return default or DEFAULT_BATCHES, per_model


def profiles_for_batches(path: Path, proto: Any, batches: Sequence[int]) -> tuple[tuple[str, ...], list[str]]:
    """The ``--shape`` profiles of ``--batch`` sizes for a model whose graph inputs ``proto`` holds, by
    ``convpass bench``'s rule, and notes on the sizes left out (a fixed batch dim of another size)."""
    shapes, notes = [], []
    for batch in batches:
        try:
            shapes.append(shape_spec(input_shapes(proto, batch)))
        except CaseSkipped as e:
            notes.append(f"{path.name}: batch {batch} left out: {e}")
        except ValueError as e:
            raise ConvpassError(f"{path}: --batch: {e}") from None
    if not shapes:
        raise ConvpassError(f"{path}: none of the batch sizes {list(batches)} fits the model")
    return tuple(shapes), notes
