"""The models of a fleet run: their specs (``--batch`` profiles), the files they are written to,
their problems as collected, and the order in which those problems are measured
(:func:`tuning_order`, the problems of one geometry as one task: :class:`Geometries`).

Importing this module is cheap (no ONNX, onnx-ir or graph passes): :mod:`convpass.fleet.driver`
imports it before it launches the workers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from convpass.core.errors import ConvpassError, OptionError
from convpass.core.files import check_readable
from convpass.core.options import TuneOptions
from convpass.core.profiles import parse_batches, profiles_for_batches
from convpass.fleet.model_procs import ModelSpec, prepare

if TYPE_CHECKING:
    import onnx_ir as ir

    from convpass.compiler.passes.collect_conv_problems import ProblemUse
    from convpass.compiler.pipeline import OptimizeReport
    from convpass.core.problem import ConvProblem, ConvShape

OUTPUT_SUFFIX = ".tuned.onnx"


def specs_with_batches(paths: Sequence[str | os.PathLike[str]], batch_specs: Sequence[str]) -> list[ModelSpec]:
    """Models with one profile per batch size (``--batch 1,32 --batch r3d_18=1,8``, as ``convpass
    bench``), resolved when each model is collected (see :class:`ModelSpec`): nothing is read here
    but the file names."""
    default, per_model = parse_batches(list(batch_specs))
    stems = {Path(p).stem for p in paths}
    unknown = sorted(set(per_model) - stems)
    if unknown:
        raise OptionError(f"--batch names model(s) not given: {', '.join(unknown)}")
    specs = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise ConvpassError(f"{path}: no such file")
        check_readable(path, "model")  # a FIFO or a device: refused before anything reads it
        specs.append(ModelSpec(path, batches=tuple(per_model.get(path.stem, default))))
    return specs


def specs_from_batches(paths: Sequence[str | os.PathLike[str]], batch_specs: Sequence[str]) -> tuple[list[ModelSpec], list[str]]:
    """As :func:`specs_with_batches`, with the profiles resolved now (every model is read): the models with
    their ``--shape`` profiles, and notes on the batches left out."""
    import onnx

    from convpass.core.model_io import load_model

    specs, notes = [], []
    for lazy in specs_with_batches(paths, batch_specs):
        path = lazy.path
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception:  # noqa: BLE001  (not ONNX, truncated...: load_model says precisely what)
            load_model(path)
            raise
        shapes, left_out = profiles_for_batches(path, proto, lazy.batches)
        notes += left_out
        specs.append(ModelSpec(path, shapes))
    return specs, notes


Prepared = tuple["ir.Model", "dict[ConvProblem, list[ProblemUse]]"]


@dataclasses.dataclass
class ModelProblems:
    spec: ModelSpec
    output: Path
    problems: list[ConvProblem] = dataclasses.field(default_factory=list)
    report: OptimizeReport | None = None  # None: not collected
    # The model as collect prepared it, kept for one model only (see collect) until it is written.
    prepared: Prepared | None = dataclasses.field(default=None, repr=False)

    @property
    def collected(self) -> bool:
        return self.report is not None


def outputs_of(specs: Sequence[ModelSpec], output_dir: Path) -> list[Path]:
    """``DIR/<model stem>.tuned.onnx`` per model; two models that would share one are refused."""
    outputs: dict[Path, Path] = {}
    for spec in specs:
        out = output_dir / (spec.path.stem + OUTPUT_SUFFIX)
        if out in outputs:
            raise ConvpassError(f"{spec.path} and {outputs[out]} would both be written to {out}: rename one")
        outputs[out] = spec.path
    return list(outputs)


def collect(specs: Sequence[ModelSpec], options: TuneOptions, output_dir: Path) -> tuple[list[ModelProblems], list[ConvProblem]]:
    """Every model's problems (graph passes only, nothing decided), in this process, and the
    distinct problems of all of them, in first-seen order. (:func:`convpass.fleet.driver.tune`
    collects in model processes, model by model, with the same result.)

    The last model that brings new problems keeps its prepared form: in :func:`tuning_order` it
    completes last. The others are not kept: a registry may hold hundreds of models, too many to
    keep in memory."""
    models: list[ModelProblems] = []
    seen: set[ConvProblem] = set()
    last_new: ModelProblems | None = None
    for spec, out in zip(specs, outputs_of(specs, output_dir)):
        model, uses, report, _, _ = prepare(spec, options)
        models.append(ModelProblems(spec, out, list(uses), report))
        if not seen.issuperset(uses):
            seen.update(uses)
            if last_new is not None:
                last_new.prepared = None
            last_new = models[-1]
            last_new.prepared = (model, uses)
    return models, list(dict.fromkeys(p for m in models for p in m.problems))


def tuning_order(models: Sequence[ModelProblems]) -> list[ConvProblem]:
    """The distinct problems in the order workers take them: grouped by the first model that needs
    them (in model order), the largest (FLOPs) first within a group.

    Why: a model is written as soon as all of its problems are settled. In this order the models
    complete one after another while the GPUs go on measuring, and are written meanwhile; with every
    problem largest first across all models (load balancing alone), every model would complete only
    at the very end and all the writing would be serial work after tuning. It is also the order in
    which models can be tuned while later ones are still being collected. What it costs is at the
    run's tail: the run ends on the smallest problems of the last group, not on the smallest of all,
    so the GPUs still finish within about one small problem of each other (only a last group with
    fewer problems than GPUs could end on a large one)."""
    first: dict[ConvProblem, int] = {}
    for i, m in enumerate(models):
        for p in m.problems:
            first.setdefault(p, i)
    return sorted(first, key=lambda p: (first[p], -p.primary.flops))


def group_order(problems: Sequence[ConvProblem], seen: set[ConvProblem]) -> list[ConvProblem]:
    """One model's group of :func:`tuning_order`: its problems not in ``seen``, largest first."""
    return sorted((p for p in dict.fromkeys(problems) if p not in seen), key=lambda p: -p.primary.flops)


class Geometries:
    """The problems given so far, grouped by geometry: problems whose candidate geometries meet are
    one group, measured in one task (:mod:`convpass.fleet.driver`'s docstring, step 3)."""

    def __init__(self) -> None:
        self.group_of: dict[ConvShape, tuple[ConvProblem, ...]] = {}  # geometry -> its group (first-given order)

    def add(self, problems: Sequence[ConvProblem]) -> list[tuple[tuple[ConvProblem, ...], list[tuple[ConvProblem, ...]]]]:
        """The groups that new ``problems`` make or join, in the order of their first new problem,
        each with the earlier groups (given before this call) it takes in."""
        before = dict(self.group_of)
        for p in problems:
            met = dict.fromkeys(self.group_of[s] for s in p.candidates if s in self.group_of)
            group = tuple(dict.fromkeys([*(q for g in met for q in g), p]))
            for q in group:
                for shape in q.candidates:
                    self.group_of[shape] = group
        out = []
        for group in dict.fromkeys(self.group_of[p.primary] for p in problems):
            earlier = dict.fromkeys(before[s] for q in group for s in q.candidates if s in before)
            out.append((group, list(earlier)))
        return out
