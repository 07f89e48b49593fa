"""What a model's error is measured on and how: input sets, the float32 reference, the metrics.

Metrics (``--error-metric``; E of ``--max-error`` is in the chosen one), over an input set of
feeds ``f`` and every float output ``o`` of the model, with ``y`` the candidate's outputs and ``r``
the reference's, each output's values of all feeds taken together:

* ``max-rel`` (default): ``max_o  max |y_o - r_o| / max |r_o|`` — the largest deviation relative to
  the output's own scale (a logit off by 1e-2 of the largest logit has error 1e-2);
* ``rel-l2``: ``max_o  ||y_o - r_o||_2 / ||r_o||_2``.

A non-finite candidate value (float16 overflow) makes the error infinite; an output whose
reference is all zeros has error 0 if the candidate's is too, else infinity.

Input sets: each ``--calibration`` / ``--holdout`` file is a NumPy ``.npz`` archive holding one
array per model input (by input name), of the model's rank, dtype and fixed dims (any size where
a dim is symbolic), not empty, every value finite; each file is one feed. A file is read within
bounds (:mod:`convpass.core.array_file`: no FIFO or folder, no pickle, at most 1 GiB inflated). Without files, one random-normal feed (mean 0, variance 1, float32) per shape profile,
seed 0 for calibration and seed 1 for the held-out set: real data is better (activations of
random inputs are not those of images, speech or text), and optimize says so.

The reference is the model before precision changes (its float32 weights folded as optimize
folds them) run by ONNX Runtime's CPU provider in float32, with its graph rewrites that change
results turned off (:mod:`convpass.core.ort_reference`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from convpass.core.annotation import Profile
from convpass.core.array_file import ARRAY_LIMIT, read_arrays
from convpass.core.errors import ConvpassError, OptionError
from convpass.core.ort_reference import cpu_session

Feeds = dict[str, np.ndarray]
METRICS = ("max-rel", "rel-l2")
RANDOM_SEEDS = {"calibration": 0, "holdout": 1}
INPUT_LIMIT = ARRAY_LIMIT  # bytes of one input file, and of its arrays inflated


@dataclasses.dataclass(frozen=True)
class InputSet:
    """The feeds of one input set and where they came from (recorded in the model)."""

    name: str  # calibration | holdout
    feeds: tuple[Feeds, ...]
    source: str  # "2 files: a.npz, b.npz" or "random normal, seed 0, 2 feeds (one per profile)"

    @property
    def random(self) -> bool:
        return self.source.startswith("random")


def model_error(outputs: Sequence[Sequence[np.ndarray]], reference: Sequence[Sequence[np.ndarray]], metric: str) -> float:
    """The error of ``outputs`` (per feed, per output) against ``reference`` (module docstring)."""
    if metric not in METRICS:
        raise ValueError(f"unknown error metric {metric!r}")
    worst = 0.0
    for j in range(len(reference[0])):
        if not np.issubdtype(np.asarray(reference[0][j]).dtype, np.floating):
            continue
        y = np.concatenate([np.asarray(o[j], dtype=np.float64).ravel() for o in outputs])
        r = np.concatenate([np.asarray(o[j], dtype=np.float64).ravel() for o in reference])
        if not np.all(np.isfinite(y)):
            return float("inf")
        diff = y - r
        num, den = (np.abs(diff).max(initial=0.0), np.abs(r).max(initial=0.0)) if metric == "max-rel" else (
            float(np.linalg.norm(diff)), float(np.linalg.norm(r)))
        worst = max(worst, 0.0 if num == 0 else (float("inf") if den == 0 else float(num / den)))
    return worst


def load_feeds(paths: Sequence[str | os.PathLike], model: onnx.ModelProto, name: str) -> InputSet:
    """One feed per ``.npz`` file (module docstring); a file that does not fit the model's inputs
    raises naming the file and the input."""
    inputs = _model_inputs(model)
    feeds = []
    for path in paths:
        flag = f"--{name} {path}"
        arrays = read_arrays(path, f"--{name}", INPUT_LIMIT)
        if "" in arrays:
            raise OptionError(f"{flag}: a .npy file holds one unnamed array; give an .npz archive of one array per model input, "
                              f"by name (np.savez(FILE, {next(iter(inputs), 'input')}=array))")
        missing = [k for k in inputs if k not in arrays]
        if missing:
            held = ", ".join(map(repr, list(arrays)[:10])) + (f" and {len(arrays) - 10} more" if len(arrays) > 10 else "")
            raise OptionError(f"{flag}: holds no array for the model input(s) {', '.join(missing)} (it holds {held or 'none'})")
        feeds.append({k: _checked(arrays[k], k, dims, dtype, flag) for k, (dims, dtype) in inputs.items()})
    shown = ", ".join(Path(p).name for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    return InputSet(name, tuple(feeds), f"{len(feeds)} file(s): {shown}")


def _checked(a: np.ndarray, k: str, dims: Sequence[int | None], dtype: np.dtype, flag: str) -> np.ndarray:
    """The array ``a`` for model input ``k`` if it fits (module docstring), else OptionError."""
    if a.ndim != len(dims) or a.dtype != dtype:
        raise OptionError(f"{flag}: array {k!r} is {a.dtype} of rank {a.ndim}; the model takes {dtype} of rank {len(dims)}")
    fixed = [i for i, d in enumerate(dims) if d is not None and a.shape[i] != d]
    if fixed:
        raise OptionError(f"{flag}: array {k!r} has shape {a.shape}; the model fixes dim {fixed[0]} at {dims[fixed[0]]}")
    if a.size == 0:
        raise OptionError(f"{flag}: array {k!r} has shape {a.shape}: no values to measure the error on")
    if a.dtype.kind in "fc":
        bad = a.size - int(np.count_nonzero(np.isfinite(a)))
        if bad:
            raise OptionError(f"{flag}: array {k!r} holds {bad} NaN or infinite value(s); the error cannot be measured on them")
    return a


def random_feeds(model: onnx.ModelProto, profiles: Sequence[Profile], name: str) -> InputSet:
    """One random-normal feed per shape profile (module docstring). Inputs that are not float, or
    whose shape no profile fixes, cannot be drawn: ConvpassError says which and what to give."""
    seed = RANDOM_SEEDS[name]
    rng = np.random.default_rng(seed)
    inputs = _model_inputs(model)
    shapes_per_profile = [dict(p.inputs) for p in profiles] or [{}]
    feeds = []
    for shapes in shapes_per_profile:
        feed = {}
        for k, (_, dtype) in inputs.items():
            if not np.issubdtype(dtype, np.floating):
                raise ConvpassError(f"model input {k!r} is {dtype}: random inputs cannot stand for it; give --calibration files")
            dims = shapes.get(k) or inputs[k][0]
            if any(d is None or d < 1 for d in dims):
                raise ConvpassError(f"model input {k!r} has no fixed shape to draw random inputs of: give --shape or --calibration files")
            feed[k] = rng.standard_normal(tuple(dims)).astype(dtype)
        feeds.append(feed)
    return InputSet(name, tuple(feeds), f"random normal, seed {seed}, {len(feeds)} feed(s) (one per profile)")


def reference_outputs(model: onnx.ModelProto, inputs: InputSet) -> list[list[np.ndarray]]:
    """The float32 reference (module docstring): ONNX Runtime CPU on ``model``, per feed."""
    import onnxruntime as ort

    try:
        session = cpu_session(ort, model.SerializeToString())
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise ConvpassError(f"the float32 reference cannot run in ONNX Runtime's CPU provider: {str(e).splitlines()[0]}") from None
    names = [o.name for o in model.graph.output]
    return [list(session.run(names, feed)) for feed in inputs.feeds]


def _model_inputs(model: onnx.ModelProto) -> Mapping[str, tuple[list[int | None], np.dtype]]:
    """Graph inputs that are not initializers: name -> (dims, None where not fixed; NumPy dtype)."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        out[vi.name] = (dims, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)))
    return out
