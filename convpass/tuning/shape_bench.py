"""One geometry on the bench: its random inputs, rotation sets, reference output, the check and
timing of an execution object's launch, and the head-to-head of the close candidates.

* Inputs are random (never zero); set 0 is the one checked, the other sets are copies that rotate
  the data out of L2 between launches (:func:`convpass.tuning.harness.rotation_sets`).
* The reference is the output of a deterministic algorithm with FMA math (no TF32) on set 0,
  computed once; a candidate is right within :data:`TOLERANCE` of it for its data and math type.
* :meth:`ShapeBench.check_and_time` runs a candidate's :meth:`~convpass.kernels.conv_exec.ConvExec.launch`
  once on set 0, checks it, then times the same launch over the rotation sets
  (:func:`convpass.tuning.harness.time_launches`), and keeps its captured group for
  :meth:`ShapeBench.settle`. Which candidates are built and how: :mod:`convpass.tuning.candidates`.
* A key whose input is a channel slice (:class:`~convpass.core.problem.InputSlice`: a Concat's
  buffer, a Split's input) is timed reading exactly that: each set's ``x`` is the slice view of a
  wider buffer in the key's memory format (its other channels NaN, so a kernel that strays
  reads them and fails the check). A candidate whose object reads packed inputs, or whose slice
  read cuDNN refuses (:func:`~convpass.kernels.conv_exec.refuses_slice`), is timed as the executor
  runs it then: the input copied into a packed buffer (the executor's copy,
  :func:`~convpass.native.cuda.copy_into`), then the launch, both in the time; its row's note says so.
  A graph-API engine's plan is built reading ``x`` with the slice's strides
  (:attr:`~convpass.kernels.conv_exec.ConvExec.input_slice_strides`; a configuration that ignores
  them reads the NaN channels and fails the check) and gets the slice itself; one cuDNN does not
  build so reads a packed ``x`` and is timed with the copy, and one whose plan refuses the slice
  in place (:class:`~convpass.native.cudnn.graph_api.InputRefused`: its start misaligned) with
  the executor's copy into a buffer of the slice's strides; the note names cuDNN's refusal. An
  engine row timed before plans read slices (its note: the object reads packed inputs) is
  :func:`~convpass.tuning.cache_rows.superseded`: :func:`~convpass.tuning.cache_rows.current`
  drops it and, until they are timed again, its key's rows of its graph.
* A key whose output is written into a channel slice (:class:`~convpass.core.problem.OutputSlice`:
  a Concat's buffer) is timed writing exactly that: each set's ``y`` is the slice view of a wider
  buffer in the key's memory format (its other channels NaN, and the check fails a candidate that
  writes any of them). A candidate whose object writes packed outputs (a fused call, an engine's
  plan), or whose strided output cuDNN refuses (any cuDNN error of a launch that wrote a slice, as
  the executor takes it), is timed as the executor runs it then: the launch into a packed buffer,
  then its copy into the slice, both in the time; its row's note says so. A graph-API engine's
  plan is built writing ``y`` with the slice's strides
  (:attr:`~convpass.kernels.conv_exec.ConvExec.output_slice_strides`; a configuration that ignores
  them writes the NaN channels and fails the check) and gets the slice itself; one cuDNN does not
  build so writes a packed ``y`` and is timed with the copy, and one whose plan refuses the slice
  in place (:class:`~convpass.native.cudnn.graph_api.OutputRefused`: its start misaligned) with
  the executor's launch into a buffer of the slice's strides and its copy; the note names cuDNN's
  refusal. An engine row timed before plans wrote slices (its note: the object writes packed
  outputs) is :func:`~convpass.tuning.cache_rows.superseded` as an input slice's is. A launch that read and
  wrote slices and was refused tries each alone, in the executor's order (the input packed, then
  the output packed), before both packed.
* A key whose fused residual is read from a channel slice (:class:`~convpass.core.problem.ResidualSlice`:
  a Split's half) is timed reading exactly that: each set's ``z`` is the slice view of a wider
  buffer in the key's memory format (its other channels NaN). A candidate whose object reads the
  strided ``z`` (a graph-API fused graph: its plan is built with the slice's strides,
  :attr:`~convpass.kernels.conv_exec.ConvExec.residual_strides`) gets the slice itself; one that
  reads a packed residual (cuDNN's legacy fused call) is timed with the executor's copy of the
  slice into a packed buffer first, the copy in the time; its row's note says which. A graph that
  cuDNN does not build or run with the strided ``z`` is a row saying so (the candidates').
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Sequence
from typing import Any

from convpass.core.options import TuneOptions
from convpass.core.problem import TOLERANCE, ChannelSlice, ConvProblem, ConvShape, InputSlice, OutputSlice, ProblemKey, ResidualSlice
from convpass.tuning import harness
from convpass.tuning.cache_rows import PACKED_READS, PACKED_WRITES, Measurement, current, superseded  # current, superseded: the tuner's, there
from convpass.tuning.decide import allowed, bias_ms, cost_ms, epilogue_ms, residual_ms

logger = logging.getLogger("convpass")

__all__ = ["HEAD_TO_HEAD_MARGIN", "HEAD_TO_HEAD_MAX", "HEAD_TO_HEAD_WORKSPACE_BYTES", "OUTPUT", "REFERENCE_ALGOS", "TOLERANCE",
           "ShapeBench", "best_after", "current", "make_row", "superseded", "was_measured"]

# Deterministic algorithms a reference can be computed with, in order of preference.
REFERENCE_ALGOS = {
    "fwd": ("implicit_gemm", "implicit_precomp_gemm", "gemm", "direct"),
    "dgrad": ("algo_1", "fft_tiling", "fft"),
    "wgrad": ("algo_1", "fft", "fft_tiling"),
}
# Close candidates are timed again in turn (ShapeBench.settle): those within this margin of the
# best by the decision's cost, at most this many.
HEAD_TO_HEAD_MARGIN = 0.05
HEAD_TO_HEAD_MAX = 3
# Workspace a geometry's kept groups may hold for that (at most 1/32 of the GPU's memory): a
# candidate whose workspace would pass it keeps no group, and a decision it is close in is then not
# settled in turn.
HEAD_TO_HEAD_WORKSPACE_BYTES = 1 << 30
# What each direction reads and writes.
OUTPUT = {"fwd": "y", "dgrad": "x", "wgrad": "w"}


def make_row(key, algo, status, time_ms, workspace, deterministic, now, method, note="", heuristic_rank=None, find_rank=None) -> Measurement:
    return Measurement(
        key=key,
        algo=algo,
        status=status,
        time_ms=time_ms,
        workspace_bytes=int(max(0, workspace)),
        deterministic=bool(deterministic),
        measured_at=now,
        method=method,
        note=note,
        heuristic_rank=heuristic_rank,
        find_rank=find_rank,
    )


def was_measured(row: Measurement) -> bool:
    """Whether ``row`` ran and was measured (an early-stopped estimate was not; a late stop's
    groups were: :mod:`convpass.tuning.harness`)."""
    return row.status == "ok" and row.time_ms is not None and "early stop" not in row.note


def best_after(best: float | None, row: Measurement) -> float | None:
    """The best time so far after ``row`` (early-stopped estimates do not count)."""
    if was_measured(row):
        return row.time_ms if best is None else min(best, row.time_ms)
    return best


class ShapeBench:
    """Random inputs, rotation sets and the reference output for one geometry (module docstring)."""

    def __init__(self, shape: ConvShape, x_slice: InputSlice | None = None, y_slice: OutputSlice | None = None,
                 z_slice: ResidualSlice | None = None) -> None:
        self.shape = shape
        self.x_slice = x_slice  # every set's x is this slice of a wider buffer (module docstring)
        self.y_slice = y_slice  # every set's y is this slice of a wider buffer (module docstring)
        self.z_slice = z_slice  # every set's residual z is this slice of a wider buffer (module docstring)
        self._sets: dict[str, list[dict]] = {}
        self._reference = None
        # (key, algo) -> the captured group its timing replayed, and what that group needs kept
        # alive (its workspace, the execution object, the launch and its weights): for the close
        # candidates' head-to-head
        self._groups: dict[tuple[ProblemKey, str], tuple[Any, int, Any]] = {}
        self._group_budget: int | None = None
        self._base = {
            name: harness.random_array(dims, shape.dtype, "nchw", seed, scale)
            for name, dims, seed, scale in (
                ("x", shape.x_shape, 1, 1.0),
                ("w", shape.w_shape, 2, (shape.c // shape.groups * harness.prod(shape.kernel)) ** -0.5),
                ("y", shape.y_shape, 3, 1.0),
            )
        }

    def buffers(self, layout: str, count: int) -> list[dict]:
        """``count`` input sets in ``layout``: set 0 holds the random base data (the one checked);
        the others exist to rotate the data out of L2 between launches, so they are copies of that
        (a conv's speed does not depend on its values; drawing random numbers for each of up to 64
        sets took 4 s of a ResNet-50's tuning)."""
        from convpass.native.cudnn import as_layout, empty_like_layout

        have = self._sets.setdefault(layout, [])
        if not have:
            have.append({name: as_layout(array, layout).copy() if layout == "nchw" else as_layout(array, layout) for name, array in self._base.items()})
            self._slice_tensors(have[0], layout)

        def copy(a: Any) -> Any:
            out = empty_like_layout(a.shape, self.shape.dtype, layout)
            out[...] = a
            return out

        while len(have) < count:  # from the base data: set 0's output holds whatever the last check wrote
            have.append({name: copy(a) for name, a in self._base.items()})
            self._slice_tensors(have[-1], layout)
        return have[:count]

    def _slice_tensors(self, group: dict, layout: str) -> None:
        """With an input slice, ``group["x"]`` moved into its slice of a wider buffer in ``layout``;
        with an output slice, ``group["y"]`` so, the buffer kept as ``group["y_buffer"]`` (the
        other channels NaN in both)."""
        for name, where in (("x", self.x_slice), ("y", self.y_slice)):
            if where is not None:
                group[name], wide = self._in_slice(group[name], where, layout)
                if name == "y":
                    group["y_buffer"] = wide

    def _in_slice(self, a: Any, where: ChannelSlice, layout: str) -> tuple[Any, Any]:
        """``a`` copied into its slice ``where`` of a new wider buffer in ``layout`` (the other
        channels NaN): (the slice view, the buffer)."""
        from convpass.native.cuda import copy_into
        from convpass.native.cudnn import empty_like_layout

        wide = empty_like_layout((a.shape[0], where.channels, *a.shape[2:]), self.shape.dtype, layout)
        self._poison(wide)
        view = wide[:, where.first:where.first + a.shape[1]]
        copy_into(view, a)
        return view, wide

    def residual(self, layout: str, seed: int) -> Any:
        """A random residual ``z`` of the output's shape in ``layout`` (``seed``: its values, the
        same in every format): with a residual slice, that slice of a wider buffer (module docstring)."""
        z = harness.random_array(self.shape.y_shape, self.shape.dtype, layout, seed)
        return z if self.z_slice is None else self._in_slice(z, self.z_slice, layout)[0]

    def _poison(self, a: Any) -> None:
        a.fill(float("nan")) if self.shape.dtype != "bfloat16" else a.fill(0x7FC0)

    def _strays(self, group: dict) -> bool:
        """Whether a launch wrote any channel of ``group``'s output buffer outside its slice."""
        import cupy as cp

        wide, s = group.get("y_buffer"), self.y_slice
        if wide is None or s is None:
            return False
        rest = [part for part in (wide[:, :s.first], wide[:, s.first + self.shape.k:]) if part.shape[1]]
        return not all(bool(cp.isnan(harness.to_float32(part, self.shape.dtype)).all()) for part in rest)

    def rotation(self, layout: str, residual: bool = False) -> list[dict]:
        """The input sets in ``layout`` that rotate the data out of L2 (:func:`convpass.tuning.harness.rotation_sets`),
        sized by what each holds: with ``residual`` (a timing that adds each set's ``z``), its
        ``z`` too, the whole buffer of a residual slice."""
        return self.buffers(layout, harness.rotation_sets(self.set_bytes(residual)))

    def set_bytes(self, residual: bool = False) -> int:
        """The bytes one rotation set holds: ``x``, ``w``, ``y`` (a slice's: the whole buffer),
        and with ``residual`` its ``z`` (of the output's size; a residual slice's: its whole buffer)."""
        y = self._base["y"]
        tensors = [(a.nbytes, a.shape[1], None if name == "w" else getattr(self, f"{name}_slice")) for name, a in self._base.items()]
        if residual:
            tensors.append((y.nbytes, y.shape[1], self.z_slice))
        # each slice's tensor is part of a buffer of where.channels channels
        return sum(n if where is None else n * where.channels // channels for n, channels, where in tensors)

    def find_workspace(self) -> int:
        import cupy as cp

        free, _ = cp.cuda.runtime.memGetInfo()
        return int(min(free // 4, 1 << 30))

    def reference(self):
        """float32 output of a deterministic FMA algorithm on set 0 (NCHW), computed once."""
        if self._reference is not None:
            return self._reference
        from convpass.native.cudnn import ConvDescriptors, CudnnError, as_layout, run

        key = self.shape.key("nchw", "fma")
        out_name = OUTPUT[self.shape.direction]
        base = self.buffers("nchw", 1)[0]
        arrays = {name: as_layout(base[name], "nchw") for name in ("x", "w", "y")}  # packed (copies of slices)
        with ConvDescriptors(key) as descs:
            for algo in REFERENCE_ALGOS[self.shape.direction]:
                try:
                    run(descs, None, algo, arrays["x"], arrays["w"], arrays["y"])
                except CudnnError:
                    continue
                self._reference = harness.to_float32(arrays[out_name], self.shape.dtype).copy()
                # restore the output buffer's random content for later timings of other directions
                return self._reference
        raise RuntimeError(f"no deterministic reference algorithm supports {self.shape}")

    def check_and_time(self, conv: Any, det: bool, now: float, best_ms: float | None, *, bias: Any = None, residual: bool = False,
                       capture_required: bool = False, expected: Any = None) -> Measurement:
        """``conv.launch`` (an execution object of :mod:`convpass.kernels.conv_exec`, with ``bias``
        and, with ``residual``, each set's ``z``) run once on set 0 and checked against the
        reference (or ``expected``; a ``wrong_result`` row past the tolerance), then timed over the
        rotation sets, and set 0's output checked again after the timing's launches (a ``wrong_result``
        row where only the first launch was right) (an ``ok`` row; ``unsupported`` when ``capture_required`` and its launches
        could not be captured). CUDA and cuDNN errors propagate: the callers know what they mean."""
        import cupy as cp

        key, algo, ws = conv.key, str(conv.algo), conv.workspace_bytes
        out_name = OUTPUT[key.shape.direction]
        reference = self.reference() if expected is None else expected
        workspace = cp.empty(max(ws, 1), dtype=cp.uint8)
        sets = self.rotation(key.layout, residual)
        weights = {id(b): conv.prepare_weight(b["w"]) for b in sets}  # as the executor passes them
        tensors = _Tensors(key, conv, sets, residual)

        def launch(b: dict, workspace: Any) -> None:
            conv.launch(tensors.x(b), weights[id(b)], tensors.y(b), workspace, bias, tensors.z(b) if residual else None)
            tensors.written(b)

        check = sets[0]
        self._poison(check.get("y_buffer", check[out_name]))
        while True:
            try:
                first_ms = harness.first_launch_ms(lambda: launch(check, workspace))  # also the timing's warm-up
                break
            except Exception as e:
                if not tensors.refused(e):
                    raise

        def error() -> float:  # set 0's output against its reference, as it stands
            out = check[out_name] if key.shape.dtype != "bfloat16" else harness.to_float32(check[out_name], "bfloat16")
            return harness.relative_error(out, reference)

        err = error()
        tolerance = TOLERANCE[(key.shape.dtype, key.math)]
        if not err <= tolerance:
            return make_row(key, algo, "wrong_result", None, ws, det, now, "measure", note=f"relative error {err:.2e} > {tolerance:.0e}")
        if self._strays(check):
            return make_row(key, algo, "wrong_result", None, ws, det, now, "measure", note="it wrote channels outside its output slice")
        timing = harness.time_launches(lambda i: launch(sets[i], workspace), len(sets), best_ms, first_ms=first_ms)
        after = error()  # what the timing's launches left there: right once is not enough (the executor replays)
        if not after <= tolerance:
            return make_row(key, algo, "wrong_result", None, ws, det, now, "measure",
                            note=f"relative error {err:.1e} after its first launch, {after:.2e} > {tolerance:.0e} after {timing.launches} more")
        if capture_required and timing.eager:
            return make_row(key, algo, "unsupported", None, ws, det, now, "measure", note="its launches cannot be captured into a CUDA graph")
        if timing.group is not None and self.group_bytes() + ws <= self.group_budget():
            self._groups[(key, algo)] = (timing.group, timing.group_launches, (workspace, conv, launch))
        note = f"relative error {err:.1e}; {timing.launches} launches, spread {timing.spread:.1%}"
        if timing.early_stop:
            note += f"; early stop: {timing.stopped_by} ({best_ms:.4f} ms)"
        elif timing.stopped_by:  # a late stop: a measurement from fewer groups, not an estimate
            note += f"; stopped there, {timing.stopped_by} ({best_ms:.4f} ms)"
        if timing.eager:
            note += "; eager launches (not capturable): includes launch overhead"
        return make_row(key, algo, "ok", timing.time_ms, ws, det, now, "measure", note=note + tensors.note)

    def group_bytes(self) -> int:
        """Workspace the kept groups hold."""
        return sum(kept[0].nbytes for _, _, kept in self._groups.values())

    def group_budget(self) -> int:
        """Bytes of workspace the kept groups may hold (:data:`HEAD_TO_HEAD_WORKSPACE_BYTES`)."""
        if self._group_budget is None:
            import cupy as cp

            self._group_budget = min(HEAD_TO_HEAD_WORKSPACE_BYTES, cp.cuda.runtime.memGetInfo()[1] // 32)
        return self._group_budget

    def settle(self, rows: list[Measurement], problem: ConvProblem, options: TuneOptions,
               have: Sequence[Measurement] = ()) -> list[Measurement]:
        """``rows`` with this geometry's close candidates timed again in turn
        (:func:`convpass.tuning.harness.head_to_head`). Close: allowed by ``options`` and within
        :data:`HEAD_TO_HEAD_MARGIN` of the best of all the problem's rows (``have`` too) by the
        decision's cost (:func:`convpass.tuning.decide.cost_ms`), the :data:`HEAD_TO_HEAD_MAX` best of
        them. Only when every one of them kept its group here; else ``rows`` as they are, since a
        candidate not timed in turn could not be weighed against the others. Their times take their
        order from the turns and keep their first timings' mean, so that the fastest of them stays at
        or below the first timing of any candidate left out. A CUDA or cuDNN error in the turns
        leaves ``rows`` as they are, with a warning."""
        strategy, _ = options.strategy(problem.direction)
        if strategy not in ("measure", "forced") or len(self._groups) < 2:
            return rows
        considered = [*rows, *have]
        epilogue_of, residual_of, bias_of = epilogue_ms(considered, problem), residual_ms(considered, problem), bias_ms(considered, problem)
        ok = allowed(problem, options, epilogue_of, residual_of)
        timed = sorted((cost, i) for i, m in enumerate(considered) if m.method == "measure" and ok(m)
                       and (cost := cost_ms(m, epilogue_of, problem.fusion, residual_of, bias_of)) is not None)
        close = [i for cost, i in timed if cost <= timed[0][0] * (1 + HEAD_TO_HEAD_MARGIN)][:HEAD_TO_HEAD_MAX] if timed else []
        if len(close) < 2 or any(i >= len(rows) or (rows[i].key, rows[i].algo) not in self._groups for i in close):
            return rows
        try:
            turns = harness.head_to_head([self._groups[(rows[i].key, rows[i].algo)][:2] for i in close])
        except Exception as e:  # noqa: BLE001  (a CUDA or cuDNN error: the first timings stand)
            logger.warning("the close candidates of %s were not timed again in turn: %s", self.shape, e)
            return rows
        level = statistics.fmean(rows[i].time_ms for i in close) / statistics.fmean(turns)
        out = list(rows)
        for i, t in zip(close, turns):
            m = rows[i]
            out[i] = dataclasses.replace(m, time_ms=t * level, note=f"{m.note}; timed again in turn with {len(close) - 1} close "
                                                                       f"candidate(s): {t:.5f} ms, {m.time_ms:.5f} -> {t * level:.5f} ms at the first timings' level")
        return out

    def release(self) -> None:
        self._groups.clear()
        self._sets.clear()
        self._base.clear()
        self._reference = None


class _Tensors:
    """The ``x`` a candidate's launch reads, the ``y`` it writes and, with ``residual``, the ``z``
    it adds (module docstring): each set's own (packed, or the key's slices in place); where the
    object takes packed tensors only or cuDNN refused a slice (:meth:`refused`), a packed copy of
    the input slice (and of the residual slice) made first, and a packed output copied into its
    slice after (:meth:`written`), as the executor does."""

    _NOTES = {"x": ("input slice read in place", "input copied first"), "y": ("output written into its slice in place", "output copied into its slice after"),
              "z": ("residual slice read in place", "residual copied first")}

    def __init__(self, key: ProblemKey, conv: Any, sets: list[dict], residual: bool = False) -> None:
        self.key, self.sets = key, sets
        # an engine's plan built for the slice reads exactly its strides
        plan_reads = key.x_slice is not None and conv.input_slice_strides is not None and conv.input_slice_strides == key.x_strides
        self.read = key.x_slice is not None and (conv.input_strides == "slice" or plan_reads)
        # where the copy of x goes: the first channels of a buffer as wide as the slice's for a plan that reads its strides
        self._x_channels = key.x_slice.channels if plan_reads and key.x_slice is not None else None
        plan_writes = key.y_slice is not None and conv.output_slice_strides is not None and conv.output_slice_strides == key.y_strides
        self.write = key.y_slice is not None and (conv.output_strides != "packed" or plan_writes)
        self._y_channels = key.y_slice.channels if plan_writes and key.y_slice is not None else None  # likewise the launch's y
        self._slices = {"x": key.x_slice, "y": key.y_slice, "z": key.z_slice if residual else None}
        self._packed: dict[str, dict[int, Any]] = {"x": {}, "y": {}, "z": {}}
        self._notes: dict[str, str] = {}
        self._alone: list[tuple[bool, bool]] | None = None  # after a refusal of both: the states left to try
        z_read = self._slices["z"] is not None and conv.residual_strides == key.z_strides
        x_why = f"cuDNN refuses the slice: {conv.input_refusal}" if key.x_slice is not None and conv.input_refusal else PACKED_READS
        y_why = f"cuDNN refuses the slice: {conv.output_refusal}" if key.y_slice is not None and conv.output_refusal else PACKED_WRITES
        for name, on, why in (("x", self.read, x_why), ("y", self.write, y_why),
                              ("z", z_read, "the object reads a packed residual")):
            if self._slices[name] is None:
                continue
            if on:
                self._in_place(name)
            else:
                self._pack(name, why)

    @property
    def note(self) -> str:
        return "".join(f"; {self._notes[name]}" for name, where in self._slices.items() if where is not None)

    def _pack(self, name: str, why: str) -> None:
        """Launch on a packed ``x`` / ``y`` / ``z`` from now on (a copy of the slice first / into it
        after): the packed buffers made here, never while the timing captures launches."""
        from convpass.native.cudnn import empty_like_layout

        self._notes[name] = f"{self._NOTES[name][1]} ({why})"
        for group in self.sets:
            shape = group[name].shape
            wide = {"x": self._x_channels, "y": self._y_channels}.get(name) or shape[1]  # a plan's slice strides, at an aligned start
            self._packed[name][id(group)] = empty_like_layout((shape[0], wide, *shape[2:]), self.key.shape.dtype, self.key.layout)[:, :shape[1]]

    def _in_place(self, name: str) -> None:
        """Launch on the set's own slice ``x`` / ``y`` / ``z`` from now on."""
        self._packed[name].clear()
        self._notes[name] = self._NOTES[name][0]

    def _state(self, read: bool, write: bool, why: str) -> None:
        """Read the input slice in place or not, write the output slice in place or not, from now on."""
        for name, on in (("x", read), ("y", write)):
            if self._slices[name] is None:
                continue
            if on:
                self._in_place(name)
            elif not self._packed[name]:
                self._pack(name, why)
        self.read, self.write = read, write

    def x(self, group: dict) -> Any:
        return self._read(group, "x")

    def z(self, group: dict) -> Any:
        return self._read(group, "z")

    def _read(self, group: dict, name: str) -> Any:
        """The set's ``x`` / ``z`` as the launch reads it: its own, or copied into a packed buffer first."""
        packed = self._packed[name].get(id(group))
        if packed is None:
            return group[name]
        from convpass.native.cuda import copy_into

        copy_into(packed, group[name])
        return packed

    def y(self, group: dict) -> Any:
        return self._packed["y"].get(id(group), group["y"])

    def written(self, group: dict) -> None:
        """After a launch into a packed output: its copy into the set's slice."""
        packed = self._packed["y"].get(id(group))
        if packed is not None:
            from convpass.native.cuda import copy_into

            copy_into(group["y"], packed)

    def refused(self, e: BaseException) -> bool:
        """Whether ``e`` is cuDNN refusing the launch's slices (:func:`~convpass.kernels.conv_exec.refuses_slice`):
        then the next launch runs as the executor's does next (module docstring)."""
        from convpass.kernels.conv_exec import refuses_slice
        from convpass.native.cudnn.graph_api import InputRefused, OutputRefused

        why = f"cuDNN refuses the slice: {str(e).splitlines()[0]}"
        if not (self.read or self.write):
            return False
        if self.read and isinstance(e, InputRefused):  # an engine's plan refusing the slice in place: the executor's copy into its strides
            self._state(False, self.write, why)
            return True
        if self.write and isinstance(e, OutputRefused):  # likewise its output: a launch into a buffer of its strides, then the copy
            self._state(self.read, False, why)
            return True
        if self._alone is not None:  # trying each slice alone: any cuDNN error of the try moves on
            if not refuses_slice(e, write=True):
                return False
            self._state(*(self._alone.pop(0) if self._alone else (False, False)), why)
            return True
        if not refuses_slice(e, write=self.write):
            return False
        if self.read and self.write:
            self._alone = [(True, False)]
            self._state(False, True, why)
        else:
            self._state(False, False, why)
        return True
