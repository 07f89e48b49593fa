"""Synthetic tuning caches for the precision tests: every problem of a model timed at every data
type, math mode and layout by a simple rate model, so that the real cache backend decides from them
on a machine without a GPU.

The rates are made up (this is a test double, not a measurement): FMA float32 20 TFLOP/s, TF32 60,
float16 150, plus 5 us per conv; a transpose or cast moves its bytes at 2 TB/s plus 2 us.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from convpass.compiler.passes.resolve_shapes import VALUE_SHAPES_KEY
from convpass.core.device import DeviceFingerprint
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, ConvShape
from convpass.tuning.cache import Measurement, TuningCache

DEVICE = DeviceFingerprint("NVIDIA Synthetic GPU", "9.0", 132, 91900)
RATES = {("float32", "fma"): 20e12, ("float32", "default"): 60e12, ("float16", "default"): 150e12,
         ("bfloat16", "default"): 150e12}


def conv_ms(shape: ConvShape, math: str, rates: Mapping[tuple[str, str], float] = RATES) -> float:
    return 0.005 + shape.flops / rates[(shape.dtype, math)] * 1e3


def copy_ms(dims: Sequence[int], itemsize: int) -> float:
    n = 1
    for d in dims:
        n *= int(d)
    return 0.002 + 2 * n * itemsize / 2e12 * 1e3


def rows_for(problem: ConvProblem, rates: Mapping[tuple[str, str], float] = RATES, dtypes=("float32", "float16")) -> list[Measurement]:
    out = []
    for shape in problem.candidates:
        for dtype in dtypes:
            s = dataclasses.replace(shape, dtype=dtype)
            for layout in ("nchw", "nhwc"):
                for math in ("default", "fma") if dtype == "float32" else ("default",):
                    t = conv_ms(s, math, rates) * (1.0 if layout == "nchw" else 1.05)
                    out.append(Measurement(s.key(layout, math), "implicit_gemm", "ok", t, 0, True, 1.0, "measure"))
    return out


def synthetic_cache(path: Path, model: onnx.ModelProto, shapes: Sequence[str] = (), rates=RATES) -> TuningCache:
    """A tuning cache at ``path`` holding rows for every problem of ``model`` (float32 and float16)
    and transpose times for every tensor shape of it."""
    from convpass.compiler.pipeline import OptimizeReport, build_options, prepare_model
    from convpass.core.model_io import load_model

    work = load_model(model)
    uses = prepare_model(work, build_options({}), shapes, OptimizeReport())
    cache = TuningCache(path)
    for problem in uses:
        cache.put(DEVICE, rows_for(problem, rates))
    seen = set()
    for profile in work.meta.get(VALUE_SHAPES_KEY, []):
        for dims in profile.values():
            if dims and all(isinstance(d, int) for d in dims) and 3 <= len(dims) <= 5 and tuple(dims) not in seen:
                seen.add(tuple(dims))
                for dtype, size in (("float32", 4), ("float16", 2)):
                    cache.put_transpose(DEVICE, tuple(dims), dtype, copy_ms(dims, size))
    return cache


def options(**kw) -> TuneOptions:
    return TuneOptions(**kw)


__all__ = ["DEVICE", "RATES", "conv_ms", "copy_ms", "ir", "rows_for", "synthetic_cache", "options"]
