"""The document ``convpass bench`` writes and reads back: environment, settings, measured peaks,
the annotated cases, the summary (rankings against every peer group and the targets' verdicts)
and notes. Its schema is :mod:`convpass.bench.schema`.

A *case* is one model at one batch: its contenders (:mod:`convpass.bench.records`), the best of
each peer group and the ratios (:mod:`convpass.bench.ranking`), the ``roofline`` and, with
``--profile-ops``, the ``op_profile`` (:mod:`convpass.bench.opprofile`). With
``--fresh-process``, every contender that runs in a fresh process also has a ``fresh`` record
(:mod:`convpass.bench.fresh`). A case records ``model_order``: 1 for the first case of its model in
the bench process, 2 for the next batch size, and so on. The convpass contender records
``cuda_graph``: the executor's graph status after its steady-state runs.

Documents are ``convpass.bench/4``; versions 1 to 3 are read too: ``--from-json`` recomputes the
rankings and the summary, and what they did not record shows as ``?`` / not measured (their
``model_order`` is their cases' order: the bench has always run a model's batch sizes one after
the other in one process).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from convpass.bench import ranking
from convpass.bench import targets as targets_mod
from convpass.bench.schema import SCHEMA_ID
from convpass.core.files import write_text_atomically

DOCUMENT_LIMIT = 64 << 20  # bytes of a recorded document --from-json reads (a run of many cases is a few MB)


def summarize(cases: Sequence[Mapping[str, Any]], targets: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The rankings against every peer group and each target's verdict (default: the packaged
    targets), over annotated cases."""
    judged = targets if targets is not None else targets_mod.load()
    return {"cases": len(cases), "rankings": ranking.summarize_rankings(cases), "targets": targets_mod.judge_all(cases, judged)}


def build_document(environment: Mapping[str, Any], settings: Mapping[str, Any], peaks: Mapping[str, Any] | None,
                   cases: Sequence[dict[str, Any]], created: str | None = None, notes: Sequence[str] = (),
                   targets: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON document: environment, settings (with the targets judged by), peaks, the
    annotated cases and the summary. ``targets``: default the packaged targets file's."""
    judged = list(targets) if targets is not None else targets_mod.load()
    for case in cases:
        ranking.annotate_case(case)
    return {
        "schema": SCHEMA_ID,
        "created": created,
        "environment": copy.deepcopy(dict(environment)),
        "settings": copy.deepcopy(dict(settings)) | {"targets": copy.deepcopy(judged)},
        "peaks": dict(peaks) if peaks else None,
        "cases": list(cases),
        "summary": summarize(cases, judged),
        "notes": list(notes),
    }


def merge_documents(docs: Sequence[Mapping[str, Any]], targets: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Several recorded runs as one document (cases concatenated, rankings and summary recomputed
    against ``targets``, default the packaged ones). The environment and settings of the first
    run are kept; runs on another device are noted."""
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    cases = []
    for d in docs:
        order: dict[Any, int] = {}
        for c in d.get("cases", []):
            order[c.get("model")] = order.get(c.get("model"), 0) + 1
            # documents that did not record it: a run's cases in the order its process ran them
            cases.append(dict(c) if c.get("model_order") is not None else dict(c, model_order=order[c.get("model")]))
    notes = list(dict.fromkeys(n for d in docs for n in d.get("notes", [])))  # parts of one run share their notes
    devices = {(d.get("environment") or {}).get("device") for d in docs}
    if len(devices) > 1:
        notes.append(f"merged runs from different devices: {', '.join(sorted(map(str, devices)))}; ratios are per run")
    return build_document(first.get("environment") or {}, first.get("settings") or {}, first.get("peaks"), cases,
                          first.get("created"), notes, targets)


def to_json(doc: Mapping[str, Any]) -> str:
    return json.dumps(_finite(doc), indent=2) + "\n"


def _finite(x: Any) -> Any:
    """NaN / Inf (not JSON) become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str | os.PathLike, doc: Mapping[str, Any], what: str = "--json-file",
               protect: Sequence[tuple[str | os.PathLike, str]] = ()) -> None:
    """Atomically: a reader (or an interrupted run) never sees half a document; never over one of
    the files ``protect`` names, or a special file (:func:`convpass.core.files.write_text_atomically`)."""
    write_text_atomically(path, to_json(doc), what, protect)

