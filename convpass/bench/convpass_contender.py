"""convpass as a contender of ``convpass bench``: ``optimize`` of the model for the case's batch
(timed: wall seconds, the tuner's seconds, problems measured vs from the tuning cache; Gemm /
MatMul TF32 on unless ``--tf32 off``, as for the peers), saved to a temporary file with its
kernel side-car (:func:`write_kernels`: the kernels compiled ahead of time, as ``convpass
optimize`` writes them on a GPU; timed apart); then the executor's cold start
(``Executor(path, device="cuda")`` -> first result, synchronized), its steady state and its CUDA
graph status (``Executor.graph_status()`` after the steady-state runs).

Also: the op profile of ``--profile-ops`` (:func:`run_op_profile`: eager runs with CUDA events
around every launch) and a model's later batch sizes in the executor that ran its first
(:func:`run_batch_sizes_in_one_executor`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from convpass.bench import measure, opprofile
from convpass.bench.measure import check, device_sync, free_gpu_memory, host, make_feeds
from convpass.bench.peers import first_line
from convpass.bench.records import contender, graph_status_record, unavailable
from convpass.core.profiles import input_shapes, shape_spec


def decision_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of memory formats, math modes and sources over a tuned model's conv records."""
    out: dict[str, dict[str, int]] = {"memory_format": {}, "math_mode": {}, "source": {}}
    for r in records:
        for k in out:
            v = str(r.get(k))
            out[k][v] = out[k].get(v, 0) + 1
    return out


def uses_tf32(records: Sequence[Mapping[str, Any]], matmul_tf32: bool = False) -> bool:
    """Whether any conv may run with TF32: every conv not recorded as ``fma`` (TF32 off) may, since
    undecided (``auto``) and untuned convs run with cuDNN's default math; or Gemm / MatMul does."""
    return any(r.get("math_mode") != "fma" for r in records) or bool(matmul_tf32)


def run_optimize(path: Path, spec: str | Sequence[str], tf32: str, cache: str | None, out_path: Path,
                 engines: str = "all", kernels: bool = True) -> tuple[dict[str, Any], list[dict]]:
    """Tune ``path`` for one shape profile (or several); save to ``out_path`` with its kernel
    side-car unless ``kernels`` is false; (tuning record, inspect records)."""
    from rich.console import Console

    from convpass.compiler.pipeline import inspect, optimize_model
    from convpass.core.model_io import load_model, save_model
    from convpass.core.options import TuneOptions

    # Gemm / MatMul TF32 as the peers get it (ONNX Runtime's use_tf32, torch's allow_tf32): on
    # unless --tf32 off; convpass optimize's own default (--matmul-tf32 off) is MindSpore's.
    options = TuneOptions(tf32=tf32, matmul_tf32=tf32 != "off", engines=engines)
    t0 = time.perf_counter()
    model = load_model(path)
    rep = optimize_model(model, options, [spec] if isinstance(spec, str) else list(spec), cache, None, Console(stderr=True, quiet=True))
    save_model(model, out_path)
    wall = time.perf_counter() - t0
    records = inspect(out_path)
    tuning = {
        "optimize_s": wall,
        "tuning_s": rep.tuning_seconds,
        "problems": rep.problems,
        "measured": rep.measured,
        "cached": rep.cached,
        "failed": rep.failed,
        "undecided": rep.undecided,
        "engine_decisions": rep.engine_decisions,
        "fused_decisions": rep.fused_decisions,
        "own_kernel_decisions": rep.own_kernel_decisions,
        "all_cached": bool(rep.measured == 0 and (rep.cached or 0) > 0),
        "backend": rep.backend,
        "decisions": decision_summary(records),
        "tf32_option": tf32,
        "matmul_tf32": options.matmul_tf32,
        **(write_kernels(out_path) if kernels else {"kernels": NO_KERNELS, "kernels_s": None}),
    }
    return tuning, records


NO_KERNELS = "not written (bench --no-kernels): the executor compiles them at start-up, inside its cold start"


def write_kernels(tuned_path: Path) -> dict[str, Any]:
    """The tuned model's kernel side-car, compiled as ``convpass optimize`` compiles it on a GPU
    (:mod:`convpass.compiler.aot`; always compiled here, never kept from an earlier run, so ``kernels_s``
    is the compile time), so that the executor starts as a deployment's does: ``kernels`` (what
    was written, or why not), ``kernels_s`` and ``in_place`` (:func:`in_place_record`)."""
    from convpass.compiler.aot import compile_kernels
    from convpass.core.errors import ConvpassError

    t0 = time.perf_counter()
    try:
        report = compile_kernels(tuned_path)
    except ConvpassError as e:
        return {"kernels": f"not written: {str(e).strip().splitlines()[0]}", "kernels_s": time.perf_counter() - t0}
    return {"kernels": report.line(), "kernels_s": time.perf_counter() - t0, "in_place": in_place_record(report)}


def in_place_record(report: Any) -> dict[str, Any] | None:
    """The in-place check that compiling the kernels ran (:mod:`convpass.runtime.in_place`): its
    line, the tuned conv launches timed, and one line per conv more than 15% over its tuned time
    (None when it did not run)."""
    line = report.in_place_line()
    if line is None:
        return None
    return {"line": line, "timed": sum(len(d["convs"]) for d in report.in_place),
            "judged": all(d.get("reliable") for d in report.in_place), "slow": report.slow_convs()}


def run_convpass(tuned_path: Path, tuning: dict[str, Any], records: Sequence[Mapping[str, Any]], dev_feeds: Mapping[str, Any],
                 ref: Sequence[np.ndarray] | None, dtype: str, runs: int, warmup: int) -> dict[str, Any]:
    """The convpass executor on the tuned model: cold start, steady state, output check."""
    tf32 = uses_tf32(records, tuning.get("matmul_tf32", False)) if dtype == "float32" else None
    config = {"device": "cuda", "cuda_graph": True, "tf32_option": tuning.get("tf32_option"), "matmul_tf32": tuning.get("matmul_tf32", False)}
    try:
        from convpass.core.errors import ExecutorError
        from convpass.runtime.executor import Executor
    except ImportError as e:
        return unavailable("convpass", "convpass", f"convpass executor cannot be imported: {first_line(e)}", config)
    free_gpu_memory()
    try:
        t0 = time.perf_counter()
        ex = Executor(os.fspath(tuned_path), device="cuda", output_kind="device")
        first = ex.run(None, dict(dev_feeds))
        device_sync()
        cold = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  (ExecutorError, CudnnError, out of memory...: reported, the peers still run)
        msg = first_line(e)
        status = "unavailable" if isinstance(e, ExecutorError) and "not available" in msg else "failed"
        return contender("convpass", "convpass", config, status=status, reason=f"convpass executor: {msg}", tf32=tf32,
                         tuning=tuning)
    try:
        first_host = [host(o) for o in first]
        del first
        last: list[Any] = []

        def run() -> None:
            last[:] = ex.run(None, dev_feeds)

        measure.warm_gpu()
        times = measure.time_steady(run, device_sync, runs, warmup)
        last_host = [host(o) for o in last]
        graph = graph_status_record(ex.graph_status())  # known: the plan has run at least twice
    except Exception as e:  # noqa: BLE001
        c = contender("convpass", "convpass", config, status="failed", reason=first_line(e), cold_start_s=cold, tf32=tf32)
        c["tuning"] = tuning
        return c
    c = contender("convpass", "convpass", config, cold_start_s=cold, times_ms=times, tf32=tf32, cuda_graph=graph)
    c["tuning"] = tuning
    check(c, [first_host, last_host], ref, tf32, dtype)  # the steady-state (graph-replayed) output too
    ex = last = None  # the executor and its outputs freed before the next contender (names kept for run())
    free_gpu_memory()
    return c


def run_op_profile(tuned_path: Path, dev_feeds: Mapping[str, Any], runs: int) -> dict[str, Any]:
    """GPU time per launch of the tuned model in eager runs, by op family (the case's ``op_profile``)."""
    try:
        from convpass.runtime.executor import Executor
    except ImportError as e:
        return opprofile.failed(f"convpass executor cannot be imported: {first_line(e)}")
    free_gpu_memory()
    ex = None
    try:
        ex = Executor(os.fspath(tuned_path), device="cuda", cuda_graph=False, output_kind="device")
        return opprofile.profile_executor(ex, dict(dev_feeds), runs=runs)
    except Exception as e:  # noqa: BLE001  (reported; the case's other figures stand)
        return opprofile.failed(first_line(e))
    finally:
        del ex
        free_gpu_memory()


def run_batch_sizes_in_one_executor(path: Path, batches: Sequence[int], tf32: str, cache: str | None,
                                    workdir: Path, engines: str = "all", kernels: bool = True) -> dict[int, dict[str, Any]]:
    """A model's second batch size in the same process: one model tuned for every batch
    size (from the tuning cache the cases filled), one executor; it runs the first batch size, then
    each later one is timed from the call to the first result in device memory (plan build, kernels,
    warm-up, capture, first run). Returns a record per later batch size: ``status`` ("ok" or
    "failed"), ``seconds``, ``after`` (the batch size that ran first), ``reason``."""
    if len(batches) < 2:
        return {}
    model = onnx.load(os.fspath(path), load_external_data=False)
    shapes = {b: input_shapes(model, b) for b in batches}
    feeds = {b: make_feeds(model, shapes[b]) for b in batches}
    del model
    out = workdir / f"{path.stem}.all-batches.tuned.onnx"
    first, later = batches[0], list(batches[1:])
    try:
        from convpass.runtime.executor import Executor

        run_optimize(path, [shape_spec(shapes[b]) for b in batches], tf32, cache, out, engines, kernels)
        free_gpu_memory()
        cp = measure.cupy()
        ex = Executor(os.fspath(out), device="cuda", output_kind="device")
        outs = ex.run(None, {n: cp.asarray(a) for n, a in feeds[first].items()})
        device_sync()
        del outs
        records: dict[int, dict[str, Any]] = {}
        for b in later:
            dev = {n: cp.asarray(a) for n, a in feeds[b].items()}
            device_sync()
            t0 = time.perf_counter()
            outs = ex.run(None, dev)
            device_sync()
            seconds = time.perf_counter() - t0
            finite = all(bool(np.isfinite(host(o)).all()) for o in outs if np.dtype(o.dtype).kind == "f")
            records[b] = {"status": "ok" if finite else "failed", "seconds": seconds, "after": first,
                          "reason": None if finite else "non-finite output"}
            del outs, dev
        return records
    except Exception as e:  # noqa: BLE001  (reported in the case; the bench goes on)
        return {b: {"status": "failed", "seconds": None, "after": first, "reason": first_line(e)} for b in later}
    finally:
        free_gpu_memory()
        for f in workdir.glob(f"{out.name}*"):
            try:
                f.unlink()
            except OSError:
                pass
