"""The options of ``optimize``, shared by the CLI and the Python API, validated in one place.

The algorithm options take MindSpore's ``gpu_config`` vocabulary: ``normal`` (cuDNN's heuristic),
``performance`` (cuDNN's trial search, Find) or a named cuDNN algorithm, which is then forced.

Messages name an option as its caller spells it: :data:`CLI` (``--workspace-limit``, ``--shape``)
or :data:`API` (``workspace_limit``, ``shapes[1]``). The caller passes its :class:`OptionNames` to
:func:`tune_options` and :func:`parse_profiles`; nothing else validates these values.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from convpass.core.algo import is_transform
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
# off: every candidate measured; learned: candidates ordered and cut by what the tuning cache's
# history on the device says of their geometry class (convpass.tuning.prune).
PRUNE_CHOICES = ("off", "learned")
# Precision per conv (docs/precision.md): auto = chosen within --max-error by measurement; the others
# force one precision on every conv. None (the default): the model's data types stay and --tf32
# decides float32 convs by speed alone. fp32 = FMA math (TF32 off), any algorithm; fp32-strict =
# FMA math with GEMM-based or direct algorithms only: no Winograd, no FFT (convpass.core.algo,
# "Transform algorithms"), the most accurate level.
STRICT = "fp32-strict"
PRECISIONS = (STRICT, "fp32", "tf32", "fp16", "bf16")
# The precisions of a float32 conv (its math and algorithms), least accurate first.
WIDE_PRECISIONS = ("tf32", "fp32", STRICT)
_MATH_OF_PRECISION = {"tf32": "default", "fp32": "fma", STRICT: "fma"}
PRECISION_CHOICES = ("auto", *PRECISIONS)
ERROR_METRICS = ("max-rel", "rel-l2")
# Why bf16 is refused (docs/precision.md, "What is honoured where").
BF16_UNSUPPORTED = (
    "--precision bf16: a bfloat16 Conv is standard ONNX only from opset 22 (convpass reads opsets up to 21), "
    "ONNX Runtime's CPU provider has no bfloat16 Conv, and the convpass executor holds no bfloat16 tensors; "
    "use fp16 (or auto, which chooses among fp32-strict, fp32, tf32 and fp16)"
)

# Algorithm names per direction, as users write them (MindSpore's vocabulary); the cuDNN enums
# module owns them (pure Python: importing it loads nothing).
ALGORITHMS: dict[str, tuple[str, ...]] = {d: algo_names(d) for d in ("fwd", "dgrad", "wgrad")}
_ALGO_OPTION = {"fwd": "fprop_algo", "dgrad": "dgrad_algo", "wgrad": "wgrad_algo"}

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3}


@dataclasses.dataclass(frozen=True)
class OptionNames:
    """How a caller spells an option in messages: ``cli`` (``--tf32``, ``--shape``) or ``api``
    (``tf32``, ``shapes[1]``). ``name`` is the Python keyword (``workspace_limit``, ``shapes``)."""

    style: str

    def __call__(self, name: str, index: int | None = None) -> str:
        if self.style == "cli":
            return "--" + _CLI_SPELLING.get(name, name).replace("_", "-")
        return name if index is None else f"{name}[{index}]"

    def example(self, name: str, value: str) -> str:
        """How the caller would give ``value`` to a list option: ``--shape x=1x3`` or ``shapes=['x=1x3']``."""
        if self.style == "cli":
            return f"{self(name)} {value}"
        return f"{name}=[{value!r}]"


_CLI_SPELLING = {"shapes": "shape"}
CLI = OptionNames("cli")
API = OptionNames("api")


def parse_size(text: str | int | None, names: OptionNames | None = None) -> int | None:
    """``"256MiB"`` -> 268435456; ``None`` / ``"none"`` -> no limit."""
    flag = (names or CLI)("workspace_limit")
    if text is None or (isinstance(text, int) and not isinstance(text, bool)):
        if isinstance(text, int) and text < 0:
            raise OptionError(f"{flag} must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise OptionError(f"{flag} {text!r}: expected a size such as 0, 64MiB, 1GB or none")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if text.strip().lower() in ("none", "unlimited"):
        return None
    if not m or m[2].lower() not in _SIZE_UNITS:
        raise OptionError(f"{flag} {text!r}: expected a size such as 0, 64MiB, 1GB or none")
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
    prune: str = "off"

    def __post_init__(self) -> None:
        _check(self, CLI)
        self._check_precision()

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
        clash = {("fp32", "on"): "turns TF32 off", (STRICT, "on"): "turns TF32 off",
                 ("tf32", "off"): "turns TF32 on"}.get((self.precision or "", self.tf32))
        if clash:
            raise OptionError(f"--precision {self.precision} {clash} for every conv: it contradicts --tf32 {self.tf32}")
        if self.precision == STRICT:
            for direction, option in _ALGO_OPTION.items():
                forced = self.strategy(direction)[1]
                if forced is not None and is_transform(forced):
                    raise OptionError(f"--precision {STRICT} runs no Winograd or FFT algorithm: it contradicts "
                                      f"--{option.replace('_', '-')} {forced}")

    @property
    def wide_precisions(self) -> tuple[str, ...]:
        """The precisions a float32 conv may take, most accurate last (TF32 is the math of a float32
        conv: FP32 = FMA math, TF32 = tensor-core math; FP32-strict = FMA math without transform
        algorithms). ``fp32-strict`` is a level of ``--precision auto`` (unless ``--tf32 on``) and of
        its own forced mode only: without ``--precision``, or forced elsewhere, the options mean what
        they meant before it existed."""
        if self.precision in WIDE_PRECISIONS:
            return (self.precision,)
        wide = {"auto": ("tf32", "fp32"), "on": ("tf32",), "off": ("fp32",)}[self.tf32]
        return (*wide, STRICT) if self.precision == "auto" and "fp32" in wide else wide

    @property
    def transforms(self) -> bool:
        """Whether transform algorithms (Winograd, FFT: :func:`convpass.core.algo.is_transform`) are
        candidates: everywhere but at the ``fp32-strict`` precision."""
        return self.precision != STRICT

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
        return tuple(dict.fromkeys(_MATH_OF_PRECISION[p] for p in self.wide_precisions))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(options: TuneOptions, names: OptionNames) -> None:
    """Every rule on the values of :class:`TuneOptions`; messages name options by ``names``."""
    _choice(names("mode"), options.mode, MODES)
    _choice(names("engines"), options.engines, ENGINE_CHOICES)
    _choice(names("prune"), options.prune, PRUNE_CHOICES)
    _choice(names("tf32"), options.tf32, TF32_CHOICES)
    _choice(names("layout"), options.layout, LAYOUT_CHOICES)
    for direction in ("fwd", "dgrad", "wgrad"):
        option = _ALGO_OPTION[direction]
        value = getattr(options, option)
        if value is not None and value not in ALGO_KEYWORDS + ALGORITHMS[direction]:
            raise OptionError(
                f"{names(option)} {value!r}: expected normal, performance or one of {', '.join(ALGORITHMS[direction])}"
            )
    directions = options.directions
    if not directions or any(d not in DIRECTIONS for d in directions) or "fwd" not in directions:
        raise OptionError(f"{names('directions')} {','.join(map(str, directions))!r}: expected fwd plus optionally dgrad, wgrad")
    if not isinstance(options.matmul_tf32, bool):
        raise OptionError(f"{names('matmul_tf32')} {options.matmul_tf32!r}: expected on, off, True or False")
    if not isinstance(options.deterministic, bool):
        raise OptionError(f"{names('deterministic')} {options.deterministic!r}: expected True or False")
    if options.workspace_limit is not None and options.workspace_limit < 0:
        raise OptionError(f"{names('workspace_limit')} must be >= 0")


def _choice(flag: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise OptionError(f"{flag} {value!r}: expected one of {', '.join(choices)}")


def check_precision_data(options: TuneOptions, calibration: Sequence[str], holdout: Sequence[str]) -> None:
    """The calibration and held-out input files apply only where errors are measured."""
    if (calibration or holdout) and options.precision is None:
        flag = "--calibration" if calibration else "--holdout"
        raise OptionError(f"{flag} applies with --precision (the inputs the model's error is measured on)")


def parse_directions(text: str | Sequence[str], names: OptionNames | None = None) -> tuple[str, ...]:
    if not isinstance(text, str) and not (isinstance(text, Sequence) and all(isinstance(i, str) for i in text)):
        raise OptionError(f"{(names or CLI)('directions')} {text!r}: expected fwd plus optionally dgrad, wgrad")
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(dict.fromkeys(i.strip() for i in items if i.strip()))


def tune_options(values: Mapping[str, Any], names: OptionNames = CLI) -> TuneOptions:
    """:class:`TuneOptions` from the CLI's or the Python API's values (sizes such as ``"64MiB"``,
    directions as ``"fwd,dgrad"``, ``matmul_tf32`` as ``on`` / ``off`` or a bool), every value
    checked and a wrong one named as ``names`` spells it."""
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(TuneOptions)})
    if unknown:
        raise OptionError(f"unknown option(s): {', '.join(unknown)}")
    kw = dict(values)
    if "workspace_limit" in kw:
        kw["workspace_limit"] = parse_size(kw["workspace_limit"], names)
    if "directions" in kw:
        kw["directions"] = parse_directions(kw["directions"], names)
    if isinstance(kw.get("matmul_tf32"), str):
        kw["matmul_tf32"] = {"on": True, "off": False}.get(kw["matmul_tf32"], kw["matmul_tf32"])
    candidate = TuneOptions.__new__(TuneOptions)  # checked with the caller's names before the dataclass checks it again
    for field in dataclasses.fields(TuneOptions):
        object.__setattr__(candidate, field.name, kw.get(field.name, field.default))
    _check(candidate, names)
    return TuneOptions(**kw)


def parse_profiles(shapes: Sequence[str | Mapping[str, Sequence[int]]] | str, names: OptionNames = CLI) -> list[dict[str, tuple[int, ...]]]:
    """Shape profiles as ``{input: dims}`` from ``NAME=DIMS[,NAME=DIMS]`` strings or mappings; a wrong
    entry is named as ``names`` spells it (``--shape 'x'`` or ``shapes[1]``)."""
    if isinstance(shapes, (str, Mapping)):
        raise OptionError(f"{names('shapes')}: expected a list of profiles, one NAME=DIMS[,NAME=DIMS] string or "
                          f"{{name: dims}} mapping each, got {type(shapes).__name__}")
    from convpass.core.profiles import parse_shape_spec  # imports onnx: not at the CLI's parser build

    profiles = []
    for i, spec in enumerate(shapes):
        where = names("shapes", i)
        if isinstance(spec, str):
            profiles.append(parse_shape_spec(spec, where))
            continue
        if not isinstance(spec, Mapping):
            raise OptionError(f"{where} {spec!r}: expected NAME=DIMS such as input=1x3x224x224, or {{name: dims}}")
        profile = {}
        for name, dims in spec.items():
            ok = isinstance(name, str) and name and isinstance(dims, Sequence) and not isinstance(dims, str) and all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
            if not ok:
                raise OptionError(f"{where} {{{name!r}: {dims!r}}}: expected an input name and positive integer dims")
            profile[name] = tuple(dims)
        profiles.append(profile)
    return profiles
