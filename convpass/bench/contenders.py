"""What ``convpass bench`` runs on the GPU: the contenders, the reference, the environment record.

Every contender is timed the same way (:func:`time_steady`): ``warmup`` untimed runs, then ``runs``
runs each followed by ``cudaDeviceSynchronize``, timed on the host clock (``perf_counter``) from
before the call to after the synchronize, so every runtime pays its own launch and Python overhead
(ONNX Runtime runs on its own stream, so CUDA events on CuPy's stream would not bracket it). Inputs
and outputs stay on the device: CuPy arrays for convpass, IOBinding to CuPy buffers for ONNX
Runtime, DLPack views of the same CuPy input for PyTorch. The clocks are warmed by a short matmul
before each contender's steady-state runs.

* convpass: ``optimize`` of the model for this batch (timed: wall seconds, the tuner's seconds,
  problems measured vs from the tuning cache; Gemm / MatMul TF32 on unless ``--tf32 off``, as for
  the peers), saved to a temporary file with its kernel side-car (:func:`write_kernels`: the
  kernels compiled ahead of time, as ``convpass optimize`` writes them on a GPU; timed apart); then
  the executor's cold start (``Executor(path, device="cuda")`` -> first result, synchronized) and
  its steady state.
* ONNX Runtime CUDA EP: ``cudnn_conv_algo_search`` EXHAUSTIVE / HEURISTIC x ``prefer_nhwc`` 0 / 1,
  ``use_tf32`` = 1 unless convpass was asked for ``--tf32 off``: session creation, first run (it
  includes ORT's algorithm search), steady state.
* PyTorch eager, for models that ``models/export_panel.py`` builds (found through the
  ``panel.json`` next to the model or ``--panel-json``; seeded, so the weights are the exported
  ones, which the output check confirms): ``cudnn.benchmark = True``, ``inference_mode``,
  channels_last off and on; cold start = ``module.to("cuda")`` + first forward (with
  cudnn.benchmark's search); building the module on the CPU is not counted.
* Reference: ONNX Runtime's CPU EP on the original model and the same input (the convpass CPU
  executor, said so, when onnxruntime is not installed).
* convpass's CUDA graph status (``Executor.graph_status()`` after the steady-state runs: one
  captured graph, or which node stopped the capture and why) is recorded on its contender.
* ``--profile-ops`` (``profile_runs`` > 0): after every contender's timed runs, the tuned model runs
  eagerly with CUDA events around each launch (:func:`convpass.bench.opprofile.profile_executor`):
  GPU time per launch, by op family, recorded as the case's ``op_profile``.
* ``--fresh-process`` (``fresh_timeout``): then every contender once more in a fresh Python process
  of its own (:func:`run_fresh`, :mod:`convpass.bench.fresh`), one at a time, with empty kernel
  caches: the same inputs (host arrays in, the first result back in host memory), convpass on the
  tuned model, ONNX Runtime on the original, PyTorch building the module and loading the weights
  this process saved; its output checked too. Recorded as the contender's ``fresh``.

A contender whose runtime is missing comes back as ``unavailable: <reason>``, one that raises as
``failed: <error>``; nothing here stops the other contenders.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from convpass.bench import fresh, opprofile, report
from convpass.bench.peers import (  # noqa: F401  (ORT_CONFIGS, ort_name, export_panel_candidates: this module's API too)
    CUDA_EP_DID_NOT_LOAD,
    ORT_CONFIGS,
    export_panel_candidates,
    first_tensor,
    load_export_panel,
    ort_configs,
    ort_label,
    ort_name,
    ort_provider_options,
    panel_entry,
    torch_configs,
    torch_flags,
    torch_label,
    torch_memory_format,
    torch_name,
)
from convpass.bench.peers import first_line as _first_line
from convpass.bench.roofline import conv_roofline
from convpass.core.profiles import CaseSkipped, input_shapes, model_inputs, shape_spec  # noqa: F401  (this module's API too)

TIMING = "host perf_counter around each run + cudaDeviceSynchronize; device-resident input and output"


# ---------------------------------------------------------------------------------------------
# inputs


def make_feeds(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], seed: int = 0) -> dict[str, np.ndarray]:
    """Random host inputs: standard normal for floats, small integers otherwise (never all zeros)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, _, dtype in model_inputs(model):
        shape = tuple(shapes[name])
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            feeds[name] = rng.integers(1, 10, shape).astype(dtype)
    return feeds


# ---------------------------------------------------------------------------------------------
# timing


def time_steady(run: Callable[[], Any], sync: Callable[[], None], runs: int, warmup: int,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """``warmup`` untimed runs, then ``runs`` timed runs (ms), each ended by ``sync``."""
    for _ in range(warmup):
        run()
        sync()
    times = []
    for _ in range(runs):
        t0 = clock()
        run()
        sync()
        times.append((clock() - t0) * 1e3)
    return times


def _cupy():
    import cupy as cp

    return cp


def device_sync() -> None:
    _cupy().cuda.runtime.deviceSynchronize()


def warm_gpu(seconds: float = 0.05) -> None:
    """Bring the clocks up before a steady-state measurement (idle GPUs sit at low clocks)."""
    cp = _cupy()
    a = cp.ones((2048, 2048), dtype=cp.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(4):
            a @ a
        device_sync()


def free_gpu_memory() -> None:
    gc.collect()
    cp = _cupy()
    device_sync()
    cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------------------------
# availability


def ort_unavailable_reason() -> str | None:
    """None when ONNX Runtime's CUDA EP is importable, else why not."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        return f"onnxruntime is not installed ({e}); install onnxruntime-gpu"
    try:
        providers = list(ort.get_available_providers())
    except Exception as e:  # noqa: BLE001
        return f"onnxruntime cannot list its providers: {_first_line(e)}"
    if "CUDAExecutionProvider" not in providers:
        return (f"onnxruntime {getattr(ort, '__version__', '?')} has no CUDAExecutionProvider "
                f"(providers: {', '.join(providers) or 'none'}); install onnxruntime-gpu")
    return None


def torch_unavailable_reason() -> str | None:
    """None when PyTorch with CUDA is importable, else why not."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e})"
    except Exception as e:  # noqa: BLE001
        return f"torch cannot be imported: {_first_line(e)}"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device (CPU-only build or no driver)"
    except Exception as e:  # noqa: BLE001
        return f"torch CUDA check failed: {_first_line(e)}"
    return None


# ---------------------------------------------------------------------------------------------
# reference


def reference_outputs(path: str | os.PathLike, feeds: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray] | None, str | None, str | None]:
    """(outputs, label, note): ONNX Runtime CPU on the original model, else the convpass CPU executor."""
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if ort is not None:
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            sess = ort.InferenceSession(os.fspath(path), so, providers=["CPUExecutionProvider"])
            outs = sess.run(None, dict(feeds))
            return [np.asarray(o) for o in outs], f"onnxruntime {ort.__version__} CPU", None
        except Exception as e:  # noqa: BLE001
            note = f"onnxruntime CPU reference failed ({_first_line(e)}); "
    else:
        note = "onnxruntime is not installed; "
    try:
        from convpass.runtime.executor import Executor

        ex = Executor(os.fspath(path), device="cpu")
        outs = ex.run(None, dict(feeds))
        return [np.asarray(o) for o in outs], "convpass CPU executor (NumPy)", note + "reference is the convpass CPU executor"
    except Exception as e:  # noqa: BLE001
        return None, None, note + f"the convpass CPU executor failed too ({_first_line(e)}): outputs are unchecked"


def check(c: dict[str, Any], output_sets: Sequence[Sequence[Any] | None], ref: Sequence[np.ndarray] | None,
          tf32: bool | None, dtype: str) -> dict[str, Any]:
    """Judge a timed contender against the reference: the worst error over its output sets (the
    first run's and the last steady-state run's, so a broken replay cannot hide behind a good first run)."""
    tol = report.tolerance_for(tf32, dtype)
    if ref is None:
        return report.judge(c, None, tol)
    worst = 0.0
    for outputs in output_sets:
        worst = max(worst, math.inf if outputs is None else report.relative_error(outputs, ref))
    return report.judge(c, worst, tol)


def _host(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)
    if callable(get):  # CuPy
        return get()
    return np.asarray(x)


# ---------------------------------------------------------------------------------------------
# convpass


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
    was written, or why not) and ``kernels_s``."""
    from convpass.compiler.aot import compile_kernels
    from convpass.core.errors import ConvpassError

    t0 = time.perf_counter()
    try:
        written = compile_kernels(tuned_path).line()
    except ConvpassError as e:
        written = f"not written: {str(e).strip().splitlines()[0]}"
    return {"kernels": written, "kernels_s": time.perf_counter() - t0}


def run_convpass(tuned_path: Path, tuning: dict[str, Any], records: Sequence[Mapping[str, Any]], dev_feeds: Mapping[str, Any],
                 ref: Sequence[np.ndarray] | None, dtype: str, runs: int, warmup: int) -> dict[str, Any]:
    """The convpass executor on the tuned model: cold start, steady state, output check."""
    tf32 = uses_tf32(records, tuning.get("matmul_tf32", False)) if dtype == "float32" else None
    config = {"device": "cuda", "cuda_graph": True, "tf32_option": tuning.get("tf32_option"), "matmul_tf32": tuning.get("matmul_tf32", False)}
    try:
        from convpass.core.errors import ExecutorError
        from convpass.runtime.executor import Executor
    except ImportError as e:
        return report.unavailable("convpass", "convpass", f"convpass executor cannot be imported: {_first_line(e)}", config)
    free_gpu_memory()
    try:
        t0 = time.perf_counter()
        ex = Executor(os.fspath(tuned_path), device="cuda", output_kind="device")
        first = ex.run(None, dict(dev_feeds))
        device_sync()
        cold = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  (ExecutorError, CudnnError, out of memory...: reported, the peers still run)
        msg = _first_line(e)
        status = "unavailable" if isinstance(e, ExecutorError) and "not available" in msg else "failed"
        return report.contender("convpass", "convpass", config, status=status, reason=f"convpass executor: {msg}", tf32=tf32,
                                tuning=tuning)
    try:
        first_host = [_host(o) for o in first]
        del first
        last: list[Any] = []

        def run() -> None:
            last[:] = ex.run(None, dev_feeds)

        warm_gpu()
        times = time_steady(run, device_sync, runs, warmup)
        last_host = [_host(o) for o in last]
        graph = report.graph_status_record(ex.graph_status())  # known: the plan has run at least twice
    except Exception as e:  # noqa: BLE001
        c = report.contender("convpass", "convpass", config, status="failed", reason=_first_line(e), cold_start_s=cold, tf32=tf32)
        c["tuning"] = tuning
        return c
    c = report.contender("convpass", "convpass", config, cold_start_s=cold, times_ms=times, tf32=tf32, cuda_graph=graph)
    c["tuning"] = tuning
    check(c, [first_host, last_host], ref, tf32, dtype)  # the steady-state (graph-replayed) output too
    del ex, last
    free_gpu_memory()
    return c


def run_op_profile(tuned_path: Path, dev_feeds: Mapping[str, Any], runs: int) -> dict[str, Any]:
    """GPU time per launch of the tuned model in eager runs, by op family (the case's ``op_profile``)."""
    try:
        from convpass.runtime.executor import Executor
    except ImportError as e:
        return opprofile.failed(f"convpass executor cannot be imported: {_first_line(e)}")
    free_gpu_memory()
    ex = None
    try:
        ex = Executor(os.fspath(tuned_path), device="cuda", cuda_graph=False, output_kind="device")
        return opprofile.profile_executor(ex, dict(dev_feeds), runs=runs)
    except Exception as e:  # noqa: BLE001  (reported; the case's other figures stand)
        return opprofile.failed(_first_line(e))
    finally:
        del ex
        free_gpu_memory()


# ---------------------------------------------------------------------------------------------
# ONNX Runtime CUDA EP


def run_ort(path: Path, feeds_host: Mapping[str, np.ndarray], dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
            use_tf32: bool, dtype: str, runs: int, warmup: int) -> list[dict[str, Any]]:
    """The four ORT CUDA EP configurations (or four ``unavailable`` records saying why)."""
    configs = ort_configs(use_tf32)
    reason = ort_unavailable_reason()
    if reason is not None:
        return [report.unavailable(ort_name(c["cudnn_conv_algo_search"], c["prefer_nhwc"]), "ort", reason, c) for c in configs]
    return [_run_ort_one(path, feeds_host, dev_feeds, ref, cfg, dtype, runs, warmup) for cfg in configs]


def _run_ort_one(path: Path, feeds_host: Mapping[str, np.ndarray], dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
                 cfg: dict[str, Any], dtype: str, runs: int, warmup: int) -> dict[str, Any]:
    import onnxruntime as ort

    cp = _cupy()
    name = ort_name(cfg["cudnn_conv_algo_search"], cfg["prefer_nhwc"])
    tf32 = bool(cfg["use_tf32"])
    free_gpu_memory()
    sess = binding = None
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        dev = cp.cuda.Device().id
        provider_options = ort_provider_options(cfg, dev)
        t0 = time.perf_counter()
        sess = ort.InferenceSession(os.fspath(path), so, providers=[("CUDAExecutionProvider", provider_options), "CPUExecutionProvider"])
        session_s = time.perf_counter() - t0
        if "CUDAExecutionProvider" not in sess.get_providers():
            return report.unavailable(name, "ort", CUDA_EP_DID_NOT_LOAD, cfg)
        binding = sess.io_binding()
        for n, x in dev_feeds.items():
            binding.bind_input(n, "cuda", dev, feeds_host[n].dtype.type, list(x.shape), x.data.ptr)
        out_names = [o.name for o in sess.get_outputs()]
        out_bufs = []
        if ref is not None and len(ref) == len(out_names):
            for n, r in zip(out_names, ref):
                buf = cp.empty(r.shape, dtype=r.dtype)
                out_bufs.append(buf)
                binding.bind_output(n, "cuda", dev, r.dtype.type, list(r.shape), buf.data.ptr)
        else:
            for n in out_names:
                binding.bind_output(n, "cuda", dev)
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        device_sync()
        first_s = time.perf_counter() - t0

        def outputs() -> list[np.ndarray]:
            if out_bufs:
                return [b.get() for b in out_bufs]
            return [np.asarray(o.numpy()) for o in binding.get_outputs()]

        first_host = outputs()
        warm_gpu()
        times = time_steady(lambda: sess.run_with_iobinding(binding), device_sync, runs, warmup)
        last_host = outputs()
    except Exception as e:  # noqa: BLE001
        return report.contender(name, "ort", cfg, status="failed", reason=_first_line(e), tf32=tf32)
    finally:
        del sess, binding
    c = report.contender(name, "ort", cfg, cold_start_s=session_s + first_s, session_s=session_s, first_run_s=first_s,
                         times_ms=times, tf32=tf32)
    check(c, [first_host, last_host], ref, tf32, dtype)
    return c


# ---------------------------------------------------------------------------------------------
# PyTorch eager


def run_torch(model_path: Path, panel_json: str | None, dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
              tf32: bool, dtype: str, runs: int, warmup: int, module_cache: dict[str, Any]) -> list[dict[str, Any]]:
    """PyTorch eager, channels_last off and on (or records saying why not)."""
    cfgs = torch_configs(tf32)
    names = [torch_name(c["channels_last"]) for c in cfgs]
    reason = torch_unavailable_reason()
    if reason is not None:
        return [report.unavailable(n, "torch", reason, c) for n, c in zip(names, cfgs)]
    entry, why = panel_entry(model_path, panel_json)
    if entry is None:
        return [report.unavailable(n, "torch", why or "no known builder", c, status="skipped") for n, c in zip(names, cfgs)]
    if len(dev_feeds) != 1:
        return [report.unavailable(n, "torch", "PyTorch contender supports single-input models only", c, status="skipped")
                for n, c in zip(names, cfgs)]
    key = entry.get("name") or model_path.stem
    try:
        if key not in module_cache:
            panel = load_export_panel()
            t0 = time.perf_counter()
            module, _ = panel.build_torch_model(key)
            module_cache.clear()  # one CPU module at a time
            module_cache[key] = (module, time.perf_counter() - t0)
        module, build_s = module_cache[key]
    except Exception as e:  # noqa: BLE001
        return [report.contender(n, "torch", c, status="failed", reason=f"building {key}: {_first_line(e)}") for n, c in zip(names, cfgs)]
    out = []
    for n, c in zip(names, cfgs):
        c = dict(c, builder=entry.get("builder"), panel_name=key, module_build_s=round(build_s, 3),
                 cold_start="module.to(cuda) + first forward (incl. cudnn.benchmark search); CPU construction excluded")
        out.append(_run_torch_one(n, c, module, entry, dev_feeds, ref, tf32, dtype, runs, warmup))
    return out


def _run_torch_one(name: str, cfg: dict[str, Any], module_cpu: Any, entry: Mapping[str, Any], dev_feeds: Mapping[str, Any],
                   ref: Sequence[np.ndarray] | None, tf32: bool, dtype: str, runs: int, warmup: int) -> dict[str, Any]:
    import torch

    (x_cp,) = dev_feeds.values()
    fmt = None
    if cfg["channels_last"]:
        fmt = torch_memory_format(torch, x_cp.ndim)
        if fmt is None:
            return report.unavailable(name, "torch", f"channels_last does not apply to rank-{x_cp.ndim} inputs", cfg, status="skipped")
    free_gpu_memory()
    m = None
    try:
        with torch_flags(torch, cfg):
            x = torch.from_dlpack(x_cp)  # the same device input, no copy
            if fmt is not None:
                x = x.contiguous(memory_format=fmt)
            m = copy.deepcopy(module_cpu)
            if entry.get("dtype") == "float16":
                m = m.half()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = m.to("cuda")
            if fmt is not None:
                m = m.to(memory_format=fmt)
            with torch.inference_mode():
                y = first_tensor(m(x))
                torch.cuda.synchronize()
                cold = time.perf_counter() - t0
                first_host = [y.detach().float().contiguous().cpu().numpy()]
                last: list[Any] = [None]

                def run() -> None:
                    last[0] = m(x)

                warm_gpu()
                times = time_steady(run, torch.cuda.synchronize, runs, warmup)
                last_host = [first_tensor(last[0]).detach().float().contiguous().cpu().numpy()]
    except Exception as e:  # noqa: BLE001
        return report.contender(name, "torch", cfg, status="failed", reason=_first_line(e), tf32=bool(tf32))
    finally:
        del m
    c = report.contender(name, "torch", cfg, cold_start_s=cold, times_ms=times, tf32=bool(tf32))
    check(c, [first_host, last_host], ref, tf32, dtype)
    if c["status"] == "wrong":
        c["reason"] += " (weights differ from the ONNX file, or a different computation)"
    return c


# ---------------------------------------------------------------------------------------------
# one case


def bench_case(path: Path, batch: int, *, vs: Sequence[str], runs: int, warmup: int, tf32: str, cache: str | None,
               panel_json: str | None, peaks: Mapping[str, Any] | None, workdir: Path,
               module_cache: dict[str, Any], log: Callable[[str], None] = lambda s: None,
               profile_runs: int = 0, fresh_timeout: float | None = None, engines: str = "all", kernels: bool = True) -> dict[str, Any]:
    """Benchmark one model at one batch; returns the (not yet annotated) case record (``engines``:
    convpass's ``--engines`` tuning space; ``kernels``: write the tuned model's kernel side-car).

    ``profile_runs`` > 0: after every contender's timed runs, that many eager runs of the tuned
    model with a CUDA event pair around each launch (``op_profile``). ``fresh_timeout``: then every
    contender once more in a fresh process of its own (:func:`run_fresh`), each given that many
    seconds."""
    model = onnx.load(os.fspath(path), load_external_data=False)
    shapes = input_shapes(model, batch)
    dtypes = {n: str(dt) for n, _, dt in model_inputs(model)}
    dtype = next(iter(dtypes.values()), "float32")
    feeds = make_feeds(model, shapes)
    del model
    case: dict[str, Any] = {
        "model": path.stem, "file": str(path), "batch": batch, "inputs": {n: list(s) for n, s in shapes.items()},
        "dtype": dtype, "reference": None, "contenders": [], "best_peer": None, "best_ort": None, "best_torch": None,
        "ratios": {}, "roofline": None, "op_profile": None, "model_order": None, "notes": [],
    }
    log(f"{path.stem} b{batch}: reference")
    ref, label, note = reference_outputs(path, feeds)
    case["reference"] = label
    if note:
        case["notes"].append(note)

    cp = _cupy()
    dev_feeds = {n: cp.asarray(a) for n, a in feeds.items()}
    device_sync()

    # convpass: optimize, then the executor
    log(f"{path.stem} b{batch}: convpass optimize")
    tuned_path = workdir / f"{path.stem}.b{batch}.tuned.onnx"
    records: list[dict] = []
    try:
        tuning, records = run_optimize(path, shape_spec(shapes), tf32, cache, tuned_path, engines, kernels)
    except Exception as e:  # noqa: BLE001
        case["contenders"].append(report.contender("convpass", "convpass", {"tf32_option": tf32}, status="failed",
                                                   reason=f"optimize: {_first_line(e)}"))
    else:
        log(f"{path.stem} b{batch}: convpass executor")
        case["contenders"].append(run_convpass(tuned_path, tuning, records, dev_feeds, ref, dtype, runs, warmup))
        profile = next((r["profile"] for r in records if r.get("profile")), None)
        case["roofline"] = conv_roofline(records, peaks, profile)
    use_tf32 = tf32 != "off"
    if "ort" in vs:
        log(f"{path.stem} b{batch}: onnxruntime CUDA EP x4")
        case["contenders"] += run_ort(path, feeds, dev_feeds, ref, use_tf32, dtype, runs, warmup)
    if "torch" in vs:
        log(f"{path.stem} b{batch}: torch eager x2")
        case["contenders"] += run_torch(path, panel_json, dev_feeds, ref, use_tf32, dtype, runs, warmup, module_cache)
    if profile_runs > 0:
        log(f"{path.stem} b{batch}: convpass GPU time per op family (eager x{profile_runs})")
        case["op_profile"] = (run_op_profile(tuned_path, dev_feeds, profile_runs) if tuned_path.is_file()
                              else opprofile.failed("no tuned model: convpass optimize failed"))
    del dev_feeds
    free_gpu_memory()  # the fresh processes need the GPU's memory
    if fresh_timeout:
        run_fresh(case, path, tuned_path, feeds, ref, panel_json=panel_json, module_cache=module_cache,
                  timeout=fresh_timeout, workdir=workdir, log=log)
    for f in workdir.glob(f"{path.stem}.b{batch}.tuned.onnx*"):
        try:
            f.unlink()
        except OSError:
            pass
    return case


def run_batch_sizes_in_one_executor(path: Path, batches: Sequence[int], tf32: str, cache: str | None,
                                    workdir: Path, engines: str = "all", kernels: bool = True) -> dict[int, dict[str, Any]]:
    """Issue 10's "a model's second batch size in the same process": one model tuned for every batch
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
        cp = _cupy()
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
            finite = all(bool(np.isfinite(_host(o)).all()) for o in outs if np.dtype(o.dtype).kind == "f")
            records[b] = {"status": "ok" if finite else "failed", "seconds": seconds, "after": first,
                          "reason": None if finite else "non-finite output"}
            del outs, dev
        return records
    except Exception as e:  # noqa: BLE001  (reported in the case; the bench goes on)
        return {b: {"status": "failed", "seconds": None, "after": first, "reason": _first_line(e)} for b in later}
    finally:
        free_gpu_memory()
        for f in workdir.glob(f"{out.name}*"):
            try:
                f.unlink()
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# fresh processes


# the runtimes whose bytecode warm-up run (fresh.warm_bytecode) this process has done
_BYTECODE_WARMED: set[str] = set()


def run_fresh(case: dict[str, Any], path: Path, tuned_path: Path, feeds: Mapping[str, np.ndarray], ref: Sequence[np.ndarray] | None,
              *, panel_json: str | None, module_cache: Mapping[str, Any], timeout: float, workdir: Path,
              log: Callable[[str], None] = lambda s: None) -> None:
    """Every contender of ``case`` once more in a fresh process (:mod:`convpass.bench.fresh`), one
    after the other, on the same model (convpass: the tuned one and its kernel side-car) and inputs,
    its first output checked against the reference: the contender's ``fresh`` record. A contender
    that could not run in this process (unavailable, skipped) is not started again. Each runtime's
    first child in this process is preceded by an unmeasured one that writes the bytecode of what
    it imports (:func:`fresh.warm_bytecode`)."""
    stem = f"{path.stem}.b{case['batch']}"
    inputs, out, weights = (workdir / f"{stem}.fresh-{what}" for what in ("inputs.npz", "out.npz", "weights.pt"))

    def one(c: Mapping[str, Any]) -> dict[str, Any]:
        cmd, why = _fresh_command(c, path, tuned_path, inputs, out, weights, panel_json, module_cache)
        if cmd is None:
            return fresh.record(c["status"] if c["status"] in ("unavailable", "skipped") else "skipped", why)
        log(f"{path.stem} b{case['batch']}: {c['name']} in a fresh process")
        out.unlink(missing_ok=True)
        rec = fresh.spawn(cmd, timeout, workdir)
        if rec["status"] == "ok":
            with np.load(out) as z:
                outs = [z[f"arr_{i}"] for i in range(len(z.files))]
            tol = report.tolerance_for(c.get("tf32"), case.get("dtype", "float32"))
            report.judge(rec, None if ref is None else report.relative_error(outs, ref), tol)
        return rec

    np.savez(inputs, **feeds)
    try:
        for c in case["contenders"]:
            if c["family"] not in _BYTECODE_WARMED:
                cmd, _ = _fresh_command(c, path, tuned_path, inputs, out, weights, panel_json, module_cache)
                if cmd is not None:
                    _BYTECODE_WARMED.add(c["family"])
                    log(f"{c['family']}: {fresh.warm_bytecode(cmd, timeout, workdir)}")
            try:
                c["fresh"] = one(c)
            except Exception as e:  # noqa: BLE001  (reported; the other contenders still run)
                c["fresh"] = fresh.record("failed", _first_line(e))
    finally:
        for f in (inputs, out, weights):
            f.unlink(missing_ok=True)


def _fresh_command(c: Mapping[str, Any], path: Path, tuned_path: Path, inputs: Path, out: Path, weights: Path,
                   panel_json: str | None, module_cache: Mapping[str, Any]) -> tuple[list[str] | None, str | None]:
    """The child's command line for contender ``c``, or (None, why it is not started)."""
    if c["status"] in ("unavailable", "skipped"):
        return None, c.get("reason")
    cfg = c.get("config") or {}
    if c["family"] == "convpass":
        if not tuned_path.is_file():
            return None, "no tuned model (convpass optimize failed)"
        return fresh.child_command("convpass", tuned_path, inputs, out=out), None
    if c["family"] == "ort":
        return fresh.child_command("ort", path, inputs, config=ort_label(cfg), tf32=bool(cfg["use_tf32"]), out=out), None
    built = module_cache.get(cfg.get("panel_name"))
    if built is None:
        return None, "no PyTorch module was built in this process"
    if not weights.is_file():
        import torch

        torch.save(built[0].state_dict(), weights)  # the weights the child loads, as a deployment loads its checkpoint
    return fresh.child_command("torch", path, inputs, config=torch_label(cfg), tf32=bool(cfg["allow_tf32"]), weights=weights,
                               panel_json=panel_json, out=out), None


# ---------------------------------------------------------------------------------------------
# environment


def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _module_version(name: str) -> str | None:
    mod = sys.modules.get(name)
    return getattr(mod, "__version__", None) if mod is not None else None


def package_versions() -> dict[str, str | None]:
    """Versions of everything the numbers depend on (None: not installed)."""
    from convpass.core.version import __version__

    out = {
        "python": platform.python_version(),
        "convpass": __version__,
        "numpy": np.__version__,
        "onnx": onnx.__version__,
        "onnx-ir": _dist_version("onnx-ir", "onnx_ir"),
        "onnxruntime": _dist_version("onnxruntime") or None,
        "onnxruntime-gpu": _dist_version("onnxruntime-gpu"),
        "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy") or _module_version("cupy"),
        "nvidia-cudnn": _dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
        "torch": _dist_version("torch") or _module_version("torch"),
        "torchvision": _dist_version("torchvision") or _module_version("torchvision"),
        "matplotlib": _dist_version("matplotlib"),
    }
    ort = sys.modules.get("onnxruntime")
    if ort is None:
        try:
            import onnxruntime as ort  # noqa: F811
        except ImportError:
            ort = None
    if ort is not None:
        version = getattr(ort, "__version__", None)
        if out["onnxruntime-gpu"] is None and out["onnxruntime"] is None:
            out["onnxruntime"] = version
        try:
            out["onnxruntime-providers"] = ",".join(ort.get_available_providers())
        except Exception:  # noqa: BLE001
            out["onnxruntime-providers"] = None
    return out


def driver_version() -> str | None:
    """The NVIDIA kernel driver release (e.g. 580.159.04)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False)
        line = res.stdout.strip().splitlines()
        return line[0].strip() if res.returncode == 0 and line else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def environment() -> dict[str, Any]:
    """Device, driver, CUDA, cuDNN and package versions."""
    cp = _cupy()
    rt = cp.cuda.runtime
    dev = cp.cuda.Device()
    props = rt.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    env: dict[str, Any] = {
        "device": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": int(props["multiProcessorCount"]),
        "memory_bytes": int(props["totalGlobalMem"]),
        "driver": driver_version(),
        "cuda_runtime": _cuda_version(int(rt.runtimeGetVersion())),
        "cuda_driver_api": _cuda_version(int(rt.driverGetVersion())),
        "cudnn": None,
        "cudnn_path": None,
        "host": platform.node(),
    }
    try:
        from convpass.native.cudnn import library
        from convpass.core.device import cudnn_version_string

        env["cudnn"] = cudnn_version_string(library.version())
        env["cudnn_path"] = library.path()
    except Exception as e:  # noqa: BLE001
        env["cudnn"] = None
        env["cudnn_error"] = _first_line(e)
    env["packages"] = package_versions()
    return env
