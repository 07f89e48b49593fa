"""x -> GroupNorm -> q, k, v 1x1 convs (an attention block's input side) on the cuda backend, the
convs tuned in NHWC: the GroupNorm's output arrives channels-first, and the three convs read one
shared channels-last copy of it (one ``layout_conversions``) instead of each copying it inside its
launch (``layout_copies``); the outputs match ONNX Runtime (CPU). The CPU side:
tests/test_shared_layouts.py."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

from conftest import run_ort, steady_run  # noqa: E402
from fused_models import qkv  # noqa: E402

import convpass  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

SHAPE = (16, 64, 32, 32)


def _err(y, want) -> float:
    return float(np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want))


def test_q_k_v_read_one_conversion_of_the_groupnorm_output_and_match_onnx_runtime(tmp_path):
    model = qkv(SHAPE, groups=8)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", engines="legacy", layout="nhwc")
    x = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    (y,), added = steady_run(tuned, {"x": x})
    assert added["layout_conversions"] == 1, f"{added['layout_conversions']} shared conversions in one run (one expected)"
    assert added["layout_copies"] == 0, f"{added['layout_copies']} conv inputs copied inside conv launches (none expected)"
    assert _err(y, want) <= 5e-3
    captured = Executor(tuned, device="cuda")
    for _ in range(3):
        (y,) = captured.run(None, {"x": x})
    assert _err(y, want) <= 5e-3
