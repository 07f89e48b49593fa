"""CPU tests of ``convpass bench``'s strongest peers, with stand-ins for the GPU runtimes: ONNX
Runtime's CUDA EP with CUDA graphs (provider options, IOBinding on fixed device buffers, a refusal
to capture carried to the report with its best configuration without CUDA graphs standing in),
torch.compile (its modes, its first call recorded as its cold start, fresh compile caches), the
ranking against the best of every peer group, ``--vs`` (the parser and its help agree), the
targets file (``--targets``) and what the package may say (no issue numbers, machines or dates).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import MODELS, REPO
from test_bench import ENV, SETTINGS, _fake_cupy, _t

from convpass.bench import (
    contenders,
    document,
    measure,
    ort_contender,
    peers,
    ranking,
    records,
    render,
    render_summary,
    schema,
    targets,
    torch_contender,
)
from convpass.cli import bench as bench_cli
from convpass.core.errors import ConvpassError

REFUSAL = ("[ONNXRuntimeError] : 1 : FAIL : This session cannot use the graph capture feature as requested by the user as "
           "all compute graph nodes have not been partitioned to the CUDA execution provider.\nsecond line of ORT's message")


# ---------------------------------------------------------------------------------------------
# a stand-in for onnxruntime: y = 2 x, through the device pointers it is bound to


def _view(ptr: int, shape: list[int]) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), tuple(shape))


class _Fail(Exception):
    """onnxruntime's pybind error type is named Fail."""


class _Binding:
    def __init__(self) -> None:
        self.inputs: list[tuple] = []
        self.outputs: list[tuple] = []

    def bind_input(self, name, device, device_id, dtype, shape, ptr):
        self.inputs.append((name, device, device_id, dtype, shape, ptr))

    def bind_output(self, name, device="cuda", device_id=0, dtype=None, shape=None, ptr=None):
        self.outputs.append((name, device, device_id, dtype, shape, ptr))


def _fake_ort(refuse_graphs: bool = False) -> types.ModuleType:
    ort = types.ModuleType("onnxruntime")
    ort.__version__ = "1.99.0"
    ort.sessions = []
    ort.get_available_providers = lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]

    class SessionOptions:
        log_severity_level = 0

    class InferenceSession:
        def __init__(self, path, so, providers):
            self.providers = providers
            self.options = dict(providers[0][1])
            if refuse_graphs and self.options.get("enable_cuda_graph") == "1":
                raise _Fail(REFUSAL)
            self.bindings: list[_Binding] = []
            self.runs: list[_Binding] = []
            ort.sessions.append(self)

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

        def get_outputs(self):
            return [types.SimpleNamespace(name="y")]

        def io_binding(self):
            self.bindings.append(_Binding())
            return self.bindings[-1]

        def run_with_iobinding(self, binding):
            self.runs.append(binding)
            (_, _, _, _, shape, xp), = binding.inputs
            (_, _, _, _, yshape, yp), = binding.outputs
            _view(yp, yshape)[...] = 2 * _view(xp, shape)

    ort.SessionOptions = SessionOptions
    ort.InferenceSession = InferenceSession
    return ort


@pytest.fixture
def gpu_stand_ins(monkeypatch):
    cp = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(measure, "warm_gpu", lambda seconds=0.05: None)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    return {"feeds": {"x": x}, "dev": {"x": cp.asarray(x)}, "ref": [2 * x], "cp": cp}


def test_ort_graph_configurations_use_cuda_graphs_and_fixed_iobinding_buffers(monkeypatch, gpu_stand_ins):
    ort = _fake_ort()
    monkeypatch.setitem(sys.modules, "onnxruntime", ort)
    s = gpu_stand_ins
    got = ort_contender.run_ort_graph(Path("m.onnx"), s["feeds"], s["dev"], s["ref"], True, "float32", runs=3, warmup=2)
    assert [c["name"] for c in got] == ["ort-graph EXHAUSTIVE nchw", "ort-graph EXHAUSTIVE nhwc", "ort-graph HEURISTIC nchw",
                                        "ort-graph HEURISTIC nhwc"]
    assert {c["family"] for c in got} == {"ort-graph"} and {c["status"] for c in got} == {"ok"}
    assert all(c["config"]["enable_cuda_graph"] == 1 and c["config"]["io_binding"] is True for c in got)
    x_ptr = s["dev"]["x"].data.ptr
    for sess, c in zip(ort.sessions, got):
        assert sess.options["enable_cuda_graph"] == "1" and sess.options["use_tf32"] == "1"
        assert sess.options["cudnn_conv_algo_search"] == c["config"]["cudnn_conv_algo_search"]
        assert sess.options["prefer_nhwc"] == str(c["config"]["prefer_nhwc"])
        (binding,) = sess.bindings  # one binding, every run through it: the addresses the graph was captured on
        assert binding.inputs == [("x", "cuda", 0, np.float32, [2, 3, 4, 4], x_ptr)]
        (name, device, _, dtype, shape, out_ptr), = binding.outputs
        assert (name, device, dtype, shape) == ("y", "cuda", np.float32, [2, 3, 4, 4]) and out_ptr
        assert len(sess.runs) == 1 + 2 + 3 and all(b is binding for b in sess.runs)
        assert c["runs"] == 3 and c["rel_err"] == 0.0 and c["cold_start_s"] == pytest.approx(c["session_s"] + c["first_run_s"])
    # without CUDA graphs the same four configurations say nothing of them
    ort.sessions.clear()
    plain = ort_contender.run_ort(Path("m.onnx"), s["feeds"], s["dev"], s["ref"], True, "float32", runs=1, warmup=0)
    assert [c["family"] for c in plain] == ["ort"] * 4 and all("enable_cuda_graph" not in x.options for x in ort.sessions)
    assert peers.ort_provider_options(peers.ort_configs(True, graph=True)[0], 3)["device_id"] == "3"


def test_ort_graph_without_a_reference_cannot_size_its_fixed_outputs(monkeypatch, gpu_stand_ins):
    monkeypatch.setitem(sys.modules, "onnxruntime", _fake_ort())
    s = gpu_stand_ins
    got = ort_contender.run_ort_graph(Path("m.onnx"), s["feeds"], s["dev"], None, True, "float32", runs=1, warmup=0)
    assert {c["status"] for c in got} == {"failed"} and "fixed shape" in got[0]["reason"]


def _convpass(median: float) -> dict:
    return records.contender("convpass", "convpass", {"device": "cuda"}, cold_start_s=0.1, times_ms=[median], rel_err=0.0,
                             tolerance=5e-3, tf32=True)


def _case(model: str, batch: int, cs: list[dict]) -> dict:
    return {"model": model, "file": f"{model}.onnx", "batch": batch, "inputs": {"x": [batch, 3, 4, 4]}, "dtype": "float32",
            "reference": "ref", "contenders": cs, "ratios": {}, "roofline": None, "op_profile": None, "notes": []}


def test_a_refusal_to_capture_is_reported_and_the_best_configuration_without_graphs_stands_in(monkeypatch, gpu_stand_ins):
    monkeypatch.setitem(sys.modules, "onnxruntime", _fake_ort(refuse_graphs=True))
    s = gpu_stand_ins
    logs: list[str] = []
    # --vs ort-graph alone: every configuration refused, so the four without CUDA graphs run to stand in
    peers_ran = contenders.run_peers(Path("m.onnx"), s["feeds"], s["dev"], s["ref"], vs=("ort-graph",), tf32=True, dtype="float32",
                                     runs=2, warmup=0, panel_json=None, module_cache={}, compile_modes=(), log=logs.append)
    graphs = [c for c in peers_ran if c["family"] == "ort-graph"]
    assert {c["status"] for c in graphs} == {"refused"} and len(graphs) == 4
    first_line = REFUSAL.splitlines()[0]
    assert all(c["reason"] == f"_Fail: {first_line}" for c in graphs)  # ORT's own message, first line
    assert [c["family"] for c in peers_ran].count("ort") == 4 and any("to stand in" in line for line in logs)
    for c in peers_ran:  # make one configuration without graphs the fastest
        if c["family"] == "ort":
            c.update(median_ms=2.0 if c["name"] == "ort HEURISTIC nhwc" else 3.0)
    case = ranking.annotate_case(_case("rrdb", 1, [_convpass(1.0), *peers_ran]))
    assert case["best"]["ort-graph"] == case["best"]["ort"] == "ort HEURISTIC nhwc"
    assert case["stand_ins"] == {"ort-graph": f"_Fail: {first_line}"}
    assert case["ratios"]["vs_ort_graph"] == case["ratios"]["vs_ort"] == pytest.approx(0.5)
    doc = document.build_document(ENV, SETTINGS, None, [case])
    assert schema.validate_document(doc) == []
    text = render.format_report(doc)
    assert f"refused: _Fail: {first_line}" in text and "second line" not in text
    assert f"ONNX Runtime CUDA EP with CUDA graphs: refused (_Fail: {first_line}); ort HEURISTIC nhwc stands in" in text
    ranked = doc["summary"]["rankings"]["ort-graph"]
    assert ranked["stand_ins"] == {"rrdb b1": f"_Fail: {first_line}"} and ranked["groups"]["batch 1"]["geomean"] == pytest.approx(0.5)
    assert "standing in (ONNX Runtime refused to capture) for rrdb b1" in render_summary.format_summary(doc["summary"])
    # a graph configuration that captured: no stand-in, even where another one was refused
    ok = records.contender("ort-graph EXHAUSTIVE nchw", "ort-graph", times_ms=[4.0], rel_err=0.0, tolerance=5e-3)
    case = ranking.annotate_case(_case("rrdb", 1, [_convpass(1.0), *peers_ran, ok]))
    assert case["best"]["ort-graph"] == "ort-graph EXHAUSTIVE nchw" and case["stand_ins"] == {}


def test_ranking_against_the_best_of_every_peer_group():
    def peer(name: str, family: str, ms: float, status: str = "ok") -> dict:
        c = records.contender(name, family, times_ms=[ms], rel_err=0.0, tolerance=5e-3)
        return records.judge(c, 1.0, 5e-3) if status == "wrong" else c

    # b1: ORT graph 4 ms is the best peer; b32: torch.compile 8 ms, ahead of a wrong (never ranked) 1 ms ORT
    cases = [
        _case("m", 1, [_convpass(2.0), peer("ort EXHAUSTIVE nchw", "ort", 5.0), peer("ort-graph EXHAUSTIVE nchw", "ort-graph", 4.0),
                       peer("torch nchw", "torch", 10.0), peer("torch.compile default", "torch-compile", 6.0)]),
        _case("m", 32, [_convpass(12.0), peer("ort HEURISTIC nhwc", "ort", 1.0, "wrong"), peer("ort EXHAUSTIVE nhwc", "ort", 16.0),
                        peer("torch channels_last", "torch", 20.0), peer("torch.compile reduce-overhead", "torch-compile", 8.0)]),
    ]
    doc = document.build_document(ENV, SETTINGS, None, cases)
    assert schema.validate_document(doc) == []
    b1, b32 = doc["cases"]
    assert b1["best"] == {"all": "ort-graph EXHAUSTIVE nchw", "ort-any": "ort-graph EXHAUSTIVE nchw", "ort": "ort EXHAUSTIVE nchw",
                          "ort-graph": "ort-graph EXHAUSTIVE nchw", "torch": "torch nchw", "torch-compile": "torch.compile default"}
    assert b1["ratios"]["vs_all"] == pytest.approx(0.5) and b1["ratios"]["vs_ort"] == pytest.approx(0.4)
    assert b32["best"]["all"] == "torch.compile reduce-overhead" and b32["best"]["ort"] == "ort EXHAUSTIVE nhwc"
    assert b32["best"]["ort-graph"] is None and b32["ratios"]["vs_ort_graph"] is None
    assert records.find(b32, "ort HEURISTIC nhwc")["ratio_to_best_peer"] is None
    r = doc["summary"]["rankings"]
    assert (r["all"]["groups"]["batch 1"]["geomean"], r["all"]["groups"]["batch > 1"]["geomean"]) == (pytest.approx(0.5), pytest.approx(1.5))
    assert (r["all"]["worst"], r["all"]["worst_case"]) == (pytest.approx(1.5), "m b32")
    assert r["ort-graph"]["n"] == 1 and r["ort-graph"]["not_measured"] == ["m b32"]
    assert r["torch-compile"]["worst"] == pytest.approx(1.5) and r["torch"]["worst"] == pytest.approx(0.6)
    # the targets judge convpass against the best of ONNX Runtime's eight and of torch.compile's modes
    s = doc["summary"]
    assert _t(s, "steady_vs_ort_every_case")["per_case"] == {"m b1": pytest.approx(0.5), "m b32": pytest.approx(0.75)}
    compiled = _t(s, "steady_vs_torch_compile_every_case")
    assert compiled["worst_case"] == "m b32" and compiled["failing"] == ["m b32"] and compiled["verdict"] == "not met"
    text = render.format_report(doc)
    assert "    every peer: batch 1 0.50x (1 case(s)); batch > 1 1.50x (1 case(s)); worst 1.50x (m b32)" in text
    assert "convpass vs the best of every peer 0.50x (ort-graph EXHAUSTIVE nchw);" in text


# ---------------------------------------------------------------------------------------------
# a stand-in for torch: y = 2 x; torch.compile's first call "compiles" for a while


class _Tensor:
    def __init__(self, a):
        self.a = np.asarray(a)
        self.ndim = self.a.ndim

    def contiguous(self, memory_format=None):
        return self

    def detach(self):
        return self

    def float(self):
        return _Tensor(self.a.astype(np.float32))

    def cpu(self):
        return self

    def numpy(self):
        return self.a


class _Module:
    def __init__(self):
        self.moves: list = []

    def to(self, device=None, memory_format=None):
        self.moves.append(device or memory_format)
        return self

    def half(self):
        return self

    def __call__(self, x):
        return _Tensor(2 * x.a)


def _fake_torch(compile_seconds: float) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0"
    torch.calls = {"compile": [], "reset": 0, "steps": 0, "cache_dirs": []}
    torch.channels_last, torch.channels_last_3d = "channels_last", "channels_last_3d"
    torch.backends = types.SimpleNamespace(cudnn=types.SimpleNamespace(benchmark=False, allow_tf32=False),
                                           cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=False)))
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, synchronize=lambda: None, is_initialized=lambda: True,
                                       empty_cache=lambda: None)
    torch.from_dlpack = lambda x: _Tensor(np.asarray(x))
    torch.no_grad = contextlib.nullcontext
    torch.inference_mode = contextlib.nullcontext

    def reset():
        torch.calls["reset"] += 1

    def step():
        torch.calls["steps"] += 1

    torch._dynamo = types.SimpleNamespace(reset=reset)
    torch.compiler = types.SimpleNamespace(cudagraph_mark_step_begin=step)

    def compile(module, mode, dynamic, fullgraph):
        torch.calls["compile"].append((mode, dynamic, fullgraph, torch.backends.cudnn.benchmark))
        state = {"compiled": False}

        def fn(x):
            if not state["compiled"]:
                dirs = (os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR"))
                torch.calls["cache_dirs"].append((*dirs, [sorted(os.listdir(d)) for d in dirs]))
                for d in dirs:  # what a compilation leaves in its caches
                    Path(d, "kernel.bin").write_bytes(b"x")
                time.sleep(compile_seconds)
                state["compiled"] = True
            return module(x)

        return fn

    torch.compile = compile
    return torch


@pytest.fixture
def torch_stand_in(monkeypatch, tmp_path, gpu_stand_ins):
    torch = _fake_torch(0.05)
    monkeypatch.setitem(sys.modules, "torch", torch)
    panel = types.ModuleType("export_panel")
    panel.build_torch_model = lambda name: (_Module(), None)
    monkeypatch.setitem(sys.modules, "export_panel", panel)
    (tmp_path / "panel.json").write_text(json.dumps({"models": [{"name": "m", "file": "m.onnx", "builder": "stand.in"}]}))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    return dict(gpu_stand_ins, torch=torch, model=tmp_path / "m.onnx")


def test_torch_compile_records_its_first_call_as_its_cold_start(torch_stand_in):
    s = torch_stand_in
    eager = torch_contender.run_torch(s["model"], None, s["dev"], s["ref"], True, "float32", 3, 1, {})
    assert [(c["name"], c["status"]) for c in eager] == [("torch nchw", "ok"), ("torch channels_last", "ok")]
    eager[1]["median_ms"] = eager[0]["median_ms"] / 2  # channels_last ran faster: torch.compile takes that layout
    got = torch_contender.run_torch_compile(s["model"], None, s["dev"], s["ref"], True, "float32", 3, 1, {},
                                            ("default", "reduce-overhead"), eager)
    assert [(c["name"], c["family"], c["status"]) for c in got] == [
        ("torch.compile default", "torch-compile", "ok"), ("torch.compile reduce-overhead", "torch-compile", "ok")]
    for c in got:
        assert c["compile_s"] >= 0.05 and c["cold_start_s"] >= c["compile_s"]  # the first call compiles
        assert c["runs"] == 3 and c["median_ms"] < 50 and c["rel_err"] == 0.0
        assert c["config"]["channels_last"] is True and c["config"]["memory_format_from"] == "eager's faster layout"
        assert c["config"]["dynamic"] is False and "first call (compilation" in c["config"]["cold_start"]
    assert [m for m, *_ in s["torch"].calls["compile"]] == ["default", "reduce-overhead"]
    assert all(bench for *_, bench in s["torch"].calls["compile"])  # cudnn.benchmark on while compiling
    assert s["torch"].calls["steps"] == 2 * (1 + 1 + 3)  # a new cudagraph-tree step before every call
    assert s["torch"].calls["reset"] >= 4  # Dynamo reset before and after each mode
    (ind1, tri1, seen1), (ind2, tri2, seen2) = s["torch"].calls["cache_dirs"]
    assert seen1 == seen2 == [[], []]  # empty caches for every mode: the first mode's kernels are gone
    assert "/somewhere/else" not in (tri1, tri2) and Path(ind1).parent == Path(tri2).parent
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"
    # the record renders with its first call beside its cold start, and validates
    case = _case("m", 2, [_convpass(1.0), *eager, *got])
    doc = document.build_document(ENV, SETTINGS, None, [case])
    assert schema.validate_document(doc) == []
    row = next(ln for ln in render.format_case(doc["cases"][0]).splitlines() if "torch.compile default" in ln)
    assert f"(first call {got[0]['compile_s']:.3f})" in row
    md = render.format_markdown(doc["cases"]).splitlines()
    col = md[0].split("|").index(" torch.compile first call s ")
    best = records.find(doc["cases"][0], doc["cases"][0]["best"]["torch-compile"])
    assert md[2].split("|")[col].strip() == f"{best['compile_s']:.3f}"


def test_torch_compile_that_fails_says_why_and_eager_missing_means_nchw(torch_stand_in, monkeypatch):
    s = torch_stand_in

    def broken(module, mode, dynamic, fullgraph):
        def fn(x):
            raise RuntimeError("InductorError: no Triton for this GPU\ntraceback follows")
        return fn

    monkeypatch.setattr(s["torch"], "compile", broken)
    (c,) = torch_contender.run_torch_compile(s["model"], None, s["dev"], s["ref"], True, "float32", 2, 0, {}, ("max-autotune",))
    assert c["status"] == "failed" and c["reason"] == "RuntimeError: InductorError: no Triton for this GPU"
    assert c["config"]["channels_last"] is False and c["config"]["memory_format_from"] == "NCHW (eager did not run)"
    monkeypatch.setitem(sys.modules, "torch", None)
    got = torch_contender.run_torch_compile(s["model"], None, s["dev"], s["ref"], True, "float32", 2, 0, {}, ("default",))
    assert got[0]["status"] == "unavailable" and got[0]["reason"].startswith("torch is not installed")


def test_torch_compile_modes_option():
    assert peers.parse_compile_modes("default,reduce-overhead") == ("default", "reduce-overhead")
    assert peers.parse_compile_modes(" max-autotune ,default,default") == ("max-autotune", "default")
    for bad in ("", "fast", "default,turbo"):
        with pytest.raises(ValueError):
            peers.parse_compile_modes(bad)
    args = _parser().parse_args(["bench", "m.onnx", "--torch-compile-modes", "turbo"])
    with pytest.raises(ConvpassError, match="--torch-compile-modes"):
        args.func(args)


# ---------------------------------------------------------------------------------------------
# --vs: the parser and its help agree


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convpass")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.add_bench_parser(sub)
    return parser


def _vs_help() -> str:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["bench"]._actions if "--vs" in a.option_strings)
    return action.help


def test_vs_help_names_exactly_what_the_parser_accepts():
    text = _vs_help()
    listed = re.search(r"a comma-separated list of ([a-z, -]+);", text).group(1).split(", ")
    alternatives = re.findall(r"; or (\w+)", text)
    assert listed == ["ort", "ort-graph", "torch", "torch-compile"] and alternatives == ["all", "none"]
    for word in listed + alternatives:  # every word the help names is accepted
        bench_cli.parse_vs(word)
    assert bench_cli.parse_vs(",".join(listed)) == bench_cli.parse_vs("all") == tuple(listed) == contenders.PEERS
    # every word the parser accepts is named in the help, and nothing else is accepted
    assert set(bench_cli.VS_WORDS) == set(listed + alternatives)
    for word in ("both", "onnxruntime", "ort_graph", "compile", "tensorrt"):
        assert word not in re.findall(r"[a-z_-]+", text.split(". ")[0]) or word in bench_cli.VS_WORDS
        with pytest.raises(ConvpassError):
            bench_cli.parse_vs(word)
    assert bench_cli.PEERS == contenders.PEERS


# ---------------------------------------------------------------------------------------------
# the targets file


def test_the_packaged_targets_file_is_valid_and_names_what_it_judges():
    packaged = targets.load()
    assert packaged == targets.load(targets.DEFAULT_FILE) and len({t["name"] for t in packaged}) == len(packaged)
    by_name = {t["name"]: t for t in packaged}
    assert by_name["steady_vs_ort_per_batch_group"]["measure"] == "vs_ort_any"
    assert (by_name["steady_vs_ort_every_case"]["at_most"], by_name["steady_vs_torch_compile_every_case"]["at_most"]) == (1.05, 1.15)
    for t in packaged:
        assert not re.search(r"issue|\d{2,}", t["name"]), t["name"]
        assert t["measure"] in targets.MEASURES


def test_targets_option_reads_another_file_and_refuses_a_malformed_one(tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"targets": [{"name": "any_peer", "judges": "convpass against every peer, in every case",
                                             "measure": "vs_all", "rule": "every_case", "at_most": 2.0}]}))
    chosen = targets.load(mine)
    cs = [_convpass(1.5), records.contender("ort HEURISTIC nchw", "ort", times_ms=[1.0], rel_err=0.0, tolerance=5e-3)]
    doc = document.build_document(ENV, SETTINGS, None, [_case("m", 1, cs)], targets=chosen)
    assert [t["name"] for t in doc["summary"]["targets"]] == ["any_peer"] and doc["settings"]["targets"] == chosen
    assert doc["summary"]["targets"][0]["verdict"] == "met"
    bad = {
        "no list": {"about": "x"},
        "unknown measure": {"targets": [{"name": "a", "judges": "a", "measure": "speed", "rule": "every_case", "at_most": 1}]},
        "no bound": {"targets": [{"name": "a", "judges": "a", "measure": "vs_all", "rule": "every_case"}]},
        "two names": {"targets": [{"name": "a", "judges": "a", "measure": "vs_all", "rule": "geomean", "at_most": 1}] * 2},
        "a bound on a status": {"targets": [{"name": "a", "judges": "a", "measure": "cuda_graph", "rule": "every_case", "at_most": 1}]},
        "a mean of counts": {"targets": [{"name": "a", "judges": "a", "measure": "in_place_slow_convs", "rule": "geomean",
                                          "at_most": 0}]},
        "a floor on counts": {"targets": [{"name": "a", "judges": "a", "measure": "in_place_slow_convs", "rule": "every_case",
                                           "at_least": 0}]},
    }
    for what, content in bad.items():
        mine.write_text(json.dumps(content))
        with pytest.raises(ConvpassError) as e:
            targets.load(mine)
        assert str(e.value).startswith(f"--targets {mine}: ") and "\n" not in str(e.value), what
    mine.write_text("{not json")
    with pytest.raises(ConvpassError, match="cannot read a targets file"):
        targets.load(mine)
    args = _parser().parse_args(["bench", str(MODELS / "residual_cnn.onnx"), "--targets", str(mine)])
    assert bench_cli.main([str(MODELS / "residual_cnn.onnx"), "--targets", str(mine)]) == 1
    with pytest.raises(ConvpassError, match="--targets"):
        args.func(args)


def test_fresh_records_and_the_schema_agree():
    from convpass.bench import fresh

    assert set(schema.FRESH_SCHEMA["properties"]) == set(fresh.RECORD_KEYS)
    assert set(schema.CONTENDER_SCHEMA["properties"]) == set(records.CONTENDER_KEYS)


# ---------------------------------------------------------------------------------------------
# the product speaks of the product


def test_the_bench_package_names_no_issue_machine_or_date():
    pattern = re.compile(r"\bissues?\s*#?\d+|\bH[12]00\b|\bA100\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)
    files = sorted((REPO / "convpass" / "bench").glob("*.py")) + [REPO / "convpass" / "bench" / "targets.json",
                                                                  REPO / "convpass" / "cli" / "bench.py"]
    found = [f"{f.name}:{n}: {line.strip()}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []


def test_jsonschema_is_imported_only_to_check_and_its_absence_is_one_line(monkeypatch):
    import subprocess

    from convpass.bench import jsonschema_check

    code = ("import sys, convpass.cli.bench, convpass.bench.schema, convpass.bench.targets, convpass.bench.document; "
            "sys.exit('jsonschema' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    jsonschema_check._validator.cache_clear()
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(ConvpassError, match=r"^jsonschema is not installed .*pip install jsonschema") as e:
        targets.load()
    assert "\n" not in str(e.value)
    with pytest.raises(ConvpassError, match="jsonschema is not installed"):
        schema.validate_document({})
    jsonschema_check._validator.cache_clear()
