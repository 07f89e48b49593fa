"""benchmarks/prune_replay.py on synthetic caches: models inferred from the runs' pauses, today's
search reproduces every decision, a learned rule measures less and keeps them, the early stop and
the fallback are replayed, and --json holds every figure."""

from __future__ import annotations

import importlib.util
import json
import sys

import prune_rows
from conftest import REPO
from prune_rows import DEVICE, problem_rows, shape

from convpass.tuning.cache import TuningCache
from convpass.tuning.prune import History, KeyPlan, Rule

_spec = importlib.util.spec_from_file_location("prune_replay", REPO / "benchmarks" / "prune_replay.py")
prune_replay = importlib.util.module_from_spec(_spec)
sys.modules["prune_replay"] = prune_replay  # its dataclasses look their module up
_spec.loader.exec_module(prune_replay)


def test_models_are_runs_apart_and_a_batch_pair_is_one_model():
    rows = prune_rows.models(count=3, per_model=2)
    models = prune_replay.models_of(rows)
    assert sorted(set(models.values())) == [0, 1, 2]
    assert models[str(shape(1, 8))] == models[str(shape(16, 8))] == 0 and models[str(shape(16, 12))] == 2


def test_todays_search_reproduces_every_decision():
    rows = prune_rows.models()
    models = prune_replay.models_of(rows)
    today = prune_replay.replay(rows, None, models)
    s = prune_replay.summary(today, today)
    assert s["keys"] == 24 and s["identical"] == 24 and s["measured"] == s["today"] == 24 * 5 and s["skipped"] == 0


def test_a_learned_rule_skips_the_losers_of_the_other_model_and_keeps_the_decisions():
    rows = prune_rows.models()
    models = prune_replay.models_of(rows)
    today = prune_replay.replay(rows, None, models)
    pruned = prune_replay.replay(rows, Rule(0.03, 6, 100), models)
    s = prune_replay.summary(pruned, today)
    assert s["identical"] == s["within_3"] == 24 and s["worst_ratio"] == 1.0
    assert s["measured"] == 24 * 1 and s["skipped"] == 24 * 4  # only implicit_precomp_gemm: the others never came near


def test_a_rule_that_skips_the_winner_is_reported_off():
    rows = prune_rows.models(count=1, per_model=12)
    # a second model where the engine wins: each model's history says the other's winner never comes near (batch 1);
    # the first model's batch-16 class is unknown to the second, so searched in full
    rows += [m for i in range(6) for m in problem_rows(shape(1, 30 + i), 5000.0 + i,
                                                       {"implicit_precomp_gemm": 0.10, "fft": 0.5, "engine:eng7_k2=1": 0.05})]
    models = prune_replay.models_of(rows)
    s = prune_replay.summary(prune_replay.replay(rows, Rule(0.03, 6, 100), models), prune_replay.replay(rows, None, models))
    assert s["keys"] == 30 and s["identical"] == s["within_3"] == 12 and s["worst_ratio"] == 2.0 and "c=30" in s["worst_key"]


def test_the_only_supported_candidate_is_measured_even_when_its_family_is_skipped():
    rows = prune_rows.models(count=1, per_model=12)
    key = shape(1, 40).key("nchw", "default")
    lone = problem_rows(shape(1, 40), 9000.0, {"implicit_precomp_gemm": None, "fft": 0.5, "engine:eng7_k2=1": None})
    history = History.learn(rows)
    plan = KeyPlan(prune_replay.geometry_class(key), False, history, Rule(0.03, 6, 100))
    measured, full, cut, skipped, best = prune_replay.replay_key(key, "", lone, plan, None)
    assert skipped == 0 and full == 1 and best == 0.5
    assert prune_replay.decision(key, "", measured).algo == "fft"


def test_the_early_stop_is_replayed_from_the_rows_times():
    key = shape(1, 8).key("nchw", "default")
    rows = problem_rows(shape(1, 8), 0.0, {"implicit_precomp_gemm": 0.10, "implicit_gemm": 0.16, "fft": 0.14, "engine:eng7_k2=1": 0.2})
    plan = KeyPlan("c", True, History(), Rule())
    _, full, cut, skipped, best = prune_replay.replay_key(key, "", rows, plan, None)
    assert (full, cut, skipped, best) == (2, 2, 0, 0.10)  # 0.16 and 0.2 are over 1.5x 0.10; 0.14 is not


def test_main_prints_the_tables_and_writes_every_figure(tmp_path, capsys):
    with TuningCache(tmp_path / "c.db") as cache:
        cache.put(DEVICE, prune_rows.models())
    out = tmp_path / "r.json"
    assert prune_replay.main([str(tmp_path / "c.db"), "--json", str(out), "--min-problems", "6"]) == 0
    text = capsys.readouterr().out
    assert "per geometry class" in text and "fwd/dense/3x3/s1/nchw/float32-default/xs" in text and "2 models inferred" in text
    doc = json.loads(out.read_text())
    assert doc["overall"]["keys"] == 24 and doc["rule"]["min_problems"] == 6 and len(doc["keys"]) == 24
    assert set(doc["models"]) == {"model 0", "model 1"} and not list(tmp_path.glob("*.tmp"))
