"""PyTorch as a contender of ``convpass bench``, for models that ``models/export_panel.py`` builds
(found through the ``panel.json`` next to the model or ``--panel-json``; seeded, so the weights
are the exported ones, which the output check confirms). Building the module on the CPU is not
counted.

* Eager (family ``torch``, :func:`run_torch`): ``cudnn.benchmark = True``, ``inference_mode``,
  channels_last off and on; cold start = ``module.to("cuda")`` + first forward (with
  cudnn.benchmark's search).
* torch.compile (family ``torch-compile``, :func:`run_torch_compile`): one contender per mode
  (``default``, ``reduce-overhead``; ``max-autotune`` when asked), ``dynamic=False``, the same
  flags under ``no_grad``, in the memory format eager ran faster in (NCHW when eager did not run).
  Its cold start is ``module.to("cuda")`` + ``torch.compile`` + the first call, which compiles:
  ``compile_s`` is that first call. Each mode compiles with empty Inductor and Triton disk caches
  and Dynamo reset, in the bench process: what an earlier compilation there loaded into memory (and
  cudnn.benchmark's choices from eager) may still be reused. Steady state as for eager.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convpass.bench import measure
from convpass.bench.measure import check, free_gpu_memory
from convpass.bench.peers import (
    compile_configs,
    compile_name,
    first_line,
    first_tensor,
    load_export_panel,
    panel_entry,
    torch_configs,
    torch_flags,
    torch_memory_format,
    torch_name,
)
from convpass.bench.ranking import best_of
from convpass.bench.records import contender, unavailable

EAGER_COLD = "module.to(cuda) + first forward (incl. cudnn.benchmark search); CPU construction excluded"
COMPILE_COLD = ("module.to(cuda) + torch.compile + first call (compilation; empty Inductor and Triton disk caches); "
                "CPU construction excluded")


def torch_unavailable_reason() -> str | None:
    """None when PyTorch with CUDA is importable, else why not."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e})"
    except Exception as e:  # noqa: BLE001
        return f"torch cannot be imported: {first_line(e)}"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device (CPU-only build or no driver)"
    except Exception as e:  # noqa: BLE001
        return f"torch CUDA check failed: {first_line(e)}"
    return None


def _module(model_path: Path, panel_json: str | None, dev_feeds: Mapping[str, Any],
            module_cache: dict[str, Any]) -> tuple[tuple[Any, float, Mapping[str, Any], str] | None, str, str]:
    """((CPU module, build seconds, panel entry, panel name), "", "") or (None, status, why not)."""
    reason = torch_unavailable_reason()
    if reason is not None:
        return None, "unavailable", reason
    entry, why = panel_entry(model_path, panel_json)
    if entry is None:
        return None, "skipped", why or "no known builder"
    if len(dev_feeds) != 1:
        return None, "skipped", "PyTorch contender supports single-input models only"
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
        return None, "failed", f"building {key}: {first_line(e)}"
    return (module, build_s, entry, key), "", ""


def _configs_with_module(cfgs: Sequence[dict[str, Any]], built: tuple[Any, float, Mapping[str, Any], str], cold: str) -> list[dict]:
    _, build_s, entry, key = built
    return [dict(c, builder=entry.get("builder"), panel_name=key, module_build_s=round(build_s, 3), cold_start=cold) for c in cfgs]


def run_torch(model_path: Path, panel_json: str | None, dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
              tf32: bool, dtype: str, runs: int, warmup: int, module_cache: dict[str, Any]) -> list[dict[str, Any]]:
    """PyTorch eager, channels_last off and on (or records saying why not)."""
    cfgs = torch_configs(tf32)
    names = [torch_name(c["channels_last"]) for c in cfgs]
    built, status, why = _module(model_path, panel_json, dev_feeds, module_cache)
    if built is None:
        return [unavailable(n, "torch", why, c, status=status) for n, c in zip(names, cfgs)]
    return [_run_one(n, "torch", c, built, dev_feeds, ref, tf32, dtype, runs, warmup)
            for n, c in zip(names, _configs_with_module(cfgs, built, EAGER_COLD))]


def run_torch_compile(model_path: Path, panel_json: str | None, dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None,
                      tf32: bool, dtype: str, runs: int, warmup: int, module_cache: dict[str, Any], modes: Sequence[str],
                      eager: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """torch.compile, one contender per mode, in eager's faster memory format (or records saying why not)."""
    best_eager = best_of(eager, ("torch",))
    channels_last = bool(best_eager and (best_eager.get("config") or {}).get("channels_last"))
    cfgs = compile_configs(tf32, tuple(modes), channels_last)
    for c in cfgs:
        c["memory_format_from"] = "eager's faster layout" if best_eager else "NCHW (eager did not run)"
    names = [compile_name(c["mode"]) for c in cfgs]
    built, status, why = _module(model_path, panel_json, dev_feeds, module_cache)
    if built is None:
        return [unavailable(n, "torch-compile", why, c, status=status) for n, c in zip(names, cfgs)]
    return [_run_one(n, "torch-compile", c, built, dev_feeds, ref, tf32, dtype, runs, warmup)
            for n, c in zip(names, _configs_with_module(cfgs, built, COMPILE_COLD))]


_CACHE_ROOT: list[str] = []  # the bench process's compile-cache folder, made on first use


@contextlib.contextmanager
def fresh_compile_caches(torch: Any) -> Iterator[None]:
    """Empty Inductor and Triton disk caches and a reset Dynamo for one compilation; the variables
    restored after. One folder per bench process, emptied before each compilation (compile workers
    an earlier compilation started keep its path), removed when the process exits."""
    if not _CACHE_ROOT:
        _CACHE_ROOT.append(tempfile.mkdtemp(prefix="convpass-bench-compile-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT[0], True)
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        path = os.path.join(_CACHE_ROOT[0], sub)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        os.environ[var] = path
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_one(name: str, family: str, cfg: dict[str, Any], built: tuple[Any, float, Mapping[str, Any], str],
             dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None, tf32: bool, dtype: str, runs: int,
             warmup: int) -> dict[str, Any]:
    """One eager layout or one compile mode: cold start (and, compiled, the first call's time), steady state, check."""
    import torch

    module_cpu, _, entry, _ = built
    (x_cp,) = dev_feeds.values()
    fmt = None
    if cfg["channels_last"]:
        fmt = torch_memory_format(torch, x_cp.ndim)
        if fmt is None:
            return unavailable(name, family, f"channels_last does not apply to rank-{x_cp.ndim} inputs", cfg, status="skipped")
    compiled = family == "torch-compile"
    free_gpu_memory()
    m = fn = None
    try:
        with torch_flags(torch, cfg), (fresh_compile_caches(torch) if compiled else contextlib.nullcontext()):
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
            fn = torch.compile(m, mode=cfg["mode"], dynamic=cfg["dynamic"], fullgraph=cfg["fullgraph"]) if compiled else m
            step = getattr(torch.compiler, "cudagraph_mark_step_begin", None) if compiled else None

            def call() -> Any:
                if step is not None:
                    step()  # a new inference step for cudagraph trees (reduce-overhead, max-autotune)
                return fn(x)

            with torch.no_grad() if compiled else torch.inference_mode():
                t1 = time.perf_counter()
                y = first_tensor(call())
                torch.cuda.synchronize()
                first_call = time.perf_counter() - t1
                cold = time.perf_counter() - t0
                first_host = [y.detach().float().contiguous().cpu().numpy()]
                del y
                last: list[Any] = [None]

                def run() -> None:
                    last[0] = call()

                measure.warm_gpu()
                times = measure.time_steady(run, torch.cuda.synchronize, runs, warmup)
                last_host = [first_tensor(last[0]).detach().float().contiguous().cpu().numpy()]
    except Exception as e:  # noqa: BLE001
        return contender(name, family, cfg, status="failed", reason=first_line(e), tf32=bool(tf32))
    finally:
        m = fn = None  # freed before the next mode
    c = contender(name, family, cfg, cold_start_s=cold, times_ms=times, tf32=bool(tf32),
                  compile_s=first_call if compiled else None)
    check(c, [first_host, last_host], ref, tf32, dtype)
    if c["status"] == "wrong":
        c["reason"] += " (weights differ from the ONNX file, or a different computation)"
    return c
