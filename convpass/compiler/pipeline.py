"""The optimize pipeline: load -> resolve shapes -> canonicalize -> collect problems -> decide -> annotate.

The Python API and the CLI both run :func:`optimize_model` (through :func:`run_optimize`);
:func:`optimize` is the public entry that returns an ``onnx.ModelProto`` (and writes it when
``output`` is given), :func:`inspect` reads a tuned model's decisions back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from rich.console import Console

from convpass.compiler import fusions
from convpass.compiler.passes import manager
from convpass.compiler.passes.annotate_convs import AnnotateConvsPass, DeviceChoices
from convpass.compiler.passes.collect_conv_problems import CollectConvProblemsPass, ConvProblem, ProblemUse
from convpass.compiler.passes.fold_conv_weights import FoldConvWeightsPass
from convpass.compiler.passes.plan_layouts import plan_layouts
from convpass.compiler.passes.resolve_shapes import MODEL_SHAPES, PROFILES_KEY, SKIP_KEY, VALUE_SHAPES_KEY, ResolveShapesPass
from convpass.compiler.passes.strip_annotations import Previous, StripAnnotationsPass, is_tuned
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.annotation import SCHEMA_VERSION, ModelInfo, Profile
from convpass.core.errors import ConvpassError
from convpass.core.model_io import load_model, to_proto
from convpass.core.options import CLI, STRICT, WIDE_PRECISIONS, OptionNames, TuneOptions, check_precision_data, tune_options
from convpass.core.version import __version__
from convpass.native import device as device_mod
from convpass.tuning.decide import CacheBackend, DecisionBackend, bias_ms, choice_from, cost_ms, epilogue_ms, residual_ms, select

logger = logging.getLogger("convpass")


@dataclasses.dataclass
class OptimizeReport:
    """What an optimize run did, for the summary line and for callers."""

    convs: int = 0
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    problems: int = 0
    decided: int = 0
    undecided: int = 0
    profiles: tuple[Profile, ...] = ()
    backend: str = ""
    device: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    measured: int | None = None  # problems timed on the GPU (None: no GPU backend)
    cached: int | None = None
    failed: int | None = None
    # decisions by where they came from: timed on this GPU now, read from the tuning cache (on this
    # GPU or, with --device-name, for another); the rest are left to run time (undecided)
    decided_measured: int = 0
    decided_cached: int = 0
    tuning_seconds: float | None = None
    # per profile: (sum of chosen conv times, sum of cuDNN-heuristic conv times, convs counted)
    conv_time_ms: dict[str, tuple[float, float, int]] = dataclasses.field(default_factory=dict)
    layout_plans: dict[str, Any] = dataclasses.field(default_factory=dict)  # profile -> LayoutPlan
    layout_mode: str | None = None  # what --layout auto became when it could not plan
    by_device: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # device -> (decided, undecided)
    # recorded conv decisions (node x table x profile) and how many of them are graph-API engines
    decisions_recorded: int = 0
    engine_decisions: int = 0
    fused_decisions: int = 0  # decisions whose epilogue runs fused into the conv's call (legacy fused call or fused graph)
    own_kernel_decisions: int = 0  # decisions that run convpass's own kernel (runtime.cuda.depthwise)
    precision: dict[str, Any] | None = None  # what --precision chose and measured (convpass.core.annotation: convpass.precision)
    fusion_units: int = 0  # fusion units found (convpass.compiler.fusions)
    fusion_measured: int = 0  # their decisions (unit x device x profile) timed on the GPU
    fusion_fused: int = 0  # of those, the ones measured to run fused
    fusion_kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # units per kind (norm, bias)
    fusion_timed_now: list[str] = dataclasses.field(default_factory=list)  # unit signatures timed in this run (not cached)
    kernels: str | None = None  # what became of the kernel side-car (compiler.optimize.write_kernels)
    in_place: tuple[dict[str, Any], ...] = ()  # per profile: the in-place check compiling the kernels ran


def _make_backend(options: TuneOptions, cache_path: str | os.PathLike | None, device_name: str | None, report: OptimizeReport, console: Console,
                  names: OptionNames = CLI) -> DecisionBackend:
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_file import default_cache_path

    local = device_mod.detect()
    if local is not None and (device_name is None or local.matches_name(device_name)):
        from convpass.tuning.tuner import CudnnTuner

        report.backend = f"measured on {local.name} (cuDNN {local.cudnn_version_str})"
        report.device = str(local)
        return CudnnTuner(TuningCache(cache_path), local, console=console)
    if device_name is None:
        report.backend = f"no GPU found and no {names('device_name')}: nothing can be measured or looked up"
        return CacheBackend(None, None)
    path = Path(cache_path).expanduser() if cache_path is not None else default_cache_path()
    if not path.exists():  # decisions are read, never measured, here: an empty new cache holds none
        raise ConvpassError(f"{names('device_name')} {device_name}: tuning cache {path} does not exist; give the cache recorded "
                            f"on that GPU type with {names('cache')} (or CONVPASS_CACHE)")
    cache = TuningCache(path, readonly=True)
    target = cache.resolve_device(device_name)
    report.backend = f"tuning cache {cache.path} for {target.name} (cuDNN {target.cudnn_version_str}); no GPU used"
    report.device = str(target)
    return CacheBackend(cache, target)


def prepare_model(model: ir.Model, options: TuneOptions, shapes: Sequence[str | dict], report: OptimizeReport,
                  names: OptionNames = CLI) -> dict[ConvProblem, list[ProblemUse]]:
    """The graph passes before any decision (in place; :func:`convpass.compiler.passes.manager.preparation`):
    fold conv weights and BatchNormalizations, resolve shapes per profile, canonicalize, collect the
    distinct problems. Fills the report's counts; returns every problem with its uses, in graph
    order. ``names``: how messages name the shape profiles."""
    fold = FoldConvWeightsPass()
    resolve = ResolveShapesPass(shapes, names)
    collect = CollectConvProblemsPass(options.directions, options.fusions)
    manager.run(manager.preparation(fold, resolve, collect), model)
    report.notes.extend(fold.notes)  # folded weights that grew the model
    report.notes.extend(resolve.notes)  # tensors the CPU run resolved, per profile
    report.profiles = model.meta[PROFILES_KEY]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type in ("Conv", "ConvTranspose") and node.domain in ("", "ai.onnx"):
            report.convs += 1
            if SKIP_KEY in node.meta:
                report.skipped.append((node.name or node.outputs[0].name, node.meta[SKIP_KEY]))
    report.problems = len(collect.problems)
    return collect.problems


def decide_and_annotate(
    model: ir.Model,
    options: TuneOptions,
    uses: dict[ConvProblem, list[ProblemUse]],
    backends: Sequence[DecisionBackend],
    report: OptimizeReport,
    precision_of: Mapping[str, str] | None = None,
    errors: Mapping[str, tuple[float | None, float | None]] | None = None,
    fusion_timer: fusions.Timer | None = None,
) -> None:
    """Decide every problem with each backend (one decision table per backend's device, in order)
    and write the tables into the prepared model. No backends: one table of ``auto`` decisions.
    ``precision_of``: per conv (node name), the float32 precision the precision plan gives it alone
    (``tf32``, ``fp32``, ``fp32-strict``: its math, and whether transform algorithms may run it);
    ``errors``: per conv, its measured error contribution and
    sensitivity (:class:`AnnotateConvsPass`). Fusion units are decided per backend's device too
    (:mod:`convpass.compiler.fusions`: timed where the backend measures on this GPU, or with
    ``fusion_timer``; else not measured) and recorded beside the tables."""
    problems = list(uses)
    devices = tuple(str(b.device) for b in backends if b.device is not None)
    if len(backends) > 1 and len(devices) != len(backends):
        raise ValueError("several decision tables need a device each")
    tables: list[DeviceChoices] = []
    value_shapes = model.meta.get(VALUE_SHAPES_KEY, [])
    units = fusions.find_units(model, value_shapes)
    record: dict = {}
    for backend in backends:
        choices = backend.decide(problems, options)
        decided = sum(1 for c in choices.values() if c is not None)
        report.decided += decided
        from_cache = decided if not getattr(backend, "measures", False) else getattr(getattr(backend, "summary", None), "cached_decided", 0)
        report.decided_cached += from_cache
        report.decided_measured += decided - from_cache
        report.undecided += len(problems) - decided
        if backend.device is not None:
            report.by_device[str(backend.device)] = (decided, len(problems) - decided)
        device = str(backend.device or "")
        timer = fusion_timer if fusion_timer is not None else (fusions.gpu_timer() if getattr(backend, "measures", False) else None)
        store = getattr(backend, "cache", None)  # the tuning cache: fusion timings kept beside the conv measurements
        for key, (kind, names, decisions) in fusions.decide_fusions(model, units, value_shapes, device, timer, report.notes, store,
                                                                    backend.device, report.fusion_timed_now).items():
            record.setdefault(key, (kind, names, []))[2].extend(decisions)
        fused = [fusions.fused_nodes(u, record, device, p) for p, u in enumerate(units)]
        unit_costs = [fusions.fused_unit_costs(u, record, device, p) for p, u in enumerate(units)]
        overrides = _plan_layouts(model, backend, options, uses, report, precision_of or {}, fused, unit_costs)
        _tuning_summary(report, backend, uses, overrides)
        tables.append(DeviceChoices(choices, overrides))
        if len(problems) > decided:
            where = f" for {backend.device}" if len(backends) > 1 else ""
            report.notes.append(
                f"{len(problems) - decided} of {len(problems)} problems could not be measured or found in the cache{where}: "
                "recorded as algo=auto (cuDNN's heuristic decides at run time)"
            )
    if not backends:
        tables.append(DeviceChoices({}))
        report.undecided = len(problems)
        record = fusions.decide_fusions(model, units, value_shapes, "", None, report.notes)
    info = ModelInfo(
        schema_version=SCHEMA_VERSION,
        convpass_version=__version__,
        device=devices[0] if devices else "",
        cudnn_version="",
        mode=options.mode,
        profiles=report.profiles,
        matmul_allow_tf32=options.matmul_tf32,
        options={**options.to_json(), **({"layout_applied": report.layout_mode} if report.layout_mode else {})},
        devices=devices,
        precision=report.precision or {},
    )
    AnnotateConvsPass(tables, info, options.directions, options.fusions, errors, *_undecided_math(options, precision_of or {}),
                      strict=frozenset(n for n, level in (precision_of or {}).items() if level == STRICT))(model)
    fusions.write_record(model, record)
    _count_engines(model, report)
    _count_fusions(record, report)


def _count_fusions(record: dict, report: OptimizeReport) -> None:
    """The report's fusion counts: units, and per source how many decisions fuse."""
    decisions = [d for _, _, ds in record.values() for d in ds]
    report.fusion_units = len(record)
    kinds: dict[str, int] = {}
    for kind, _, _ in record.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    report.fusion_kinds = kinds
    report.fusion_measured = sum(1 for d in decisions if d.source == annotation.MEASURED)
    report.fusion_fused = sum(1 for d in decisions if d.fused)


def _count_engines(model: ir.Model, report: OptimizeReport) -> None:
    def values(attr: Any) -> list[Any]:
        if attr is None:
            return []
        return list(attr.value) if isinstance(attr.value, (list, tuple)) else [attr.value]

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == annotation.DOMAIN and node.op_type in annotation.ANNOTATED_OPS:
            report.decisions_recorded += len(values(node.attributes.get("algo")))
            report.engine_decisions += sum(1 for v in values(node.attributes.get("engine")) if v)
            report.fused_decisions += sum(1 for v in values(node.attributes.get("fusion")) if v)
            report.own_kernel_decisions += sum(1 for v in values(node.attributes.get("algo")) if Algo.parse(v).is_own)


def optimize_model(
    model: ir.Model,
    options: TuneOptions,
    shapes: Sequence[str | dict] = (),
    cache: str | os.PathLike | None = None,
    device_name: str | None = None,
    console: Console | None = None,
    backend: DecisionBackend | None = None,
    calibration: Sequence[str | os.PathLike] = (),
    holdout: Sequence[str | os.PathLike] = (),
    evaluator: Any = None,
    names: OptionNames = CLI,
) -> OptimizeReport:
    """Run the whole pipeline on an in-memory model (modified in place); returns the report.
    With ``options.precision``: the precision plan (:mod:`convpass.compiler.precision.flow`), its
    errors measured on ``calibration`` / ``holdout`` (.npz files; none: random inputs) by
    ``evaluator`` (default: the GPU executor where this machine's GPU measures, else the CPU
    emulation). ``names``: how messages name the options (the CLI's flags or the Python API's
    arguments)."""
    console = console or Console(stderr=True, soft_wrap=True)
    report = OptimizeReport()
    check_precision_data(options, calibration, holdout)
    if options.precision is not None:
        from convpass.compiler.precision.flow import Steps, optimize_precision

        def make_backend() -> DecisionBackend:
            if backend is not None:
                report.backend, report.device = type(backend).__name__, str(backend.device or "")
                return backend
            return _make_backend(options, cache, device_name, report, console)

        steps = Steps(prepare_model, decide_and_annotate, OptimizeReport)
        optimize_precision(steps, model, options, shapes, make_backend, report, calibration, holdout, evaluator)
        return report
    uses = prepare_model(model, options, shapes, report, names)
    if uses:
        if backend is None:
            backend = _make_backend(options, cache, device_name, report, console, names)
        else:
            report.backend = type(backend).__name__
            report.device = str(backend.device or "")
    decide_and_annotate(model, options, uses, [backend] if uses and backend is not None else [], report)
    return report


def _tuning_summary(report: OptimizeReport, backend: DecisionBackend, uses: dict, overrides: dict) -> None:
    """Counts and conv-time sums (the recorded decisions vs cuDNN's heuristic) from a measuring
    backend (one that has a ``summary``)."""
    summary = getattr(backend, "summary", None)
    if summary is None:
        return
    report.measured, report.cached, report.failed = summary.measured, summary.cached, summary.failed
    report.tuning_seconds = summary.seconds
    if getattr(summary, "pruning", ""):
        report.notes.append(summary.pruning)  # --prune learned: said at the default verbosity, not only with -v
    chosen, baseline = getattr(backend, "chosen_ms", {}), getattr(backend, "baseline_ms", {})
    for i, profile in enumerate(report.profiles):
        total_c = total_b = 0.0
        count = 0
        for problem, problem_uses in uses.items():
            for use in problem_uses:
                if use.profile != i or problem.direction == "wgrad" or problem not in baseline:
                    continue
                if (use.node.op_type == "ConvTranspose") != (problem.direction == "dgrad"):
                    continue  # a training direction of a Conv, not how it runs
                planned = overrides.get((use.node, i))
                time_ms = planned.time_ms if planned is not None else chosen.get(problem)
                if time_ms is None:
                    continue
                total_c += time_ms
                total_b += baseline[problem]
                count += 1
        if count:
            report.conv_time_ms[profile.name] = (total_c, total_b, count)


def _undecided_math(options: TuneOptions, precision_of: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The cuDNN math an undecided float32 conv records (``fma`` under --tf32 off or --precision
    fp32 / fp32-strict, ``default`` under --tf32 on or --precision tf32, ``auto`` where both are
    allowed), and per conv with a precision of its own (``precision_of``)."""
    modes = options.math_modes("float32")
    own = {name: _node_options(options, None, level).math_modes("float32")[0]
           for name, level in precision_of.items() if level in WIDE_PRECISIONS}
    return (modes[0] if len(modes) == 1 else annotation.AUTO), own




def _plan_layouts(model: ir.Model, backend: DecisionBackend, options: TuneOptions, uses: dict, report: OptimizeReport,
                  precision_of: Mapping[str, str], fused: Sequence[Sequence[Sequence[ir.Node]]] = (),
                  unit_costs: Sequence[Mapping[ir.Node, Mapping[str, float]]] = ()) -> dict:
    """With ``--layout auto``: each conv's layout from the min-cut plan over the whole graph (conv
    times + transpose times, measured by the tuner or recorded in the tuning cache), then its best
    configuration in that layout. Where the cache lacks a transpose time the plan needs, each conv
    takes its own best layout, with a note. Convs with a precision of their own (``precision_of``)
    choose under it, in the plan or, without one, in their own best layout. ``fused``: per profile, the
    node lists of the fusion units that run fused (one movable step each); ``unit_costs``, per
    profile, their times per format where they were timed in both."""
    rows = getattr(backend, "rows", None)
    transpose_ms = getattr(backend, "transpose_ms", None)
    if rows is None or (options.layout == "auto" and transpose_ms is None):
        if options.layout == "auto":
            report.layout_mode = "per-conv"
        return _precision_overrides(backend, options, uses, precision_of, rows) if rows is not None else {}
    if options.layout != "auto":
        return _precision_overrides(backend, options, uses, precision_of, rows)
    overrides = {}
    missing: set[tuple] = set()
    measures = getattr(backend, "measures", False)  # as the backend's own decisions (DecisionBackend.measures)
    value_shapes = model.meta.get(VALUE_SHAPES_KEY, [])
    picks: dict[tuple, Any] = {}

    def pick_in(problem: Any, layout: str, node: ir.Node) -> Any:
        """The problem's configuration in ``layout`` (under the node's own precision, if any), chosen
        once (convs share problems, and each is asked for its costs and then for its pick: three
        times per conv and profile)."""
        level = precision_of.get(node.name)
        if (problem, layout, level) not in picks:
            picks[(problem, layout, level)] = select(rows.get(problem, []), problem, _node_options(options, layout, level))
        return picks[(problem, layout, level)]
    for i, profile in enumerate(report.profiles):
        shapes = value_shapes[i] if i < len(value_shapes) else {}
        own: dict = {}  # node -> its own-direction problem at this profile
        for problem, problem_uses in uses.items():
            for use in problem_uses:
                if use.node.graph is not model.graph:
                    continue  # a conv in an If / Loop / Scan body: its own best layout (the plan is the main graph's)
                if use.profile == i and (use.node.op_type == "ConvTranspose") == (problem.direction == "dgrad") and problem.direction != "wgrad":
                    own.setdefault(use.node, problem)
        conv_costs = {}
        for node, problem in own.items():
            costs = {}
            mine = rows.get(problem, [])
            epilogue, residual, bias = epilogue_ms(mine, problem), residual_ms(mine, problem), bias_ms(mine, problem)
            for layout in ("nchw", "nhwc"):
                pick = pick_in(problem, layout, node)
                if pick is not None and pick.time_ms is not None:
                    costs[layout] = cost_ms(pick, epilogue, problem.fusion, residual, bias)
            conv_costs[node] = costs

        def cost(value: ir.Value, shapes: Mapping[str, Sequence[Any]] = shapes) -> float:  # this profile's shapes
            dims = shapes.get(value.name)
            if not dims or any(not isinstance(d, int) for d in dims):
                return 0.0
            if len(dims) < 3 or dims[1] == 1 or math.prod(dims[2:]) == 1:
                # no channels-last form, or one channel or one position: both formats are one memory
                # order (cudnn.layout_of: "both"), so nothing is converted
                return 0.0
            dtype = {ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}.get(value.dtype, "float32")
            ms = transpose_ms(tuple(dims), dtype)
            if ms is None:
                missing.add((tuple(dims), dtype))
                return 0.0
            return ms

        plan = plan_layouts(model.graph, conv_costs, cost, fused[i] if i < len(fused) else (), shapes,
                            unit_costs[i] if i < len(unit_costs) else None,
                            priced_slices=[node for node, problem in own.items() if problem.x_slice is not None])
        if missing:
            continue  # not planned: the notes below
        for node, layout in plan.layouts.items():
            problem = own[node]
            pick = pick_in(problem, layout, node)
            if pick is not None:
                source = options.strategy(problem.direction)[0] if measures else "cache"
                overrides[(node, i)] = choice_from(pick, source, rows.get(problem, []), problem)
        if plan.layouts:
            report.layout_plans[profile.name] = plan
    if missing:
        report.layout_mode = "per-conv"
        report.layout_plans.clear()
        shown = ", ".join(f"{'x'.join(map(str, d))} {t}" for d, t in sorted(missing)[:3])
        report.notes.append(
            f"--layout auto weighs conv times against transpose times, and the tuning cache holds none for {len(missing)} "
            f"tensor shape(s) the plan needs ({shown}{', ...' if len(missing) > 3 else ''}): each conv takes its own best "
            "layout here (as --layout per-conv); tuning the model once on a GPU of this type records them"
        )
        return _precision_overrides(backend, options, uses, precision_of, rows)
    return overrides


def _node_options(options: TuneOptions, layout: str | None, level: str | None) -> TuneOptions:
    """The options one conv chooses under: ``layout`` (None: the options') and its own float32
    precision ``level`` (``tf32``, ``fp32``, ``fp32-strict``; None: the options')."""
    changes: dict[str, Any] = {} if layout is None else {"layout": layout}
    if level is not None and level != options.precision:
        changes.update(tf32="on" if level == "tf32" else "off", precision=level, max_error=None)
    return dataclasses.replace(options, **changes) if changes else options


def _precision_overrides(backend: DecisionBackend, options: TuneOptions, uses: dict, precision_of: Mapping[str, str], rows: dict) -> dict:
    """Without a layout plan: each conv with a precision of its own (``precision_of``) takes its best
    configuration under it, in any layout the options allow."""
    overrides = {}
    measures = getattr(backend, "measures", False)
    for problem, problem_uses in uses.items():
        for use in problem_uses:
            level = precision_of.get(use.node.name)
            if level is None or (use.node.op_type == "ConvTranspose") != (problem.direction == "dgrad") or problem.direction == "wgrad":
                continue
            found = rows.get(problem, [])
            pick = select(found, problem, _node_options(options, None, level))
            if pick is not None:
                source = options.strategy(problem.direction)[0] if measures else "cache"
                overrides[(use.node, use.profile)] = choice_from(pick, source, found, problem)
    return overrides


_UNIT_KINDS = {"norm": "normalization + epilogue", "bias": "conv bias into the element-wise step after it"}


def precision_line(record: Mapping[str, Any]) -> str:
    """One line of a model's ``convpass.precision`` record."""
    counts = ", ".join(f"{n} {p}" for p, n in sorted(record.get("convs", {}).items()))
    budget = f"{record['metric']} <= {record['max_error']:.3g}" if record.get("max_error") is not None else record.get("metric", "")
    errors = ", ".join(f"{k} {record[k]['error']:.3g}" for k in ("calibration", "holdout") if k in record)
    within = "" if record.get("within_budget", True) else " [over budget]"
    return (f"precision {record.get('mode')} ({budget}): {counts}; {record.get('casts', 0)} casts; error on {errors}"
            f"{within} ({record.get('evaluator', '')})")


def build_options(kwargs: dict[str, Any], names: OptionNames = CLI) -> TuneOptions:
    """TuneOptions from the Python API's / CLI's keyword values (sizes and lists as text allowed):
    :func:`convpass.core.options.tune_options`."""
    return tune_options(kwargs, names)


def untuned(model: ir.Model, label: Any, retune: bool, hint: str = "pass --retune to tune it again (with the profiles it records "
            "unless --shape is given), or optimize the model it was tuned from") -> Previous | None:
    """A model convpass tuned already: refused (a :class:`ConvpassError` saying ``hint``) unless
    ``retune``, else turned back into the standard model in place, and its recorded decisions
    returned (None for a model never tuned)."""
    if not is_tuned(model):
        return None
    if not retune:
        convs = sum(1 for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain == annotation.DOMAIN)
        raise ConvpassError(f"{label} is already tuned by convpass ({convs} tuned convolution(s)); {hint}")
    strip = StripAnnotationsPass()
    strip(model)
    return strip.previous or Previous(ModelInfo(SCHEMA_VERSION, "", "", "", "", (), False, {}), {})


def spec_of(profile: Profile) -> str | dict:
    """The ``--shape`` a recorded profile was made from (its name), so that re-tuning names it the
    same; its recorded input shapes where the name is no such spec."""
    from convpass.core.profiles import parse_shape_spec

    if profile.name == MODEL_SHAPES:
        return {}
    try:
        parse_shape_spec(profile.name)
        return profile.name
    except ConvpassError:
        return dict(profile.inputs)


def inputs_of(model: Any, cache: str | os.PathLike | None) -> list[tuple[Any, str]]:
    """The files an optimize run reads, which its output must not replace: the model (when given
    as a path) and the tuning cache."""
    from convpass.tuning.cache_file import default_cache_path

    files: list[tuple[Any, str]] = [(cache if cache is not None else default_cache_path(), "the tuning cache")]
    if isinstance(model, (str, os.PathLike)):
        files.insert(0, (model, "the input model"))
    return files


def inspect(model: str | os.PathLike[str] | onnx.ModelProto | bytes, *, device: str | None = None) -> list[dict[str, Any]]:
    """The decisions a tuned model records: one record per convolution, device table and profile.

    Args:
        model: A tuned model: a path, serialized bytes or an ``onnx.ModelProto``. A model that was
            not tuned is read too: its convolutions are listed once each, ``source="untuned"``.
        device: Keep only the decision tables of the devices it names: a full device fingerprint
            or part of a GPU name (e.g. ``"H100"``). None: every table.

    Returns:
        Records in graph order, each a dict with ``node``, ``op``, ``device``, ``profile``,
        ``problem_key``, ``algo``, ``engine``, ``fusion``, ``dgrad_algo``, ``wgrad_algo``,
        ``memory_format``, ``math_mode``, ``tf32``, ``workspace_bytes``, ``time_ms`` and
        ``source`` (``measure``, ``exhaustive``, ``heuristic``, ``forced``, ``cache``, ``auto``
        or ``untuned``). Values not recorded are None.

    Raises:
        ConvpassError: the file is not a readable ONNX model, its annotations cannot be read, or
            ``device`` names no device the model has decisions for.
    """

    proto = model if isinstance(model, onnx.ModelProto) else to_proto(load_model(model))
    info, nodes = annotation.read_annotations(proto)
    by_name = {n.node_name: n for n in nodes}
    profiles = [p.name for p in info.profiles] if info else []
    devices = list(info.devices) if info and info.devices else [""]
    if device is not None:
        wanted = [d for d in devices if d and device_mod.DeviceFingerprint.parse(d).matches_name(device)]
        if not wanted:
            raise ConvpassError(f"the model has no decisions for a device matching {device!r}; its devices: "
                                f"{', '.join(d for d in devices if d) or 'none'}")
    else:
        wanted = devices
    records = []
    for node in annotation.all_nodes(proto.graph):
        if annotation.standard_op_type(node) not in annotation.CONV_OPS:
            continue
        name = node.name or node.output[0]
        if not annotation.is_annotated_conv(node):
            if node.domain in ("", "ai.onnx"):
                records.append({"node": name, "op": node.op_type, "device": None, "profile": None, "problem_key": "",
                                "algo": None, "engine": None, "fusion": None, "dgrad_algo": None, "wgrad_algo": None, "memory_format": None,
                                "math_mode": None, "tf32": None, "precision": None, "precision_error": None, "precision_sensitivity": None,
                                "workspace_bytes": None, "time_ms": None, "source": "untuned"})
            continue
        for dev, table in zip(devices, by_name[name].tables):
            if dev not in wanted:
                continue
            for i, d in enumerate(table):
                records.append(
                    {
                        "node": name,
                        "op": annotation.standard_op_type(node),
                        "device": dev or None,
                        "profile": profiles[i] if i < len(profiles) else str(i),
                        "problem_key": d.problem_key,
                        "algo": d.algo,
                        "engine": d.engine or None,
                        "fusion": d.fusion or None,
                        "dgrad_algo": d.dgrad_algo,
                        "wgrad_algo": d.wgrad_algo,
                        "memory_format": d.memory_format,
                        "math_mode": d.math_mode,
                        "tf32": d.tf32,
                        "precision": d.precision,
                        "precision_error": by_name[name].precision_error,
                        "precision_sensitivity": by_name[name].precision_sensitivity,
                        "workspace_bytes": d.workspace_bytes,
                        "time_ms": d.time_ms,
                        "source": d.source,
                    }
                )
    return records
