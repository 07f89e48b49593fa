"""``convpass tune MODEL... (--shape SPEC... | --batch N[,N]...) -o DIR [--cluster local|ray|ray://HOST:PORT]
[--devices NAME[,NAME]] [--cache PATH] [--retries N] [--task-timeout S] [--json] [--json-file PATH]``
plus the decision options of ``optimize``. See :mod:`convpass.fleet.driver` for what it does.

Exit status: 0 when every model was written (problems that failed are ``auto`` in them and listed);
130 when interrupted (what was measured is in the cache; the models complete before the interrupt
may be written, the report lists which); 1 for bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from convpass.core.errors import OptionError


def add_tune_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from convpass.cli.options import add_decision_options
    from convpass.cli.output import add_json_options
    from convpass.core.options import LAYOUT_CHOICES

    p = sub.add_parser(
        "tune",
        help="tune many models on every GPU of a cluster (local processes or Ray) into one cache",
        description="Collect the distinct convolution problems of all MODELs and profiles, measure them on every "
        "GPU of the cluster (one worker per GPU; problems go to GPUs of the type they are tuned for), write the "
        "results into the tuning cache (the driver alone writes it), then write each tuned model with one "
        "decision table per device type.",
    )
    p.add_argument("models", nargs="+", metavar="MODEL.onnx")
    p.add_argument("-o", "--output-dir", required=True, metavar="DIR",
                   help="where the tuned models go, as DIR/<model name>.tuned.onnx (written atomically)")
    profiles = p.add_mutually_exclusive_group()
    profiles.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS[,NAME=DIMS]",
                          help="a shape profile for every model (as optimize); repeat for several profiles")
    profiles.add_argument("--batch", action="append", default=[], metavar="N[,N] | NAME=N[,N]",
                          help="one profile per batch size, the first dim of every input (as convpass bench); "
                          "NAME=N[,N] for the model whose file stem is NAME")
    p.add_argument("--cluster", default="local", metavar="local|ray|ray://HOST:PORT",
                   help="local (default: one worker process per local GPU), ray (RAY_ADDRESS, else the Ray cluster last started "
                   "on this machine, else a new local Ray), "
                   "or ray://HOST:PORT; Ray needs pip install 'convpass[fleet]'")
    p.add_argument("--devices", default="", metavar="NAME[,NAME]",
                   help="device types to tune for, e.g. h100,h200 (default: every GPU type in the cluster); a name "
                   "no GPU of the cluster matches takes its decisions from the tuning cache only")
    p.add_argument("--retries", type=int, default=2, metavar="N", help="tries after a task's first failure (default 2); a task is one geometry's problems")
    p.add_argument("--task-timeout", type=float, metavar="SECONDS",
                   help="a task (one geometry's problems, measured one after the other) still running after this long "
                   "has its worker killed and runs again elsewhere")
    add_decision_options(p, LAYOUT_CHOICES, "per-conv",
                         "memory format: per-conv (default: each conv its own best), nchw, nhwc; auto is refused here "
                         "(its whole-graph plan needs transpose timings that fleet workers do not send back)")
    add_json_options(p, "convpass.tune/1")
    p.set_defaults(func=tune_command)
    return p


def tune_command(args: argparse.Namespace) -> int:
    # Nothing heavy before driver.tune launches the workers: the models are read (and --batch
    # resolved) in the model processes, the options are built (which imports the pipeline) while
    # the workers start.
    from convpass.cli.options import decision_options
    from convpass.cli.output import emit_json
    from convpass.fleet import driver
    from convpass.fleet import models as fleet_models
    from convpass.fleet import report as fleet_report
    from convpass.fleet.model_procs import ModelSpec

    if args.retries < 0:
        raise OptionError(f"--retries must be >= 0, got {args.retries}")
    if args.task_timeout is not None and args.task_timeout <= 0:
        raise OptionError(f"--task-timeout must be > 0 seconds, got {args.task_timeout:g}")
    if args.prune != "off":
        raise OptionError("--prune learned applies to convpass optimize: the fleet's workers measure every candidate")
    if args.batch:
        specs = fleet_models.specs_with_batches(args.models, args.batch)
    else:
        specs = [ModelSpec(Path(m), tuple(args.shape)) for m in args.models]
    console = Console(stderr=True, quiet=args.quiet, soft_wrap=True)  # -q: no progress bar and no report
    try:
        report = driver.tune(
            specs,
            args.output_dir,
            decision_options(args),
            cluster=args.cluster,
            devices=[d.strip() for d in args.devices.split(",") if d.strip()],
            cache=args.cache,
            retries=args.retries,
            task_timeout=args.task_timeout,
            console=console,
        )
    except KeyboardInterrupt:  # a second Ctrl-C, or one before tuning: no report to say what was written
        print(f"convpass: interrupted; what was measured is in the tuning cache; a model in {args.output_dir} "
              "written by this run is complete (written atomically)", file=sys.stderr)
        return 130
    fleet_report.print_report(report, console)
    emit_json(args, {"schema": "convpass.tune/1", **report.to_json()})
    return 130 if report.interrupted else 0
