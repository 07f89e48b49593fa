"""The per-conv decisions of a tuned model: which nodes are annotated convs, the
:class:`ConvDecision` each holds per (device table, shape profile), and the decision attributes
that carry them on the node, written (:func:`decision_attributes`, :func:`precision_attributes`)
and read back (:func:`read_node`).

The format is described once, in :mod:`convpass.core.annotation`, which is also where callers
import these names from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
from onnx import helper

from convpass.core.algo import is_transform
from convpass.core.errors import ConvpassError
from convpass.core.options import STRICT

__all__ = [
    "ANNOTATED_OPS",
    "AUTO",
    "BIASLESS_SUFFIX",
    "CONV_OPS",
    "DECISION_ATTRIBUTES",
    "DOMAIN",
    "LEVEL_ATTRIBUTE",
    "PRECISION_ATTRIBUTES",
    "SOURCES",
    "AnnotationError",
    "ConvDecision",
    "NodeAnnotation",
    "all_nodes",
    "annotated_op_type",
    "check_direction",
    "decision_attributes",
    "is_annotated_conv",
    "level_attributes",
    "precision_attributes",
    "read_node",
    "standard_op_type",
]

DOMAIN = "ai.convpass"
CONV_OPS = ("Conv", "ConvTranspose")
BIASLESS_SUFFIX = "NoBias"
# the op types of annotated convs in DOMAIN -> the standard op each one runs
ANNOTATED_OPS = {**{op: op for op in CONV_OPS}, **{op + BIASLESS_SUFFIX: op for op in CONV_OPS}}

AUTO = "auto"
SOURCES = ("measure", "exhaustive", "heuristic", "forced", "cache", AUTO)

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
# per node: the precision level asked for the conv where its decisions cannot tell it (schema 7,
# optional: only ``fp32-strict``; a reader that does not know it reads the conv as fp32)
LEVEL_ATTRIBUTE = "precision"
_PRECISION_OF_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}


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
    strict: bool = False  # the node asks for fp32-strict (its LEVEL_ATTRIBUTE; not a decision attribute)

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
        """fp32-strict / fp32 / tf32 / fp16 / bf16 (:mod:`convpass.core.annotation`, "Precision");
        None when not decided."""
        dtype = self.problem_key.split("|")[10] if self.problem_key.count("|") >= 10 else ""
        if dtype in _PRECISION_OF_DTYPE:
            return _PRECISION_OF_DTYPE[dtype]
        if self.math_mode == AUTO:
            return None
        if self.math_mode != "fma":
            return "tf32"
        return STRICT if self.strict and self.honours_strict else "fp32"

    @property
    def honours_strict(self) -> bool:
        """Whether the decision runs no transform algorithm (Winograd, FFT) in any direction it
        records, and is decided (``auto`` leaves the choice to cuDNN's heuristic at run time)."""
        decided = self.algo != AUTO or bool(self.engine)
        return decided and not any(is_transform(a) for a in (self.algo, self.dgrad_algo, self.wgrad_algo))


@dataclasses.dataclass(frozen=True)
class NodeAnnotation:
    """The decisions recorded on one conv node: ``decisions`` is the read table (one per profile),
    ``tables`` every table, in ``ModelInfo.devices`` order."""

    node_name: str
    op_type: str
    decisions: tuple[ConvDecision, ...]
    tables: tuple[tuple[ConvDecision, ...], ...] = ()
    precision_error: float | None = None  # schema 7 (:mod:`convpass.core.annotation`, "Precision")
    precision_sensitivity: float | None = None


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


def level_attributes(strict: bool) -> dict[str, str]:
    """The per-node level attribute of a conv asked to run at ``fp32-strict``; none otherwise."""
    return {LEVEL_ATTRIBUTE: STRICT} if strict else {}


def annotated_op_type(op_type: str, has_bias: bool) -> str:
    """The op type in DOMAIN of a tuned ``Conv`` / ``ConvTranspose`` with or without a bias."""
    return op_type if has_bias else op_type + BIASLESS_SUFFIX


def standard_op_type(node: onnx.NodeProto) -> str:
    """The standard op an annotated conv runs (its own op type for any other node)."""
    return ANNOTATED_OPS[node.op_type] if is_annotated_conv(node) else node.op_type


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
    strict = _level(node, name) == STRICT
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
            strict=strict,
        )
        for i in range(entries)
    ]
    tables = tuple(tuple(decisions[t * n_profiles:(t + 1) * n_profiles]) for t in range(n_tables))
    measured = {a.name: float(a.f) for a in node.attribute if a.name in PRECISION_ATTRIBUTES}
    error, sensitivity = (measured.get(k, math.nan) for k in PRECISION_ATTRIBUTES)
    return NodeAnnotation(node_name=name, op_type=standard_op_type(node), decisions=tables[table], tables=tables,
                          precision_error=None if math.isnan(error) else error,
                          precision_sensitivity=None if math.isnan(sensitivity) else sensitivity)


def _level(node: onnx.NodeProto, name: str) -> str | None:
    """The node's level attribute (:data:`LEVEL_ATTRIBUTE`), None where it has none."""
    for a in node.attribute:
        if a.name == LEVEL_ATTRIBUTE:
            value = helper.get_attribute_value(a)
            if value != STRICT.encode():
                raise AnnotationError(f"node {name!r}: {LEVEL_ATTRIBUTE} is {value!r}, not {STRICT!r}")
            return STRICT
    return None


def check_direction(annotation_: NodeAnnotation) -> None:
    """A decision's problem must be the node's own direction (a Conv's ``fwd``, a ConvTranspose's ``dgrad``)."""
    want = "fwd" if annotation_.op_type == "Conv" else "dgrad"
    for table in annotation_.tables:
        for d in table:
            direction = d.problem_key.split("|", 1)[0] if d.problem_key else want
            if direction != want:
                raise AnnotationError(f"node {annotation_.node_name!r} is a {annotation_.op_type} but its decision is for a "
                                      f"{direction} problem ({d.problem_key[:80]!r}): the tuned model was altered; "
                                      "re-run `convpass optimize` on the original model")
