"""scripts/diag_fence.py, the fence part of scripts/diag_engine_epilogue.py (a GPU diagnostic), on
the CPU: which launches each scope fences, what a fused launch comes right after in a plan, the
smallest right scope per model and over several models, the cost arithmetic, and the verdict line
the diagnostic prints."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
from conftest import REPO, fake_cuda

from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.core.algo import Algo

sys.path.insert(0, str(REPO / "scripts"))
import diag_engine_epilogue  # noqa: E402
import diag_fence  # noqa: E402
from diag_fence import ENGINE, LEGACY, OTHER, START, FenceScope, across_models, scope_verdict  # noqa: E402

KEY = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (2, 16, 14, 14), (16, 16, 3, 3)).shapes[0].key("nhwc", "default")
YES = "CUDA graph: yes"


def engine(algo: str, log: list | None = None):
    from convpass.kernels.conv_exec import EngineConv

    log = [] if log is None else log
    fusion = Algo.parse(algo).fusion
    plan = types.SimpleNamespace(config=types.SimpleNamespace(algo=algo), workspace_bytes=0, execute=lambda *a, **k: log.append("execute"))
    conv = EngineConv(KEY, Algo.parse(algo), fusion, types.SimpleNamespace(cuda=fake_cuda(log)), plan)
    conv._pass = lambda y, bias, z: log.append("pass")
    return conv


def result(scope: str, errors: list[float], fences: int, fused: int = 63, graph: str = YES) -> dict:
    return {"scope": scope, "errors": errors, "graph": graph, "fences": fences, "fused": fused}


@pytest.mark.parametrize("algo,after,fenced", [
    ("engine:eng4_k24=2+bias+add+relu", OTHER, {"residual", "eng4", "eng4+residual", "every-fused"}),
    ("engine:eng4+bias+relu", LEGACY, {"eng4", "after-cudnn", "every-fused"}),
    ("engine:eng45+bias+add+relu", ENGINE, {"residual", "after-cudnn", "every-fused"}),  # engine 45 is not engine 4
    ("engine:eng5+bias+swish", START, {"every-fused"}),
    ("engine:eng4", LEGACY, set()),  # a bare engine: never, whatever the scope
])
def test_each_scope_fences_the_fused_launches_it_names(algo, after, fenced):
    conv = engine(algo)
    got = set()
    for name in diag_fence.SCOPES:
        scope = FenceScope(name)
        scope.capturing, scope.last = (lambda: True), after
        if scope.needed(conv):
            got.add(name)
    assert got == fenced


def test_a_launch_ends_in_its_cudnn_call_unless_an_epilogue_pass_follows_it():
    from convpass.kernels.conv_exec import FusedLegacyConv, LegacyConv

    assert diag_fence.last_kernel(LegacyConv(KEY, Algo.parse("implicit_gemm"), "", None, None, 0)) == LEGACY
    assert diag_fence.last_kernel(LegacyConv(KEY, Algo.parse("implicit_gemm"), "bias+relu", None, None, 0)) == OTHER
    assert diag_fence.last_kernel(FusedLegacyConv(KEY, Algo.parse("implicit_gemm+bias+relu"), "bias+relu", None, None, 0)) == LEGACY
    assert diag_fence.last_kernel(engine("engine:eng4+bias+add+relu")) == ENGINE
    assert diag_fence.last_kernel(engine("engine:eng4")) == ENGINE
    bare_then_pass = engine("engine:eng4")
    bare_then_pass.epilogue = "bias"
    assert diag_fence.last_kernel(bare_then_pass) == OTHER
    assert diag_fence.last_kernel(object()) == OTHER


def test_in_a_plan_the_scope_replaces_the_products_fence_and_records_what_each_fused_launch_came_after(monkeypatch):
    """Through the real launch path: the runner's launch wrapper, the conv launch listener and the
    product's ``fence_needed`` put back after the scope's life."""
    from convpass.kernels import conv_exec
    from convpass.kernels.conv_exec import LegacyConv
    from convpass.kernels.convolution import ConvLaunch
    from convpass.kernels.launch import Launch
    from convpass.native import cudnn
    from convpass.runtime.cuda import runner

    log: list = []
    monkeypatch.setattr(cudnn, "run", lambda *a, **k: log.append("cudnn.run"))

    class ConvStep(ConvLaunch):
        def __init__(self, conv) -> None:
            self.conv, self.node = conv, types.SimpleNamespace(name=f"conv{len(log)}")

        def run(self, env) -> None:
            self.conv.launch("x", "w", "y", None, "b", "z")

    class Other(Launch):
        def __init__(self) -> None:
            self.node = types.SimpleNamespace(name="add")

        def run(self, env) -> None:
            log.append("add")

    legacy = LegacyConv(KEY, Algo.parse("implicit_gemm"), "", None, None, 0)
    legacy._strided.strides = lambda conv, x, y: {}  # packed arrays
    residual = engine("engine:eng4+bias+add+relu", log)
    monkeypatch.setattr(conv_exec.graph_api, "misaligned", lambda **k: [])
    scope = FenceScope("after-cudnn")
    scope.capturing = lambda: True
    product, run_launch = conv_exec.fence_needed, runner._run_launch
    with contextlib.ExitStack() as stack:
        for p in scope.patches():
            stack.enter_context(p)
        assert conv_exec.fence_needed is not product
        for launch in (ConvStep(residual), ConvStep(legacy), ConvStep(residual), Other(), ConvStep(residual)):
            runner._run_launch(launch, [])
    assert conv_exec.fence_needed is product and runner._run_launch is run_launch
    assert log == ["execute", "cudnn.run", ("fence", 16), "execute", "add", "execute"]
    assert [(r["after"], r["fenced"]) for r in scope.captured] == [(START, False), (LEGACY, True), (OTHER, False)]
    s = scope.summary()
    assert (s["fences"], s["fused"], s["fenced_after"]) == (1, 3, {LEGACY: 1})


def test_only_launches_made_while_capturing_are_counted():
    scope = FenceScope("every-fused")
    scope.capturing = lambda: False
    assert scope.needed(engine("engine:eng4+bias+relu"))
    assert scope.summary()["fused"] == 0


def test_the_smallest_right_scope_has_the_fewest_fences_and_the_control_is_wrong():
    results = [result("none", [1e-4, 1e-4, 0.3, 0.3], 0), result("residual", [1e-4] * 4, 16), result("eng4", [1e-4] * 4, 12),
               result("eng4+residual", [1e-4, 1e-4, 0.2, 1e-4], 8), result("after-cudnn", [1e-4] * 4, 12), result("every-fused", [1e-4] * 4, 63)]
    v = scope_verdict(results)
    assert (v["smallest"], v["fences"], v["control_right"]) == ("eng4", 12, False)  # eng4 before after-cudnn: the first of equals
    assert v["wrong"] == ["none", "eng4+residual"] and v["failed"] == []
    line = diag_fence.verdict_line("model resnet50 b16", v)
    assert "smallest right scope 'eng4' (12 of 63" in line and "race did not show" not in line


def test_a_failed_or_segmented_run_is_never_the_answer_and_a_right_control_is_said():
    results = [result("none", [1e-4] * 4, 0), result("residual", [], 0), result("eng4", [1e-4] * 4, 2, graph="CUDA graph: no (node x)"),
               None, result("every-fused", [1e-4] * 4, 63)]
    v = scope_verdict(results)
    assert v["smallest"] == "none" and v["control_right"] is True and v["failed"] == ["residual", "eng4"]
    assert "the control (no fence) is right too" in diag_fence.verdict_line("m", v)
    nothing = scope_verdict([result("none", [0.3], 0), result("every-fused", [0.3], 63)])
    assert nothing["smallest"] is None and "NO scope is right" in diag_fence.verdict_line("m", nothing)


def test_over_several_models_a_scope_is_right_only_where_it_is_right_in_every_one():
    per_model = {
        "resnet50 b16": [result("none", [0.3], 0, 16), result("residual", [1e-4], 16, 16), result("eng4", [1e-4], 10, 16),
                         result("every-fused", [1e-4], 16, 16)],
        "cspdarknet53 b16": [result("none", [1e-4], 0, 63), result("residual", [1e-4], 0, 63), result("eng4", [0.1], 20, 63),
                             result("every-fused", [1e-4], 63, 63)],
        "vae_decoder b16": [result("none", [0.2], 0, 30), result("residual", [1e-4], 12, 30), result("every-fused", [1e-4], 30, 30)],
    }
    rows = {r["scope"]: r for r in across_models(per_model)}
    assert rows["residual"]["fences"] == 28 and rows["residual"]["fused"] == 109
    assert rows["eng4"]["errors"] == []  # the VAE did not run it: failed, not right
    v = scope_verdict(across_models(per_model))
    assert (v["smallest"], v["fences"], v["control_right"]) == ("residual", 28, False)
    assert v["wrong"] == ["none"] and v["failed"] == ["eng4"]


def test_the_cost_of_a_fence_in_microseconds():
    assert diag_fence.per_fence_us(0.7, 0.3, 200) == pytest.approx(2.0)
    cost = {"n": 200, "ms": {"empty": 0.004, "fences": 0.404, "kernels": 0.3, "kernels+fences": 0.9, "eager kernels": 0.5,
                             "eager kernels+fences": 1.3},
            "us": {"graph_fences": 2.0, "graph_between_kernels": 3.0, "eager_between_kernels": 4.0, "host_per_fence_call": 5.0},
            "errors": {}}
    lines = diag_fence.cost_lines(cost)
    assert len(lines) == 3 and all(line.startswith("FENCE cost") for line in lines)
    assert "2.00 us per fence" in lines[0] and "1.50 us each" in lines[1] and "3.00 us per fence" in lines[1]
    assert "4.00 us per fence" in lines[2] and "5.00 us per fence call" in lines[2]
    partial = dict(cost, ms={k: v for k, v in cost["ms"].items() if k != "empty"}, errors={"graph empty": "CUDARuntimeError: x"})
    assert [line.split(":")[0] for line in diag_fence.cost_lines(partial)] == ["FENCE cost, captured", "FENCE cost, eager", "FENCE cost"]


def test_the_diagnostics_verdicts_end_with_the_fence_scope_line_and_say_only_that_with_only_fence(capsys):
    doc = {"model": "resnet50", "batch": 16, "conditions": [], "only": "all",
           "fence_scopes": [result("none", [1e-4, 0.3], 0, 16), result("residual", [1e-4, 1e-4], 16, 16)]}
    diag_engine_epilogue.verdicts(doc)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("DIAG VERDICT model resnet50 b16: bench condition")
    assert out[-1].startswith("DIAG VERDICT fence scope, model resnet50 b16: smallest right scope 'residual' (16 of 16")
    assert doc["fence_verdict"]["smallest"] == "residual"
    diag_engine_epilogue.verdicts(dict(doc, only="fence"))
    assert capsys.readouterr().out.splitlines() == out[-1:]


def test_unknown_scopes_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        diag_engine_epilogue.main(["--cache", "x.db", "--scopes", "none,eng9"])
    assert e.value.code == 2 and "unknown ['eng9']" in capsys.readouterr().err


def test_the_fence_summary_holds_the_cost_each_models_scopes_and_the_verdict_over_them(tmp_path, capsys):
    import json

    cost = {"n": 200, "ms": {}, "us": {"graph_between_kernels": 2.5, "graph_fences": 1.5, "eager_between_kernels": 3.0,
                                       "host_per_fence_call": 4.0}, "errors": {}}
    scopes = {"resnet50 b16": [result("none", [0.3], 0, 16), result("residual", [1e-4], 16, 16)],
              "cspdarknet53 b16": [result("none", [1e-4], 0, 63), result("residual", [1e-4], 0, 63)]}
    diag_engine_epilogue.write_fence_summary(tmp_path, cost, scopes, final=False)
    assert capsys.readouterr().out == ""
    diag_engine_epilogue.write_fence_summary(tmp_path, cost, scopes, final=True)
    doc = json.loads((tmp_path / "diag-fence.json").read_text())
    assert doc["verdict"]["smallest"] == "residual" and doc["fence_cost"]["us"]["graph_between_kernels"] == 2.5
    assert sorted(doc["scopes"]) == ["cspdarknet53 b16", "resnet50 b16"] and not list(tmp_path.glob("*.tmp"))
    out = capsys.readouterr().out
    assert "VERDICT fence scope, every model (resnet50 b16, cspdarknet53 b16): smallest right scope 'residual' (16 of 79" in out
    assert "VERDICT fence cost: 2.50 us per fence between kernels in a graph, 1.50 us per fence alone" in out
