"""scripts/diag_fence.py, the fence part of scripts/diag_engine_epilogue.py (a GPU diagnostic), on
the CPU: which launches each scope fences, what a fused launch comes right after in a plan, the
smallest right scope per model and over several models, the cost arithmetic, and the verdict line
the diagnostic prints."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
from conftest import REPO, FakeLibcuda, fake_cuda

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


# ---------------------------------------------------------------------------------------------
# the captured graph's edges


def test_the_edge_data_and_kernel_node_params_have_the_drivers_layout():
    import ctypes

    from diag_fence import KernelNodeParams

    from convpass.native.cuda_graph_edges import EdgeData

    assert ctypes.sizeof(EdgeData) == 8
    assert [getattr(EdgeData, f).offset for f in ("from_port", "to_port", "type", "reserved")] == [0, 1, 2, 3]
    raw = bytes(EdgeData(1, 0, 1))
    assert raw == b"\x01\x00\x01\x00\x00\x00\x00\x00"
    assert [getattr(KernelNodeParams, f).offset for f in ("func", "grid", "block", "shared", "kernelParams", "extra", "kern", "ctx")] == \
        [0, 8, 20, 32, 40, 48, 56, 64]


def E(src: str, dst: str, type_: int = 0, from_port: int = 0, to_port: int = 0):
    return diag_fence.Edge(src, dst, type_, from_port, to_port)


def test_edges_are_counted_by_kind_and_the_programmatic_ones_by_the_kernels_they_join():
    edges = [E("k_a", "cudnn_x"), E("memset", "cudnn_x"), E("k_a", "cudnn_x", 1, 1), E("k_b", "cudnn_x", 1, 1), E("k_a", "cudnn_x", 1, 1),
             E("cudnn_x", "k_b", 1, 2), E("k_b", "k_c", 0, 0, 1)]
    s = diag_fence.edge_summary(edges, nodes=6)
    assert (s["edges"], s["nodes"], s["programmatic"], s["non_default"]) == (7, 6, 4, 5)
    assert s["kinds"] == {"default/default": 3, "programmatic/programmatic": 3, "programmatic/launch order": 1}
    assert list(s["pairs"].items()) == [("k_a -> cudnn_x", 2), ("k_b -> cudnn_x", 1), ("cudnn_x -> k_b", 1)]
    assert diag_fence.edge_summary([E("a", "b")])["programmatic"] == 0
    assert diag_fence.edge_kind(E("a", "b", 3, 7)) == "type 3/port 7"


def summary(programmatic: int = 2, captured=(1e-4, 0.3), rewritten=(1e-4, 1e-4), **extra) -> dict:
    pairs = {"k_a -> cudnn_x": programmatic} if programmatic else {}
    return {"edges": 300, "nodes": 200, "kinds": {}, "programmatic": programmatic, "non_default": programmatic, "pairs": pairs,
            "captured": list(captured), "rewritten": list(rewritten), **extra}


def test_the_edges_verdict_says_the_count_the_kernels_and_whether_default_edges_are_right():
    line = diag_fence.edges_verdict_line("model resnet50 b16", summary())
    assert line.startswith("VERDICT edges, model resnet50 b16: 2 programmatic edge(s) of 300 (kernels k_a -> cudnn_x x2); "
                           "rewritten to default: right; as captured, replayed the same way: WRONG")
    assert "zero-cost fix" in line
    wrong = diag_fence.edges_verdict_line("m", summary(rewritten=(1e-4, 0.2)))
    assert "rewritten to default: WRONG" in wrong and "zero-cost fix" not in wrong
    none = diag_fence.edges_verdict_line("m", summary(programmatic=0, rewritten=()))
    assert "0 programmatic edge(s) of 300 (kernels -)" in none and "rewritten to default: not tried" in none
    assert "hypothesis does not hold" in none
    failed = diag_fence.edges_verdict_line("m", summary(rewritten=(), rewritten_error="cuGraphInstantiateWithFlags: X (1)"))
    assert "rewritten to default: not tried (cuGraphInstantiateWithFlags: X (1))" in failed
    quiet = diag_fence.edges_verdict_line("m", summary(captured=(1e-4,)))
    assert "not told apart" in quiet and "zero-cost" not in quiet
    assert diag_fence.edges_verdict_line("m", {"unavailable": "no graph"}) == "VERDICT edges, m: unavailable: no graph"
    many = summary()
    many["pairs"] = {f"k{i} -> c": 1 for i in range(6)}
    assert "; 2 more pair(s))" in diag_fence.edges_verdict_line("m", many)
    long = summary()
    long["pairs"] = {"sm90_" + "x" * 100 + " -> cudnn_y": 2}
    assert f"(kernels sm90_{'x' * 40}... -> cudnn_y x2)" in diag_fence.edges_verdict_line("m", long)


def test_the_edges_lines_say_each_replay():
    lines = diag_fence.edge_lines(summary(rewired=2, left=0))
    assert lines[0].startswith("EDGES captured without a fence: 300 edge(s) between 200 node(s)")
    assert lines[1] == "EDGES   programmatic x2: k_a -> cudnn_x"
    assert lines[2] == "EDGES as captured (a copy, replayed the same way): runs 1..2: 1.00e-04 3.00e-01!: WRONG"
    assert lines[3] == "EDGES rewritten: runs 1..2: 1.00e-04 1.00e-04: right"
    assert lines[4] == "EDGES rewritten: 2 edge(s) made default; 0 non-default left"
    assert diag_fence.edge_lines({"unavailable": "why"}) == ["EDGES unavailable: why"]


class FakeCuda(FakeLibcuda):
    """:class:`conftest.FakeLibcuda` with nodes: kernel nodes (handles below 100 modulo 1000) are
    named ``k<handle>``, others are memsets."""

    def __init__(self, edges, missing=()) -> None:
        super().__init__(edges, missing)

    @staticmethod
    def _nodes(edges):
        return {n for a, b, _ in edges for n in (a, b)}

    def _cuGraphGetNodes(self, g, arr, count):
        count._obj.value = len(self._nodes(self.graphs[g.value]))
        return 0

    def _cuGraphNodeGetType(self, node, kind):
        kind._obj.value = 0 if node.value % 1000 < 100 else 2
        return 0

    def _cuGraphKernelNodeGetParams_v2(self, node, params):
        params._obj.func = node.value
        return 0

    def _cuFuncGetName(self, name, func):
        name._obj.value = f"k{func.value % 1000}".encode()
        return 0


PDL = (1, 0, 1)  # (from_port, to_port, type): a programmatic edge
GRAPH_EDGES = [(1, 2, (0, 0, 0)), (2, 3, PDL), (3, 200, (0, 0, 0)), (200, 4, (0, 0, 0)), (4, 5, PDL)]


def test_the_graphs_edges_are_read_and_named_and_the_programmatic_ones_made_default():
    drv = diag_fence.Driver(FakeCuda(GRAPH_EDGES))
    edges, nodes = diag_fence.graph_edges(drv, 1)
    assert nodes == 6 and [(e.src, e.dst, e.type, e.from_port) for e in edges] == [
        ("k1", "k2", 0, 0), ("k2", "k3", 1, 1), ("k3", "memset", 0, 0), ("memset", "k4", 0, 0), ("k4", "k5", 1, 1)]
    assert diag_fence.rewrite_to_default(drv, 1, edges) == 2
    after, _ = diag_fence.graph_edges(drv, 1)
    assert sorted((e.a, e.b) for e in after) == [(1, 2), (2, 3), (3, 200), (4, 5), (200, 4)] and all(map(diag_fence.is_default, after))
    assert diag_fence.rewrite_to_default(drv, 1, after) == 0


def test_a_missing_symbol_is_unavailable_and_a_failed_call_names_the_function_and_the_error():
    lib = FakeCuda(GRAPH_EDGES, missing={"cuGraphGetEdges_v2"})
    with pytest.raises(diag_fence.EdgesUnavailable, match="no cuGraphGetEdges_v2"):
        diag_fence.graph_edges(diag_fence.Driver(lib), 1)
    lib = FakeCuda(GRAPH_EDGES)
    type(lib)._cuGraphGetNodes_bad = staticmethod(lambda *a: 1)
    with pytest.raises(diag_fence.DriverError, match=r"cuGraphGetNodes_bad: CUDA_ERROR_INVALID_VALUE \(1\)"):
        diag_fence.Driver(lib)(("cuGraphGetNodes_bad",))
    del type(lib)._cuGraphGetNodes_bad


def captured_executor(graph_handle: int = 1):
    state = types.SimpleNamespace(captured=True, graph=types.SimpleNamespace(graph=graph_handle))
    return types.SimpleNamespace(last_plan=types.SimpleNamespace(backend_state=state))


def test_the_edges_check_replays_a_copy_as_captured_then_rewritten_and_leaves_the_executors_graph_alone(monkeypatch, capsys):
    lib = FakeCuda(GRAPH_EDGES)
    real = diag_fence.Driver
    monkeypatch.setattr(diag_fence, "Driver", lambda: real(lib))
    replayed = []

    def replays(drv, exec_, state, feeds, error_of, runs):
        programmatic = sum(1 for _, _, d in lib.execs[exec_] if d == PDL)
        replayed.append(programmatic)
        return [0.3 if programmatic else 1e-4] * runs

    monkeypatch.setattr(diag_fence, "_replays", replays)
    out = diag_fence.edges_check(captured_executor(), {}, lambda outs: 0.0, runs=6)
    assert replayed == [2, 0]  # as captured first, then rewritten
    assert out["captured"] == [0.3] * 6 and out["rewritten"] == [1e-4] * 6 and (out["rewired"], out["left"]) == (2, 0)
    assert out["programmatic"] == 2 and out["pairs"] == {"k2 -> k3": 1, "k4 -> k5": 1}
    assert lib.graphs[1] == GRAPH_EDGES and sorted(lib.destroyed) == [2, 100, 101]  # the clone and both execs, not the original
    printed = capsys.readouterr().out
    assert "DIAG EDGES rewritten: runs 1..6:" in printed and printed.rstrip().endswith("0 non-default left")
    assert "zero-cost fix" in diag_fence.edges_verdict_line("m", out)


def test_the_edges_check_says_why_it_cannot_run(capsys):
    segmented = types.SimpleNamespace(last_plan=types.SimpleNamespace(backend_state=types.SimpleNamespace(captured=False)))
    out = diag_fence.edges_check(segmented, {}, lambda outs: 0.0)
    assert out == {"unavailable": "EdgesUnavailable: the plan is not one captured CUDA graph"}
    assert capsys.readouterr().out == "DIAG EDGES unavailable: EdgesUnavailable: the plan is not one captured CUDA graph\n"


def test_the_edges_verdict_follows_the_fence_scope_verdict(capsys):
    edges = summary()
    doc = {"model": "resnet50", "batch": 16, "conditions": [], "only": "fence",
           "fence_scopes": [dict(result("none", [1e-4, 0.3], 0, 16), edges=edges), result("residual", [1e-4, 1e-4], 16, 16)]}
    diag_engine_epilogue.verdicts(doc)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in out] == ["DIAG VERDICT fence scope", "DIAG VERDICT edges"]
    assert out[1].startswith("DIAG VERDICT edges, model resnet50 b16: 2 programmatic edge(s) of 300")
