"""The optimize pipeline: load -> resolve shapes -> canonicalize -> collect problems -> decide -> annotate.

The Python API and the CLI both run :func:`optimize_model`; :func:`optimize` is the public entry
that returns an ``onnx.ModelProto`` (and writes it when ``output`` is given).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from rich.console import Console

from convpass.native import device as device_mod
from convpass.core import annotation
from convpass.core.version import __version__
from convpass.core.annotation import ModelInfo, Profile, SCHEMA_VERSION
from convpass.tuning.decide import CacheBackend, DecisionBackend, choice_from, cost_ms, epilogue_ms, select
from convpass.core.errors import ConvpassError
from convpass.core.files import check_output
from convpass.core.text import literal, markup
from convpass.core.model_io import load_model, save_model, to_proto
from convpass.core.options import TuneOptions, parse_directions, parse_size
from convpass.compiler.passes.annotate_convs import AnnotateConvsPass, DeviceChoices
from convpass.compiler.passes.canonicalize_convs import CanonicalizeConvsPass
from convpass.compiler.passes.collect_conv_problems import CollectConvProblemsPass, ConvProblem, ProblemUse
from convpass.compiler.passes.fold_conv_weights import FoldConvWeightsPass
from convpass.compiler.passes.plan_layouts import plan_layouts
from convpass.compiler.passes.resolve_shapes import MODEL_SHAPES, PROFILES_KEY, SKIP_KEY, VALUE_SHAPES_KEY, ResolveShapesPass
from convpass.compiler.passes.strip_annotations import Previous, StripAnnotationsPass, changes, is_tuned
from convpass.kernels.depthwise import is_own

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


def _make_backend(options: TuneOptions, cache_path: str | os.PathLike | None, device_name: str | None, report: OptimizeReport, console: Console) -> DecisionBackend:
    from convpass.tuning.cache import TuningCache, default_cache_path

    local = device_mod.detect()
    if local is not None and (device_name is None or local.matches_name(device_name)):
        from convpass.tuning.tuner import CudnnTuner

        report.backend = f"measured on {local.name} (cuDNN {local.cudnn_version_str})"
        report.device = str(local)
        return CudnnTuner(TuningCache(cache_path), local, console=console)
    if device_name is None:
        report.backend = "no GPU found and no --device-name: nothing can be measured or looked up"
        return CacheBackend(None, None)
    path = Path(cache_path).expanduser() if cache_path is not None else default_cache_path()
    if not path.exists():  # decisions are read, never measured, here: an empty new cache holds none
        raise ConvpassError(f"--device-name {device_name}: tuning cache {path} does not exist; give the cache recorded "
                            "on that GPU type with --cache (or CONVPASS_CACHE)")
    cache = TuningCache(path, readonly=True)
    target = cache.resolve_device(device_name)
    report.backend = f"tuning cache {cache.path} for {target.name} (cuDNN {target.cudnn_version_str}); no GPU used"
    report.device = str(target)
    return CacheBackend(cache, target)


def prepare_model(model: ir.Model, options: TuneOptions, shapes: Sequence[str | dict], report: OptimizeReport) -> dict[ConvProblem, list[ProblemUse]]:
    """The graph passes before any decision (in place): fold conv weights, resolve shapes per
    profile, canonicalize, collect the distinct problems. Fills the report's counts; returns every
    problem with its uses, in graph order."""
    FoldConvWeightsPass()(model)
    resolve = ResolveShapesPass(shapes)
    resolve(model)
    report.notes.extend(resolve.notes)  # tensors the CPU run resolved, per profile
    CanonicalizeConvsPass()(model)
    collect = CollectConvProblemsPass(options.directions, options.fusions)
    collect(model)
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
) -> None:
    """Decide every problem with each backend (one decision table per backend's device, in order)
    and write the tables into the prepared model. No backends: one table of ``auto`` decisions."""
    problems = list(uses)
    devices = tuple(str(b.device) for b in backends if b.device is not None)
    if len(backends) > 1 and len(devices) != len(backends):
        raise ValueError("several decision tables need a device each")
    tables: list[DeviceChoices] = []
    for backend in backends:
        choices = backend.decide(problems, options)
        decided = sum(1 for c in choices.values() if c is not None)
        report.decided += decided
        report.undecided += len(problems) - decided
        if backend.device is not None:
            report.by_device[str(backend.device)] = (decided, len(problems) - decided)
        overrides = _plan_layouts(model, backend, options, uses, report)
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
    )
    AnnotateConvsPass(tables, info, options.directions, options.fusions)(model)
    _count_engines(model, report)


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
            report.own_kernel_decisions += sum(1 for v in values(node.attributes.get("algo")) if is_own(v))


def optimize_model(
    model: ir.Model,
    options: TuneOptions,
    shapes: Sequence[str | dict] = (),
    cache: str | os.PathLike | None = None,
    device_name: str | None = None,
    console: Console | None = None,
    backend: DecisionBackend | None = None,
) -> OptimizeReport:
    """Run the whole pipeline on an in-memory model (modified in place); returns the report."""
    console = console or Console(stderr=True, soft_wrap=True)
    report = OptimizeReport()
    uses = prepare_model(model, options, shapes, report)
    if uses:
        if backend is None:
            backend = _make_backend(options, cache, device_name, report, console)
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


def _plan_layouts(model: ir.Model, backend: DecisionBackend, options: TuneOptions, uses: dict, report: OptimizeReport) -> dict:
    """With ``--layout auto``: each conv's layout from the min-cut plan over the whole graph (conv
    times + transpose times, measured by the tuner or recorded in the tuning cache), then its best
    configuration in that layout. Where the cache lacks a transpose time the plan needs, each conv
    takes its own best layout, with a note."""
    rows = getattr(backend, "rows", None)
    transpose_ms = getattr(backend, "transpose_ms", None)
    if options.layout != "auto":
        return {}
    if rows is None or transpose_ms is None:
        report.layout_mode = "per-conv"
        return {}
    overrides = {}
    missing: set[tuple] = set()
    measures = getattr(backend, "measures", False)  # as the backend's own decisions (DecisionBackend.measures)
    value_shapes = model.meta.get(VALUE_SHAPES_KEY, [])
    picks: dict[tuple, Any] = {}

    def pick_in(problem: Any, layout: str) -> Any:
        """The problem's configuration in ``layout``, chosen once (convs share problems, and each
        is asked for its costs and then for its pick: three times per conv and profile)."""
        if (problem, layout) not in picks:
            picks[(problem, layout)] = select(rows.get(problem, []), problem, dataclasses.replace(options, layout=layout))
        return picks[(problem, layout)]
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
            epilogue = epilogue_ms(rows.get(problem, []), problem)
            for layout in ("nchw", "nhwc"):
                pick = pick_in(problem, layout)
                if pick is not None and pick.time_ms is not None:
                    costs[layout] = cost_ms(pick, epilogue, problem.fusion)
            conv_costs[node] = costs

        def cost(value: ir.Value) -> float:
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

        plan = plan_layouts(model.graph, conv_costs, cost)
        if missing:
            continue  # not planned: the notes below
        for node, layout in plan.layouts.items():
            problem = own[node]
            pick = pick_in(problem, layout)
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
        return {}
    return overrides


def print_report(report: OptimizeReport, console: Console, output: str | None = None) -> None:
    tuned = report.convs - len(report.skipped)
    console.print(
        f"[bold]convpass[/]: {report.convs} convolutions ({tuned} tuned), {report.problems} distinct problems over "
        f"{len(report.profiles)} profile(s) {markup('[' + ', '.join(p.name for p in report.profiles) + ']')}"
    )
    if report.backend:
        console.print(f"  decisions: {markup(report.backend)}")
    console.print(f"  decided {report.decided}, left to run time (auto) {report.undecided}")
    if report.measured is not None:
        line = f"  measured {report.measured} problems, {report.cached} from the tuning cache, {report.failed} failed"
        if report.tuning_seconds is not None:
            line += f" ({report.tuning_seconds:.1f} s)"
        console.print(line)
        if report.measured == 0 and report.cached:
            console.print("  every decision came from the tuning cache: nothing was timed")
    if report.engine_decisions:
        console.print(f"  {report.engine_decisions} of {report.decisions_recorded} conv decisions run a cuDNN graph-API engine")
    if report.own_kernel_decisions:
        console.print(f"  {report.own_kernel_decisions} of {report.decisions_recorded} conv decisions run convpass's own depthwise kernel "
                      "(measured faster than every cuDNN algorithm)")
    if report.fused_decisions:
        console.print(f"  {report.fused_decisions} of {report.decisions_recorded} conv decisions run their epilogue fused into the conv's call "
                      "(the rest: the conv, then one element-wise pass)")
    if report.measured is not None:
        for name, plan in report.layout_plans.items():
            nhwc = sum(1 for v in plan.layouts.values() if v == "nhwc")
            console.print(
                f"  layout plan {markup(f'[{name}]')}: {nhwc} of {len(plan.layouts)} convs NHWC, {plan.transposes} transposes; "
                f"{plan.cost_ms:.3f} ms with transposes (per-conv best layouts alone: {plan.per_conv_best_ms:.3f} ms of convs)"
            )
        for name, (chosen, heuristic, count) in report.conv_time_ms.items():
            console.print(
                f"  conv time {markup(f'[{name}]')}, {count} convs: chosen {chosen:.3f} ms vs cuDNN heuristic {heuristic:.3f} ms "
                f"({chosen / heuristic:.2f}x)"
            )
    for name, why in report.skipped:
        console.print(f"  [yellow]untuned[/] {markup(name)}: {markup(why)}")
    for note in report.notes:
        console.print(f"  [yellow]note[/]: {markup(note)}")
    if output:
        console.print(f"  wrote {markup(output)}")


def build_options(kwargs: dict[str, Any]) -> TuneOptions:
    """TuneOptions from the Python API's / CLI's keyword values (sizes and lists as text allowed)."""
    kw = dict(kwargs)
    if "workspace_limit" in kw:
        kw["workspace_limit"] = parse_size(kw["workspace_limit"])
    if "directions" in kw:
        kw["directions"] = parse_directions(kw["directions"])
    if isinstance(kw.get("matmul_tf32"), str):
        kw["matmul_tf32"] = {"on": True, "off": False}.get(kw["matmul_tf32"], kw["matmul_tf32"])
    try:
        return TuneOptions(**kw)
    except TypeError as e:
        raise ConvpassError(f"unknown option: {e}") from None


def optimize(model: str | os.PathLike | onnx.ModelProto | bytes, output: str | os.PathLike | None = None, **kwargs: Any) -> onnx.ModelProto:
    """Tune every convolution of ``model`` and return the annotated model (see the README); takes
    the arguments of :func:`optimize_ir`."""
    return to_proto(optimize_ir(model, output, **kwargs))


def optimize_ir(
    model: str | os.PathLike | onnx.ModelProto | bytes,
    output: str | os.PathLike | None = None,
    *,
    shapes: Sequence[str | dict] = (),
    cache: str | os.PathLike | None = None,
    device_name: str | None = None,
    quiet: bool = False,
    kernels: bool = True,
    retune: bool = False,
    **options: Any,
) -> ir.Model:
    """:func:`optimize`, returning the onnx-ir model: the CLI, which only wants the file, makes no
    protobuf copy of it (0.1 s for a 100 MB model).

    Options (as on the CLI): ``mode`` (heuristic | exhaustive | measure), ``fprop_algo`` /
    ``dgrad_algo`` / ``wgrad_algo`` (normal | performance | an algorithm name), ``tf32``
    (auto | on | off), ``layout`` (auto | nchw | nhwc), ``matmul_tf32`` (bool), ``workspace_limit``
    (bytes or "64MiB"), ``deterministic`` (bool), ``directions`` ("fwd,dgrad,wgrad"), ``engines``
    (legacy | graph | all: cuDNN's legacy algorithms, its graph-API engine configurations, or both).
    ``shapes``: one entry per profile, ``"input=1x3x224x224"`` or ``{"input": (1, 3, 224, 224)}``.
    ``kernels``: with an ``output`` on a machine with a GPU, also compile the GPU kernels the tuned
    model's plans need and write them beside it (``<output>.kernels``, :mod:`convpass.compiler.aot`).
    ``retune``: a model convpass tuned already is tuned again (its recorded profiles unless
    ``shapes`` are given) and the report says which decisions changed; without it such a model is
    refused (:func:`untuned`).
    """
    device_mod.start_driver()  # ready by the time the decisions need the GPU's fingerprint
    tune_options = build_options(options)
    console = Console(stderr=True, quiet=quiet, soft_wrap=True)
    protect = _inputs_of(model, cache)
    if output is not None:
        check_output(output, "output", protect)
    ir_model = load_model(model)
    previous = untuned(ir_model, model if isinstance(model, (str, os.PathLike)) else "model", retune)
    if previous is not None and not shapes:
        shapes = [_spec_of(p) for p in previous.info.profiles]
    report = optimize_model(ir_model, tune_options, shapes, cache, device_name, console)
    if previous is not None:
        report.notes[:0] = changes(previous, ir_model)
    if output is not None:
        save_model(ir_model, output, protect)
    print_report(report, console, str(output) if output is not None else None)
    if output is not None:
        _write_kernels(Path(output), kernels, console)
    return ir_model


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


def _spec_of(profile: Profile) -> str | dict:
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


def _inputs_of(model: Any, cache: str | os.PathLike | None) -> list[tuple[Any, str]]:
    """The files an optimize run reads, which its output must not replace: the model (when given
    as a path) and the tuning cache."""
    from convpass.tuning.cache import default_cache_path

    files: list[tuple[Any, str]] = [(cache if cache is not None else default_cache_path(), "the tuning cache")]
    if isinstance(model, (str, os.PathLike)):
        files.insert(0, (model, "the input model"))
    return files


def _write_kernels(output: Path, kernels: bool, console: Console) -> None:
    """The tuned model's kernel side-car (:mod:`convpass.compiler.aot`). The one beside ``output`` is kept
    when it was compiled for exactly this model here (a cached re-run writes the same bytes), and
    deleted otherwise, since it no longer matches."""
    from convpass.compiler.aot import compile_kernels, current_sidecar
    from convpass.core.kernel_file import sidecar_path
    from convpass.runtime.cuda import unavailable_reason

    reason = unavailable_reason() if kernels else None
    kept = current_sidecar(output) if kernels and reason is None else None
    if kept is not None:
        console.print(literal("kernels: " + kept))
        return
    sidecar_path(output).unlink(missing_ok=True)
    if not kernels:
        return
    if reason is not None:
        console.print(literal(f"kernels: not compiled ahead of time here ({reason}); `convpass compile {output}` on the target GPU writes them"))
        return
    try:
        console.print(literal("kernels: " + compile_kernels(output).line()))
    except ConvpassError as e:
        message = f"the tuned model was written, its kernels were not: {e}"
        if console.quiet:  # a warning, not a note: said even when only errors are printed
            logger.warning("%s", message)
        else:
            console.print(f"[yellow]warning[/]: {markup(message)}", markup=True)


def inspect(model: str | os.PathLike | onnx.ModelProto, device: str | None = None) -> list[dict[str, Any]]:
    """One record per convolution, device table and profile, in graph order: node, op, device,
    profile, decisions. ``device`` (a fingerprint or part of a GPU name, as ``--device-name``) keeps
    only the tables of the devices it names.

    Convolutions that were not tuned (plain standard ops) are listed once with ``source="untuned"``.
    """
    from convpass.core import annotation

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
                                "math_mode": None, "tf32": None, "workspace_bytes": None, "time_ms": None, "source": "untuned"})
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
                        "workspace_bytes": d.workspace_bytes,
                        "time_ms": d.time_ms,
                        "source": d.source,
                    }
                )
    return records
