"""How ``convpass bench`` ranks convpass against its peers in one case: the best configuration of
each peer group, the ratios the summary and the targets read, the cold-start comparisons.

Peer groups (:data:`PEER_GROUPS`): every peer together, ONNX Runtime in any configuration (with
or without CUDA graphs), and each peer family alone. The best of a group is its rankable
contender (``ok`` or ``unchecked``) with the lowest steady-state median; a ``wrong`` output is
never a best. Where ONNX Runtime refused every CUDA-graph configuration of a case, its best
configuration without CUDA graphs stands in for the ``ort-graph`` group, and the case says so
(``stand_ins``: the group and ONNX Runtime's reason).

:func:`annotate_case` fills, on a case: ``best`` (group -> contender name), ``stand_ins``, each
contender's ``ratio_to_best_peer`` and ``ratios``: ``vs_<group>`` (convpass median / the group's
best median), ``cold_start_speedup_vs_ort_exhaustive``, the fresh-process ratios, the next batch
size's start (seconds) and ``non_conv_share`` (the tuned model's GPU time outside convolutions
over its total, from ``--profile-ops``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from convpass.bench.records import BATCH_GROUPS, PEER_FAMILIES, RANKABLE, batch_group, case_label, find, rankable
from convpass.bench.stats import geomean

# group -> (families, title); the order the summary lists them in
PEER_GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "all": (PEER_FAMILIES, "every peer"),
    "ort-any": (("ort", "ort-graph"), "ONNX Runtime, any configuration"),
    "ort": (("ort",), "ONNX Runtime CUDA EP"),
    "ort-graph": (("ort-graph",), "ONNX Runtime CUDA EP with CUDA graphs"),
    "torch": (("torch",), "PyTorch eager"),
    "torch-compile": (("torch-compile",), "torch.compile"),
}
# a group whose configurations were all refused: the group that stands in for it
STAND_IN = {"ort-graph": "ort"}


def ratio_key(group: str) -> str:
    """``vs_ort_graph`` for group ``ort-graph``: the key of ``case["ratios"]``."""
    return "vs_" + group.replace("-", "_")


def best_of(contenders: Sequence[Mapping[str, Any]], families: Sequence[str]) -> Mapping[str, Any] | None:
    """The rankable contender of the given families with the lowest median (None when there is none)."""
    pool = [c for c in contenders if c.get("family") in families and rankable(c)]
    return min(pool, key=lambda c: c["median_ms"]) if pool else None


def best_in_group(contenders: Sequence[Mapping[str, Any]], group: str) -> tuple[Mapping[str, Any] | None, str | None]:
    """(the group's best contender, the refusal reason when a stand-in is that best)."""
    families, _ = PEER_GROUPS[group]
    best = best_of(contenders, families)
    if best is not None or group not in STAND_IN:
        return best, None
    refused = [c for c in contenders if c.get("family") in families and c.get("status") == "refused"]
    if not refused:
        return None, None
    stand_in = best_of(contenders, (STAND_IN[group],))
    return (stand_in, refused[0].get("reason") or "refused") if stand_in else (None, None)


def ort_exhaustive_cold(case: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ORT EXHAUSTIVE configuration without CUDA graphs with the shortest session + first run
    (the one kindest to ORT)."""
    pool = [
        c for c in case.get("contenders", [])
        if c.get("family") == "ort" and (c.get("config") or {}).get("cudnn_conv_algo_search") == "EXHAUSTIVE"
        and c.get("status") in RANKABLE and isinstance(c.get("cold_start_s"), (int, float))
    ]
    return min(pool, key=lambda c: c["cold_start_s"]) if pool else None


def fresh_total(c: Mapping[str, Any] | None) -> float | None:
    """A contender's fresh-process time to the first result (spawn -> first result in host memory),
    when its fresh process gave a valid result; else None."""
    rec = (c or {}).get("fresh") or {}
    total = (rec.get("parts") or {}).get("total_s")
    return float(total) if rec.get("status") in RANKABLE and isinstance(total, (int, float)) and total > 0 else None


def fastest_fresh(case: Mapping[str, Any], family: str, search: str | None = None) -> Mapping[str, Any] | None:
    """The ``family`` contender (ORT: of ``cudnn_conv_algo_search`` ``search``) with the shortest
    fresh-process time (the layout kindest to the peer), or None."""
    pool = [
        c for c in case.get("contenders", [])
        if c.get("family") == family and fresh_total(c) is not None
        and (search is None or (c.get("config") or {}).get("cudnn_conv_algo_search") == search)
    ]
    return min(pool, key=fresh_total) if pool else None


def non_conv_share(profile: Mapping[str, Any] | None) -> float | None:
    """GPU time outside convolutions / the tuned model's GPU time, from its op profile (None: not measured)."""
    p = profile or {}
    total, non_conv = p.get("total_ms"), p.get("non_conv_ms")
    if p.get("status") != "ok" or not isinstance(total, (int, float)) or total <= 0 or not isinstance(non_conv, (int, float)):
        return None
    return non_conv / total


def _ratio(ours: Mapping[str, Any] | None, best: Mapping[str, Any] | None) -> float | None:
    return ours["median_ms"] / best["median_ms"] if ours is not None and rankable(ours) and best else None


def annotate_case(case: dict[str, Any]) -> dict[str, Any]:
    """Fill ``best``, ``stand_ins``, each contender's ``ratio_to_best_peer`` and ``ratios`` (module docstring)."""
    cs = case.get("contenders", [])
    for old in ("best_peer", "best_ort", "best_torch"):  # what documents before peer groups recorded
        case.pop(old, None)
    best: dict[str, Mapping[str, Any] | None] = {}
    stand_ins: dict[str, str] = {}
    for group in PEER_GROUPS:
        best[group], why = best_in_group(cs, group)
        if why is not None:
            stand_ins[group] = why
    for c in cs:
        c["ratio_to_best_peer"] = _ratio(c, best["all"])
    case["best"] = {g: (c["name"] if c else None) for g, c in best.items()}
    case["stand_ins"] = stand_ins
    ours = find(case, "convpass")
    ok = ours is not None and rankable(ours)
    cold = ort_exhaustive_cold(case)
    ours_cold = ours.get("cold_start_s") if ok else None
    ours_fresh = fresh_total(ours)
    heuristic, exhaustive = fastest_fresh(case, "ort", "HEURISTIC"), fastest_fresh(case, "ort", "EXHAUSTIVE")
    later = (case.get("model_order") or 0) >= 2
    same = case.get("same_executor") or {}
    case["ratios"] = {
        **{ratio_key(g): _ratio(ours, c) for g, c in best.items()},
        "cold_start_speedup_vs_ort_exhaustive": (
            cold["cold_start_s"] / ours_cold if cold and isinstance(ours_cold, (int, float)) and ours_cold > 0 else None
        ),
        "ort_exhaustive_cold": cold["name"] if cold else None,
        "fresh_vs_ort_heuristic": ours_fresh / fresh_total(heuristic) if ours_fresh and heuristic else None,
        "fresh_vs_ort_exhaustive": ours_fresh / fresh_total(exhaustive) if ours_fresh and exhaustive else None,
        "ort_heuristic_fresh": heuristic["name"] if heuristic else None,
        "ort_exhaustive_fresh": exhaustive["name"] if exhaustive else None,
        # seconds, not a ratio: a model's second (or later) batch size in the same process, i.e. in
        # the executor that ran its first one (convpass_contender.run_batch_sizes_in_one_executor)
        "second_case_cold_start_s": same.get("seconds") if later and same.get("status") == "ok" else None,
        "non_conv_share": non_conv_share(case.get("op_profile")),
    }
    return case


def summarize_rankings(cases: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """convpass against each peer group over the (annotated) cases: per group, the geometric mean
    of ``vs_<group>`` over the batch-1 cases and over the batch > 1 cases, the worst case, the
    cases where a stand-in was the best and those with no ratio (a case where convpass itself
    gave no valid result has none)."""
    out: dict[str, dict[str, Any]] = {}
    for group, (families, title) in PEER_GROUPS.items():
        key = ratio_key(group)
        got = {case_label(c): ((c.get("ratios") or {}).get(key), c.get("batch")) for c in cases}
        ratios = {k: v for k, (v, _) in got.items() if isinstance(v, (int, float)) and v > 0}
        per_group = {}
        for bg in BATCH_GROUPS:
            xs = [v for k, v in ratios.items() if batch_group(got[k][1]) == bg]
            per_group[bg] = {"n": len(xs), "geomean": geomean(xs)}
        worst = max(ratios.items(), key=lambda kv: kv[1]) if ratios else None
        out[group] = {
            "title": title, "families": list(families), "n": len(ratios), "groups": per_group,
            "worst": worst[1] if worst else None, "worst_case": worst[0] if worst else None,
            "stand_ins": {case_label(c): (c.get("stand_ins") or {})[group] for c in cases if group in (c.get("stand_ins") or {})},
            "not_measured": [k for k in got if k not in ratios],
        }
    return out
