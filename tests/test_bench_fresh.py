"""CPU tests of the fresh-process cold start (``convpass bench --fresh-process``,
:mod:`convpass.bench.fresh`): the parts from the stamps, the child on the CPU executor and on ONNX
Runtime's CPU EP (real processes), the parent's harness (fresh kernel-cache folders, the rest of the
environment kept, a child that fails, exits non-zero, prints nothing or hangs), that the child
imports nothing but the standard library before its runtime; the bench's fresh records, the cold-start
ratios, targets and verdicts, the tables, the schema and merging older documents; and the bench
command with ``--fresh-process``, its children real, on the CPU.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import MODELS, REPO, run_ort

from convpass.bench import contenders, document, fresh, peers, ranking, records, render, render_summary, schema, stats
from convpass.core.errors import ConvpassError

MODEL = MODELS / "residual_cnn.onnx"  # fixed batch 1: input 1x3x64x64


def _inputs(tmp_path, batch: int = 1):
    x = np.random.default_rng(0).standard_normal((batch, 3, 64, 64)).astype(np.float32)
    path = tmp_path / "inputs.npz"
    np.savez(path, input=x)
    return path, {"input": x}


def _outputs(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# ---------------------------------------------------------------------------------------------
# parts


def test_parts_from_stamps():
    stamps = {"spawn": 100.0, "main": 100.5, "import": 101.5, "inputs": 101.6, "context": 102.0, "model_read": 102.5,
              "plan": 104.0, "first_result": 104.25}
    got = fresh.parts(stamps)
    assert list(got) == list(fresh.PART_KEYS)
    assert got == pytest.approx({"interpreter_s": 0.5, "import_s": 1.0, "inputs_s": 0.1, "context_s": 0.4, "model_read_s": 0.5,
                                 "plan_s": 1.5, "first_run_s": 0.25, "total_s": 4.25})
    # ONNX Runtime cannot separate its context and model read: their time is in the plan part
    ort = {k: v for k, v in stamps.items() if k not in fresh.UNSEPARATED["ort"]}
    got = fresh.parts(ort)
    assert got["context_s"] is None and got["model_read_s"] is None and got["plan_s"] == pytest.approx(2.4)
    assert got["total_s"] == pytest.approx(4.25)
    # no spawn time (a child started by hand): no interpreter part, no total; a child that stopped early: its parts so far
    got = fresh.parts({"spawn": None, "main": 1.0, "import": 2.0})
    assert got["interpreter_s"] is None and got["import_s"] == pytest.approx(1.0)
    assert got["plan_s"] is None and got["total_s"] is None


# ---------------------------------------------------------------------------------------------
# the child, in real processes


def test_convpass_child_on_the_cpu_executor(tmp_path):
    pytest.importorskip("onnxruntime")  # the reference
    inputs, feeds = _inputs(tmp_path)
    out = tmp_path / "out.npz"
    rec = fresh.spawn(fresh.child_command("convpass", MODEL, inputs, device="cpu", out=out), 120, tmp_path)
    assert rec["status"] == "ok" and rec["reason"] is None, rec
    assert set(rec) == set(fresh.RECORD_KEYS)
    parts = rec["parts"]
    # the context is made while the model is read (a helper thread of the executor): one part
    assert parts["context_s"] is None
    timed = [k for k in fresh.PART_KEYS if k != "context_s"]
    assert all(isinstance(parts[k], float) and parts[k] >= 0 for k in timed), parts
    assert parts["import_s"] > 0 and parts["interpreter_s"] > 0
    assert parts["total_s"] == pytest.approx(sum(parts[k] for k in timed if k != "total_s"))
    # the CPU executor never imports the kernel compiler: not counted; CuPy's (new, empty) cache stays empty
    assert rec["compilations"] is None and rec["compiled"] is None and rec["cache_files"] == 0
    (got,) = _outputs(out)
    (want,) = run_ort(onnx.load(MODEL), feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("fresh-")], "the kernel-cache folders are removed"


def test_ort_child_on_the_cpu_ep(tmp_path):
    pytest.importorskip("onnxruntime")
    inputs, feeds = _inputs(tmp_path)
    out = tmp_path / "out.npz"
    rec = fresh.spawn(fresh.child_command("ort", MODEL, inputs, config="EXHAUSTIVE-nhwc", device="cpu", out=out), 120, tmp_path)
    assert rec["status"] == "ok", rec
    parts = rec["parts"]
    assert parts["context_s"] is None and parts["model_read_s"] is None  # inside InferenceSession()
    assert parts["plan_s"] > 0 and parts["first_run_s"] > 0 and parts["total_s"] > parts["plan_s"]
    assert rec["compilations"] is None and rec["cache_files"] is None  # convpass's counters only
    np.testing.assert_allclose(_outputs(out)[0], run_ort(onnx.load(MODEL), feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_failing_child_names_the_phase_and_gives_no_numbers(tmp_path):
    inputs, _ = _inputs(tmp_path, batch=2)  # the model's batch is fixed at 1: the plan refuses it
    rec = fresh.spawn(fresh.child_command("convpass", MODEL, inputs, device="cpu"), 120, tmp_path)
    assert rec["status"] == "failed" and rec["reason"].startswith("plan: ExecutorError: input 'input' dim 0 is 2"), rec
    assert rec["parts"] is None and rec["compilations"] is None


def test_a_runtime_that_is_not_installed_fails_at_import(tmp_path):
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed here")
    inputs, _ = _inputs(tmp_path)
    cmd = fresh.child_command("torch", MODEL, inputs, config="nchw", device="cpu", weights=tmp_path / "w.pt")
    rec = fresh.spawn(cmd, 120, tmp_path)
    assert rec == fresh.record("failed", "import: ModuleNotFoundError: No module named 'torch'")


def test_child_usage_errors_are_reported(tmp_path):
    inputs, _ = _inputs(tmp_path)
    rec = fresh.spawn(fresh.child_command("ort", MODEL, inputs, device="cpu"), 60, tmp_path)  # no --config
    assert rec["status"] == "failed" and rec["reason"].startswith("exit status 2: ")
    assert "--runtime ort needs --config, one of EXHAUSTIVE-nchw, EXHAUSTIVE-nhwc, HEURISTIC-nchw, HEURISTIC-nhwc" in rec["reason"]
    rec = fresh.spawn(fresh.child_command("convpass", MODEL, inputs, config="nchw"), 60, tmp_path)
    assert "--runtime convpass has no configurations" in rec["reason"]


def test_the_child_imports_only_the_standard_library_before_its_runtime():
    code = ("import sys, convpass.bench.fresh; bad = [m for m in ('numpy', 'onnx', 'cupy', 'torch', 'onnxruntime') "
            "if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    res = subprocess.run(_py(code), capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------------------------
# the harness


def test_spawn_gives_new_empty_kernel_caches_and_keeps_the_rest_of_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVPASS_FRESH_TEST", "kept")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "warm"))
    code = r"""
import json, os, sys, time
cupy, cuda = os.environ["CUPY_CACHE_DIR"], os.environ["CUDA_CACHE_PATH"]
assert os.path.isdir(cupy) and os.path.isdir(cuda) and cupy != cuda and not os.listdir(cupy) and not os.listdir(cuda)
assert "warm" not in cupy and os.environ["CONVPASS_FRESH_TEST"] == "kept"
assert sys.argv[-2] == "--spawn-time" and 0 <= time.time() - float(sys.argv[-1]) < 60
open(os.path.join(cupy, "kernel.cubin"), "w").close()
print("library chatter")
print(json.dumps({"stamps": {}, "parts": {"total_s": 1.5}, "compilations": 0, "compiled": [], "cache_files": 1, "error": None}))
"""
    rec = fresh.spawn(_py(code), 60, tmp_path)
    assert rec == fresh.record("ok", parts={"total_s": 1.5}, compilations=0, compiled=[], cache_files=1), rec
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "each child's folders are removed after it"


def test_spawn_timeout(tmp_path):
    rec = fresh.spawn(_py("import sys, time; print('loading', file=sys.stderr, flush=True); time.sleep(60)"), 1, tmp_path)
    assert rec["status"] == "failed" and rec["reason"].startswith("timed out after 1 s"), rec
    assert rec["parts"] is None


@pytest.mark.parametrize("code, reason", [
    ("import sys; print('Traceback: boom', file=sys.stderr); sys.exit(3)", "exit status 3: Traceback: boom"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ("print('hello')", "no result line on stdout"),
    ("print('{not json')", "no result line on stdout"),
    ('import json; print(json.dumps({"stamps": {}, "parts": {}, "error": "context: CUDARuntimeError: no device"})); raise SystemExit(1)',
     "context: CUDARuntimeError: no device"),
])
def test_spawn_reports_a_failing_child_with_its_reason(tmp_path, code, reason):
    rec = fresh.spawn(_py(code), 60, tmp_path)
    assert rec == fresh.record("failed", reason)


def test_spawn_a_command_that_cannot_start(tmp_path):
    rec = fresh.spawn([str(tmp_path / "no-such-python")], 60, tmp_path)
    assert rec["status"] == "failed" and rec["reason"].startswith("could not start: FileNotFoundError")


def test_child_command_line():
    cmd = fresh.child_command("torch", "m.onnx", "in.npz", config="channels_last", tf32=False, weights="w.pt",
                              panel_json="p.json", out="o.npz")
    assert cmd[:3] == [sys.executable, "-m", "convpass.bench.fresh"]
    args = fresh._parser().parse_args(cmd[3:])
    assert (args.runtime, args.config, args.model, args.inputs, args.device, args.tf32) == (
        "torch", "channels_last", "m.onnx", "in.npz", "cuda", "off")
    assert (args.weights, args.panel_json, args.out, args.spawn_time) == ("w.pt", "p.json", "o.npz", None)
    assert fresh.CONFIGS["ort"] == ("EXHAUSTIVE-nchw", "EXHAUSTIVE-nhwc", "HEURISTIC-nchw", "HEURISTIC-nhwc")
    assert fresh.CONFIGS["torch"] == ("nchw", "channels_last")


# ---------------------------------------------------------------------------------------------
# the bench's records, ratios, targets and text (made-up figures: the arithmetic, not a measurement)


def _parts(total: float, **given: float) -> dict:
    out = dict.fromkeys(fresh.PART_KEYS)
    out.update(given, total_s=total)
    return out


def _with_fresh(c: dict, total: float | None, status: str = "ok", **values) -> dict:
    c["fresh"] = fresh.record(status, None if status == "ok" else "made up",
                              parts=None if total is None else _parts(total, import_s=0.5), **values)
    return c


def _fresh_case(model: str, batch: int, order: int, ours: float | None, cold: float = 0.1, heuristic=(3.0, 2.5),
                exhaustive=(6.0, 8.0), ours_status: str = "ok", compilations: int = 0, cache_files: int = 0,
                same: float | None = None) -> dict:
    times = [1.0, 1.1, 1.2]
    cs = [_with_fresh(records.contender("convpass", "convpass", {"device": "cuda"}, cold_start_s=cold, times_ms=times, tf32=True),
                      ours, ours_status, compilations=compilations, cache_files=cache_files)]
    for search, totals in (("EXHAUSTIVE", exhaustive), ("HEURISTIC", heuristic)):
        for nhwc, total in enumerate(totals):
            cfg = {"cudnn_conv_algo_search": search, "prefer_nhwc": nhwc, "use_tf32": 1}
            c = records.contender(peers.ort_name(search, nhwc), "ort", cfg, cold_start_s=0.3, session_s=0.1, first_run_s=0.2,
                                 times_ms=times, tf32=True)
            cs.append(_with_fresh(c, total))
    cs.append(_with_fresh(records.contender("torch nchw", "torch", {"channels_last": False}, cold_start_s=0.05, times_ms=times),
                          4.0))
    cs.append(records.unavailable("torch channels_last", "torch", "channels_last does not apply", status="skipped"))
    cs[-1]["fresh"] = fresh.record("skipped", "channels_last does not apply")
    return {"model": model, "file": f"{model}.onnx", "batch": batch, "inputs": {"input": [batch, 3, 224, 224]},
            "dtype": "float32", "reference": "onnxruntime CPU", "contenders": cs, "best_peer": None, "best_ort": None,
            "best_torch": None, "ratios": {}, "roofline": None, "op_profile": None, "model_order": order, "notes": [],
            **({"same_executor": {"status": "ok", "seconds": same, "after": 1, "reason": None}} if same is not None else {})}


ENV = {"device": "NVIDIA H200", "driver": None, "cuda_runtime": None, "cuda_driver_api": None, "cudnn": None, "packages": {}}
SETTINGS = {"runs": 3, "warmup": 1, "batches": {"a": [1, 32], "b": [1, 32]}, "vs": ["ort", "torch"], "tf32": "on",
            "timing": "made up", "fresh_process": {"timeout_s": 600.0}}


def _fresh_doc(cases: list[dict]) -> dict:
    return document.build_document(ENV, SETTINGS, None, cases, "2026-11-24T00:00:00+00:00", [render.fresh_note()])


def test_fresh_ratios_pick_the_fastest_layout_of_each_ort_search():
    case = ranking.annotate_case(_fresh_case("a", 1, 1, ours=2.0))
    r = case["ratios"]
    assert r["ort_heuristic_fresh"] == "ort HEURISTIC nhwc" and r["fresh_vs_ort_heuristic"] == pytest.approx(2.0 / 2.5)
    assert r["ort_exhaustive_fresh"] == "ort EXHAUSTIVE nchw" and r["fresh_vs_ort_exhaustive"] == pytest.approx(2.0 / 6.0)
    assert r["second_case_cold_start_s"] is None  # the model's first case
    assert ranking.annotate_case(_fresh_case("a", 32, 2, ours=2.0, same=0.12))["ratios"]["second_case_cold_start_s"] == 0.12
    # a new executor's cold start is not the figure: the executor that ran the first batch size is
    assert ranking.annotate_case(_fresh_case("a", 32, 2, ours=2.0, cold=0.12))["ratios"]["second_case_cold_start_s"] is None
    failed = _fresh_case("a", 32, 2, ours=2.0)
    failed["same_executor"] = {"status": "failed", "seconds": None, "after": 1, "reason": "out of memory"}
    case = ranking.annotate_case(failed)
    assert case["ratios"]["second_case_cold_start_s"] is None
    assert "ran b32: failed (out of memory)" in render.format_case(case)
    # a peer whose fresh process failed or gave a wrong result is not a baseline
    case = _fresh_case("a", 1, 1, ours=2.0)
    records.find(case, "ort HEURISTIC nhwc")["fresh"]["status"] = "wrong"
    records.find(case, "ort HEURISTIC nchw")["fresh"] = fresh.record("failed", "timed out after 600 s")
    r = ranking.annotate_case(case)["ratios"]
    assert r["fresh_vs_ort_heuristic"] is None and r["ort_heuristic_fresh"] is None


def _t(summary: dict, name: str) -> dict:
    """A target's verdict record in a summary, by name."""
    return next(t for t in summary["targets"] if t["name"] == name)


def test_fresh_targets_and_verdicts():
    cases = [
        _fresh_case("a", 1, 1, ours=2.0),  # 0.80x HEURISTIC, 0.33x EXHAUSTIVE
        _fresh_case("a", 32, 2, ours=2.0, same=0.12),
        _fresh_case("b", 1, 1, ours=3.0, cache_files=2),  # 1.20x HEURISTIC: not met; CuPy compiled something
        _fresh_case("b", 32, 2, ours=2.0, same=0.20),  # above 0.15 s
    ]
    s = _fresh_doc(cases)["summary"]
    h = _t(s, "fresh_vs_ort_heuristic_every_case")
    assert h["at_most"] == 1.0 and h["verdict"] == "not met"
    assert h["worst_case"] == "b b1" and h["worst"] == pytest.approx(1.2) and h["failing"] == ["b b1"]
    e = _t(s, "fresh_vs_ort_exhaustive_geomean")
    assert e["at_most"] == 0.5 and e["n"] == 4 and e["verdict"] == "met"
    assert e["geomean"] == pytest.approx(stats.geomean([2 / 6, 2 / 6, 3 / 6, 2 / 6]))
    second = _t(s, "next_batch_size_start")
    assert second["n"] == 2 and second["per_case"] == {"a b32": 0.12, "b b32": 0.20}
    assert second["failing"] == ["b b32"] and second["verdict"] == "not met"
    comp = _t(s, "fresh_compilations")
    assert comp["n"] == 4 and comp["failing"] == ["b b1"] and comp["verdict"] == "not met"
    assert comp["per_case"]["b b1"] == {"compilations": 0, "cache_files": 2}
    # everything within the targets
    good = [_fresh_case("a", 1, 1, ours=2.0), _fresh_case("a", 32, 2, ours=2.0, same=0.12)]
    s = _fresh_doc(good)["summary"]
    assert {_t(s, k)["verdict"] for k in ("fresh_vs_ort_heuristic_every_case", "fresh_vs_ort_exhaustive_geomean",
                                          "next_batch_size_start", "fresh_compilations")} == {"met"}
    text = render_summary.format_summary(s).splitlines()
    assert "    fresh_vs_ort_heuristic_every_case: fresh process to the first result: convpass against ONNX Runtime " \
           "HEURISTIC's fastest layout, in every case" in text
    assert "      worst 0.80x (a b1); geometric mean 0.80x over 2 case(s); target <= 1.00x in every case: MET" in text
    assert "      geometric mean 0.33x over 2 case(s); target <= 0.50x: MET" in text
    assert "      worst 0.120 s (a b32); 1 case(s); target <= 0.15 s in every case: MET" in text
    assert "the executor that ran b1 (one model tuned for both) ran b32 from the call to its first result in 0.120 s" in render.format_case(ranking.annotate_case(good[1]))
    assert "      none in 2 of 2 case(s); target: at most 0 in every case: MET" in text


def test_a_failed_convpass_fresh_process_fails_the_fresh_targets():
    cases = [_fresh_case("a", 1, 1, ours=2.0), _fresh_case("a", 32, 2, ours=None, ours_status="failed", same=0.1)]
    s = _fresh_doc(cases)["summary"]
    for key in ("fresh_vs_ort_heuristic_every_case", "fresh_vs_ort_exhaustive_geomean", "fresh_compilations"):
        assert _t(s, key)["verdict"] == "not met" and _t(s, key)["convpass_invalid"] == ["a b32"], key
        assert _t(s, key)["not_measured"] == ["a b32"]
    assert _t(s, "next_batch_size_start")["verdict"] == "met"  # the in-process run was fine
    text = render_summary.format_summary(s)
    assert "(not measured for a b32; convpass output wrong or failed for a b32)" in text and "--fresh-process" not in text


def test_without_fresh_processes_the_fresh_targets_are_not_measured():
    case = _fresh_case("a", 1, 1, ours=2.0)
    for c in case["contenders"]:
        c["fresh"] = None
    doc = _fresh_doc([case])
    s = doc["summary"]
    for key in ("fresh_vs_ort_heuristic_every_case", "fresh_vs_ort_exhaustive_geomean", "fresh_compilations"):
        assert _t(s, key)["verdict"] == "not measured" and _t(s, key)["not_measured"] == ["a b1"]
    text = render.format_report(doc)
    assert text.count("not measured for any case; run with --fresh-process") == 3
    assert "      no case to judge; target <= 0.15 s in every case: NOT MEASURED" in text.splitlines()
    assert "fresh process, spawn" not in text and "convpass fresh s" not in text


def test_fresh_table_markdown_and_schema():
    cases = [_fresh_case("a", 1, 1, ours=2.0), _fresh_case("a", 32, 2, ours=None, ours_status="failed", same=0.1)]
    records.find(cases[0], "convpass")["fresh"]["parts"] = {
        "interpreter_s": 0.05, "import_s": 0.9, "inputs_s": 0.01, "context_s": 0.3, "model_read_s": 0.2, "plan_s": 0.5,
        "first_run_s": 0.04, "total_s": 2.0}
    doc = _fresh_doc(cases)
    assert schema.validate_document(doc) == [], schema.validate_document(doc)
    again = json.loads(document.to_json(doc))
    assert again["schema"] == "convpass.bench/4" and again["settings"]["fresh_process"] == {"timeout_s": 600.0}
    assert schema.validate_document(again) == []
    text = render.format_case(doc["cases"][0])
    assert "fresh process, spawn -> first result in host memory, s ('-': a part the runtime cannot separate" in text
    lines = text.splitlines()
    head = next(ln for ln in lines if "in-process cold s" in ln)
    assert head.split() == ["contender", "in-process", "cold", "s", "interpreter", "import", "inputs", "context", "model",
                            "read", "plan", "first", "run", "total", "s", "compiled", "check"]
    ours = next(ln for ln in lines if ln.strip().startswith("convpass ") and "files" in ln)
    assert ours.split() == ["convpass", "0.100", "0.050", "0.900", "0.010", "0.300", "0.200", "0.500", "0.040", "2.000",
                            "0", "/", "0", "files", "ok"]
    ort = next(ln for ln in lines if ln.strip().startswith("ort HEURISTIC nhwc") and "2.500" in ln)
    assert ort.split()[3:] == ["0.300", "-", "0.500", "-", "-", "-", "-", "-", "2.500", "ok"]
    skipped = next(ln for ln in lines if ln.strip().startswith("torch channels_last") and "in-process" not in ln)
    assert skipped.split()[-5:] == ["skipped:", "channels_last", "does", "not", "apply"]
    assert "fresh process: convpass vs fastest ORT HEURISTIC 0.80x (ort HEURISTIC nhwc), vs fastest ORT EXHAUSTIVE 0.33x" in text
    failed = render.format_case(doc["cases"][1])
    assert "failed: made up" in failed
    md = render.format_fresh_markdown(doc["cases"])
    assert ("| a, 1 | 2.000 (0.900 / 0.300 / 0.200 / 0.500 / 0.040) | 2.500 (HEURISTIC nhwc) | 6.000 (EXHAUSTIVE nchw) | "
            "4.000 (nchw) | 0.80x | 0.33x | 0 / 0 files | 0.100 |") in md
    assert "| a, 32 | failed | 2.500 (HEURISTIC nhwc) |" in md
    report_text = render.format_report(doc)
    assert md in report_text and "note: fresh process (--fresh-process): interpreter = spawn -> the child's main" in report_text
    for runtime in ("convpass", "ort", "torch"):
        assert f"; {runtime}: {fresh.LEGEND[runtime]}" in render.fresh_note()
    bad = copy.deepcopy(doc)
    bad["cases"][0]["contenders"][0]["fresh"]["compilations"] = "none"
    assert any("fresh.compilations" in e for e in schema.validate_document(bad))


def test_merge_gives_older_documents_their_model_order():
    a = _fresh_doc([_fresh_case("a", 1, 1, ours=2.0), _fresh_case("a", 32, 2, ours=2.0, same=0.1)])
    b = _fresh_doc([_fresh_case("a", 8, 1, ours=2.0)])
    for d in (a, b):  # as convpass.bench/2 wrote them
        d["schema"] = "convpass.bench/2"
        for c in d["cases"]:
            del c["model_order"]
        assert schema.validate_document(d, recorded=True) == []
    merged = document.merge_documents([a, b])
    assert [c["model_order"] for c in merged["cases"]] == [1, 2, 1]  # each run's process started afresh
    assert _t(merged["summary"], "next_batch_size_start")["per_case"] == {"a b32": 0.1}
    # what a convpass.bench/3 run recorded is kept
    c = _fresh_doc([_fresh_case("a", 32, 2, ours=2.0)])
    assert [x["model_order"] for x in document.merge_documents([c])["cases"]] == [2]


def test_older_runs_did_not_measure_the_second_batch_target():
    """The 2026-11-22 run (convpass.bench/1) timed a new executor (another tuned file) per batch size,
    not a later batch size in the executor that ran the first: the target reads not measured."""
    recorded = json.loads((REPO / "tests" / "data" / "bench-h200-2026-11-22-panel.trimmed.json").read_text())
    s = _t(document.merge_documents([recorded])["summary"], "next_batch_size_start")
    assert s["n"] == 0 and len(s["not_measured"]) == 8 and s["verdict"] != "met"


# ---------------------------------------------------------------------------------------------
# the bench, with real children on the CPU


@pytest.fixture
def cpu_children(monkeypatch):
    """Children on the CPU: the CPU executor and ONNX Runtime's CPU EP stand in for the GPU runtimes."""
    real = fresh.child_command
    monkeypatch.setattr(fresh, "child_command", lambda *a, **kw: real(*a, **dict(kw, device="cpu")))


def test_run_fresh_gives_every_contender_its_fresh_record(tmp_path, cpu_children, monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(contenders, "_BYTECODE_WARMED", set())
    _, feeds = _inputs(tmp_path)
    (ref,) = run_ort(onnx.load(MODEL), feeds)
    times = [1.0, 1.1]
    case = {"model": "residual_cnn", "batch": 1, "dtype": "float32", "contenders": [
        records.contender("convpass", "convpass", {"device": "cuda"}, cold_start_s=0.2, times_ms=times, tf32=True),
        records.contender("ort HEURISTIC nchw", "ort", peers.ort_configs(True)[2], status="failed", reason="out of memory"),
        records.unavailable("torch nchw", "torch", "torch is not installed"),
        records.contender("torch channels_last", "torch", peers.torch_configs(True)[1], cold_start_s=0.1, times_ms=times),
    ]}
    logged = []
    contenders.run_fresh(case, MODEL, MODEL, feeds, [ref], panel_json=None, module_cache={}, timeout=120, workdir=tmp_path,
                         log=logged.append)
    ours, ort, torch_missing, torch_cl = (c["fresh"] for c in case["contenders"])
    assert ours["status"] == "ok" and ours["rel_err"] < 1e-5 and ours["tolerance"] == stats.TOL_TF32, ours
    assert ours["parts"]["total_s"] > 0 and ours["cache_files"] == 0
    assert ort["status"] == "ok" and ort["parts"]["context_s"] is None  # failed in-process: a fresh process still runs it
    assert torch_missing == fresh.record("unavailable", "torch is not installed")  # not started again
    assert torch_cl == fresh.record("skipped", "no PyTorch module was built in this process")
    # each runtime's first child is preceded by its bytecode warm-up run, once per process
    assert logged == ["convpass: bytecode warm-up run done", "residual_cnn b1: convpass in a fresh process",
                      "ort: bytecode warm-up run done", "residual_cnn b1: ort HEURISTIC nchw in a fresh process"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs.npz"], "the case's files are removed"
    # no tuned model: convpass is not started; a wrong output is caught
    case["contenders"] = case["contenders"][:1]
    contenders.run_fresh(case, MODEL, tmp_path / "missing.onnx", feeds, [ref], panel_json=None, module_cache={}, timeout=120,
                         workdir=tmp_path)
    assert case["contenders"][0]["fresh"] == fresh.record("skipped", "no tuned model (convpass optimize failed)")
    logged.clear()
    contenders.run_fresh(case, MODEL, MODEL, feeds, [ref + 1.0], panel_json=None, module_cache={}, timeout=120, workdir=tmp_path,
                         log=logged.append)
    assert case["contenders"][0]["fresh"]["status"] == "wrong"
    assert logged == ["residual_cnn b1: convpass in a fresh process"]  # warmed up already


def test_warm_bytecode_lets_the_child_write_what_the_measured_children_may_not(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as on the device machine
    pkg = tmp_path / "warmpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    result = 'print(json.dumps({"stamps": {}, "parts": {}, "error": None}))'
    cmd = [sys.executable, "-c", f"import sys, json; sys.path.insert(0, {str(tmp_path)!r}); import warmpkg; {result}"]
    assert fresh.spawn(cmd, 60, tmp_path)["status"] == "ok"
    assert not list(pkg.glob("__pycache__/*.pyc")), "a measured child keeps the environment's setting"
    assert fresh.warm_bytecode(cmd, 60, tmp_path) == "bytecode warm-up run done"
    assert list(pkg.glob("__pycache__/*.pyc"))
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    said = fresh.warm_bytecode(failing, 60, tmp_path)
    assert said.startswith("the bytecode warm-up run failed (exit status 3") and "may compile Python sources" in said


def test_bench_fresh_process_end_to_end_with_stand_ins(monkeypatch, tmp_path, capsys, cpu_children):
    """``convpass bench --fresh-process`` on this CPU machine: CuPy and the cuda executor stood in for
    in the bench's process (as in test_bench.py), the children real, on the CPU."""
    from test_bench import _bench_on_cpu, _parser

    _bench_on_cpu(monkeypatch)
    out_json = tmp_path / "bench.json"
    args = _parser().parse_args(["bench", str(MODELS / "mobile_block.onnx"), "--batch", "1,2", "--vs", "none", "--no-roofline",
                                 "--runs", "2", "--warmup", "0", "--cache", str(tmp_path / "t.db"), "--json-file", str(out_json),
                                 "--fresh-process", "--fresh-timeout", "120"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out_json.read_text())
    assert schema.validate_document(doc) == [], schema.validate_document(doc)
    assert doc["settings"]["fresh_process"] == {"timeout_s": 120.0}
    assert [c["model_order"] for c in doc["cases"]] == [1, 2]
    for case in doc["cases"]:
        rec = records.find(case, "convpass")["fresh"]
        assert rec["status"] == "ok" and rec["cache_files"] == 0 and rec["parts"]["total_s"] > 0, rec
    s = doc["summary"]
    assert _t(s, "next_batch_size_start")["n"] == 1 and _t(s, "fresh_vs_ort_heuristic_every_case")["verdict"] == "not measured"
    assert _t(s, "fresh_compilations")["verdict"] == "not measured"  # the CPU executor compiles nothing and counts nothing
    assert "[bench] mobile_block b2: convpass in a fresh process" in err
    assert out.count("fresh process, spawn -> first result in host memory") == 2
    assert "| mobile_block, 2 | " in out and "note: fresh process (--fresh-process):" in out
    args = _parser().parse_args(["bench", str(MODELS / "mobile_block.onnx"), "--fresh-process", "--fresh-timeout", "0"])
    with pytest.raises(ConvpassError, match="--fresh-timeout must be > 0"):
        args.func(args)


def test_a_fresh_process_counts_cudnn_plans_it_compiled_as_compilations(monkeypatch):
    import types

    monkeypatch.delitem(sys.modules, "convpass.native.nvrtc", raising=False)
    assert fresh._compilations() is None  # nothing of the cuda backend was imported
    monkeypatch.setitem(sys.modules, "convpass.native.nvrtc", types.SimpleNamespace(COMPILATIONS=["convpass_ew_1"]))
    monkeypatch.setitem(sys.modules, "convpass.kernels.convolution",
                        types.SimpleNamespace(ENGINE_COMPILATIONS=["cuDNN plan eng5 of 'dw1' (0.18 s)"]))
    assert fresh._compilations() == ["convpass_ew_1", "cuDNN plan eng5 of 'dw1' (0.18 s)"]
