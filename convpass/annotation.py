"""The annotation schema: how a tuned model records its convolution decisions.

This module is the only place that knows the format; the annotate pass writes through it, and
``inspect``, the executor and everything else read through it.

Format (schema version 1)
-------------------------
* Every tuned ``Conv`` / ``ConvTranspose`` node is the same op in domain ``ai.convpass``, with all
  its original attributes unchanged, plus the decision attributes below.
* The model carries one model-local function per such op (``ai.convpass.Conv``,
  ``ai.convpass.ConvTranspose``) whose body is the standard op with every standard attribute passed
  through by reference, so ``onnx.checker.check_model(full_check=True)`` accepts the model and ONNX
  Runtime runs it unchanged. The model imports ``ai.convpass`` version 1 and keeps an IR version that
  allows model-local functions (>= 8).
* Decision attributes, one value per shape profile (a scalar with one profile, a list in the order
  of the ``convpass.profiles`` metadata with several):

  ``algo``            algorithm that runs the node: the forward algorithm of a Conv, the
                      backward-data algorithm of a ConvTranspose; ``"auto"`` = chosen at run time
  ``dgrad_algo``      (optional, Conv only) backward-data algorithm for training
  ``wgrad_algo``      (optional, Conv only) backward-filter algorithm for training
  ``memory_format``   NCHW / NHWC (NCW / NWC, NCDHW / NDHWC by rank) or ``"auto"``
  ``math_mode``       cuDNN math type: ``default`` (TF32 allowed for fp32), ``tensor_op``, ``fma``
                      (TF32 off), or ``"auto"``
  ``workspace_bytes`` workspace the algorithm needs; -1 = unknown
  ``time_ms``         measured time of the chosen configuration; NaN = not measured
  ``problem_key``     :class:`convpass.problem.ProblemKey` string of the decided problem, or ``""``
  ``source``          how the decision was taken: ``measure``, ``exhaustive``, ``heuristic``,
                      ``forced``, ``cache`` or ``auto`` (not decided)

* Model metadata (``metadata_props``): ``convpass.schema_version``, ``convpass.version``,
  ``convpass.device`` (fingerprint, empty when none), ``convpass.cudnn_version``, ``convpass.mode``,
  ``convpass.profiles`` (JSON), ``convpass.matmul_allow_tf32`` (``0``/``1``: MindSpore's
  ``matmul_allow_tf32``, for Gemm / MatMul), ``convpass.options`` (JSON of the options used).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
from onnx import helper

DOMAIN = "ai.convpass"
DOMAIN_VERSION = 1
SCHEMA_VERSION = 1
CONV_OPS = ("Conv", "ConvTranspose")

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
    "dgrad_algo",
    "wgrad_algo",
    "memory_format",
    "math_mode",
    "workspace_bytes",
    "time_ms",
    "problem_key",
    "source",
)

META_PREFIX = "convpass."


class AnnotationError(ValueError):
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

    @property
    def is_auto(self) -> bool:
        return self.algo == AUTO

    @property
    def tf32(self) -> bool | None:
        """TF32 on / off for float32 convs, None when not decided."""
        if self.math_mode == AUTO:
            return None
        return self.math_mode != "fma"


@dataclasses.dataclass(frozen=True)
class Profile:
    """A shape profile: concrete shapes for the model's inputs."""

    name: str
    inputs: Mapping[str, tuple[int, ...]]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "inputs": {k: list(v) for k, v in self.inputs.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Profile":
        return cls(str(data["name"]), {k: tuple(int(d) for d in v) for k, v in data["inputs"].items()})


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Model-level convpass metadata."""

    schema_version: int
    convpass_version: str
    device: str
    cudnn_version: str
    mode: str
    profiles: tuple[Profile, ...]
    matmul_allow_tf32: bool
    options: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class NodeAnnotation:
    """The decisions recorded on one conv node, one per profile."""

    node_name: str
    op_type: str
    decisions: tuple[ConvDecision, ...]


# --------------------------------------------------------------------------------------------
# writing


def decision_attributes(decisions: Sequence[ConvDecision]) -> dict[str, Any]:
    """The decision attributes (name -> Python value) encoding one node's per-profile decisions."""
    if not decisions:
        raise ValueError("a conv needs at least one decision (one per profile)")
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
    for name in ("dgrad_algo", "wgrad_algo"):
        values = [getattr(d, name) for d in decisions]
        if any(v is not None for v in values):
            attrs[name] = pack([AUTO if v is None else v for v in values])
    return attrs


def conv_function(op_type: str, opset_version: int) -> onnx.FunctionProto:
    """The model-local function ``ai.convpass.<op_type>``: the standard op, attributes by reference."""
    standard = STANDARD_ATTRIBUTES[op_type]
    body = helper.make_node(op_type, ["X", "W", "B"], ["Y"])
    for name, attr_type in standard.items():
        ref = onnx.AttributeProto()
        ref.name = name
        ref.ref_attr_name = name
        ref.type = attr_type
        body.attribute.append(ref)
    return helper.make_function(
        DOMAIN,
        op_type,
        ["X", "W", "B"],
        ["Y"],
        [body],
        [helper.make_opsetid("", opset_version)],
        attributes=[*standard, *DECISION_ATTRIBUTES],
        doc_string=f"convpass-tuned {op_type}: runs as the standard {op_type}; decisions are attributes.",
    )


def metadata_entries(info: ModelInfo) -> dict[str, str]:
    """Model metadata (key -> value) for a tuned model."""
    return {
        f"{META_PREFIX}schema_version": str(info.schema_version),
        f"{META_PREFIX}version": info.convpass_version,
        f"{META_PREFIX}device": info.device,
        f"{META_PREFIX}cudnn_version": info.cudnn_version,
        f"{META_PREFIX}mode": info.mode,
        f"{META_PREFIX}profiles": json.dumps([p.to_json() for p in info.profiles]),
        f"{META_PREFIX}matmul_allow_tf32": "1" if info.matmul_allow_tf32 else "0",
        f"{META_PREFIX}options": json.dumps(dict(info.options), sort_keys=True),
    }


# --------------------------------------------------------------------------------------------
# reading


def is_annotated_conv(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type in CONV_OPS


def read_model_info(model: onnx.ModelProto) -> ModelInfo | None:
    """The convpass metadata of a model, or None if it was never tuned by convpass.

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
    if version < SCHEMA_VERSION:
        raise AnnotationError(
            f"model was tuned with annotation schema {version}, which this convpass no longer reads: "
            "re-run `convpass optimize` on the original model"
        )
    try:
        profiles = tuple(Profile.from_json(p) for p in json.loads(meta.get(f"{META_PREFIX}profiles", "[]")))
        options = json.loads(meta.get(f"{META_PREFIX}options", "{}"))
    except (ValueError, KeyError, TypeError) as e:
        raise AnnotationError(f"convpass metadata is damaged: {e}") from None
    return ModelInfo(
        schema_version=version,
        convpass_version=meta.get(f"{META_PREFIX}version", ""),
        device=meta.get(f"{META_PREFIX}device", ""),
        cudnn_version=meta.get(f"{META_PREFIX}cudnn_version", ""),
        mode=meta.get(f"{META_PREFIX}mode", ""),
        profiles=profiles,
        matmul_allow_tf32=meta.get(f"{META_PREFIX}matmul_allow_tf32", "0") == "1",
        options=options,
    )


def read_node(node: onnx.NodeProto, n_profiles: int) -> NodeAnnotation:
    """The per-profile decisions recorded on an annotated conv node."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in DECISION_ATTRIBUTES}
    name = node.name or node.output[0]

    def per_profile(key: str, default: Any) -> list[Any]:
        if key not in attrs:
            return [default] * n_profiles
        value = attrs[key]
        if isinstance(value, (list, tuple)):
            if len(value) != n_profiles:
                raise AnnotationError(f"node {name!r}: {key} has {len(value)} entries for {n_profiles} profiles")
            values = list(value)
        else:
            values = [value] * n_profiles
        return [v.decode() if isinstance(v, bytes) else v for v in values]

    if "algo" not in attrs:
        raise AnnotationError(f"node {name!r} is in domain {DOMAIN} but has no 'algo' attribute")
    cols = {
        key: per_profile(key, default)
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
        ]
    }
    decisions = tuple(
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
        )
        for i in range(n_profiles)
    )
    return NodeAnnotation(node_name=name, op_type=node.op_type, decisions=decisions)


def read_annotations(model: onnx.ModelProto) -> tuple[ModelInfo | None, list[NodeAnnotation]]:
    """Model metadata and every annotated conv node of the main graph, in graph order."""
    info = read_model_info(model)
    annotated = [n for n in model.graph.node if is_annotated_conv(n)]
    if annotated and info is None:
        raise AnnotationError(f"model has {DOMAIN} convolutions but no convpass metadata")
    n_profiles = max(1, len(info.profiles)) if info else 1
    return info, [read_node(n, n_profiles) for n in annotated]


def standard_attributes(node: onnx.NodeProto) -> list[onnx.AttributeProto]:
    """The node's attributes less the decision attributes: what the standard op takes."""
    return [a for a in node.attribute if a.name not in DECISION_ATTRIBUTES]
