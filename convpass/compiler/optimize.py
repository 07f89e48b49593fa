"""``optimize``: read a model, run the pipeline, write the tuned model and its kernels, and say what was done.

:func:`optimize` (the Python API) and :func:`optimize_ir` take every option as a keyword argument
and name a wrong one as the argument (``shapes[1]``); the CLI builds the options with its flag
names and calls :func:`run_optimize`, which both share. :func:`print_report` writes the summary a
person reads, :func:`report_json` the one a program reads (``convpass optimize --json``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from rich.console import Console
from rich.markup import escape

from convpass.compiler.passes.strip_annotations import changes
from convpass.compiler.pipeline import _UNIT_KINDS, OptimizeReport, inputs_of, optimize_model, precision_line, spec_of, untuned
from convpass.core.errors import ConvpassError, OptionError
from convpass.core.files import check_output
from convpass.core.model_io import load_model, save_model, to_proto
from convpass.core.options import API, CLI, OptionNames, TuneOptions, parse_profiles, tune_options
from convpass.core.text import printable as _printable
from convpass.native import device as device_mod

__all__ = ["optimize", "optimize_ir", "print_report", "report_json", "run_optimize", "write_kernels"]

logger = logging.getLogger("convpass")

ModelSource = str | os.PathLike[str] | onnx.ModelProto | bytes
ShapeProfile = str | Mapping[str, Sequence[int]]


def optimize(
    model: ModelSource,
    output: str | os.PathLike[str] | None = None,
    *,
    shapes: Sequence[ShapeProfile] = (),
    mode: str = "measure",
    tf32: str = "auto",
    layout: str = "auto",
    engines: str = "all",
    prune: str = "off",
    fprop_algo: str | None = None,
    dgrad_algo: str | None = None,
    wgrad_algo: str | None = None,
    matmul_tf32: bool | str = False,
    workspace_limit: int | str | None = None,
    deterministic: bool = False,
    directions: str | Sequence[str] = "fwd",
    cache: str | os.PathLike[str] | None = None,
    device_name: str | None = None,
    kernels: bool = True,
    quiet: bool = False,
    retune: bool = False,
    precision: str | None = None,
    max_error: float | None = None,
    error_metric: str = "max-rel",
    calibration: Sequence[str | os.PathLike[str]] = (),
    holdout: Sequence[str | os.PathLike[str]] = (),
) -> onnx.ModelProto:
    """Tune every convolution of a model and return the model with the decisions recorded in it.

    On a machine with a GPU every convolution problem is measured there (or its earlier
    measurements read from the tuning cache); without one, decisions come from the tuning cache
    for ``device_name``, and what cannot be decided is left to run time (``auto``), which the
    printed summary says.

    Args:
        model: The ONNX model: a path, serialized bytes or an ``onnx.ModelProto``.
        output: Where to write the tuned model (atomically); None writes nothing.
        shapes: One entry per shape profile: ``"input=1x3x224x224"`` (several inputs:
            ``"a=1x3x8x8,b=1x10"``) or a mapping ``{"input": (1, 3, 224, 224)}``. Needed where an
            input the convolutions depend on has symbolic dimensions. Empty: the model's own shapes.
        mode: How algorithms are chosen: ``"measure"`` (convpass's timing harness),
            ``"heuristic"`` (cuDNN's first choice) or ``"exhaustive"`` (cuDNN's Find).
        tf32: TF32 for float32 convolutions: ``"auto"`` (measure with and without, keep the
            faster), ``"on"`` or ``"off"``.
        layout: Memory format: ``"auto"`` (whole-graph plan, transposes counted), ``"per-conv"``
            (each conv its own best), ``"nchw"`` or ``"nhwc"``.
        engines: Forward candidates under ``mode="measure"``: ``"legacy"`` (cuDNN's legacy
            algorithms), ``"graph"`` (graph-API engine configurations) or ``"all"``.
        prune: ``"off"`` (every candidate measured) or ``"learned"`` (candidates ordered and
            skipped by what the tuning cache's history on this GPU says of their geometry class;
            see docs/cli.md, ``--prune``).
        fprop_algo: Forward algorithm: ``"normal"`` (heuristic), ``"performance"`` (Find) or a
            cuDNN algorithm name (``"implicit_gemm"``, ...), which is then forced. None: ``mode``.
        dgrad_algo: Backward-data algorithm, as ``fprop_algo`` (``"algo_0"``, ``"algo_1"``, ...).
        wgrad_algo: Backward-filter algorithm, as ``fprop_algo``.
        matmul_tf32: TF32 for Gemm / MatMul: True / False, or ``"on"`` / ``"off"``.
        workspace_limit: The largest workspace an algorithm may use: bytes, a size such as
            ``"256MiB"``, or None for no limit.
        deterministic: Only deterministic algorithms.
        directions: ``"fwd"``, or ``"fwd,dgrad,wgrad"`` (or a list) to also tune the training
            passes of Conv.
        cache: The tuning cache file. None: ``$CONVPASS_CACHE``, else the user cache folder.
        device_name: Take decisions from the tuning cache for this GPU (part of its name, e.g.
            ``"H200"``, or a full fingerprint) instead of measuring; the cache must exist.
        kernels: With ``output`` on a machine with a GPU, also compile the GPU kernels the tuned
            model needs and write them beside it (``<output>.kernels``).
        quiet: Print nothing but warnings (the summary goes to stderr otherwise).
        retune: Tune a model convpass tuned already again (with the profiles it records unless
            ``shapes`` are given); the report says which decisions changed. Without it such a
            model is refused.
        precision: Each conv's precision: ``"auto"`` (FP32-strict, FP32, TF32 or FP16 chosen by
            measured speed within ``max_error``, the model's error measured end to end),
            ``"fp32-strict"`` (FP32 arithmetic, GEMM-based and direct algorithms only: no Winograd,
            no FFT), ``"fp32"`` (FP32 arithmetic, any algorithm), ``"tf32"``, ``"fp16"`` (that
            precision for every conv), or None (the model's own types; ``tf32`` decides float32
            convs). See docs/precision.md.
        max_error: With ``precision="auto"``: the largest error of the outputs to accept.
        error_metric: ``"max-rel"`` (max |y - y_ref| / max |y_ref|) or ``"rel-l2"``.
        calibration: ``.npz`` files of inputs the error is measured on (empty: random normal).
        holdout: ``.npz`` files of held-out inputs the chosen plan is validated on.

    Returns:
        The tuned model.

    Raises:
        ConvpassError: a bad argument (the message names it, e.g. ``shapes[1]``), a model that
            cannot be read or tuned, or an output that cannot be written; nothing is written then.
    """
    return to_proto(optimize_ir(
        model, output, shapes=shapes, mode=mode, tf32=tf32, layout=layout, engines=engines, prune=prune, fprop_algo=fprop_algo,
        dgrad_algo=dgrad_algo, wgrad_algo=wgrad_algo, matmul_tf32=matmul_tf32, workspace_limit=workspace_limit,
        deterministic=deterministic, directions=directions, cache=cache, device_name=device_name, kernels=kernels,
        quiet=quiet, retune=retune, precision=precision, max_error=max_error, error_metric=error_metric, calibration=calibration,
        holdout=holdout,
    ))


def optimize_ir(
    model: ModelSource,
    output: str | os.PathLike[str] | None = None,
    *,
    shapes: Sequence[ShapeProfile] = (),
    mode: str = "measure",
    tf32: str = "auto",
    layout: str = "auto",
    engines: str = "all",
    prune: str = "off",
    fprop_algo: str | None = None,
    dgrad_algo: str | None = None,
    wgrad_algo: str | None = None,
    matmul_tf32: bool | str = False,
    workspace_limit: int | str | None = None,
    deterministic: bool = False,
    directions: str | Sequence[str] = "fwd",
    cache: str | os.PathLike[str] | None = None,
    device_name: str | None = None,
    kernels: bool = True,
    quiet: bool = False,
    retune: bool = False,
    precision: str | None = None,
    max_error: float | None = None,
    error_metric: str = "max-rel",
    calibration: Sequence[str | os.PathLike[str]] = (),
    holdout: Sequence[str | os.PathLike[str]] = (),
) -> ir.Model:
    """:func:`optimize`, returning the onnx-ir model instead, without the protobuf copy (0.1 s
    for a 100 MB model). Takes the same arguments and raises the same errors."""
    options = tune_options(dict(
        mode=mode, tf32=tf32, layout=layout, engines=engines, prune=prune, fprop_algo=fprop_algo, dgrad_algo=dgrad_algo,
        wgrad_algo=wgrad_algo, matmul_tf32=matmul_tf32, workspace_limit=workspace_limit, deterministic=deterministic,
        directions=directions, precision=precision, max_error=max_error, error_metric=error_metric,
    ), API)
    profiles = parse_profiles(shapes, API)
    if device_name is not None and not isinstance(device_name, str):
        raise OptionError(f"device_name {device_name!r}: expected a GPU name or a device fingerprint")
    console = Console(stderr=True, quiet=bool(quiet), soft_wrap=True)
    ir_model, _ = run_optimize(model, output, options, profiles, cache=cache, device_name=device_name, kernels=kernels,
                               console=console, names=API, calibration=calibration, holdout=holdout, retune=retune)
    return ir_model


def run_optimize(
    model: ModelSource,
    output: str | os.PathLike[str] | None,
    options: TuneOptions,
    profiles: Sequence[ShapeProfile],
    *,
    cache: str | os.PathLike[str] | None,
    device_name: str | None,
    kernels: bool,
    console: Console,
    names: OptionNames,
    calibration: Sequence[str | os.PathLike[str]] = (),
    holdout: Sequence[str | os.PathLike[str]] = (),
    retune: bool = False,
) -> tuple[ir.Model, OptimizeReport]:
    """Load, optimize, write and report, with options already checked (the CLI's and the API's
    shared path); ``names`` spells the options in messages. Returns the model and the report,
    whose ``kernels`` line says what became of the kernel side-car."""
    device_mod.start_driver()  # ready by the time the decisions need the GPU's fingerprint
    protect = [*inputs_of(model, cache),  # what the run reads, which its output must not replace
               *((path, f"a {names(flag)} file") for flag, paths in (("calibration", calibration), ("holdout", holdout))
                 for path in paths)]
    if output is not None:
        check_output(output, "-o" if names is CLI else "output", protect)
    ir_model = load_model(model)
    hint = (f"pass {names('retune')} to tune it again (with the profiles it records unless {names('shapes')} is given), "
            "or optimize the model it was tuned from") if names is CLI else \
        "pass retune=True to tune it again (with the profiles it records unless shapes are given), or optimize the model it was tuned from"
    previous = untuned(ir_model, model if isinstance(model, (str, os.PathLike)) else "the model", retune, hint)
    if previous is not None and not profiles:
        profiles = [spec_of(p) for p in previous.info.profiles]
    report = optimize_model(ir_model, options, profiles, cache, device_name, console, calibration=calibration, holdout=holdout,
                            names=names)
    if previous is not None:
        report.notes[:0] = changes(previous, ir_model)
    if output is not None:
        save_model(ir_model, output, protect)
    print_report(report, console, str(output) if output is not None else None)
    if output is not None:
        report.kernels, report.in_place = write_kernels(Path(output), kernels, console)
    return ir_model, report


def write_kernels(output: Path, kernels: bool, console: Console) -> tuple[str, tuple[dict[str, Any], ...]]:
    """The tuned model's kernel side-car (:mod:`convpass.compiler.aot`). The one beside ``output`` is kept
    when it was compiled for exactly this model here (a cached re-run writes the same bytes), and
    deleted otherwise, since it no longer matches. Returns the line that says what became of it,
    and the in-place check that compiling it ran (per profile; none when nothing was compiled)."""
    from convpass.compiler.aot import compile_kernels, current_sidecar
    from convpass.core.kernel_file import sidecar_path
    from convpass.runtime.cuda import unavailable_reason

    reason = unavailable_reason() if kernels else None
    kept = current_sidecar(output) if kernels and reason is None else None
    if kept is not None:
        return _say(console, "kernels: " + kept), ()
    sidecar_path(output).unlink(missing_ok=True)
    if not kernels:
        return "kernels: not compiled (not asked for)", ()
    if reason is not None:
        return _say(console, f"kernels: not compiled ahead of time here ({reason}); `convpass compile {output}` on the target GPU "
                             "writes them"), ()
    try:
        report = compile_kernels(output)
    except ConvpassError as e:
        message = f"the tuned model was written, its kernels were not: {e}"
        if console.quiet:  # a warning, not a note: said even when only errors are printed
            logger.warning("%s", message)
        else:
            console.print(f"[yellow]warning[/]: {_safe(message)}")
        return "kernels: " + message, ()
    line = _say(console, "kernels: " + report.line())
    in_place = report.in_place_line()
    if in_place:
        _say(console, in_place)
    for slow in report.slow_shown(output):  # what was timed alone runs slower where it runs: the worst named, the rest counted
        logger.warning("%s", slow)
    return line, report.in_place


def _printable_lines(text: object) -> str:
    return _printable(text, keep_newlines=True)


def _say(console: Console, line: str) -> str:
    console.print(_printable_lines(line), markup=False, highlight=False)
    return line


def _safe(text: object) -> str:
    """A string from the model or the options, for rich markup: control characters shown, brackets escaped."""
    return escape(_printable_lines(text))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def print_report(report: OptimizeReport, console: Console, output: str | None = None) -> None:
    """The summary of an optimize run, for a person (rich markup; every string from the model or
    the options escaped)."""
    profiles = ", ".join(p.name for p in report.profiles)
    console.print(
        f"[bold]convpass[/]: {_plural(report.convs, 'convolution')}, {_plural(report.problems, 'distinct problem')} over "
        f"{_plural(len(report.profiles), 'shape profile')} \\[{_safe(profiles)}]"
    )
    if report.backend:
        console.print(f"  decisions: {_safe(report.backend)}")
    console.print("  " + decisions_line(report))
    if report.measured is not None:
        line = (f"  tuning: {report.measured} problems timed now, {report.cached} read from the tuning cache, "
                f"{report.failed} with no configuration that passed")
        if report.tuning_seconds is not None:
            line += f" ({report.tuning_seconds:.1f} s)"
        console.print(line)
        if report.measured == 0 and report.cached and not report.fusion_timed_now:
            console.print("  every decision came from the tuning cache: nothing was timed")
    if report.engine_decisions:
        console.print(f"  {report.engine_decisions} of {report.decisions_recorded} conv decisions run a cuDNN graph-API engine")
    if report.own_kernel_decisions:
        console.print(f"  {report.own_kernel_decisions} of {report.decisions_recorded} conv decisions run convpass's own depthwise kernel "
                      "(measured faster than every cuDNN algorithm)")
    if report.fusion_units:
        measured = (f"{report.fusion_measured} decision(s) measured on the GPU, {report.fusion_fused} of them fused"
                    if report.fusion_measured else "not measured: the executor applies the rule of each kind")
        kinds = ", ".join(f"{n} {_UNIT_KINDS.get(k, k)}" for k, n in sorted(report.fusion_kinds.items()))
        console.print(f"  {report.fusion_units} fusion unit(s) ({kinds}): {measured}")
    if report.fused_decisions:
        console.print(f"  {report.fused_decisions} of {report.decisions_recorded} conv decisions run their epilogue fused into the conv's call "
                      "(the rest: the conv, then one element-wise pass)")
    if report.measured is not None:
        for name, plan in report.layout_plans.items():
            nhwc = sum(1 for v in plan.layouts.values() if v == "nhwc")
            units = f" and {plan.timed_units} fused unit(s) timed in both formats" if plan.timed_units else ""
            console.print(
                f"  layout plan \\[{_safe(name)}]: {nhwc} of {len(plan.layouts)} convs NHWC, {plan.transposes} transposes; "
                f"{plan.cost_ms:.3f} ms with transposes{units} (per-conv best layouts alone: {plan.per_conv_best_ms:.3f} ms of convs)"
            )
        for name, (chosen, heuristic, count) in report.conv_time_ms.items():
            console.print(
                f"  conv time \\[{_safe(name)}], {count} convs: chosen {chosen:.3f} ms vs cuDNN heuristic {heuristic:.3f} ms "
                f"({chosen / heuristic:.2f}x)"
            )
    if report.precision:
        console.print("  " + _safe(precision_line(report.precision)))
    for name, why in report.skipped:
        console.print(f"  [yellow]untuned[/] {_safe(name)}: {_safe(why)}")
    for note in report.notes:
        console.print(f"  [yellow]note[/]: {_safe(note)}")
    if output:
        console.print(f"  wrote {_safe(output)}")


def decisions_line(report: OptimizeReport) -> str:
    """Where the decisions came from, in words that match the counts: e.g. ``decided 3 of 4
    problems (2 by measurement now, 1 from the tuning cache); 1 left to run time``."""
    total = report.decided + report.undecided
    if total == 0:
        return "no convolution problems to decide"
    parts = []
    if report.measured is not None:
        parts.append(f"{report.decided_measured} by measurement on this GPU now")
    parts.append(f"{report.decided_cached} from the tuning cache")
    line = f"decided {report.decided} of {_plural(total, 'problem')} ({', '.join(parts)})"
    if report.undecided:
        line += f"; {report.undecided} left to run time (auto: cuDNN's heuristic chooses when the model runs)"
    return line


def report_json(report: OptimizeReport, model: str, output: str | None) -> dict[str, Any]:
    """The ``convpass.optimize/1`` document of ``convpass optimize --json`` (docs/cli.md)."""
    return {
        "schema": "convpass.optimize/1",
        "model": model,
        "output": output,
        "convolutions": report.convs,
        "untuned": [{"node": name, "reason": why} for name, why in report.skipped],
        "problems": report.problems,
        "profiles": [p.to_json() for p in report.profiles],
        "backend": report.backend,
        "device": report.device or None,
        "decisions": {"measured": report.decided_measured, "cached": report.decided_cached, "auto": report.undecided},
        "tuning": None if report.measured is None else {
            "timed": report.measured, "cached": report.cached, "failed": report.failed, "seconds": report.tuning_seconds},
        "conv_time_ms": {name: {"chosen": c, "heuristic": h, "convs": n} for name, (c, h, n) in report.conv_time_ms.items()},
        "notes": list(report.notes),
        "kernels": report.kernels,
        "in_place": list(report.in_place) or None,
    }
