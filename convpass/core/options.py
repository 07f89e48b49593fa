"""The options of ``optimize``, shared by the CLI and the Python API, validated in one place.

The algorithm options take MindSpore's ``gpu_config`` vocabulary: ``normal`` (cuDNN's heuristic),
``performance`` (cuDNN's trial search, Find) or a named cuDNN algorithm, which is then forced.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from convpass.core.cudnn_enums import algo_names
from convpass.core.errors import OptionError
from convpass.core.problem import DIRECTIONS

MODES = ("heuristic", "exhaustive", "measure")
TF32_CHOICES = ("auto", "on", "off")
# auto: whole-graph plan (conv times + transposes, a min cut); per-conv: each conv its own best
# layout, transposes ignored; nchw / nhwc: one layout everywhere.
LAYOUT_CHOICES = ("auto", "per-conv", "nchw", "nhwc")
ALGO_KEYWORDS = ("normal", "performance")
# legacy: cuDNN's legacy algorithms only; graph: graph-API engine configurations (forward convs;
# dgrad / wgrad stay legacy); all: both, the fastest wins (convpass.native.cudnn.graph_api).
ENGINE_CHOICES = ("legacy", "graph", "all")
# Precision per conv (docs/precision.md): auto = chosen within --max-error by measurement; the others
# force one precision on every conv. None (the default): the model's data types stay and --tf32
# decides float32 convs by speed alone.
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
PRECISION_CHOICES = ("auto", *PRECISIONS)
ERROR_METRICS = ("max-rel", "rel-l2")
# Why bf16 is refused (docs/precision.md, "What is honoured where").
BF16_UNSUPPORTED = (
    "--precision bf16: a bfloat16 Conv is standard ONNX only from opset 22 (convpass reads opsets up to 21), "
    "ONNX Runtime's CPU provider has no bfloat16 Conv, and the convpass executor holds no bfloat16 tensors; "
    "use fp16 (or auto, which chooses among fp32, tf32 and fp16)"
)

# Algorithm names per direction, as users write them (MindSpore's vocabulary); the cuDNN enums
# module owns them (pure Python: importing it loads nothing).
ALGORITHMS: dict[str, tuple[str, ...]] = {d: algo_names(d) for d in ("fwd", "dgrad", "wgrad")}
_ALGO_OPTION = {"fwd": "fprop_algo", "dgrad": "dgrad_algo", "wgrad": "wgrad_algo"}

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_size(text: str | int | None) -> int | None:
    """``"256MiB"`` -> 268435456; ``None`` / ``"none"`` -> no limit."""
    if text is None or isinstance(text, int):
        if isinstance(text, int) and text < 0:
            raise OptionError(f"--workspace-limit must be >= 0, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if text.strip().lower() in ("none", "unlimited"):
        return None
    if not m or m[2].lower() not in _SIZE_UNITS:
        raise OptionError(f"--workspace-limit {text!r}: expected a size such as 0, 64MiB, 1GB or none")
    return int(float(m[1]) * _SIZE_UNITS[m[2].lower()])


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """How decisions are taken (everything except shapes and where to read / write)."""

    mode: str = "measure"
    fprop_algo: str | None = None
    dgrad_algo: str | None = None
    wgrad_algo: str | None = None
    tf32: str = "auto"
    layout: str = "auto"
    matmul_tf32: bool = False
    workspace_limit: int | None = None
    deterministic: bool = False
    directions: tuple[str, ...] = ("fwd",)
    engines: str = "all"
    precision: str | None = None
    max_error: float | None = None
    error_metric: str = "max-rel"

    def __post_init__(self) -> None:
        self._check_precision()
        _choice("--mode", self.mode, MODES)
        _choice("--engines", self.engines, ENGINE_CHOICES)
        _choice("--tf32", self.tf32, TF32_CHOICES)
        _choice("--layout", self.layout, LAYOUT_CHOICES)
        for direction in ("fwd", "dgrad", "wgrad"):
            value = getattr(self, _ALGO_OPTION[direction])
            if value is not None and value not in ALGO_KEYWORDS + ALGORITHMS[direction]:
                flag = "--" + _ALGO_OPTION[direction].replace("_", "-")
                raise OptionError(
                    f"{flag} {value!r}: expected normal, performance or one of {', '.join(ALGORITHMS[direction])}"
                )
        if not self.directions or any(d not in DIRECTIONS for d in self.directions) or "fwd" not in self.directions:
            raise OptionError(f"--directions {','.join(self.directions)!r}: expected fwd plus optionally dgrad, wgrad")
        if self.workspace_limit is not None and self.workspace_limit < 0:
            raise OptionError("--workspace-limit must be >= 0")

    def _check_precision(self) -> None:
        if self.precision is not None:
            _choice("--precision", self.precision, PRECISION_CHOICES)
        _choice("--error-metric", self.error_metric, ERROR_METRICS)
        if self.precision == "bf16":
            raise OptionError(BF16_UNSUPPORTED)
        if self.max_error is not None:
            if isinstance(self.max_error, bool) or not isinstance(self.max_error, (int, float)) or not 0 < self.max_error < float("inf"):
                raise OptionError(f"--max-error {self.max_error!r}: expected a positive number, e.g. 1e-2")
            if self.precision is None:
                raise OptionError("--max-error applies with --precision (auto, or a forced precision to check against)")
        if self.precision == "auto" and self.max_error is None:
            raise OptionError("--precision auto needs --max-error E, the largest error of the outputs to accept (e.g. 1e-2)")
        clash = {("fp32", "on"): "turns TF32 off", ("tf32", "off"): "turns TF32 on"}.get((self.precision or "", self.tf32))
        if clash:
            raise OptionError(f"--precision {self.precision} {clash} for every conv: it contradicts --tf32 {self.tf32}")

    @property
    def wide_precisions(self) -> tuple[str, ...]:
        """The precisions a float32 conv may take, most accurate last (TF32 is the math of a float32
        conv: FP32 = FMA math, TF32 = tensor-core math)."""
        if self.precision in ("fp32", "tf32"):
            return (self.precision,)
        return {"auto": ("tf32", "fp32"), "on": ("tf32",), "off": ("fp32",)}[self.tf32]

    def strategy(self, direction: str) -> tuple[str, str | None]:
        """How to choose the algorithm of a direction: (heuristic|exhaustive|measure|forced, forced name)."""
        value = getattr(self, _ALGO_OPTION[direction])
        if value == "normal":
            return "heuristic", None
        if value == "performance":
            return "exhaustive", None
        if value is not None:
            return "forced", value
        return self.mode, None

    @property
    def layouts(self) -> tuple[str, ...]:
        return ("nchw", "nhwc") if self.layout in ("auto", "per-conv") else (self.layout,)

    def engine_space(self, direction: str) -> tuple[bool, bool]:
        """(legacy algorithms, graph-API engines) allowed for a direction. Engines exist for the
        forward direction under ``--mode measure`` only: the other strategies are cuDNN's legacy
        heuristic, Find or a named legacy algorithm."""
        graph = self.engines != "legacy" and direction == "fwd" and self.strategy(direction)[0] == "measure"
        return (self.engines != "graph" or not graph), graph

    @property
    def fusions(self) -> bool:
        """Whether fused conv epilogues (graph-API engines of ``act(conv + bias)``) are candidates:
        problems then carry their conv's fusion (:mod:`convpass.compiler.passes.collect_conv_problems`)."""
        return self.engine_space("fwd")[1]

    def math_modes(self, dtype: str) -> tuple[str, ...]:
        """cuDNN math types to consider for a data type under --tf32 and --precision."""
        if dtype != "float32":
            return ("default",)  # half / bf16 use tensor cores by default; TF32 does not apply
        return tuple({"tf32": "default", "fp32": "fma"}[p] for p in self.wide_precisions)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choice(flag: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise OptionError(f"{flag} {value!r}: expected one of {', '.join(choices)}")


def check_precision_data(options: TuneOptions, calibration: Sequence[str], holdout: Sequence[str]) -> None:
    """The calibration and held-out input files apply only where errors are measured."""
    if (calibration or holdout) and options.precision is None:
        flag = "--calibration" if calibration else "--holdout"
        raise OptionError(f"{flag} applies with --precision (the inputs the model's error is measured on)")


def parse_directions(text: str | Sequence[str]) -> tuple[str, ...]:
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(dict.fromkeys(i.strip() for i in items if i.strip()))
