"""One case of ``convpass bench``: a model at one batch, every contender ``--vs`` asks for, in one
process, one after the other, every output checked against the reference; then, with
``--fresh-process``, every contender once more in a fresh Python process of its own.

* the reference (:mod:`convpass.bench.reference`);
* convpass (:mod:`convpass.bench.convpass_contender`): optimize, the executor, its CUDA graph
  status; ``--profile-ops`` adds the op profile after every contender's timed runs;
* ONNX Runtime's CUDA EP (:mod:`convpass.bench.ort_contender`): four configurations without CUDA
  graphs (``ort``) and four with them (``ort-graph``); when every CUDA-graph configuration was
  refused and ``ort`` was not asked for, the four without run too, to stand in;
* PyTorch (:mod:`convpass.bench.torch_contender`): eager in two layouts (``torch``) and
  torch.compile in each mode asked for (``torch-compile``);
* ``--fresh-process`` (``fresh_timeout``): every contender of families ``convpass``, ``ort`` and
  ``torch`` once more in a fresh process (:func:`run_fresh`, :mod:`convpass.bench.fresh`), one at a
  time, with empty kernel caches: the same inputs (host arrays in, the first result back in host
  memory), convpass on the tuned model, ONNX Runtime on the original, PyTorch building the module
  and loading the weights this process saved; its output checked too. Recorded as the
  contender's ``fresh``.

A contender whose runtime is missing comes back as ``unavailable: <reason>``, one that raises as
``failed: <error>``; nothing here stops the other contenders.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from convpass.bench import fresh, measure, opprofile
from convpass.bench.convpass_contender import run_convpass, run_op_profile, run_optimize
from convpass.bench.measure import device_sync, free_gpu_memory, make_feeds
from convpass.bench.ort_contender import run_ort, run_ort_graph
from convpass.bench.peers import DEFAULT_COMPILE_MODES, first_line, ort_label, torch_label
from convpass.bench.records import contender, judge
from convpass.bench.reference import reference_outputs
from convpass.bench.roofline import conv_roofline
from convpass.bench.stats import relative_error, tolerance_for
from convpass.bench.torch_contender import run_torch, run_torch_compile
from convpass.core.profiles import input_shapes, model_inputs, shape_spec

PEERS = ("ort", "ort-graph", "torch", "torch-compile")


def bench_case(path: Path, batch: int, *, vs: Sequence[str], runs: int, warmup: int, tf32: str, cache: str | None,
               panel_json: str | None, peaks: Mapping[str, Any] | None, workdir: Path,
               module_cache: dict[str, Any], log: Callable[[str], None] = lambda s: None,
               profile_runs: int = 0, fresh_timeout: float | None = None, engines: str = "all", kernels: bool = True,
               compile_modes: Sequence[str] = DEFAULT_COMPILE_MODES) -> dict[str, Any]:
    """Benchmark one model at one batch; returns the (not yet annotated) case record. ``vs``: the
    peer families (:data:`PEERS`); ``engines``: convpass's ``--engines`` tuning space; ``kernels``:
    write the tuned model's kernel side-car; ``compile_modes``: torch.compile's modes.

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
        "dtype": dtype, "reference": None, "contenders": [], "best": {}, "stand_ins": {},
        "ratios": {}, "roofline": None, "op_profile": None, "model_order": None, "notes": [],
    }
    log(f"{path.stem} b{batch}: reference")
    ref, label, note = reference_outputs(path, feeds)
    case["reference"] = label
    if note:
        case["notes"].append(note)

    cp = measure.cupy()
    dev_feeds = {n: cp.asarray(a) for n, a in feeds.items()}
    device_sync()

    log(f"{path.stem} b{batch}: convpass optimize")
    tuned_path = workdir / f"{path.stem}.b{batch}.tuned.onnx"
    records: list[dict] = []
    try:
        tuning, records = run_optimize(path, shape_spec(shapes), tf32, cache, tuned_path, engines, kernels)
    except Exception as e:  # noqa: BLE001
        case["contenders"].append(contender("convpass", "convpass", {"tf32_option": tf32}, status="failed",
                                            reason=f"optimize: {first_line(e)}"))
    else:
        log(f"{path.stem} b{batch}: convpass executor")
        case["contenders"].append(run_convpass(tuned_path, tuning, records, dev_feeds, ref, dtype, runs, warmup))
        profile = next((r["profile"] for r in records if r.get("profile")), None)
        case["roofline"] = conv_roofline(records, peaks, profile)
    case["contenders"] += run_peers(path, feeds, dev_feeds, ref, vs=vs, tf32=tf32 != "off", dtype=dtype, runs=runs, warmup=warmup,
                                    panel_json=panel_json, module_cache=module_cache, compile_modes=compile_modes,
                                    log=lambda what: log(f"{path.stem} b{batch}: {what}"))
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


def run_peers(path: Path, feeds: Mapping[str, np.ndarray], dev_feeds: Mapping[str, Any], ref: Sequence[np.ndarray] | None, *,
              vs: Sequence[str], tf32: bool, dtype: str, runs: int, warmup: int, panel_json: str | None,
              module_cache: dict[str, Any], compile_modes: Sequence[str], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The peers' contenders, in the order of :data:`PEERS`."""
    out: list[dict[str, Any]] = []
    if "ort" in vs:
        log("onnxruntime CUDA EP x4")
        out += run_ort(path, feeds, dev_feeds, ref, tf32, dtype, runs, warmup)
    if "ort-graph" in vs:
        log("onnxruntime CUDA EP with CUDA graphs x4")
        graphs = run_ort_graph(path, feeds, dev_feeds, ref, tf32, dtype, runs, warmup)
        out += graphs
        if "ort" not in vs and graphs and all(c["status"] == "refused" for c in graphs):
            log("onnxruntime refused CUDA graphs: its configurations without them, to stand in")
            out += run_ort(path, feeds, dev_feeds, ref, tf32, dtype, runs, warmup)
    eager: list[dict[str, Any]] = []
    if "torch" in vs:
        log("torch eager x2")
        eager = run_torch(path, panel_json, dev_feeds, ref, tf32, dtype, runs, warmup, module_cache)
        out += eager
    if "torch-compile" in vs:
        log(f"torch.compile x{len(compile_modes)} ({', '.join(compile_modes)})")
        out += run_torch_compile(path, panel_json, dev_feeds, ref, tf32, dtype, runs, warmup, module_cache, compile_modes, eager)
    return out


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
    that could not run in this process (unavailable, skipped) is not started again; ONNX Runtime
    with CUDA graphs and torch.compile are not run in fresh processes (no record). Each runtime's
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
            tol = tolerance_for(c.get("tf32"), case.get("dtype", "float32"))
            judge(rec, None if ref is None else relative_error(outs, ref), tol)
        return rec

    np.savez(inputs, **feeds)
    try:
        for c in case["contenders"]:
            if c["family"] not in fresh.RUNTIMES:  # CUDA graphs and torch.compile: in this process only
                continue
            if c["family"] not in _BYTECODE_WARMED:
                cmd, _ = _fresh_command(c, path, tuned_path, inputs, out, weights, panel_json, module_cache)
                if cmd is not None:
                    _BYTECODE_WARMED.add(c["family"])
                    log(f"{c['family']}: {fresh.warm_bytecode(cmd, timeout, workdir)}")
            try:
                c["fresh"] = one(c)
            except Exception as e:  # noqa: BLE001  (reported; the other contenders still run)
                c["fresh"] = fresh.record("failed", first_line(e))
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
