"""The JSON documents the verbs print under ``--json`` (and write with ``--json-file``), as JSON Schema.

One document per verb, named by its ``schema`` field (``convpass.<verb>/<version>``); docs/cli.md
describes each field. A version changes when a field is removed or changes meaning; new fields
may be added within a version.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMAS"]

_NUM = {"type": ["number", "null"]}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_OPT_STR = {"type": ["string", "null"]}
_DIMS = {"type": "array", "items": {"type": "integer"}}


def _doc(name: str, properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": name,
        "type": "object",
        "properties": {"schema": {"const": name}, **properties},
        "required": ["schema", *(required if required is not None else properties)],
    }


_PROFILE = {"type": "object", "properties": {"name": _STR, "inputs": {"type": "object", "additionalProperties": _DIMS}},
            "required": ["name", "inputs"]}

_RECORD = {
    "type": "object",
    "properties": {
        "node": _STR, "op": _STR, "device": _OPT_STR, "profile": _OPT_STR, "problem_key": _STR, "algo": _OPT_STR,
        "engine": _OPT_STR, "fusion": _OPT_STR, "dgrad_algo": _OPT_STR, "wgrad_algo": _OPT_STR,
        "memory_format": _OPT_STR, "math_mode": _OPT_STR, "tf32": {"type": ["boolean", "null"]},
        "workspace_bytes": {"type": ["integer", "null"]}, "time_ms": _NUM,
        "source": {"enum": ["measure", "exhaustive", "heuristic", "forced", "cache", "auto", "untuned"]},
    },
    "required": ["node", "op", "device", "profile", "problem_key", "algo", "memory_format", "math_mode", "tf32",
                 "workspace_bytes", "time_ms", "source"],
}

_OUTPUT = {
    "type": "object",
    "properties": {"name": _STR, "shape": _DIMS, "dtype": _STR, "min": _NUM, "max": _NUM, "mean": _NUM,
                   "nonfinite": _INT, "file": _OPT_STR},
    "required": ["name", "shape", "dtype", "min", "max", "mean", "nonfinite", "file"],
}

_ERROR = {
    "type": "object",
    "properties": {"name": _STR, "max_abs_error": _NUM, "max_rel_error": _NUM, "ok": {"type": "boolean"}, "note": _STR},
    "required": ["name", "max_abs_error", "max_rel_error", "ok"],
}

_NUMBER = {"type": "number"}
_IN_PLACE = {  # per profile: convpass.runtime.in_place.InPlaceReport.to_json(); null when it did not run
    "type": ["array", "null"],
    "items": {"type": "object", "properties": {
        "how": _STR, "reliable": {"type": "boolean"}, "slow_ratio": _NUMBER, "floor_ms": _NUMBER,
        "convs": {"type": "array", "items": {"type": "object", "properties": {
            "node": _STR, "profile": _INT, "tuned_ms": _NUMBER, "in_place_ms": _NUMBER, "raw_ms": _NUMBER,
            "floor_ms": _NUMBER, "ratio": _NUMBER, "algo": _STR, "memory_format": _STR},
            "required": ["node", "profile", "tuned_ms", "in_place_ms", "raw_ms", "floor_ms", "ratio"]}}},
        "required": ["how", "reliable", "floor_ms", "convs"]},
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "convpass.optimize/1": _doc("convpass.optimize/1", {
        "model": _STR, "output": _OPT_STR, "convolutions": _INT,
        "untuned": {"type": "array", "items": {"type": "object", "properties": {"node": _STR, "reason": _STR},
                                               "required": ["node", "reason"]}},
        "problems": _INT, "profiles": {"type": "array", "items": _PROFILE}, "backend": _STR, "device": _OPT_STR,
        "decisions": {"type": "object", "properties": {"measured": _INT, "cached": _INT, "auto": _INT},
                      "required": ["measured", "cached", "auto"]},
        "tuning": {"type": ["object", "null"]},
        "conv_time_ms": {"type": "object", "additionalProperties": {
            "type": "object", "properties": {"chosen": {"type": "number"}, "heuristic": {"type": "number"}, "convs": _INT}}},
        "notes": {"type": "array", "items": _STR},
        "kernels": _OPT_STR,
        "in_place": _IN_PLACE,
    }, ["model", "output", "convolutions", "untuned", "problems", "profiles", "backend", "device", "decisions", "tuning",
        "conv_time_ms", "notes", "kernels"]),
    "convpass.compile/1": _doc("convpass.compile/1", {
        "model": _STR, "sidecar": _STR, "kernels": _INT, "archs": {"type": "object", "additionalProperties": _INT},
        "profiles": {"type": "array", "items": _STR}, "plans": _INT, "failed": {"type": "array", "items": _STR},
        "seconds": {"type": "number"}, "in_place": _IN_PLACE,
    }, ["model", "sidecar", "kernels", "archs", "profiles", "plans", "failed", "seconds"]),
    "convpass.inspect/1": _doc("convpass.inspect/1", {
        "model": _STR, "records": {"type": "array", "items": _RECORD}, "kernels": _OPT_STR,
    }),
    "convpass.run/1": _doc("convpass.run/1", {
        "model": _STR, "device": {"enum": ["cpu", "cuda"]}, "backend": _STR,
        "inputs": {"type": "array", "items": {"type": "object", "properties": {
            "name": _STR, "shape": _DIMS, "dtype": _STR, "source": _STR}, "required": ["name", "shape", "dtype", "source"]}},
        "outputs": {"type": "array", "items": _OUTPUT},
        "latency_ms": {"type": "object", "properties": {
            "runs": _INT, "warmup": _INT, "median": {"type": "number"}, "p90": {"type": "number"},
            "min": {"type": "number"}, "max": {"type": "number"}}, "required": ["runs", "warmup", "median", "p90"]},
        "compare": {"oneOf": [{"type": "null"}, {"type": "object", "properties": {
            "reference": _STR, "rtol": {"type": "number"}, "atol": {"type": "number"}, "ok": {"type": "boolean"},
            "outputs": {"type": "array", "items": _ERROR}}, "required": ["reference", "rtol", "atol", "ok", "outputs"]}]},
    }),
    "convpass.cache/1": _doc("convpass.cache/1", {
        "action": {"enum": ["stats", "export", "import", "clear"]},
        "path": _STR, "size_bytes": _INT, "measurements": _INT, "keys": _INT, "transposes": _INT,
        "devices": {"type": "array", "items": {"type": "object", "properties": {
            "device": _STR, "keys": _INT, "measurements": _INT}, "required": ["device", "keys", "measurements"]}},
        "file": _STR, "device": _OPT_STR, "entries": _INT, "deleted": _INT, "cache": _STR,
    }, required=["action"]),
    "convpass.tune/1": _doc("convpass.tune/1", {
        "cluster": _STR, "cache": _STR, "devices": {"type": "array", "items": _STR},
        "cache_only_devices": {"type": "array", "items": _STR},
        "models": {"type": "array", "items": {"type": "object", "properties": {
            "model": _STR, "output": _OPT_STR, "convs": _INT, "problems": _INT,
            "decided": {"type": "object", "additionalProperties": _INT},
            "undecided": {"type": "object", "additionalProperties": _INT}}, "required": ["model", "output"]}},
    }, required=["cluster", "devices", "models"]),
}
