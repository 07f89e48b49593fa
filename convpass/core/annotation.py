"""The annotation schema: how a tuned model records its convolution decisions.

This module is the only place that knows the format; the annotate pass writes through it, and
``inspect``, the executor and everything else read through it.

Format (schema version 7)
-------------------------
* Every tuned ``Conv`` / ``ConvTranspose`` node is the same op in domain ``ai.convpass``, with all
  its original attributes unchanged, plus the decision attributes below. (schema 6) A node without
  a bias input is ``ConvNoBias`` / ``ConvTransposeNoBias`` there (:func:`standard_op_type` maps
  back).
* The model carries one model-local function per such op (``ai.convpass.Conv``,
  ``ai.convpass.ConvNoBias``, ...) whose body is the standard op with every standard attribute
  passed through by reference, so ``onnx.checker.check_model(full_check=True)`` accepts the model
  and ONNX Runtime runs it unchanged. The bias-less functions take ``X, W`` only: a function with a
  ``B`` input, called without one, inlines to a conv with an empty bias input, which ONNX
  Runtime's CPU layout optimizer (NCHWc, 1.32) leaves alone (measured: a torch.export ResNet-50,
  whose convs have no bias, ran 20-30% slower in ONNX Runtime CPU once tuned under schema 5).
  The model imports ``ai.convpass`` version 1 and keeps an IR version that allows model-local
  functions (>= 8).
* **Per-device tables.** A model holds one decision table per device fingerprint it was tuned for
  (``convpass.devices``, in table order; one table with no device when nothing could be measured
  or looked up, and then every decision is ``auto``). A table has one decision per shape profile
  (``convpass.profiles``). Each decision attribute holds one value per (table, profile), device-major:
  entry ``t * n_profiles + p`` is table ``t``'s decision for profile ``p``; a single entry is
  written as a scalar.

  ``algo``            legacy algorithm that runs the node: the forward algorithm of a Conv, the
                      backward-data algorithm of a ConvTranspose; ``"auto"`` = chosen at run time.
                      When ``engine`` is set, the legacy algorithm nearest to that engine (the
                      fastest measured for the same key, else cuDNN's heuristic first choice), which
                      runs where the graph API cannot. It may also name convpass's own kernel
                      (``convpass_depthwise_r8``: :mod:`convpass.kernels.depthwise`), which
                      runs like a legacy algorithm, its ``fusion`` in the kernel
  ``engine``          (optional, schema 3) the cuDNN graph-API engine configuration that runs the
                      node, as cuDNN names its plans (``eng67_k2=16_k13=0``: engine id, then knob
                      id = value), of the graph ``y = conv(x, w)`` (the bias follows as its own
                      pass; :mod:`convpass.native.cudnn.graph_api`); ``""`` = the legacy ``algo`` runs. The
                      device fingerprint of the table names the cuDNN version it was measured with
  ``fusion``          (optional, schema 4) the epilogue fused into ``engine``'s graph, named by what
                      follows the conv: ``bias+swish`` = ``y = silu(conv(x, w) + b)``, the graph the
                      engine configuration belongs to (the executor runs the node's bias and its
                      SiLU readers in that one call); ``""`` = the bare conv. (schema 5) With no
                      ``engine``: the legacy epilogue (:mod:`convpass.core.fusion`: ``bias``,
                      ``bias+relu``, ``bias+add``, ``bias+add+relu``) fused into ``algo``'s call,
                      cuDNN's ``cudnnConvolutionBiasActivationForward``; ``""`` = the conv runs
                      alone and its epilogue as one element-wise pass
  ``dgrad_algo``      (optional, Conv only) backward-data algorithm for training
  ``wgrad_algo``      (optional, Conv only) backward-filter algorithm for training
  ``memory_format``   NCHW / NHWC (NCW / NWC, NCDHW / NDHWC by rank) or ``"auto"``
  ``math_mode``       cuDNN math type: ``default`` (TF32 allowed for fp32), ``tensor_op``, ``fma``
                      (TF32 off), or ``"auto"``
  ``workspace_bytes`` workspace the algorithm needs; -1 = unknown
  ``time_ms``         measured time of the chosen configuration, with its epilogue (schema 5: the
                      conv's step); NaN = not measured
  ``problem_key``     :class:`convpass.core.problem.ProblemKey` string of the decided problem, or ``""``
  ``source``          how the decision was taken: ``measure``, ``exhaustive``, ``heuristic``,
                      ``forced`` (on the GPU, by that strategy: from timings of this run or of an
                      earlier one in the tuning cache alike, so a re-run writes the same model),
                      ``cache`` (looked up without that GPU: ``--device-name``, or a cache-only
                      device of ``convpass tune``) or ``auto`` (not decided)

* **Precision** (schema 7; docs/precision.md). A conv's precision is read from its decision, not
  stored twice: ``fp16`` / ``bf16`` when its problem key's data type is float16 / bfloat16 (the
  graph holds the conv in that type, with Casts at its region's boundary), else ``tf32`` or ``fp32``
  by its math mode (``fma`` = fp32). Where ``optimize`` measured errors (``--precision``), each conv
  node also has, once per node (not per table or profile):

  ``precision_error``        the model's error with this conv alone at its recorded precision and
                             every other conv in FP32 (its error contribution; NaN = not measured)
  ``precision_sensitivity``  the same with this conv alone in the reduced type (FP16): what ranked
                             it when the budget loop moved convs up (NaN = not measured)

* Model metadata (``metadata_props``): ``convpass.schema_version``, ``convpass.version``,
  ``convpass.devices`` (JSON list of device fingerprints, one per table), ``convpass.mode``,
  ``convpass.profiles`` (JSON), ``convpass.matmul_allow_tf32`` (``0``/``1``: MindSpore's
  ``matmul_allow_tf32``, for Gemm / MatMul), ``convpass.options`` (JSON of the options used),
  and (schema 7, where errors were measured) ``convpass.precision``: JSON with ``mode``,
  ``metric``, ``max_error``, ``reduced`` (the reduced type), ``evaluator``, ``calibration`` and
  ``holdout`` (each ``{"error": float, "inputs": text}``), ``within_budget``, ``casts``, ``note``.
* ``convpass.fusions`` (optional; versioned on its own, :data:`FUSIONS_VERSION`, so it changes
  nothing of the per-conv schema): the fusion decisions, JSON ``{"version": 1, "units": [...]}``,
  one entry per fusion unit (:mod:`convpass.core.fusion_units`): its ``kind``, its ``nodes`` (names,
  in order: the unit's key) and its ``decisions``, one per (device, profile): ``device`` (a
  fingerprint, ``""`` when none), ``profile`` (index), ``fused`` (true / false, or null when
  nothing was measured), ``source`` (``measured`` or ``not measured``: then the executor applies
  the kind's rule) and ``times_ms`` (what was timed: ``fused_nchw``, ``fused_nhwc``,
  ``unfused_nchw``). Read by :func:`read_fusions`, written by :func:`fusion_entries`.

Schema 6 (still read) is schema 7 without the precision attributes and metadata.
Schema 5 (still read) is schema 6 with every conv named by its standard op, bias or not.
Schema 4 (still read) is schema 5 with ``fusion`` for engines only and times of the bare conv: its
legacy decisions run the conv alone and the epilogue as one pass, as they were timed. Schema 3 is
schema 4 without ``fusion``; schema 2 is schema 3 without ``engine``. Schema 1 (still read): one device, named by ``convpass.device`` (empty when none) with its cuDNN
version in ``convpass.cudnn_version``; one value per profile. It reads as one table.

Reading for a device
--------------------
:func:`read_annotations` with ``device=`` returns that device's table. For a device the model has
no table for it returns the first table and a :class:`ModelInfo` whose ``device`` names the device
that table belongs to, so a caller that compares ``ModelInfo.device`` with its own GPU (the CUDA
executor does) sees the mismatch and runs cuDNN's heuristic with one warning, as it does for any
model tuned elsewhere. ``device=None`` reads the first table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import onnx
from onnx import helper

from convpass.core.device import DeviceFingerprint
from convpass.core.fusion_units import unit_key
from convpass.core.errors import ConvpassError

DOMAIN = "ai.convpass"
DOMAIN_VERSION = 1
SCHEMA_VERSION = 7
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
CONV_OPS = ("Conv", "ConvTranspose")
BIASLESS_SUFFIX = "NoBias"
# the op types of annotated convs in DOMAIN -> the standard op each one runs
ANNOTATED_OPS = {**{op: op for op in CONV_OPS}, **{op + BIASLESS_SUFFIX: op for op in CONV_OPS}}

# Lowest IR version with model-local functions; and the highest ONNX Runtime 1.31 reads.
MIN_IR_VERSION = 8
MAX_IR_VERSION = 13

AUTO = "auto"
SOURCES = ("measure", "exhaustive", "heuristic", "forced", "cache", AUTO)

_A = onnx.AttributeProto
STANDARD_ATTRIBUTES: dict[str, dict[str, int]] = {
    "Conv": {
        "auto_pad": _A.STRING,
        "dilations": _A.INTS,
        "group": _A.INT,
        "kernel_shape": _A.INTS,
        "pads": _A.INTS,
        "strides": _A.INTS,
    },
    "ConvTranspose": {
        "auto_pad": _A.STRING,
        "dilations": _A.INTS,
        "group": _A.INT,
        "kernel_shape": _A.INTS,
        "output_padding": _A.INTS,
        "output_shape": _A.INTS,
        "pads": _A.INTS,
        "strides": _A.INTS,
    },
}
DECISION_ATTRIBUTES = (
    "algo",
    "engine",
    "fusion",
    "dgrad_algo",
    "wgrad_algo",
    "memory_format",
    "math_mode",
    "workspace_bytes",
    "time_ms",
    "problem_key",
    "source",
)
# per node, not per (table, profile): the measured error contributions (schema 7)
PRECISION_ATTRIBUTES = ("precision_error", "precision_sensitivity")
_PRECISION_OF_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}

META_PREFIX = "convpass."
# what a tuned model may declare (a file of any size could declare more)
MAX_PROFILES = 256
MAX_DEVICES = 64
MAX_META_BYTES = 1 << 20


class AnnotationError(ConvpassError, ValueError):
    """A tuned model whose convpass annotations cannot be read."""


@dataclasses.dataclass(frozen=True)
class ConvDecision:
    """How one convolution runs for one shape profile."""

    algo: str = AUTO
    memory_format: str = AUTO
    math_mode: str = AUTO
    workspace_bytes: int | None = None
    time_ms: float | None = None
    problem_key: str = ""
    source: str = AUTO
    dgrad_algo: str | None = None
    wgrad_algo: str | None = None
    engine: str = ""
    fusion: str = ""  # the epilogue fused into the engine's graph (schema 4) or the legacy call (5); "" = none

    @property
    def is_auto(self) -> bool:
        return self.algo == AUTO and not self.engine

    @property
    def tf32(self) -> bool | None:
        """TF32 on / off for float32 convs, None when not decided."""
        if self.math_mode == AUTO:
            return None
        return self.math_mode != "fma"

    @property
    def precision(self) -> str | None:
        """fp32 / tf32 / fp16 / bf16 (module docstring, "Precision"); None when not decided."""
        dtype = self.problem_key.split("|")[10] if self.problem_key.count("|") >= 10 else ""
        if dtype in _PRECISION_OF_DTYPE:
            return _PRECISION_OF_DTYPE[dtype]
        if self.math_mode == AUTO:
            return None
        return "fp32" if self.math_mode == "fma" else "tf32"


@dataclasses.dataclass(frozen=True)
class Profile:
    """A shape profile: concrete shapes for the model's inputs."""

    name: str
    inputs: Mapping[str, tuple[int, ...]]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "inputs": {k: list(v) for k, v in self.inputs.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Profile":
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

    def for_table(self, table: int) -> "ModelInfo":
        """This metadata with ``device`` (and its cuDNN version) naming table ``table``'s device."""
        device = self.devices[table] if self.devices else ""
        return dataclasses.replace(self, device=device, cudnn_version=_cudnn_of(device))


@dataclasses.dataclass(frozen=True)
class NodeAnnotation:
    """The decisions recorded on one conv node: ``decisions`` is the read table (one per profile),
    ``tables`` every table, in ``ModelInfo.devices`` order."""

    node_name: str
    op_type: str
    decisions: tuple[ConvDecision, ...]
    tables: tuple[tuple[ConvDecision, ...], ...] = ()
    precision_error: float | None = None  # schema 7 (module docstring, "Precision")
    precision_sensitivity: float | None = None


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
# writing


def decision_attributes(decisions: Sequence[ConvDecision]) -> dict[str, Any]:
    """The decision attributes (name -> Python value) encoding one node's decisions: one per
    (table, profile), device-major (a single table: one per profile)."""
    if not decisions:
        raise ValueError("a conv needs at least one decision (one per table and profile)")
    for d in decisions:
        if d.source not in SOURCES:
            raise ValueError(f"unknown decision source {d.source!r}")
    many = len(decisions) > 1
    pack = (lambda values: list(values)) if many else (lambda values: values[0])
    attrs: dict[str, Any] = {
        "algo": pack([d.algo for d in decisions]),
        "memory_format": pack([d.memory_format for d in decisions]),
        "math_mode": pack([d.math_mode for d in decisions]),
        "workspace_bytes": pack([-1 if d.workspace_bytes is None else int(d.workspace_bytes) for d in decisions]),
        "problem_key": pack([d.problem_key for d in decisions]),
        "source": pack([d.source for d in decisions]),
    }
    if any(d.time_ms is not None for d in decisions):
        attrs["time_ms"] = pack([math.nan if d.time_ms is None else float(d.time_ms) for d in decisions])
    if any(d.engine for d in decisions):
        attrs["engine"] = pack([d.engine for d in decisions])
    if any(d.fusion for d in decisions):
        attrs["fusion"] = pack([d.fusion for d in decisions])
    for name in ("dgrad_algo", "wgrad_algo"):
        values = [getattr(d, name) for d in decisions]
        if any(v is not None for v in values):
            attrs[name] = pack([AUTO if v is None else v for v in values])
    return attrs


def precision_attributes(error: float | None, sensitivity: float | None) -> dict[str, float]:
    """The per-node precision attributes (schema 7) of a conv; none when neither was measured."""
    if error is None and sensitivity is None:
        return {}
    return {"precision_error": math.nan if error is None else float(error),
            "precision_sensitivity": math.nan if sensitivity is None else float(sensitivity)}


def annotated_op_type(op_type: str, has_bias: bool) -> str:
    """The op type in DOMAIN of a tuned ``Conv`` / ``ConvTranspose`` with or without a bias."""
    return op_type if has_bias else op_type + BIASLESS_SUFFIX


def standard_op_type(node: onnx.NodeProto) -> str:
    """The standard op an annotated conv runs (its own op type for any other node)."""
    return ANNOTATED_OPS[node.op_type] if is_annotated_conv(node) else node.op_type


def conv_function(annotated_op: str, opset_version: int) -> onnx.FunctionProto:
    """The model-local function ``ai.convpass.<annotated_op>``: the standard op, attributes by
    reference; ``X, W`` only for a bias-less op type."""
    op_type = ANNOTATED_OPS[annotated_op]
    standard = STANDARD_ATTRIBUTES[op_type]
    inputs = ["X", "W"] if annotated_op != op_type else ["X", "W", "B"]
    body = helper.make_node(op_type, inputs, ["Y"])
    for name, attr_type in standard.items():
        ref = onnx.AttributeProto()
        ref.name = name
        ref.ref_attr_name = name
        ref.type = attr_type
        body.attribute.append(ref)
    return helper.make_function(
        DOMAIN,
        annotated_op,
        inputs,
        ["Y"],
        [body],
        [helper.make_opsetid("", opset_version)],
        attributes=[*standard, *DECISION_ATTRIBUTES, *PRECISION_ATTRIBUTES],
        doc_string=f"convpass-tuned {op_type}: runs as the standard {op_type}; decisions are attributes.",
    )


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


# --------------------------------------------------------------------------------------------
# reading


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of the If / Loop / Scan bodies in it, at any depth, in graph order
    (a node before the nodes of its bodies)."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from all_nodes(g)


def is_annotated_conv(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type in ANNOTATED_OPS


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


def read_node(node: onnx.NodeProto, n_profiles: int, n_tables: int = 1, table: int = 0) -> NodeAnnotation:
    """The decisions recorded on an annotated conv node: table ``table`` of ``n_tables``, one
    decision per profile, in ``decisions``; every table in ``tables``."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in DECISION_ATTRIBUTES}
    name = node.name or node.output[0]
    entries = n_tables * n_profiles

    def per_entry(key: str, default: Any) -> list[Any]:
        if key not in attrs:
            return [default] * entries
        value = attrs[key]
        if isinstance(value, (list, tuple)):
            if len(value) != entries:
                shape = f"{n_profiles} profiles" if n_tables == 1 else f"{n_tables} device tables x {n_profiles} profiles"
                raise AnnotationError(f"node {name!r}: {key} has {len(value)} entries for {shape}")
            values = list(value)
        else:
            values = [value] * entries
        out = []
        for v in values:
            if isinstance(v, bytes):
                try:
                    v = v.decode()
                except UnicodeDecodeError:
                    raise AnnotationError(f"node {name!r}: {key} is not UTF-8 text") from None
            kind = (int, float) if key == "time_ms" else int if key == "workspace_bytes" else str
            if not isinstance(v, kind) or isinstance(v, bool):
                raise AnnotationError(f"node {name!r}: {key} holds {type(v).__name__} values, not {'numbers' if kind is not str else 'text'}")
            out.append(v)
        return out

    if "algo" not in attrs:
        raise AnnotationError(f"node {name!r} is in domain {DOMAIN} but has no 'algo' attribute")
    if not 0 <= table < n_tables:
        raise ValueError(f"table {table} of {n_tables}")
    cols = {
        key: per_entry(key, default)
        for key, default in [
            ("algo", AUTO),
            ("memory_format", AUTO),
            ("math_mode", AUTO),
            ("workspace_bytes", -1),
            ("time_ms", math.nan),
            ("problem_key", ""),
            ("source", AUTO),
            ("dgrad_algo", None),
            ("wgrad_algo", None),
            ("engine", ""),
            ("fusion", ""),
        ]
    }
    decisions = [
        ConvDecision(
            algo=cols["algo"][i],
            memory_format=cols["memory_format"][i],
            math_mode=cols["math_mode"][i],
            workspace_bytes=None if cols["workspace_bytes"][i] < 0 else int(cols["workspace_bytes"][i]),
            time_ms=None if math.isnan(cols["time_ms"][i]) else float(cols["time_ms"][i]),
            problem_key=cols["problem_key"][i],
            source=cols["source"][i],
            dgrad_algo=cols["dgrad_algo"][i],
            wgrad_algo=cols["wgrad_algo"][i],
            engine=cols["engine"][i],
            fusion=cols["fusion"][i],
        )
        for i in range(entries)
    ]
    tables = tuple(tuple(decisions[t * n_profiles:(t + 1) * n_profiles]) for t in range(n_tables))
    measured = {a.name: float(a.f) for a in node.attribute if a.name in PRECISION_ATTRIBUTES}
    error, sensitivity = (measured.get(k, math.nan) for k in PRECISION_ATTRIBUTES)
    return NodeAnnotation(node_name=name, op_type=standard_op_type(node), decisions=tables[table], tables=tables,
                          precision_error=None if math.isnan(error) else error,
                          precision_sensitivity=None if math.isnan(sensitivity) else sensitivity)


def verify_functions(model: onnx.ModelProto, annotated: Sequence[onnx.NodeProto]) -> None:
    """Refuse a tuned model whose annotated convs would not run as the standard op they name: the
    model-local function of each used op type, where the model has it, must have the body
    :func:`conv_function` writes (the standard op, inputs and attributes passed through). ONNX
    Runtime runs the body, the executor the node's op: a body that differs (a Conv made a
    ConvTranspose) would make the two compute different things."""
    functions = {f.name: f for f in model.functions if f.domain == DOMAIN}
    for op_type in dict.fromkeys(n.op_type for n in annotated):
        f = functions.get(op_type)
        users = [n.name or n.output[0] for n in annotated if n.op_type == op_type]
        where = f"tuned conv {users[0]!r}" + (f" (and {len(users) - 1} more)" if len(users) > 1 else "")
        if f is None:
            continue  # ONNX Runtime cannot run the node at all (it has no op of that name): nothing to disagree with
        want = conv_function(op_type, 1)
        body = [(n.op_type, n.domain or "", list(n.input), list(n.output), sorted((a.name, a.ref_attr_name) for a in n.attribute)) for n in f.node]
        expected = [(n.op_type, "", list(n.input), list(n.output), sorted((a.name, a.ref_attr_name) for a in n.attribute)) for n in want.node]
        if body != expected or list(f.input) != list(want.input) or list(f.output) != list(want.output):
            runs = ", ".join(n.op_type for n in f.node) or "nothing"
            raise AnnotationError(f"{where}: its function {DOMAIN}.{op_type} does not run the standard {ANNOTATED_OPS[op_type]} "
                                  f"(its body runs {runs}): the tuned model was altered; re-run `convpass optimize` on the original model")


def _check_direction(annotation_: NodeAnnotation) -> None:
    """A decision's problem must be the node's own direction (a Conv's ``fwd``, a ConvTranspose's ``dgrad``)."""
    want = "fwd" if annotation_.op_type == "Conv" else "dgrad"
    for table in annotation_.tables:
        for d in table:
            direction = d.problem_key.split("|", 1)[0] if d.problem_key else want
            if direction != want:
                raise AnnotationError(f"node {annotation_.node_name!r} is a {annotation_.op_type} but its decision is for a "
                                      f"{direction} problem ({d.problem_key[:80]!r}): the tuned model was altered; "
                                      "re-run `convpass optimize` on the original model")


def read_annotations(
    model: onnx.ModelProto, device: DeviceFingerprint | str | None = None
) -> tuple[ModelInfo | None, list[NodeAnnotation]]:
    """Model metadata and every annotated conv node (:func:`all_nodes`: those of If / Loop / Scan
    bodies too), in graph order, with the decisions of ``device``'s table (see "Reading for a device" in the module docstring). A model
    whose annotated convs would not run as what they name is refused (:func:`verify_functions`)."""
    info = read_model_info(model)
    annotated = [n for n in all_nodes(model.graph) if is_annotated_conv(n)]
    if annotated and info is None:
        raise AnnotationError(f"model has {DOMAIN} convolutions but no convpass metadata")
    verify_functions(model, annotated)
    if info is None:
        return None, []
    table = (info.table_of(device) if device is not None else None) or 0
    info = info.for_table(table)
    n_profiles = max(1, len(info.profiles))
    nodes = [read_node(n, n_profiles, info.tables, table) for n in annotated]
    for node in nodes:
        _check_direction(node)
    return info, nodes


def standard_attributes(node: onnx.NodeProto) -> list[onnx.AttributeProto]:
    """The node's attributes less the decision attributes: what the standard op takes."""
    return [a for a in node.attribute if a.name not in DECISION_ATTRIBUTES and a.name not in PRECISION_ATTRIBUTES]


def standard_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a tuned model with every annotated conv back in the standard domain with its
    standard attributes: the model the graph passes collected the problems of."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in all_nodes(out.graph):
        if is_annotated_conv(node):
            keep = standard_attributes(node)
            del node.attribute[:]
            node.attribute.extend(keep)
            node.op_type = standard_op_type(node)
            node.domain = ""
    return out


# --------------------------------------------------------------------------------------------
# fusion decisions: a model-level record beside the per-conv decisions (module docstring)

FUSIONS_KEY = f"{META_PREFIX}fusions"
FUSIONS_VERSION = 1
MEASURED = "measured"
NOT_MEASURED = "not measured"


@dataclasses.dataclass(frozen=True)
class FusionDecision:
    """Whether one fusion unit runs fused on one device for one profile (module docstring)."""

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

