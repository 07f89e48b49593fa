"""ONNX Runtime's CUDA EP as a contender of ``convpass bench``, in its eight configurations:
``cudnn_conv_algo_search`` EXHAUSTIVE / HEURISTIC x ``prefer_nhwc`` 0 / 1, without CUDA graphs
(family ``ort``, :func:`run_ort`) and with them (family ``ort-graph``, :func:`run_ort_graph`:
``enable_cuda_graph=1``); ``use_tf32`` = 1 unless convpass was asked for ``--tf32 off``. Each:
session creation, first run (it includes ORT's algorithm search, and with CUDA graphs the
capture), steady state, the output checked.

Inputs and outputs go through IOBinding to CuPy device buffers. With CUDA graphs the buffers are
fixed (the inputs' and outputs sized from the reference), as a captured graph replays on the
addresses it was captured with. Where ONNX Runtime will not capture (a model with CPU-placed
nodes, control flow or dynamic shapes), the configuration is ``refused`` with ORT's own message,
first line; the ranking then lets the best configuration without CUDA graphs stand in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convpass.bench import measure
from convpass.bench.measure import check, device_sync, free_gpu_memory
from convpass.bench.peers import CUDA_EP_DID_NOT_LOAD, first_line, ort_configs, ort_name, ort_provider_options
from convpass.bench.records import contender, unavailable


def ort_unavailable_reason() -> str | None:
    """None when ONNX Runtime's CUDA EP is importable, else why not."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        return f"onnxruntime is not installed ({e}); install onnxruntime-gpu"
    try:
        providers = list(ort.get_available_providers())
    except Exception as e:  # noqa: BLE001
        return f"onnxruntime cannot list its providers: {first_line(e)}"
    if "CUDAExecutionProvider" not in providers:
        return (f"onnxruntime {getattr(ort, '__version__', '?')} has no CUDAExecutionProvider "
                f"(providers: {', '.join(providers) or 'none'}); install onnxruntime-gpu")
    return None


def _name(cfg: Mapping[str, Any]) -> str:
    return ort_name(cfg["cudnn_conv_algo_search"], cfg["prefer_nhwc"], bool(cfg.get("enable_cuda_graph")))


def run_ort(path: Path, feeds_host: Mapping[str, np.ndarray], dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
            use_tf32: bool, dtype: str, runs: int, warmup: int) -> list[dict[str, Any]]:
    """The four ORT CUDA EP configurations without CUDA graphs (or four ``unavailable`` records saying why)."""
    configs = ort_configs(use_tf32)
    reason = ort_unavailable_reason()
    if reason is not None:
        return [unavailable(_name(c), "ort", reason, c) for c in configs]
    return [_run_one(path, feeds_host, dev_feeds, ref, cfg, dtype, runs, warmup) for cfg in configs]


def run_ort_graph(path: Path, feeds_host: Mapping[str, np.ndarray], dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
                  use_tf32: bool, dtype: str, runs: int, warmup: int) -> list[dict[str, Any]]:
    """The same four configurations with ``enable_cuda_graph=1`` (family ``ort-graph``)."""
    configs = ort_configs(use_tf32, graph=True)
    reason = ort_unavailable_reason()
    if reason is not None:
        return [unavailable(_name(c), "ort-graph", reason, c) for c in configs]
    if ref is None:
        why = "CUDA graphs need output buffers of fixed shape, sized from the reference outputs, and there are none"
        return [contender(_name(c), "ort-graph", c, status="failed", reason=why) for c in configs]
    return [_run_one(path, feeds_host, dev_feeds, ref, cfg, dtype, runs, warmup) for cfg in configs]


def _session(path: Path, cfg: Mapping[str, Any], device_id: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    providers = [("CUDAExecutionProvider", ort_provider_options(cfg, device_id)), "CPUExecutionProvider"]
    return ort.InferenceSession(os.fspath(path), so, providers=providers)


def _bind(sess: Any, feeds_host: Mapping[str, np.ndarray], dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
          device_id: int) -> tuple[Any, list[Any]]:
    """An IOBinding on the device inputs, and on output buffers sized from the reference when there
    is one (else ORT allocates them): (binding, the output buffers)."""
    cp = measure.cupy()
    binding = sess.io_binding()
    for n, x in dev_feeds.items():
        binding.bind_input(n, "cuda", device_id, feeds_host[n].dtype.type, list(x.shape), x.data.ptr)
    out_names = [o.name for o in sess.get_outputs()]
    out_bufs = []
    if ref is not None and len(ref) == len(out_names):
        for n, r in zip(out_names, ref):
            buf = cp.empty(r.shape, dtype=r.dtype)
            out_bufs.append(buf)
            binding.bind_output(n, "cuda", device_id, r.dtype.type, list(r.shape), buf.data.ptr)
    else:
        for n in out_names:
            binding.bind_output(n, "cuda", device_id)
    return binding, out_bufs


def _run_one(path: Path, feeds_host: Mapping[str, np.ndarray], dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
             cfg: dict[str, Any], dtype: str, runs: int, warmup: int) -> dict[str, Any]:
    """One configuration. With CUDA graphs, a failure before the first result (session creation or
    the first run, which captures) is ONNX Runtime refusing to capture: ``refused``, its message."""
    graph = bool(cfg.get("enable_cuda_graph"))
    family, name, tf32 = ("ort-graph" if graph else "ort"), _name(cfg), bool(cfg["use_tf32"])
    dev = measure.cupy().cuda.Device().id
    free_gpu_memory()
    sess = binding = None
    try:
        t0 = time.perf_counter()
        sess = _session(path, cfg, dev)
        session_s = time.perf_counter() - t0
        if "CUDAExecutionProvider" not in sess.get_providers():
            return unavailable(name, family, CUDA_EP_DID_NOT_LOAD, cfg)
        binding, out_bufs = _bind(sess, feeds_host, dev_feeds, ref, dev)
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)  # with CUDA graphs: ORT's warm-up run and the capture
        device_sync()
        first_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        return contender(name, family, cfg, status="refused" if graph else "failed", reason=first_line(e), tf32=tf32)
    try:
        def outputs() -> list[np.ndarray]:
            if out_bufs:
                return [b.get() for b in out_bufs]
            return [np.asarray(o.numpy()) for o in binding.get_outputs()]

        first_host = outputs()
        measure.warm_gpu()
        times = measure.time_steady(lambda: sess.run_with_iobinding(binding), device_sync, runs, warmup)
        last_host = outputs()
    except Exception as e:  # noqa: BLE001
        return contender(name, family, cfg, status="failed", reason=first_line(e), tf32=tf32)
    finally:
        sess = binding = None  # freed before the next configuration
    c = contender(name, family, cfg, cold_start_s=session_s + first_s, session_s=session_s, first_run_s=first_s,
                  times_ms=times, tf32=tf32)
    check(c, [first_host, last_host], ref, tf32, dtype)
    return c
