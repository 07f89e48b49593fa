"""A residual Add (and its Relu) after a conv without a bias, run inside the conv's step with a zero
bias (:mod:`convpass.core.fusion`, "A conv without a bias"), on a real GPU: a BiT-like block
(tests/bit_block.py: GroupNorm + Relu pre-activation, convs without a bias, ``Add(c2, shortcut)``)
at batch 16, tuned here (TF32 on), runs eager and captured against ONNX Runtime CPU with the Add
(and the Relu) no launch of their own, c2's launch the residual step, and an error no worse than the
same tuned model run with the residual step off (the Add its own launch). Each test prints
``ZERO-BIAS`` lines (run with ``-s`` to see them)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from bit_block import bit_block, bit_input  # noqa: E402
from conftest import run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

TOL = 5e-3  # relative error (norm) of TF32 convs against ONNX Runtime CPU, as the other GPU tests
X = (16, 64, 16, 16)  # batch 16, as the panel's bit_resnetv2_50 runs

CASES = {
    "relu": dict(relu=True),  # conv without a bias -> Add(shortcut) -> Relu: bias+add+relu
    "bit": dict(out_channels=128, shortcut="conv", relu=False),  # BiT's first block of a stage: Add(c2, down(p)), bias+add
}


def _report(what: str) -> None:
    print(f"ZERO-BIAS {what}")


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _launches(ex) -> dict[str, str]:
    """The compiled plan's launches, node name -> label (a step another launch absorbed has none)."""
    return {launch.node.name: launch.label for launch in ex.last_plan.backend_state.launch_list()}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    path = tmp_path_factory.mktemp("zero_bias") / "c.db"
    out = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        model = bit_block(X, kw.pop("out_channels", None), **kw)
        tuned_model = convpass.optimize(model, cache=path, quiet=True, tf32="on")
        onnx.checker.check_model(tuned_model, full_check=True)
        out[name] = (model, tuned_model)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_block_runs_the_add_in_the_conv_s_step_eager_and_captured(tuned, case):
    from convpass.native.cuda import ExecutorWarning
    from convpass.runtime.cuda import CudaBackend

    model, tuned_model = tuned[case]
    relu = CASES[case].get("relu", True)
    fusion = "bias+add+relu" if relu else "bias+add"
    records = {r["node"]: r for r in convpass.inspect(tuned_model)}
    assert records["c2"]["fusion"] in (fusion, None), records["c2"]  # the fused call, or the conv and one pass
    feeds = bit_input(X, seed=3)
    want = run_ort(model, feeds)[0]
    k = want.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)  # no fallback, no refused fused call
        eager = Executor(tuned_model, device=CudaBackend(cuda_graph=False))
        eager.run(None, feeds)  # op by op (records the plan)
        eager.run(None, feeds)  # the plan's first run
        before = dict(eager.backend.counters)
        got_eager = eager.run(None, feeds)[0]
        counters = {n: v - before.get(n, 0) for n, v in eager.backend.counters.items() if v != before.get(n, 0)}
        graphed = Executor(tuned_model, device="cuda")
        got_graph = [graphed.run(None, feeds)[0] for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the yardstick: the same decisions, the Add its own launch
        unfused = Executor(tuned_model, device=CudaBackend(cuda_graph=False, fuse_residual=False))
        for _ in range(2):
            got_unfused = unfused.run(None, feeds)[0]
    assert graphed.graph_status().captured, graphed.graph_status().describe()
    errors = {"eager": _err(got_eager, want), "unfused": _err(got_unfused, want)}
    errors.update({f"replay {i}": _err(g, want) for i, g in enumerate(got_graph)})
    launches, plain = _launches(graphed), _launches(unfused)
    _report(f"{case}: c2 {records['c2']['algo']} fusion {records['c2']['fusion']}; errors vs ONNX Runtime CPU "
            + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()) + f"; launches {len(launches)} (residual step off: {len(plain)}); "
            f"plan-run counters {counters}")
    for what, e in errors.items():
        assert e <= TOL, f"{what}: relative error {e:.2e}"
        assert e <= 2 * errors["unfused"] + 1e-5, f"{what}: relative error {e:.2e}, the Add as its own launch {errors['unfused']:.2e}"
    assert _err(got_eager, got_unfused) <= TOL
    # the Add (and the Relu) are no launches of their own; c2's launch is the residual step. With
    # the step off, the Add is one launch (an element-wise group with the Relu, named by its last node)
    last = "relu" if relu else "add"
    assert "add" not in launches and "relu" not in launches and launches["c2"] == "Conv+residual+" + ("relu" if relu else "identity"), launches
    assert last in plain and plain["c2"] == "Conv" and len(plain) == len(launches) + 1, (plain, launches)
    if case == "bit":
        assert launches["down"] == "Conv", launches  # computed before c2: its Add is c2's
    if records["c2"]["fusion"]:
        assert counters.get("fused_residual_" + ("relu" if relu else "identity")) == 1, counters
    # one zero bias, made at compile time, never written
    zeros = graphed.backend.convs.resources._zero_biases
    assert list(zeros) == [(k, np.dtype(np.float32).str)] and not cp.asnumpy(next(iter(zeros.values()))).any(), zeros
