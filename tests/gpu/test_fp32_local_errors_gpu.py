"""An all-FP32 plan (``--precision fp32``) computes in float32 on the GPU: a BiT-like pre-activation
block at BiT's stage-1 size (GroupNorm as the TorchScript exporter writes it, weight-standardized
convs as it writes timm's StdConv2d), tuned on this GPU, each conv's and each GroupNorm unit's own
error against float64 on the GPU's own input (benchmarks/local_errors.py).

Float32 arithmetic gives local errors near 1e-7 (the CPU executor: 3e-7 at most on the whole of
BiT); TF32 gives about 1e-4. The bound, 1e-5, separates the two: a conv over it names its recorded
algorithm and math, a GroupNorm unit over it the fused normalization kernels. BiT's stem (Conv ->
Pad(0) -> MaxPool -> GroupNorm) on the GPU is a float32 rounding off the reference, which turns ONNX
Runtime's Pad_Fusion off (tests/test_ort_reference.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

pytest.importorskip("cupy")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import benchmark_script  # noqa: E402
from test_local_errors_benchmark import bit_block  # noqa: E402

import convpass  # noqa: E402

LOCAL_FP32 = 1e-5



@pytest.mark.parametrize("batch", [1, 16])
def test_an_fp32_plan_computes_every_conv_and_groupnorm_in_float32(batch, tmp_path):
    script = benchmark_script("local_errors")
    model = bit_block(c=64, hw=56)
    tuned = convpass.optimize(model, shapes=[f"x={batch}x64x56x56"], precision="fp32", cache=tmp_path / "c.db", quiet=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((batch, 64, 56, 56)).astype(np.float32)}
    result = script.local_errors(model, tuned, feeds, script.executor_runner("cuda"))
    convs = [r for r in result["nodes"] if r["kind"] == "conv"]
    assert len(convs) == 3 and all(r["math_mode"] == "fma" for r in convs), convs
    over = [r for r in result["nodes"] if not r["local"] <= LOCAL_FP32]
    assert not over, f"local errors over {LOCAL_FP32:g}: {over}"
    assert result["end_to_end"] <= 1e-4


@pytest.mark.parametrize("precision", ["fp32", "fp32-strict"])
def test_bits_stem_on_the_gpu_is_a_float32_rounding_off_the_reference(precision, tmp_path):
    """BiT's stem and first GroupNorm (Conv -> Pad(0) -> MaxPool -> GroupNorm + Relu), tuned here:
    the GPU's pooled stem is the zero-padded pooling of its own conv output, bit for bit, and the
    output is a float32 rounding off the reference (convpass.core.ort_reference: ONNX Runtime CPU
    with its Pad_Fusion rewrite off; with it on, ONNX Runtime 1.31 is about 1e-3 off)."""
    from test_ort_reference import _pooled, bit_stem

    script = benchmark_script("local_errors")
    model = bit_stem(112)
    tuned = convpass.optimize(model, shapes=["x=2x3x112x112"], precision=precision, cache=tmp_path / "c.db", quiet=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 112, 112)).astype(np.float32)}
    exposed = script._expose(tuned, ["stem", "pooled"], {"stem": (2, 64, 56, 56), "pooled": (2, 64, 28, 28)})
    _, stem, pooled = script.executor_runner("cuda")(exposed, feeds)
    np.testing.assert_array_equal(pooled, _pooled(stem, 0.0))
    result = script.local_errors(model, tuned, feeds, script.executor_runner("cuda"))
    gn = [r for r in result["nodes"] if r["kind"] == "groupnorm"]
    assert len(gn) == 1 and gn[0]["cumulative"] < 5e-6, result["nodes"]
    assert result["end_to_end"] < 1e-5, result
