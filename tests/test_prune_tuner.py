"""--prune in the tuner (no GPU: measurement is simulated): the option's values, the history read
once per run and only with --prune learned, no pruning on a device without history, pruned rows
complete a key only under --prune learned, the fallback to the skipped candidates, and the engine
configurations timed in the rule's order."""

from __future__ import annotations

import contextlib
import sys
import types

import prune_rows
import pytest
from prune_rows import DEVICE, row, shape

from convpass.core.device import DeviceFingerprint
from convpass.core.errors import OptionError
from convpass.core.options import API, TuneOptions, tune_options
from convpass.core.problem import ConvProblem
from convpass.tuning import tuner
from convpass.tuning.cache import TuningCache
from convpass.tuning.candidates import Candidates
from convpass.tuning.prune import PRUNED


def test_prune_takes_off_or_learned_and_is_recorded_with_the_options():
    assert TuneOptions().prune == "off" and TuneOptions(prune="learned").to_json()["prune"] == "learned"
    with pytest.raises(OptionError, match="--prune 'always'"):
        TuneOptions(prune="always")
    with pytest.raises(OptionError, match="^prune 'yes'"):
        tune_options({"prune": "yes"}, API)


def _tuner(tmp_path, monkeypatch, device: DeviceFingerprint):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=lambda **_: contextlib.nullcontext())))
    seen: list = []
    monkeypatch.setattr(tuner, "measure_problem", lambda problem, options, have=(), pruner=None: seen.append(pruner) or [
        row(problem.primary.key("nchw", "default"), "implicit_gemm", 0.1, 1.0)])
    cache = TuningCache(tmp_path / "c.db")
    cache.put(DEVICE, prune_rows.models(count=1, per_model=12))
    reads: list = []
    device_rows = cache.device_rows
    monkeypatch.setattr(cache, "device_rows", lambda d: reads.append(d) or device_rows(d))
    return tuner.CudnnTuner(cache, device), seen, reads


def test_the_history_is_read_once_per_run_and_only_with_prune_learned(tmp_path, monkeypatch):
    t, seen, reads = _tuner(tmp_path, monkeypatch, DEVICE)
    problems = [ConvProblem((shape(1, 200 + i),)) for i in range(3)]
    t.decide(problems, TuneOptions(prune="learned"))
    assert len(reads) == 1 and len(seen) == 3 and seen[0] is not None and all(p is seen[0] for p in seen)
    assert t.summary.pruning.startswith("--prune learned: 0 candidate(s) skipped")  # the fake measures nothing itself
    seen.clear(), reads.clear()
    t.summary = tuner.TuningSummary()
    t.decide([ConvProblem((shape(1, 300),))], TuneOptions())
    assert not reads and seen == [None] and t.summary.pruning == ""


def test_no_pruning_on_a_device_without_history(tmp_path, monkeypatch):
    other = DeviceFingerprint("NVIDIA H100 80GB HBM3", "9.0", 132, 91900)
    t, seen, reads = _tuner(tmp_path, monkeypatch, other)
    t.decide([ConvProblem((shape(1, 200),))], TuneOptions(prune="learned"))
    assert reads == [other] and seen == [None] and "no history" in t.summary.pruning


def test_what_pruning_did_is_a_note_of_optimize_at_the_default_verbosity():
    from convpass.compiler import pipeline

    report = pipeline.OptimizeReport()
    summary = tuner.TuningSummary(pruning="--prune learned: 3 candidate(s) skipped")
    pipeline._tuning_summary(report, types.SimpleNamespace(summary=summary), {}, {})
    assert report.notes == ["--prune learned: 3 candidate(s) skipped"]
    pipeline._tuning_summary(again := pipeline.OptimizeReport(), types.SimpleNamespace(summary=tuner.TuningSummary()), {}, {})
    assert again.notes == []


def test_pruned_rows_complete_a_key_only_under_prune_learned():
    key = shape(1, 8).key("nchw", "default")
    rows = [row(key, "implicit_gemm", None, 0.0, method="heuristic", rank=0)]
    rows += [row(key, a, 0.1, 0.0) for a in ("implicit_gemm", "implicit_precomp_gemm", "gemm", "direct", "fft", "fft_tiling", "winograd")]
    rows.append(row(key, "winograd_nonfused", None, 0.0, status="skipped", note=f"{PRUNED}: never won"))
    assert tuner.complete(rows, [key], "measure", None, pruned_ok=True)
    assert not tuner.complete(rows, [key], "measure", None)


class _FakeCandidates:
    def __init__(self):
        self.legacy: list = []
        self.engines: list = []

    def measure_legacy(self, descs, key, algo, best):
        self.legacy.append(algo)
        return row(key, algo, 0.2, 1.0)

    def measure_engines(self, key, best, order=None):
        kept, _ = order(["engine:eng1", "engine:eng2"])
        self.engines += kept
        return [row(key, a, 0.3, 1.0) for a in kept]


def test_the_skipped_candidates_are_timed_where_no_kept_one_ran():
    key = shape(1, 8).key("nchw", "default")
    pruned = [row(key, "fft", None, 0.0, status="skipped", note=f"{PRUNED}: x"),
              row(key, "engine:eng2", None, 0.0, status="skipped", note=f"{PRUNED}: x")]
    rows = [row(key, "implicit_gemm", None, 0.0, status="unsupported"), *pruned]
    fake = _FakeCandidates()
    out, best = tuner._fallback(rows, key, fake, None, None, engines=True)
    assert fake.legacy == ["fft"] and fake.engines == ["engine:eng2"] and best == 0.2
    assert not any(tuner.is_pruned(m) for m in out) and len(out) == 3
    ran = [row(key, "implicit_gemm", 0.1, 0.0), *pruned]
    fake = _FakeCandidates()
    assert tuner._fallback(ran, key, fake, None, 0.1, engines=True) == (ran, 0.1) and not fake.legacy


def test_engine_configurations_are_timed_in_the_rules_order_and_the_skipped_recorded(monkeypatch):
    from convpass.native.cudnn import graph_api

    key = shape(1, 8).key("nchw", "default")
    configs = [types.SimpleNamespace(algo=f"engine:eng{i}_k2=0", fusion="") for i in range(4)]
    monkeypatch.setattr(graph_api, "enumerate_configs", lambda key, fusion: types.SimpleNamespace(configs=lambda: configs))
    timed: list = []
    monkeypatch.setattr(Candidates, "_measure_engine", lambda self, key, config, best, enumerated=None: timed.append(config.algo) or
                        row(key, config.algo, 0.1, 1.0))

    def order(algos):
        return [algos[3], algos[1]], [(algos[0], f"{PRUNED}: a"), (algos[2], f"{PRUNED}: b")]

    rows = Candidates(None).measure_engines(key, None, order=order)
    assert timed == ["engine:eng3_k2=0", "engine:eng1_k2=0"]
    assert [(m.algo, m.status) for m in rows[:2]] == [("engine:eng0_k2=0", "skipped"), ("engine:eng2_k2=0", "skipped")]
    assert rows[0].note == f"{PRUNED}: a"
