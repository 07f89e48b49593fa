"""convpass.tuning.prune: geometry classes, families, the history learned from rows, the order
and cuts of the rule, its re-exploration and its fallback."""

from __future__ import annotations

import prune_rows
from prune_rows import problem_rows, row, shape

from convpass.core.problem import ConvShape
from convpass.tuning.prune import PRUNED, History, Pruner, Rule, family, geometry_class, needs_fallback


def test_geometry_class_names_direction_kind_kernel_stride_layout_math_and_size():
    dense = shape(1, 128).key("nhwc", "default")
    assert geometry_class(dense) == "fwd/dense/3x3/s1/nhwc/float32-default/s"  # 128 x 28 x 28 = 100,352 outputs
    dw = ConvShape("fwd", 16, 96, 96, (56, 56), (5, 5), (2, 2), (2, 2), (1, 1), 96, "float32").key("nchw", "fma")
    assert geometry_class(dw) == "fwd/depthwise/kother/s2/nchw/float32-fma/m"
    big = ConvShape("dgrad", 16, 64, 128, (128, 128), (1, 1), (0, 0), (1, 1), (1, 1), 2, "float16").key("nchw", "default")
    assert geometry_class(big) == "dgrad/grouped/1x1/s1/nchw/float16-default/l"


def test_a_family_is_the_bare_algorithm_or_the_engine_without_its_knobs():
    assert family("implicit_precomp_gemm+bias+relu") == family("implicit_precomp_gemm") == "legacy:implicit_precomp_gemm"
    assert family("engine:eng67_k2=5_k13=0") == family("engine:eng67_k2=1") == "engine:eng67"
    assert family("engine:eng1") == "engine:eng1" and family("engine:eng0_k13=1_k2=3") == "engine:eng0"
    assert family("convpass_depthwise_r4+bias") == "own:convpass_depthwise_r4"


def test_history_counts_wins_and_near_misses_per_class():
    history = History.learn(prune_rows.models(count=1, per_model=3), near=0.25)
    cls = geometry_class(shape(1, 8).key("nchw", "default"))
    assert history.wins[(cls, "legacy:implicit_precomp_gemm")] == 3
    assert history.close[(cls, "engine:eng7")] == 3  # 0.12 ms within 25% of 0.10
    assert history.close[(cls, "legacy:fft")] == 0 and history.present[(cls, "legacy:fft")] == 3
    assert history.present[(cls, "legacy:winograd")] == 3 and not history.wins[(cls, "legacy:winograd")]


def test_the_rule_orders_by_win_rate_and_skips_families_that_never_come_near():
    history = History.learn(prune_rows.models(count=1, per_model=3), near=0.03)
    key = shape(1, 8).key("nchw", "default")
    plan = Pruner(history, Rule(0.03, 3, 100)).plan(key)
    kept, skipped = plan.order(["implicit_gemm", "implicit_precomp_gemm", "fft", "winograd"])
    assert kept == ["implicit_precomp_gemm"]
    assert [a for a, _ in skipped] == ["implicit_gemm", "fft", "winograd"]
    assert all(why.startswith(PRUNED) and "never won" in why and "in 3 problems" in why for _, why in skipped)
    # two families that win: the one that wins more often is tried first, whatever the tuner's order;
    # a family the history never saw is kept, last (no win rate)
    rows = [m for c, (gemm, precomp) in zip((8, 9, 10), ((0.1, 0.2), (0.1, 0.2), (0.2, 0.1)))
            for m in problem_rows(shape(1, c), 10.0 * c, {"implicit_gemm": gemm, "implicit_precomp_gemm": precomp, "fft": 0.5})]
    plan = Pruner(History.learn(rows, near=0.03), Rule(0.03, 3, 100)).plan(key)
    kept, skipped = plan.order(["winograd", "implicit_precomp_gemm", "fft", "implicit_gemm"])
    assert kept == ["implicit_gemm", "implicit_precomp_gemm", "winograd"] and [a for a, _ in skipped] == ["fft"]


def test_few_known_problems_and_every_kth_problem_search_everything():
    history = History.learn(prune_rows.models(count=1, per_model=3))  # 6 problems of the class
    key = shape(1, 8).key("nchw", "default")
    assert Pruner(history, Rule(0.03, 7, 100)).plan(key).full  # fewer than min_problems known
    pruner = Pruner(history, Rule(0.03, 3, 3))
    assert [pruner.plan(key).full for _ in range(6)] == [False, False, True, False, False, True]
    assert Pruner(History(), Rule()).plan(key).full  # no history on the device


def test_a_pruned_row_is_no_evidence_and_a_key_with_nothing_run_falls_back():
    key = shape(1, 8).key("nchw", "default")
    rows = [row(key, "implicit_gemm", 0.1, 1.0), row(key, "fft", None, 1.0, status="skipped", note=f"{PRUNED}: ...")]
    history = History.learn(rows)
    assert history.present[(geometry_class(key), "legacy:fft")] == 0
    assert needs_fallback([row(key, "fft", None, 1.0, status="unsupported")], key)
    assert not needs_fallback(rows, key)
