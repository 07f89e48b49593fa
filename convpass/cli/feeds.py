"""The inputs of ``convpass run``: read from ``.npy`` / ``.npz`` files or generated.

Rules:

1. ``--input NAME=FILE.npy`` gives one input; ``--input FILE.npy`` is that for a model with one
   input. ``--input FILE.npz`` gives every input named by an array in the archive;
   ``--input NAME=FILE.npz`` takes the array ``NAME`` from it, or its only array. Files are read
   within bounds (:mod:`convpass.core.array_file`: at most 4 GiB, inflated; no pickle).
2. Every input no file gives is generated, seeded by ``--seed`` (default 0): floats from the
   standard normal distribution, integers uniform in 0..3, booleans true or false with
   probability 1/2.
3. A generated input's shape is the one the model declares, with ``--shape NAME=DIMS`` for an
   input named there, and ``--batch N`` (default 1) for a symbolic first dimension. Any other
   symbolic dimension needs ``--shape``; the error says which.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from convpass.core.array_file import read_arrays
from convpass.core.errors import ConvpassError

__all__ = ["Feed", "make_feeds", "parse_run_shapes"]


@dataclasses.dataclass
class Feed:
    name: str
    value: np.ndarray
    source: str  # "generated" or the file it came from

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.value.shape), "dtype": str(self.value.dtype), "source": self.source}


def parse_run_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``--shape`` values of ``run``, merged (each may name several inputs)."""
    from convpass.core.options import CLI, parse_profiles

    shapes: dict[str, tuple[int, ...]] = {}
    for profile in parse_profiles(list(specs), CLI):
        for name, dims in profile.items():
            if name in shapes:
                raise ConvpassError(f"--shape: input {name!r} given twice")
            shapes[name] = dims
    return shapes


def _load(spec: str, name: str | None, path: str) -> dict[str, np.ndarray]:
    if not os.path.exists(path):
        raise ConvpassError(f"--input {spec!r}: file not found: {path}")
    arrays = read_arrays(path, "--input", INPUT_FILE_LIMIT)  # no FIFO or device, no pickle, bounded (convpass.core.array_file)
    if "" in arrays:
        return {name: arrays[""]} if name else {"": arrays[""]}
    if name is None:
        return arrays
    if name in arrays:
        return {name: arrays[name]}
    if len(arrays) == 1:
        return {name: next(iter(arrays.values()))}
    raise ConvpassError(f"--input {spec!r}: {path} holds no array named {name!r} (it holds {', '.join(map(repr, sorted(arrays))) or 'none'})")


INPUT_FILE_LIMIT = 4 << 30  # one input file's bytes, and its arrays inflated, at most 4 GiB


def _from_files(specs: Sequence[str], input_names: list[str]) -> dict[str, Feed]:
    feeds: dict[str, Feed] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = None, spec
        elif not name or not path:
            raise ConvpassError(f"--input {spec!r}: expected NAME=FILE (.npy or .npz) or FILE")
        arrays = _load(spec, name, path)
        if "" in arrays:  # a bare .npy without NAME=
            if len(input_names) != 1:
                raise ConvpassError(f"--input {spec!r} has no NAME=; the model has {len(input_names)} inputs "
                                    f"({', '.join(input_names) or 'none'}): use --input NAME=FILE")
            arrays = {input_names[0]: arrays[""]}
        for key, value in arrays.items():
            if key not in input_names:
                if name is None:
                    continue  # an .npz may hold more than this model reads
                raise ConvpassError(f"--input {spec!r}: the model has no input {key!r}; its inputs: {', '.join(input_names)}")
            if key in feeds:
                raise ConvpassError(f"input {key!r} given twice")
            feeds[key] = Feed(key, value, path)
    return feeds


def _shape_of(arg: Any, shapes: dict[str, tuple[int, ...]], batch: int) -> tuple[int, ...]:
    if arg.name in shapes:
        given = shapes[arg.name]
        if arg.shape is not None and len(arg.shape) != len(given):
            raise ConvpassError(f"--shape {arg.name}={'x'.join(map(str, given))}: input {arg.name!r} has rank {len(arg.shape)}")
        for i, (want, got) in enumerate(zip(arg.shape or (), given)):
            if isinstance(want, int) and want > 0 and want != got:
                raise ConvpassError(f"--shape {arg.name}={'x'.join(map(str, given))}: dim {i} of input {arg.name!r} is fixed at {want}")
        return given
    if arg.shape is None:
        raise ConvpassError(f"input {arg.name!r} declares no shape: give one with --shape {arg.name}=DIMS or a file with --input")
    dims = []
    for i, d in enumerate(arg.shape):
        if isinstance(d, int) and d > 0:
            dims.append(d)
        elif i == 0:
            dims.append(batch)
        else:
            raise ConvpassError(f"dim {i} of input {arg.name!r} is symbolic ({d!r}): give it with --shape {arg.name}=DIMS "
                                f"(or a file with --input {arg.name}=FILE)")
    return tuple(dims)


MAX_GENERATED_BYTES = 4 << 30  # one generated input at most 4 GiB


def _generate(name: str, dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    size = math.prod(shape) * dtype.itemsize
    if size > MAX_GENERATED_BYTES:
        raise ConvpassError(f"input {name!r} of shape {'x'.join(map(str, shape))} would take {size / 2**30:.1f} GiB; "
                            f"convpass generates inputs of at most {MAX_GENERATED_BYTES >> 30} GiB (give a smaller --shape or --batch)")
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 4, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    raise ConvpassError(f"cannot generate an input of type {dtype}: give a file with --input")


def make_feeds(inputs: Sequence[Any], files: Sequence[str], shapes: dict[str, tuple[int, ...]], batch: int, seed: int) -> list[Feed]:
    """The feeds of every model input (``inputs``: the executor's ``get_inputs()``), by the module rules."""
    if batch < 1:
        raise ConvpassError(f"--batch must be >= 1, got {batch}")
    names = [a.name for a in inputs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise ConvpassError(f"--shape names unknown input(s) {', '.join(map(repr, unknown))}; the model's inputs: {', '.join(names)}")
    given = _from_files(files, names)
    rng = np.random.default_rng(seed)
    feeds = []
    for arg in inputs:
        if arg.name in given:
            feeds.append(given[arg.name])
        else:
            feeds.append(Feed(arg.name, _generate(arg.name, np.dtype(arg.dtype), _shape_of(arg, shapes, batch), rng), "generated"))
    return feeds
