"""The model-level records of a tuned model, in its ``metadata_props``: the schema version, the
devices of the decision tables, the shape profiles (:class:`Profile`), the options and the
precision record (:class:`ModelInfo`, written by :func:`metadata_entries`, read by
:func:`read_model_info`), and the fusion decisions (:class:`FusionRecord`, versioned on its own:
:func:`fusion_entries`, :func:`read_fusions`).

The format is described once, in :mod:`convpass.core.annotation`, which is also where callers
import these names from.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import onnx

from convpass.core.annotation_decisions import AnnotationError
from convpass.core.device import DeviceFingerprint
from convpass.core.fusion_units import unit_key

__all__ = [
    "FUSIONS_KEY",
    "FUSIONS_VERSION",
    "MAX_DEVICES",
    "MAX_META_BYTES",
    "MAX_PROFILES",
    "MEASURED",
    "META_PREFIX",
    "NOT_MEASURED",
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "FusionDecision",
    "FusionRecord",
    "ModelInfo",
    "Profile",
    "fusion_entries",
    "metadata_entries",
    "read_fusions",
    "read_model_info",
]

SCHEMA_VERSION = 7
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6, 7)

META_PREFIX = "convpass."
# what a tuned model may declare (a file of any size could declare more)
MAX_PROFILES = 256
MAX_DEVICES = 64
MAX_META_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Profile:
    """A shape profile: concrete shapes for the model's inputs."""

    name: str
    inputs: Mapping[str, tuple[int, ...]]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "inputs": {k: list(v) for k, v in self.inputs.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Profile:
        inputs = {str(k): tuple(int(d) for d in v) for k, v in data["inputs"].items()}
        for k, dims in inputs.items():
            if len(dims) > 64 or any(not 0 < d < 2**63 for d in dims):
                raise ValueError(f"profile input {k[:40]!r} has dims {str(list(dims))[:80]}, not a shape")
        return cls(str(data["name"]), inputs)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Model-level convpass metadata.

    ``devices`` lists the fingerprint of every decision table, in table order; ``device`` is the
    one whose table was read (the first by default, "" when the model has no device) and
    ``cudnn_version`` its cuDNN version. Given only ``device``, ``devices`` is ``(device,)``.
    """

    schema_version: int
    convpass_version: str
    device: str
    cudnn_version: str
    mode: str
    profiles: tuple[Profile, ...]
    matmul_allow_tf32: bool
    options: Mapping[str, Any]
    devices: tuple[str, ...] = ()
    precision: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # convpass.precision (schema 7)

    def __post_init__(self) -> None:
        if not self.devices and self.device:
            object.__setattr__(self, "devices", (self.device,))
        if self.device not in self.devices and (self.device or self.devices):
            raise ValueError(f"ModelInfo.device {self.device!r} is not one of its devices {list(self.devices)}")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"ModelInfo.devices lists a device twice: {list(self.devices)}")

    @property
    def tables(self) -> int:
        """How many decision tables each annotated node holds."""
        return max(1, len(self.devices))

    def table_of(self, device: DeviceFingerprint | str) -> int | None:
        """The index of ``device``'s table (fingerprints compared exactly), or None."""
        wanted = _canonical_device(str(device))
        for i, d in enumerate(self.devices):
            if _canonical_device(d) == wanted:
                return i
        return None

    def for_table(self, table: int) -> ModelInfo:
        """This metadata with ``device`` (and its cuDNN version) naming table ``table``'s device."""
        device = self.devices[table] if self.devices else ""
        return dataclasses.replace(self, device=device, cudnn_version=_cudnn_of(device))


def _canonical_device(text: str) -> str:
    try:
        return str(DeviceFingerprint.parse(text))
    except ValueError:
        return text


def _cudnn_of(device: str) -> str:
    """The cuDNN version of a fingerprint as written in metadata (``91900``), "" without one."""
    try:
        return str(DeviceFingerprint.parse(device).cudnn_version)
    except ValueError:
        return ""


# --------------------------------------------------------------------------------------------
# the model's metadata


def metadata_entries(info: ModelInfo) -> dict[str, str]:
    """Model metadata (key -> value) for a tuned model, in the current schema."""
    entries = {
        f"{META_PREFIX}schema_version": str(SCHEMA_VERSION),
        f"{META_PREFIX}version": info.convpass_version,
        f"{META_PREFIX}devices": json.dumps(list(info.devices)),
        f"{META_PREFIX}mode": info.mode,
        f"{META_PREFIX}profiles": json.dumps([p.to_json() for p in info.profiles]),
        f"{META_PREFIX}matmul_allow_tf32": "1" if info.matmul_allow_tf32 else "0",
        f"{META_PREFIX}options": json.dumps(dict(info.options), sort_keys=True),
    }
    if info.precision:
        entries[f"{META_PREFIX}precision"] = json.dumps(dict(info.precision), sort_keys=True)
    return entries


def read_model_info(model: onnx.ModelProto) -> ModelInfo | None:
    """The convpass metadata of a model (``device`` = its first table's), or None if it was never
    tuned by convpass.

    Raises AnnotationError for a schema this version cannot read.
    """
    meta = {p.key: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
    if not meta:
        return None
    raw = meta.get(f"{META_PREFIX}schema_version", "")
    try:
        version = int(raw)
    except ValueError:
        raise AnnotationError(f"convpass.schema_version is {raw!r}, not a number: the model's annotations are damaged") from None
    if version > SCHEMA_VERSION:
        raise AnnotationError(
            f"model was tuned by a newer convpass (annotation schema {version}; this convpass reads up to "
            f"{SCHEMA_VERSION}): upgrade convpass or re-run `convpass optimize` on the original model"
        )
    if version not in READABLE_SCHEMA_VERSIONS:
        raise AnnotationError(
            f"model was tuned with annotation schema {version}, which this convpass no longer reads: "
            "re-run `convpass optimize` on the original model"
        )
    for key, value in meta.items():
        if len(value) > MAX_META_BYTES:
            raise AnnotationError(f"metadata {key[:60]!r} holds {len(value):,} characters, more than the {MAX_META_BYTES:,} convpass reads")
    try:
        listed_profiles = json.loads(meta.get(f"{META_PREFIX}profiles", "[]"))
        if not isinstance(listed_profiles, list):
            raise ValueError(f"convpass.profiles must be a list, got {type(listed_profiles).__name__}")
        if len(listed_profiles) > MAX_PROFILES:
            raise AnnotationError(f"the model declares {len(listed_profiles):,} shape profiles; convpass reads at most {MAX_PROFILES}")
        profiles = tuple(Profile.from_json(p) for p in listed_profiles)
        options = json.loads(meta.get(f"{META_PREFIX}options", "{}"))
        precision = json.loads(meta.get(f"{META_PREFIX}precision", "{}")) if version >= 7 else {}
        if not isinstance(precision, dict):
            raise ValueError(f"convpass.precision must be a JSON object, got {precision!r}")
        if version == 1:
            one = meta.get(f"{META_PREFIX}device", "")
            devices: tuple[str, ...] = (one,) if one else ()
        else:
            listed = json.loads(meta.get(f"{META_PREFIX}devices", "[]"))
            if not isinstance(listed, list) or not all(isinstance(d, str) and d for d in listed):
                raise ValueError(f"convpass.devices must be a list of fingerprints, got {str(listed)[:80]!r}")
            if len(listed) > MAX_DEVICES:
                raise AnnotationError(f"the model declares {len(listed):,} device tables; convpass reads at most {MAX_DEVICES}")
            devices = tuple(listed)
        info = ModelInfo(
            schema_version=version,
            convpass_version=meta.get(f"{META_PREFIX}version", ""),
            device=devices[0] if devices else "",
            cudnn_version=_cudnn_of(devices[0] if devices else ""),
            mode=meta.get(f"{META_PREFIX}mode", ""),
            profiles=profiles,
            matmul_allow_tf32=meta.get(f"{META_PREFIX}matmul_allow_tf32", "0") == "1",
            options=options,
            devices=devices,
            precision=precision,
        )
    except AnnotationError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AnnotationError(f"convpass metadata is damaged: {str(e)[:200]}") from None
    except RecursionError:
        raise AnnotationError("convpass metadata is damaged: JSON nested too deeply") from None
    return info


# --------------------------------------------------------------------------------------------
# fusion decisions: a model-level record beside the per-conv decisions (:mod:`convpass.core.annotation`)

FUSIONS_KEY = f"{META_PREFIX}fusions"
FUSIONS_VERSION = 1
MEASURED = "measured"
NOT_MEASURED = "not measured"


@dataclasses.dataclass(frozen=True)
class FusionDecision:
    """Whether one fusion unit runs fused on one device for one profile (:mod:`convpass.core.annotation`)."""

    device: str
    profile: int
    fused: bool | None
    source: str
    times_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "profile": self.profile, "fused": self.fused, "source": self.source,
                "times_ms": {k: float(v) for k, v in self.times_ms.items()}}


@dataclasses.dataclass(frozen=True)
class FusionRecord:
    """Every fusion unit's decisions: unit key (:func:`convpass.core.fusion_units.unit_key`) ->
    (kind, node names, decisions)."""

    units: Mapping[str, tuple[str, tuple[str, ...], tuple[FusionDecision, ...]]]

    def decision(self, key: str, device: DeviceFingerprint | str | None, profile: int | None) -> FusionDecision | None:
        """The decision of unit ``key`` for ``device`` (fingerprints compared exactly; None or "":
        the decision recorded without a device) and ``profile``, or None when there is none."""
        entry = self.units.get(key)
        if entry is None or profile is None:
            return None
        wanted = _canonical_device(str(device)) if device else ""
        for d in entry[2]:
            if d.profile == profile and (_canonical_device(d.device) if d.device else "") == wanted:
                return d
        return None

    def to_json(self) -> dict[str, Any]:
        return {"version": FUSIONS_VERSION,
                "units": [{"kind": kind, "nodes": list(nodes), "decisions": [d.to_json() for d in decisions]}
                          for kind, nodes, decisions in self.units.values()]}


def fusion_entries(record: FusionRecord) -> dict[str, str]:
    """The model metadata (key -> value) holding ``record``."""
    return {FUSIONS_KEY: json.dumps(record.to_json(), sort_keys=True)}


def read_fusions(model: onnx.ModelProto) -> FusionRecord | None:
    """The model's fusion decisions, or None when it records none. Raises AnnotationError for a
    damaged record or a newer version than this convpass reads."""
    raw = next((p.value for p in model.metadata_props if p.key == FUSIONS_KEY), None)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        version = int(data.get("version", 0))
        if version > FUSIONS_VERSION:
            raise AnnotationError(f"{FUSIONS_KEY} is version {version}; this convpass reads up to {FUSIONS_VERSION}: "
                                  "upgrade convpass or re-run `convpass optimize`")
        units: dict[str, tuple[str, tuple[str, ...], tuple[FusionDecision, ...]]] = {}
        for u in data["units"]:
            nodes = tuple(str(n) for n in u["nodes"])
            decisions = tuple(
                FusionDecision(str(d.get("device", "")), int(d["profile"]), None if d.get("fused") is None else bool(d["fused"]),
                               str(d.get("source", NOT_MEASURED)), {str(k): float(v) for k, v in dict(d.get("times_ms", {})).items()})
                for d in u["decisions"])
            units[unit_key(nodes)] = (str(u["kind"]), nodes, decisions)
    except AnnotationError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AnnotationError(f"{FUSIONS_KEY} is damaged: {e}") from None
    return FusionRecord(units)
