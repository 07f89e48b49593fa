"""HGNetV2's learnable affine block on a real GPU: with the identity affine of an untrained export
folded away, the tuned model has no Mul or Add left, each conv runs its ReLU in its own step, and
the outputs match ONNX Runtime CPU eager and captured (TF32 tolerance)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import run_ort  # noqa: E402
from test_fold_relu_affine import _lab_block  # noqa: E402

import convpass  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

TOL = 5e-3  # relative error (norm) of a TF32 conv


def _check(got, want):
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < TOL, err


@pytest.mark.parametrize("shifts", [(0.0, 0.0), (0.25, -0.5)], ids=["identity affine", "trained shift"])
def test_the_folded_block_runs_like_onnx_runtime(tmp_path, shifts):
    model = _lab_block(scales=(1.0, 1.3), shifts=shifts)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on")
    onnx.checker.check_model(tuned, full_check=True)
    left = [n.op_type for n in tuned.graph.node if n.op_type in ("Mul", "Add")]
    assert left == ([] if shifts == (0.0, 0.0) else ["Add", "Add"]), left
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    from convpass.runtime.cuda import CudaBackend

    eager = Executor(tuned, device=CudaBackend(cuda_graph=False))
    _check(eager.run(None, {"x": x})[0], want)
    graphed = Executor(tuned, device="cuda")
    for _ in range(3):
        _check(graphed.run(None, {"x": x})[0], want)
