"""The JSON document ``convpass bench`` writes, as a JSON Schema (draft 2020-12), checked with
``jsonschema`` (:mod:`convpass.bench.jsonschema_check`).

:func:`document_schema` is the schema of what this version writes (``convpass.bench/4``); with
``recorded=True``, of a recorded document to re-render (``--from-json``): any readable version,
its summary and per-case rankings not checked (they are recomputed). :func:`validate_document`
lists the errors of a document as ``$.path: message`` lines (empty when valid), and checks that
it survives a JSON round trip (no NaN / Inf).
"""

from __future__ import annotations

import json
from typing import Any

from convpass.bench import jsonschema_check, opprofile
from convpass.bench.records import BATCH_GROUPS, FAMILIES, STATUSES
from convpass.bench.targets import VERDICTS

SCHEMA_ID = "convpass.bench/4"
READABLE_SCHEMAS = ("convpass.bench/1", "convpass.bench/2", "convpass.bench/3", SCHEMA_ID)  # --from-json reads these

NUM = {"type": "number"}
INT = {"type": "integer"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
ANY: dict[str, Any] = {}
STRS = {"type": "array", "items": STR}


def _opt(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` or null."""
    out = dict(spec)
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    elif "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
    else:
        out = {"anyOf": [spec, {"type": "null"}]}
    return out


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """An object with these keys: ``required`` ones must be present; ``optional`` ones may be
    absent or null. Other keys are allowed (a newer writer may add some)."""
    props = dict(required) | {k: _opt(v) for k, v in (optional or {}).items()}
    return {"type": "object", "required": list(required), "properties": props}


def _map(values: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": values}


def _list(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


FRESH_SCHEMA = _obj({"status": {"enum": list(STATUSES)}}, {
    "reason": STR, "parts": _map(_opt(NUM)), "compilations": INT, "compiled": STRS, "cache_files": INT, "module": STR,
    "rel_err": NUM, "tolerance": NUM,
})

CONTENDER_SCHEMA = _obj({
    "name": STR, "family": {"enum": list(FAMILIES)}, "config": {"type": "object"}, "status": {"enum": list(STATUSES)},
    "times_ms": _list(NUM),
}, {
    "reason": STR, "cold_start_s": NUM, "session_s": NUM, "first_run_s": NUM, "compile_s": NUM, "median_ms": NUM, "p10_ms": NUM,
    "p90_ms": NUM, "min_ms": NUM, "runs": INT, "rel_err": NUM, "tolerance": NUM, "tf32": BOOL, "ratio_to_best_peer": NUM,
    "tuning": _obj({}, {"in_place": _obj({"line": STR, "timed": INT, "judged": BOOL, "slow": STRS})}),
    "cuda_graph": _obj({"captured": _opt(BOOL), "reason": STR, "node": STR, "text": STR}),
    "fresh": FRESH_SCHEMA,
})

OP_PROFILE_SCHEMA = _obj({"status": {"enum": ["ok", "failed"]}}, {
    "reason": STR, "runs": INT, "method": STR, "host_gaps_excluded": BOOL, "launches": INT, "total_ms": NUM, "conv_ms": NUM,
    "non_conv_ms": NUM, "non_conv_pct": NUM, "top_non_conv_family": {"enum": list(opprofile.FAMILIES)}, "top_non_conv_ms": NUM,
    "families": _map(_obj({"ms": NUM, "launches": INT})),
    "labels": _list(_obj({"label": STR, "op_type": STR, "family": {"enum": list(opprofile.FAMILIES)}, "ms": NUM, "launches": INT})),
    "floor_ms": NUM,
})

ROOFLINE_SCHEMA = _obj({
    "convs": INT, "counted": INT, "flops": NUM, "bytes": NUM, "compute_bound_convs": INT, "peaks": _map(_opt(NUM)),
    "per_conv": _list({"type": "object"}),
}, {"bound_ms": NUM, "measured_conv_ms": NUM, "efficiency": NUM, "note": STR})

_CASE_REQUIRED = {
    "model": STR, "file": STR, "batch": INT, "inputs": _map(_list(INT)), "dtype": STR, "contenders": _list(CONTENDER_SCHEMA),
    "notes": STRS,
}
_CASE_OPTIONAL = {
    "reference": STR, "model_order": INT,
    "same_executor": _obj({"status": {"enum": ["ok", "failed"]}, "after": INT}, {"seconds": NUM, "reason": STR}),
    "roofline": ROOFLINE_SCHEMA, "op_profile": OP_PROFILE_SCHEMA,
}
_RANKED = {"best": _map(_opt(STR)), "stand_ins": _map(STR), "ratios": _map(_opt({"type": ["number", "string"]}))}

_RANKING_SCHEMA = _obj({
    "title": STR, "families": STRS, "n": INT,
    "groups": _obj({g: _obj({"n": INT, "geomean": _opt(NUM)}) for g in BATCH_GROUPS}),
    "worst": _opt(NUM), "worst_case": _opt(STR), "stand_ins": _map(STR), "not_measured": STRS,
})
_TARGET_SCHEMA = _obj({
    "name": STR, "judges": STR, "measure": STR, "rule": STR, "cases": STR, "verdict": {"enum": list(VERDICTS)}, "n": INT,
    "not_measured": STRS,
}, {
    "at_most": NUM, "at_least": NUM, "geomean": NUM, "worst": NUM, "worst_case": STR, "convpass_invalid": STRS, "captured": STRS,
    "not_judged": STRS,
    "per_case": {"type": "object"}, "failing": {"type": ["array", "object"]},
    "groups": _list(_obj({"group": {"enum": list(BATCH_GROUPS)}, "batches": _list(INT), "verdict": {"enum": list(VERDICTS)},
                          "n": INT, "geomean": _opt(NUM), "per_case": _map(NUM), "not_measured": STRS, "convpass_invalid": STRS})),
})

_ENVIRONMENT = _obj({}, {"device": STR, "driver": STR, "cuda_runtime": STR, "cuda_driver_api": STR, "cudnn": STR,
                         "packages": _map(_opt(STR))})
_SETTINGS = _obj({"runs": INT, "warmup": INT, "batches": _map(_list(INT)), "vs": STRS, "tf32": STR, "timing": STR},
                 {"profile_ops": INT, "fresh_process": _obj({"timeout_s": NUM}), "targets": {"type": ["array", "object"]},
                  "targets_file": STR, "torch_compile_modes": STRS})


def document_schema(recorded: bool = False) -> dict[str, Any]:
    """The schema of a document this version writes, or (``recorded``) of one it re-renders."""
    case = _obj(_CASE_REQUIRED | ({} if recorded else _RANKED), _CASE_OPTIONAL)
    required = {
        "schema": {"enum": list(READABLE_SCHEMAS) if recorded else [SCHEMA_ID]},
        "environment": _ENVIRONMENT, "settings": _SETTINGS, "cases": _list(case), "notes": STRS,
    }
    if not recorded:
        required["summary"] = _obj({"cases": INT, "rankings": _map(_RANKING_SCHEMA), "targets": _list(_TARGET_SCHEMA)})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **_obj(required, {
        "created": STR, "peaks": _map(_opt(NUM))})}


def validate_document(doc: Any, recorded: bool = False) -> list[str]:
    """Schema errors of a bench document (empty when valid), then whether it survives a JSON round
    trip. ``recorded``: check a document to re-render instead of one this version writes."""
    errors = jsonschema_check.errors(doc, document_schema(recorded))
    if not errors:
        try:
            json.loads(json.dumps(doc, allow_nan=False))
        except (TypeError, ValueError) as e:
            errors.append(f"$: not JSON-serializable without NaN / Inf: {e}")
    return errors
