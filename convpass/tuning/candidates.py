"""The candidates of one geometry, per family, as execution objects checked and timed on its bench.

Each candidate is the :mod:`convpass.kernels.conv_exec` object the executor runs for the same
decision, made by :func:`~convpass.kernels.conv_exec.conv_exec` from the problem key, the algorithm
and the epilogue it is timed with, and timed through its ``launch``
(:meth:`convpass.tuning.shape_bench.ShapeBench.check_and_time`):

* **legacy algorithms** (:meth:`Candidates.measure_legacy`): the bare conv, a ``LegacyConv``;
* **legacy epilogues** (:meth:`Candidates.measure_legacy_epilogue`): the executor's one-pass
  epilogue over the output (an ``epilogue`` row), and cuDNN's fused call of the fastest legacy
  algorithms, a ``FusedLegacyConv`` each;
* **graph-API engines** (:meth:`Candidates.measure_engines`): every configuration cuDNN offers,
  an ``EngineConv`` with the bias as its own pass after the conv (the executor adds it so; rows
  of a key are shared by every epilogue of it), or a fused graph's (:meth:`Candidates.measure_fused`,
  with its activation timed as its own pass; a graph with its residual ``+add``, with the
  activation and the Add as one pass and the Add alone as its own), or a legacy epilogue's graph
  (:meth:`Candidates.measure_engine_epilogue`, with the epilogue's one pass and the bias pass that
  a bare engine's time holds);
* **convpass's own kernels** (:meth:`Candidates.measure_own`): every variant bare, then the fastest
  with the legacy epilogue in the kernel, an ``OwnConv`` each.

A candidate cuDNN or the kernel refuses, gets wrong or cannot run is a row saying so: tuning goes on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from convpass.core import fusion as epilogue
from convpass.core.algo import Algo
from convpass.core.layout import storage_order
from convpass.core.problem import ProblemKey
from convpass.kernels import conv_exec, depthwise
from convpass.tuning import harness
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD
from convpass.tuning.shape_bench import ShapeBench, best_after, make_row, was_measured

__all__ = ["FFT_TILING_MAX_GROUPS", "Candidates", "Order", "skip_reason"]

# A pruning plan's order: candidates in the tuner's order -> (to time, in order; skipped, with why).
Order: TypeAlias = Callable[[list[str]], tuple[list[str], list[tuple[str, str]]]]

# cuDNN's legacy API runs FFT tiling once per group: on depthwise convs of hundreds of channels one
# launch takes seconds to tens of seconds. Above this many groups it is skipped unless forced.
FFT_TILING_MAX_GROUPS = 8


def skip_reason(key: ProblemKey, algo: str, forced: bool) -> str | None:
    """Why a candidate is not run at all (None: run it). Forced choices are always run."""
    if algo == "fft_tiling" and key.shape.groups > FFT_TILING_MAX_GROUPS and not forced:
        return f"skipped: cuDNN runs FFT tiling once per group (g={key.shape.groups}); seconds per launch"
    return None


_activation_kernels: dict[str, Any] = {}


def _activation_kernel(fusion: str) -> Any:
    """A CuPy element-wise kernel of ``fusion``'s activation, ``(x, y)``; with the residual
    (``+add``), ``(x, z, y)``: the activation of ``x`` plus ``z``, the one pass the plan's
    element-wise fusion runs the two in (tuning time only: the executor runs its own generated
    kernels, compiled ahead of time)."""
    import cupy as cp

    from convpass.native.cudnn import graph_api

    if fusion not in _activation_kernels:
        f = graph_api.fusion_of(fusion)
        if f.residual:
            _activation_kernels[fusion] = cp.ElementwiseKernel(
                "T x, T z", "T y", f"float v = (float)x; y = (T)(({f.cuda}) + (float)z);", f"convpass_{f.frontend_op}_add")
        else:
            _activation_kernels[fusion] = cp.ElementwiseKernel(
                "T x", "T y", f"float v = (float)x; y = (T)({f.cuda});", f"convpass_{f.frontend_op}")
    return _activation_kernels[fusion]


def _stored(a: Any) -> Any:
    """``a`` in its memory order (:func:`~convpass.core.layout.storage_order`: a channel slice of a
    channels-last buffer too), so an element-wise pass over several arrays walks each alike."""
    order = storage_order(a)
    return a.transpose(order) if order else a


def _z_note(key: ProblemKey, residual: bool) -> str:
    """What a pass row's note adds where it read its residual from the key's channel slice."""
    return "; its residual read from its channel slice" if residual and key.z_slice is not None else ""


def _oom(key: ProblemKey, algo: str, ws: int, det: bool, now: float, e: Exception, method: str = "measure") -> Measurement:
    return make_row(key, algo, "oom", None, ws, det, now, method, note=str(e).splitlines()[0])


def _cudnn_failed(key: ProblemKey, algo: str, ws: int, det: bool, now: float, e: Any) -> Measurement:
    status = "oom" if "ALLOC" in e.status_name else ("unsupported" if e.not_supported else "error")
    return make_row(key, algo, status, None, ws, det, now, "measure", note=str(e))


class Candidates:
    """Every family's candidates of one geometry, timed on ``bench`` (module docstring)."""

    def __init__(self, bench: ShapeBench) -> None:
        self.bench = bench
        self._engine_biases: dict[tuple[str, str], tuple[Any, Any]] = {}

    def release(self) -> None:
        self._engine_biases.clear()
        self.bench.release()

    # ------------------------------------------------------------------ legacy algorithms

    def measure_legacy(self, descs, key: ProblemKey, algo: str, best_ms: float | None, forced: bool = False) -> Measurement:
        """One legacy algorithm, the bare conv: checked against the reference, then timed."""
        import cupy as cp

        from convpass.native.cudnn import CudnnError, is_deterministic

        now = time.time()
        det = is_deterministic(key.shape.direction, algo)
        why = skip_reason(key, algo, forced)
        if why:
            return make_row(key, algo, "skipped", None, 0, det, now, "measure", note=why)
        try:
            conv = conv_exec.conv_exec(key, algo, cp=cp, descs=descs)
        except CudnnError as e:
            status = "unsupported" if e.not_supported else "error"
            return make_row(key, algo, status, None, 0, det, now, "measure", note=str(e))
        try:
            return self.bench.check_and_time(conv, det, now, best_ms)
        except cp.cuda.memory.OutOfMemoryError as e:
            return _oom(key, algo, conv.workspace_bytes, det, now, e)
        except CudnnError as e:
            return _cudnn_failed(key, algo, conv.workspace_bytes, det, now, e)

    def measure_legacy_epilogue(self, descs, key: ProblemKey, name: str, algos: Sequence[str], best_ms: float | None) -> list[Measurement]:
        """A legacy epilogue for ``key`` (:mod:`convpass.core.fusion`): the executor's one-pass
        epilogue over the output (the ``epilogue`` row an unfused configuration adds), then
        cuDNN's fused conv + bias + activation call of each of ``algos``, checked and timed."""
        rows = [self._measure_epilogue_pass(key, name)]
        if rows[0].status == "ok" and best_ms is not None:
            best_ms += rows[0].time_ms  # an early stop compares a fused call with conv + pass
        for algo in algos:
            rows.append(self._measure_fused_call(descs, key, algo, name, best_ms))
            best_ms = best_after(best_ms, rows[-1])
        return rows

    def _measure_epilogue_pass(self, key: ProblemKey, name: str) -> Measurement:
        import cupy as cp

        now = time.time()
        residual, relu = epilogue.parts(name)
        try:
            sets = self.bench.rotation(key.layout, residual)
            bias = self._bias_and_residuals(key, residual, sets)
            timing = harness.time_launches(
                lambda i: conv_exec.apply_epilogue(cp, sets[i]["y"], bias, relu, sets[i]["z"] if residual else None), len(sets))
        except cp.cuda.memory.OutOfMemoryError as e:
            return _oom(key, name, 0, True, now, e, EPILOGUE_METHOD)
        return make_row(key, name, "ok", timing.time_ms, 0, True, now, EPILOGUE_METHOD,
                        note=f"the executor's one element-wise pass over the output; {timing.launches} launches, spread {timing.spread:.1%}")

    def _measure_fused_call(self, descs, key: ProblemKey, algo: str, name: str, best_ms: float | None) -> Measurement:
        """``algo`` with the epilogue fused into its call (cudnnConvolutionBiasActivationForward)."""
        import cupy as cp

        from convpass.native.cudnn import CudnnError, is_deterministic

        now = time.time()
        fused = Algo.parse(algo).fused(name)
        det = is_deterministic("fwd", algo)
        residual, _ = epilogue.parts(name)
        ws = 0
        try:
            conv = conv_exec.conv_exec(key, fused, name, cp=cp, descs=descs)
            ws = conv.workspace_bytes
            bias, expected = self._epilogue_inputs(key, name, self.bench.rotation(key.layout, residual))
            row = self.bench.check_and_time(conv, det, now, best_ms, bias=bias, residual=residual, expected=expected)
        except cp.cuda.memory.OutOfMemoryError as e:
            return _oom(key, str(fused), ws, det, now, e)
        except ValueError as e:  # a pairing cuDNN does not implement (identity needs implicit_precomp_gemm)
            return make_row(key, str(fused), "unsupported", None, ws, det, now, "measure", note=str(e))
        except CudnnError as e:
            return _cudnn_failed(key, str(fused), ws, det, now, e)
        if row.status == "ok":
            row = dataclasses.replace(row, note=f"{row.note}; the conv with {name} in one cuDNN call")
        return row

    def _epilogue_inputs(self, key: ProblemKey, name: str, sets: list[dict]) -> tuple[Any, Any]:
        """The bias of a legacy epilogue's timings (and its residual in every set), and what the
        conv with that epilogue must give on set 0: ``act(reference + b + z)``."""
        import cupy as cp

        residual, relu = epilogue.parts(name)
        bias = self._bias_and_residuals(key, residual, sets)
        shape = self.bench.shape
        expected = self.bench.reference() + harness.to_float32(bias, shape.dtype).reshape((1, -1) + (1,) * len(shape.spatial))
        if residual:
            expected = expected + harness.to_float32(sets[0]["z"], shape.dtype)
        return bias, (cp.maximum(expected, 0) if relu else expected)

    def _bias_and_residuals(self, key: ProblemKey, residual: bool, sets: list[dict]) -> Any:
        """The bias of the epilogue timings (``(K,)``), and with ``residual`` a ``z`` in every set."""
        if residual:
            self._residuals(key, sets)
        return harness.random_array((self.bench.shape.k,), self.bench.shape.dtype, "nchw", 5)

    def _residuals(self, key: ProblemKey, sets: list[dict]) -> None:
        """A residual ``z`` of the output's shape in every set (in the key's memory format; the same
        values in every format: the seed decides them; a slice of a wider buffer where the key
        names one: :meth:`~convpass.tuning.shape_bench.ShapeBench.residual`), made once."""
        for i, b in enumerate(sets):
            if "z" not in b:
                b["z"] = self.bench.residual(key.layout, 40 + i)

    # ------------------------------------------------------------------ graph-API engines

    def measure_engines(self, key: ProblemKey, best_ms: float | None, fusion: str = "", order: Order | None = None) -> list[Measurement]:
        """Every graph-API engine configuration of ``key`` (``y = conv(x, w)``, or the graph of
        ``fusion``), checked against the reference and timed like the legacy algorithms. Always at
        least one row: ``engine:none`` (unsupported) when cuDNN offers no configuration. ``order``
        (:meth:`convpass.tuning.prune.KeyPlan.order`): the configurations to time, in its order,
        and those to skip, each a ``skipped`` row saying why."""
        from convpass.native.cudnn import graph_api

        now = time.time()
        none = str(Algo("engine", "none", fusion))
        try:
            enumerated = graph_api.enumerate_configs(key, fusion)
        except graph_api.GraphApiError as e:
            return [make_row(key, none, "unsupported", None, 0, True, now, "measure", note=str(e))]
        found = enumerated.configs()
        if not found:
            return [make_row(key, none, "unsupported", None, 0, True, now, "measure", note="cuDNN offers no engine configuration")]
        rows = []
        if order is not None:
            kept, skipped = order([c.algo for c in found])
            rows = [make_row(key, algo, "skipped", None, 0, True, now, "measure", note=why) for algo, why in skipped]
            by_algo = {c.algo: c for c in found}
            found = [by_algo[a] for a in kept]
        for config in found:
            row = self._measure_engine(key, config, best_ms, enumerated)
            rows.append(row)
            best_ms = best_after(best_ms, row)
        return rows

    def measure_engine_epilogue(self, key: ProblemKey, name: str, best_ms: float | None, have: Sequence[Measurement] = (),
                                order: Order | None = None) -> list[Measurement]:
        """A legacy epilogue ``name`` as graph-API engines run it: its one pass and the bias's own
        pass (the ``epilogue`` rows :func:`convpass.tuning.decide.cost_ms` weighs an unfused engine
        with: what the executor runs after it, what its time holds), each unless ``have`` holds it,
        then every engine configuration of the fused graph ``conv -> bias [-> add(z)] [-> relu]``
        (:meth:`measure_engines`, in ``order`` where a pruning plan gives one: ``engine:none+<name>``
        where cuDNN offers none)."""
        done = {m.algo: m for m in have if m.key == key and m.method == EPILOGUE_METHOD}
        rows = [self._measure_epilogue_pass(key, p) for p in dict.fromkeys((name, epilogue.LEGACY[0])) if p not in done]
        own = next((m for m in [*rows, *done.values()] if m.algo == name and m.status == "ok"), None)
        if own is not None and best_ms is not None:
            best_ms += own.time_ms  # an early stop compares a fused graph with conv + pass
        return [*rows, *self.measure_engines(key, best_ms, name, order)]

    def measure_fused(self, key: ProblemKey, fusion: str, best_ms: float | None) -> list[Measurement]:
        """A fused epilogue for ``key``: its activation timed as its own pass over the output (the
        ``epilogue`` row every unfused configuration adds: :mod:`convpass.tuning.decide`; with the
        residual, the activation and the Add in that one pass, then the ``add`` row: the Add alone,
        what a configuration of the shorter graph adds), then every engine configuration of the
        fused graph (:meth:`measure_engines`). The shorter graph's own rows are its own fusion's
        (the tuner measures them too)."""
        rows = [self._measure_activation(key, fusion)]
        if epilogue.adds_residual(fusion):
            rows.append(self._measure_residual_pass(key))
        if rows[0].status == "ok" and best_ms is not None:
            best_ms += rows[0].time_ms  # an early stop compares a fused graph with conv + pass
        return [*rows, *self.measure_engines(key, best_ms, fusion)]

    def _measure_activation(self, key: ProblemKey, fusion: str) -> Measurement:
        """The activation of ``fusion`` as the executor runs it after an unfused conv: one
        element-wise pass over the output's storage, in place (with the residual: ``act(y) + z``,
        ``z`` read where the plan reads it: its channel slice for a key that names one)."""
        import cupy as cp

        now = time.time()
        residual = epilogue.adds_residual(fusion)
        try:
            kernel = _activation_kernel(fusion)
            sets = self.bench.rotation(key.layout, residual)
            if residual:
                self._residuals(key, sets)
                timing = harness.time_launches(lambda i: kernel(_stored(sets[i]["y"]), _stored(sets[i]["z"]), _stored(sets[i]["y"])), len(sets))
            else:
                timing = harness.time_launches(lambda i: kernel(_stored(sets[i]["y"]), _stored(sets[i]["y"])), len(sets))
        except cp.cuda.memory.OutOfMemoryError as e:
            return _oom(key, fusion, 0, True, now, e, EPILOGUE_METHOD)
        what = "its activation and its residual Add as one pass" if residual else "its activation as its own pass"
        return make_row(key, fusion, "ok", timing.time_ms, 0, True, now, EPILOGUE_METHOD,
                        note=f"{what} over the output; {timing.launches} launches, spread {timing.spread:.1%}" + _z_note(key, residual))

    def _measure_residual_pass(self, key: ProblemKey) -> Measurement:
        """The residual Add as the plan runs it after a step of the shorter graph: CuPy's add of two
        arrays of the output's shape over their storage (the ``add`` row, :data:`convpass.core.fusion.RESIDUAL_PASS`;
        ``z`` its channel slice for a key that names one)."""
        import cupy as cp

        now = time.time()
        name = epilogue.RESIDUAL_PASS
        try:
            sets = self.bench.rotation(key.layout, True)
            self._residuals(key, sets)
            timing = harness.time_launches(lambda i: cp.add(_stored(sets[i]["y"]), _stored(sets[i]["z"]), out=_stored(sets[i]["y"])), len(sets))
        except cp.cuda.memory.OutOfMemoryError as e:
            return _oom(key, name, 0, True, now, e, EPILOGUE_METHOD)
        return make_row(key, name, "ok", timing.time_ms, 0, True, now, EPILOGUE_METHOD,
                        note=f"the residual Add as its own pass over the output; {timing.launches} launches, spread {timing.spread:.1%}"
                        + _z_note(key, True))

    def _engine_bias(self, fusion: str, key: ProblemKey) -> tuple[Any, Any]:
        """The bias every engine candidate of this geometry is timed with (``(K,)``), and the
        expected output of conv + bias (+ ``fusion``'s activation, + set 0's residual ``z`` of
        ``key``'s sets for a fusion with its residual): made once per fusion, not per candidate."""
        import cupy as cp

        from convpass.native.cudnn import graph_api

        residual = epilogue.takes_residual(fusion)
        index = (fusion, key.layout if residual else "")
        if index not in self._engine_biases:
            shape = self.bench.shape
            bias = harness.random_array((1, shape.k) + (1,) * len(shape.spatial), shape.dtype, "nchw", 5)
            expected = self.bench.reference() + harness.to_float32(bias, shape.dtype)
            if fusion:
                z = None
                if residual:
                    sets = self.bench.rotation(key.layout, True)
                    self._residuals(key, sets)
                    z = harness.to_float32(sets[0]["z"], shape.dtype)
                expected = graph_api.fusion_of(fusion).reference(cp, expected, z)
            self._engine_biases[index] = (bias.reshape(-1), expected)
        return self._engine_biases[index]

    def _measure_engine(self, key: ProblemKey, config, best_ms: float | None, enumerated=None) -> Measurement:
        import cupy as cp

        from convpass.native.cudnn import graph_api

        now = time.time()
        algo = config.algo
        # Timed as the executor runs it: the conv, then the bias as its own pass (legacy algorithms
        # are timed without their bias, which the executor can often fuse into their call); a fused
        # graph in its one call. The executor replays a captured CUDA graph: an engine that cannot
        # be captured is no candidate.
        try:
            started = time.perf_counter()
            conv = conv_exec.conv_exec(key, algo, config.fusion or "bias", cp=cp, enumerated=enumerated)
            build_s = time.perf_counter() - started
        except graph_api.GraphApiError as e:
            return make_row(key, algo, "unsupported", None, 0, True, now, "measure", note=str(e))
        ws = conv.workspace_bytes
        try:
            bias, expected = self._engine_bias(config.fusion, key)
            row = self.bench.check_and_time(conv, True, now, best_ms, bias=bias, residual=epilogue.takes_residual(config.fusion),
                                            capture_required=True, expected=expected)
        except cp.cuda.memory.OutOfMemoryError as e:
            return _oom(key, algo, ws, True, now, e)
        except graph_api.GraphApiError as e:
            return make_row(key, algo, "error", None, ws, True, now, "measure", note=str(e))
        if row.status == "ok":
            how = f"fused {config.fusion} in one call" if config.fusion else "conv then bias pass"
            row = dataclasses.replace(row, note=f"{row.note}; graph API, {how}; plan built in {build_s:.3f} s")
        return row

    # ------------------------------------------------------------------ convpass's own kernels

    def measure_own(self, key: ProblemKey, fusion: str, best_ms: float | None, have: Sequence[Measurement] = ()) -> list[Measurement]:
        """convpass's own kernels for ``key`` (:func:`convpass.kernels.depthwise.candidates`),
        checked and timed like the legacy algorithms; then, with a legacy epilogue ``fusion``, the
        fastest of them (timed here or in ``have``) with the epilogue in the kernel. Candidates
        already in ``have`` are not timed again."""
        done = {m.algo for m in have if m.key == key and m.method == "measure"}
        rows = []
        for algo in depthwise.candidates(key.shape):
            if algo not in done:
                rows.append(self._measure_own(key, algo, "", best_ms))
                best_ms = best_after(best_ms, rows[-1])
        bare = [m for m in [*rows, *have] if m.key == key and m.method == "measure" and was_measured(m)
                and Algo.parse(m.algo).bare_of("own")]
        if epilogue.is_legacy(fusion) and bare:
            fastest = min(bare, key=lambda m: (m.time_ms, m.algo)).algo
            if str(Algo.parse(fastest).fused(fusion)) not in done:
                rows.append(self._measure_own(key, fastest, fusion, None))
        return rows

    def _measure_own(self, key: ProblemKey, algo: str, fusion: str, best_ms: float | None) -> Measurement:
        """One own kernel, bare or with the legacy epilogue ``fusion`` in it."""
        import cupy as cp

        now = time.time()
        name = str(Algo.parse(algo).fused(fusion))
        try:
            conv = conv_exec.conv_exec(key, name, fusion, cp=cp)
        except ValueError as e:  # a shape or name it refuses
            return make_row(key, name, "unsupported", None, 0, True, now, "measure", note=str(e).splitlines()[0])
        try:
            conv.build()
        except Exception as e:  # noqa: BLE001  (a compiler or driver error: recorded, tuning goes on with the others)
            return make_row(key, name, "error", None, 0, True, now, "measure", note=f"the kernel did not build: {str(e).splitlines()[0]}")
        try:
            bias, expected, residual = None, None, False
            if fusion:
                residual, _ = epilogue.parts(fusion)
                bias, expected = self._epilogue_inputs(key, fusion, self.bench.rotation(key.layout, residual))
            row = self.bench.check_and_time(conv, True, now, best_ms, bias=bias, residual=residual, capture_required=True, expected=expected)
        except cp.cuda.memory.OutOfMemoryError as e:
            return _oom(key, name, 0, True, now, e)
        if row.status == "ok":
            row = dataclasses.replace(row, note=f"{row.note}; convpass's own kernel{f', {fusion} in it' if fusion else ''}")
        return row
