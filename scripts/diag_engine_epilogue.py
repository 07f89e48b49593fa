#!/usr/bin/env python3
"""Which fused graph-API engine convs give wrong model outputs in convpass's executor, and under
which condition: a GPU diagnostic for one device call (resnet50 at batch 16: a few minutes on an
H200; not part of the package).

Background: ``convpass bench`` (H200, cuDNN 9.19.0, TF32, kernels and cuDNN plans built ahead of
time into the side-car, one CUDA graph) gave wrong outputs for resnet50 and vae_decoder at batch
16 only; their residual convs ran ``engine:eng4[_k24=2|_k24=47]+bias+add[+relu]`` graphs, which
the tuner had checked right once (fresh buffers, NaN-filled output, the plan it built on the graph
it enumerated, one eager launch). What the executor does differently is tried here one condition
at a time.

Per model (``--models``, default resnet50) at ``--batch`` (16):

1. decisions from the tuning cache only (``--cache``; the GPU is hidden from ``optimize``, so
   nothing is measured), the model re-targeted to this GPU's fingerprint when the cache's differs
   (said loudly: engine ids are only comparable under the same cuDNN);
2. the kernel side-car (``compile_kernels``, a fresh process, as the bench writes it), then, in
   another fresh process that builds nothing, each suspect plan loaded from it and checked;
3. the model against ONNX Runtime CPU (the bench's reference and tolerance) under conditions: the
   bench's (side-car, captured); eager; plans built in this process instead of loaded; one plan
   per node instead of one per problem; a no-op kernel before each fused engine launch; a
   synchronization before each (eager); the output NaN- / zero-filled before each; with the
   executor's first-run checks on (``check_first_run``, the guard);
4. every fused engine conv against a float32 FMA cuDNN reference computed from the very arrays its
   launch read: in the eager plan run, in the captured plan's eager warm-up, and in the graph's
   first replay (the launch's inputs and output copied into snapshots inside the graph);
5. each suspect (problem, configuration), and up to ``--controls`` other eng4 configurations of
   the same problem, in isolation: the tuner's conditions (plan built on the enumerated graph,
   NaN-filled output, one launch), and the executor's (plan built from its name on a graph of its
   own, serialized and loaded, loaded from the side-car; garbage / zero output; 16- and 256-byte
   offsets; a workspace pointer; three buffer sets launched back to back, eagerly and captured in
   one graph; the inputs written by a kernel just before the launch);
6. the model (captured, side-car) under each fence scope of scripts/diag_fence.py: the product's
   fence before every fused engine launch (``conv_exec.fence_needed``) narrowed to some launches
   (none: the control; graphs with a residual; engine 4's; engine 4's with a residual; launches
   right after a cuDNN conv call; every fused launch, the product's default), each run's error and
   how many captured launches it fenced; with the control, the captured graph's edges by kind
   (``DIAG EDGES``: programmatic ones named by their kernels) and a copy of the graph replayed as
   captured and with those edges made default (``DIAG EDGES rewritten``);
7. verdict lines (``DIAG VERDICT``; ``VERDICT fence scope``: the smallest right scope per model and
   over every model; ``VERDICT edges``), everything in ``<out>/diag-<model>.json``.

Once per call, first: the fence's cost on this GPU (``DIAG FENCE cost``: a CUDA graph of
``--fence-n`` fences against an empty graph; as many no-op kernels with and without a fence before
each, captured and eagerly), in every ``diag-<model>.json`` and in ``<out>/diag-fence.json`` with
the scopes' results and the verdict over every model.

Staging, here (once): the frontend in .cudnnfe as scripts/graph-api-check.sh says, the tuning
cache compressed into an ignored folder::

    echo /.tunecache/ >> "$(git rev-parse --git-common-dir)/info/exclude"; mkdir -p .tunecache
    .cudnnfe/tool/zstd -19 -q -f /tmp/g0.db -o .tunecache/g0.db.zst

then one device call (kind nvidia-h200, the bench's GPU and cuDNN; carry .cudnnfe/00,
.cudnnfe/tool and .tunecache; about 3 minutes)::

    set -o pipefail; export out=$OUT; . scripts/device-env.sh && device_env || exit 1
    python3 models/export_panel.py --out .panel --models resnet50 >$OUT/export.log 2>&1 || { tail -5 $OUT/export.log; exit 1; }
    .cudnnfe/tool/zstd -d -q -f .tunecache/g0.db.zst -o /tmp/g0.db
    python3 scripts/diag_engine_epilogue.py --cache /tmp/g0.db --panel .panel --models resnet50 --batch 16 --out $OUT 2>&1 | tee $OUT/diag.log

(``--models resnet50,vae_decoder`` adds the VAE, whose ONNX Runtime CPU reference at batch 16
takes a while; on another Hopper GPU the decisions are replayed as if tuned there, said so.)

``--only fence`` answers the fence's questions alone (its cost; per model the decisions, the
side-car, the reference and the scopes; nothing else), for several models in one call::

    python3 scripts/diag_engine_epilogue.py --only fence --cache /tmp/g0.db --panel .panel \
        --models resnet50,cspdarknet53,vae_decoder --batch 16 --out $OUT 2>&1 | tee $OUT/diag.log
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sqlite3
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from diag_fence import (
    CONTROL,
    DEFAULT,
    SCOPES,
    TOL_MODEL,
    FenceScope,
    _cp,
    across_models,
    cost_lines,
    edges_check,
    edges_verdict_line,
    fence_cost,
    log,
    noop_kernel,
    patched,
    scope_line,
    scope_verdict,
    verdict_line,
)

REF_ALGOS = ("implicit_gemm", "implicit_precomp_gemm", "gemm", "direct")  # FMA references, in order


def guarded(what: str, fn, *args, **kw) -> Any:
    """``fn(*args, **kw)``, or None with the error printed: one phase failing never ends the call."""
    started = time.perf_counter()
    try:
        out = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        log(f"{what}: FAILED after {time.perf_counter() - started:.1f} s: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        traceback.print_exc(limit=6)
        return None
    log(f"{what}: done in {time.perf_counter() - started:.1f} s")
    return out


# ---------------------------------------------------------------------------------------------
# references and checks


_descs: dict[Any, Any] = {}


def fma_reference(key: Any, epilogue: str, x: Any, w: Any, bias: Any, z: Any) -> Any:
    """``epilogue(conv(x, w) + bias [, z])`` in float32 (NCHW), the conv by cuDNN's legacy API with
    FMA math (no TF32) and a deterministic algorithm, as the tuner's reference."""
    from convpass.native import cudnn
    from convpass.native.cudnn import graph_api

    cp = _cp()
    ref_key = key.shape.key("nchw", "fma")
    if ref_key not in _descs:
        _descs[ref_key] = cudnn.ConvDescriptors(ref_key)
    xn, wn = cudnn.as_layout(x, "nchw"), cudnn.as_layout(w, "nchw")
    yn = cudnn.empty_like_layout(key.shape.y_shape, key.shape.dtype, "nchw")
    for algo in REF_ALGOS:
        try:
            cudnn.run(_descs[ref_key], "fwd", algo, xn, wn, yn)
            break
        except cudnn.CudnnError:
            continue
    else:
        raise RuntimeError(f"no FMA reference algorithm for {ref_key}")
    v = yn.astype(cp.float32)
    if epilogue == "relu":
        return cp.maximum(v, 0)
    if not epilogue:
        return v
    v += bias.astype(cp.float32).reshape((1, -1) + (1,) * (v.ndim - 2))
    return graph_api.fusion_of(epilogue).reference(cp, v, None if z is None else z.astype(cp.float32))


def errors(y: Any, want: Any) -> dict[str, Any]:
    """Normwise relative error, and per sample (first axis) where it is off."""
    from convpass.kernels.engine_check import relative_error

    cp = _cp()
    total = relative_error(cp, y, want)
    per = [relative_error(cp, y[i:i + 1], want[i:i + 1]) for i in range(y.shape[0])]
    nan = int(cp.isnan(y).sum())
    return {"err": total, "per_sample": [float(f"{e:.3g}") for e in per], "nan": nan}


def verdict(e: dict[str, Any] | None, tol: float) -> str:
    if e is None:
        return "n/a"
    return "ok" if e["err"] <= tol else "WRONG"


def short(e: dict[str, Any] | None, tol: float) -> str:
    if e is None:
        return "n/a"
    bad = [i for i, v in enumerate(e["per_sample"]) if not v <= tol]
    where = f" samples {bad}" if bad and len(bad) < len(e["per_sample"]) else (" all samples" if bad else "")
    nan = f" nan={e['nan']}" if e["nan"] else ""
    return f"{verdict(e, tol)} {e['err']:.2e}{where}{nan}"


# ---------------------------------------------------------------------------------------------
# 1. decisions from the cache


def cache_device(cache: str, wanted: str | None) -> str:
    with sqlite3.connect(f"file:{cache}?mode=ro", uri=True) as db:
        devices = [r[0] for r in db.execute("SELECT DISTINCT device FROM measurements")]
    if wanted:
        hits = [d for d in devices if wanted.lower() in d.lower()]
        if not hits:
            raise SystemExit(f"--device-name {wanted!r}: the cache holds {devices}")
        return hits[0]
    if len(devices) != 1:
        raise SystemExit(f"the cache holds several devices {devices}: name one with --device-name")
    return devices[0]


def tune(model: Path, batch: int, cache: str, device: str, out: Path) -> tuple[Path, dict[str, tuple[int, ...]]]:
    import onnx

    import convpass
    from convpass.core.profiles import input_shapes, shape_spec
    from convpass.native import device as device_mod

    shapes = input_shapes(onnx.load(str(model), load_external_data=False), batch)
    tuned = out / f"{model.stem}.b{batch}.tuned.onnx"
    with patched(device_mod, "detect", lambda: None):  # decisions from the cache only: nothing measured
        convpass.optimize(str(model), str(tuned), shapes=[shape_spec(shapes)], tf32="on", matmul_tf32=True, engines="all",
                          cache=cache, device_name=device, kernels=False, quiet=True)
    return tuned, shapes


def retarget(tuned: Path, local: Any) -> list[str] | None:
    """Name this GPU as the model's device (the executor trusts decisions of its own device only);
    returns the devices it named before, None when nothing changed."""
    import onnx

    m = onnx.load(str(tuned))
    for p in m.metadata_props:
        if p.key == "convpass.devices":
            before = json.loads(p.value)
            if before == [str(local)]:
                return None
            p.value = json.dumps([str(local)])
            onnx.save(m, str(tuned))
            return before
    return None


# ---------------------------------------------------------------------------------------------
# 3. the model under conditions


def model_error(outs: list[Any], ref: list[np.ndarray]) -> float:
    cp = _cp()
    num = den = 0.0
    for o, r in zip(outs, ref):
        h = cp.asnumpy(o).astype(np.float64) if hasattr(o, "device") else np.asarray(o, np.float64)
        num += float(((h - r) ** 2).sum())
        den += float((np.asarray(r, np.float64) ** 2).sum())
    return float(np.sqrt(num) / max(np.sqrt(den), 1e-30)) if np.isfinite(num) else float("inf")


def executor(tuned: Path, graph: bool, sidecar: bool, check: bool = False) -> Any:
    from convpass.runtime import Executor
    from convpass.runtime.cuda import CudaBackend

    return Executor(str(tuned), device=CudaBackend(cuda_graph=graph, check_first_run=check), kernels=None if sidecar else False,
                    output_kind="device")


def run_condition(name: str, tuned: Path, feeds: dict[str, Any], ref: list[np.ndarray], *, graph: bool, sidecar: bool = True,
                  check: bool = False, patches: tuple = (), runs: int = 4, inspect: Any = None) -> dict[str, Any]:
    """Runs 1 (op by op), 2 (the plan's first run: the warm-up of a captured one) and the replays;
    then ``inspect(ex)`` on the executor, its result in the doc's ``inspected``."""
    cp = _cp()
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for p in patches:
            stack.enter_context(p)
        ex = executor(tuned, graph, sidecar, check)
        errs = []
        for _ in range(runs):
            outs = ex.run(None, feeds)
            cp.cuda.Device().synchronize()
            errs.append(model_error(outs, ref))
        status = ex.graph_status().describe()
        builds = len(ex.backend.convs.engine_builds)
        inspected = None if inspect is None else inspect(ex)
        del ex, outs
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
    said = [str(w.message).splitlines()[0] for w in caught]
    doc = {"condition": name, "errors": errs, "graph": status, "plans_built": builds, "warnings": said}
    if inspect is not None:
        doc["inspected"] = inspected
    marks = " ".join(f"{e:.2e}{'' if e <= TOL_MODEL else '!'}" for e in errs)
    log(f"model {name:<38} runs 1..{runs}: {marks}  [{status}; {builds} plans built here]")
    for w in said[:4]:
        log(f"    warning: {w[:220]}")
    return doc


def before_engine_launch(action) -> Any:
    """Run ``action(y)`` before each fused engine launch (a patch of EngineConv._launch)."""
    from convpass.kernels.conv_exec import EngineConv

    orig = EngineConv._launch

    def _launch(self, x, w, y, workspace, bias, z):
        if self.fused:
            action(y)
        orig(self, x, w, y, workspace, bias, z)

    return patched(EngineConv, "_launch", _launch)


def one_plan_per_node() -> Any:
    from convpass.kernels.conv_resolve import ConvResolver
    from convpass.native.cudnn import graph_api

    def _engine_plan(self, node, key, config):
        ident = graph_api.plan_id(key, config)
        mine = f"{ident}@{node}"
        if mine not in self._plans:
            self._plans[mine] = self._load_or_build_plan(node, key, config, ident)
        return self._plans[mine]

    return patched(ConvResolver, "_engine_plan", _engine_plan)


# ---------------------------------------------------------------------------------------------
# 4. every fused engine conv in the executor


class Watch:
    """A launch listener checking each fused engine launch against the FMA reference: eagerly
    (synchronized, right after it) outside a capture; inside one, its inputs and output copied into
    snapshots allocated in the eager warm-up (same launch order), checked after a replay."""

    def __init__(self) -> None:
        cp = _cp()
        self.pool = cp.cuda.MemoryPool()  # apart from the plan's pool
        self.node: str | None = None
        self.armed = False
        self.eager: list[dict[str, Any]] = []
        self.snaps: list[dict[str, Any]] = []
        self.captured = 0

    def patches(self) -> list[Any]:
        from convpass.kernels import conv_exec
        from convpass.kernels.convolution import ConvLaunch

        orig = ConvLaunch.run
        watch = self

        def run(launch, env):
            watch.node = launch.node.name
            try:
                orig(launch, env)
            finally:
                watch.node = None

        @contextlib.contextmanager
        def listening():
            conv_exec.add_launch_listener(self)
            try:
                yield
            finally:
                conv_exec.remove_launch_listener(self)

        return [patched(ConvLaunch, "run", run), listening()]

    def _copy(self, a: Any) -> Any:
        cp = _cp()
        mem = self.pool.malloc(a.nbytes)
        return cp.ndarray(a.shape, a.dtype, memptr=mem, strides=a.strides)

    def __call__(self, conv: Any, args: tuple) -> None:
        from convpass.kernels.conv_exec import EngineConv
        from convpass.native import cudnn

        if not (self.armed and isinstance(conv, EngineConv) and conv.fused):
            return
        cp = _cp()
        x, w, y, _, bias, z = args
        stream = cp.cuda.get_current_stream()
        if stream.is_capturing():
            i, self.captured = self.captured, self.captured + 1
            if i < len(self.snaps) and self.snaps[i]["node"] == self.node:
                s = self.snaps[i]
                for name, a in (("x", x), ("z", z), ("y", y)):
                    if a is not None and s.get(name) is not None:
                        s[name].data.copy_from_device_async(a.data, a.nbytes, stream)
            return
        with cp.cuda.using_allocator(self.pool.malloc):
            stream.synchronize()
            want = fma_reference(conv.key, conv.epilogue, x, w, bias, z)
            e = errors(y, want)
            align = {n: int(a.data.ptr) % 1024 for n, a in (("x", x), ("w", w), ("y", y), ("bias", bias), ("z", z)) if a is not None}
            self.eager.append({"node": self.node, "algo": str(conv.algo), "key": str(conv.key), "plan": id(conv.plan), "align": align, **e})
            dense = all(a is None or cudnn.layout_of(a) is not None for a in (x, y, z))
            self.snaps.append({"node": self.node, "conv": conv, "w": w, "bias": bias,
                               **({"x": self._copy(x), "y": self._copy(y), "z": None if z is None else self._copy(z)} if dense else {})})

    def check_snapshots(self) -> list[dict[str, Any]]:
        cp = _cp()
        cp.cuda.Device().synchronize()
        out = []
        with cp.cuda.using_allocator(self.pool.malloc):
            for s in self.snaps:
                if s.get("y") is None:
                    continue
                conv = s["conv"]
                want = fma_reference(conv.key, conv.epilogue, s["x"], s["w"], s["bias"], s["z"])
                out.append({"node": s["node"], "algo": str(conv.algo), **errors(s["y"], want)})
        return out


def per_conv(tuned: Path, feeds: dict[str, Any], graph: bool) -> dict[str, Any]:
    cp = _cp()
    watch = Watch()
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in watch.patches():
            stack.enter_context(p)
        ex = executor(tuned, graph, sidecar=True)
        ex.run(None, feeds)  # op by op (fused engines do not run in it)
        watch.armed = True
        ex.run(None, feeds)  # the plan's first run: eager (the warm-up), then captured
        replay = []
        if graph:
            ex.run(None, feeds)  # the first replay
            cp.cuda.Device().synchronize()
            replay = watch.check_snapshots()
    return {"eager": watch.eager, "replay": replay, "captured_launches": watch.captured, "snapshots": len(watch.snaps)}


# ---------------------------------------------------------------------------------------------
# 5. one (problem, configuration) in isolation


class Case:
    """Random inputs of ``key`` in its memory format and their FMA reference, for ``fusion``."""

    def __init__(self, key: Any, fusion: str, seed: int) -> None:
        from convpass.core.fusion import takes_residual
        from convpass.native import cudnn

        cp = _cp()
        s, layout, dt = key.shape, key.layout, key.shape.dtype
        rs = cp.random.RandomState(seed)
        fan_in = (s.c // s.groups) * int(np.prod(s.kernel))
        self.x = cudnn.as_layout(rs.standard_normal(s.x_shape, dtype=cp.float32).astype(dt), layout)
        self.w = cudnn.as_layout((rs.standard_normal(s.w_shape, dtype=cp.float32) * fan_in ** -0.5).astype(dt), layout)
        self.b = (0.1 * rs.standard_normal(s.k, dtype=cp.float32)).astype(dt)
        self.z = cudnn.as_layout(rs.standard_normal(s.y_shape, dtype=cp.float32).astype(dt), layout) if takes_residual(fusion) else None
        self.key, self.fusion = key, fusion
        self.want = fma_reference(key, fusion, self.x, self.w, self.b, self.z)

    def y(self, fill: float | None = float("nan")) -> Any:
        from convpass.native import cudnn

        cp = _cp()
        y = cudnn.empty_like_layout(self.key.shape.y_shape, self.key.shape.dtype, self.key.layout)
        if fill is None:  # garbage: large random values
            y[...] = cp.random.standard_normal(y.shape, dtype=cp.float32) * 100
        else:
            y.fill(fill)
        return y


def launch(plan: Any, case: Case, y: Any, x: Any = None, z: Any = None, ws: Any = None, bias: Any = None) -> None:
    from convpass.core.fusion import takes_residual

    fused = bool(plan.config.fusion)
    plan.execute(case.x if x is None else x, case.w, y, ws, bias=(case.b if bias is None else bias) if fused else None,
                 z=(case.z if z is None else z) if takes_residual(plan.config.fusion) else None)


def at_offset(a: Any, offset: int, keep: list) -> Any:
    """A copy of ``a`` (dense) at ``offset`` bytes into a larger buffer, same strides."""
    cp = _cp()
    raw = cp.empty(a.nbytes + offset + 256, dtype=cp.uint8)
    keep.append(raw)
    v = cp.ndarray(a.shape, a.dtype, memptr=raw.data + offset, strides=a.strides)
    v[...] = a
    return v


def _zeros_like(a: Any) -> Any:
    """Zeros of ``a``'s shape, dtype and memory format."""
    from convpass.native.cudnn import empty_like_layout, layout_of

    out = empty_like_layout(a.shape, a.dtype, "nhwc" if layout_of(a) == "nhwc" else "nchw")
    out.fill(0)
    return out


def iso_conditions(plan: Any, cases: list[Case], which: tuple[str, ...]) -> dict[str, Any]:
    """Run ``plan`` under each condition of ``which``; the error of its outputs per condition."""
    from convpass.native.cuda import quiet_for_capture

    cp = _cp()
    tol = 5e-3
    out: dict[str, Any] = {}
    c0 = cases[0]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        def one(y: Any) -> dict[str, Any]:
            stream.synchronize()
            return errors(y, c0.want)

        for cond in which:
            try:
                if cond in ("nan", "zero", "garbage"):
                    y = c0.y({"nan": float("nan"), "zero": 0.0, "garbage": None}[cond])
                    launch(plan, c0, y)
                    out[cond] = one(y)
                elif cond == "workspace":
                    y = c0.y()
                    launch(plan, c0, y, ws=cp.empty(1 << 20, dtype=cp.uint8))
                    out[cond] = one(y)
                elif cond.startswith("offset"):
                    keep: list = []
                    off = int(cond[6:])
                    y = at_offset(c0.y(), off, keep)
                    launch(plan, c0, y, x=at_offset(c0.x, off, keep), z=None if c0.z is None else at_offset(c0.z, off, keep),
                           bias=at_offset(c0.b, off, keep))
                    out[cond] = one(y)
                elif cond == "multi_eager":
                    ys = [c.y() for c in cases]
                    for c, y in zip(cases, ys):
                        launch(plan, c, y)
                    stream.synchronize()
                    out[cond] = [errors(y, c.want) for c, y in zip(cases, ys)]
                elif cond in ("multi_captured_same", "multi_captured_other"):
                    ys = [c.y() for c in cases]
                    for c, y in zip(cases, ys):  # eager launches first, as the executor's warm-up
                        launch(plan, c, y)
                    stream.synchronize()
                    if cond == "multi_captured_other":  # captured at other buffers than the eager launches'
                        ys = [c.y() for c in cases]
                    with quiet_for_capture():
                        stream.begin_capture()
                        try:
                            for c, y in zip(cases, ys):
                                launch(plan, c, y)
                        finally:
                            g = stream.end_capture()
                    for y in ys:
                        y.fill(float("nan"))
                    g.launch(stream)
                    stream.synchronize()
                    out[cond] = [errors(y, c.want) for c, y in zip(cases, ys)]
                elif cond == "race":  # the inputs written by a copy kernel right before the launch, no sync between
                    x, z, y = _zeros_like(c0.x), None if c0.z is None else _zeros_like(c0.z), c0.y()
                    stream.synchronize()
                    cp.copyto(x, c0.x)
                    if z is not None:
                        cp.copyto(z, c0.z)
                    launch(plan, c0, y, x=x, z=z)
                    out[cond] = one(y)
                else:
                    raise ValueError(cond)
            except Exception as e:  # noqa: BLE001
                out[cond] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    for cond, e in out.items():
        if isinstance(e, list):
            out[cond] = {"sets": e, "err": max(s["err"] for s in e), "per_sample": [], "nan": sum(s["nan"] for s in e)}
    out["_verdict"] = {c: ("error" if "error" in e else verdict(e, tol)) for c, e in out.items() if c != "_verdict"}
    return out


ALL = ("nan", "garbage", "zero", "workspace", "offset16", "offset256", "multi_eager", "multi_captured_same", "multi_captured_other", "race")
SHORT = ("nan", "multi_eager", "multi_captured_other", "race")


def isolation(tuned: Path, suspects: list[dict[str, Any]], controls: int) -> list[dict[str, Any]]:
    """Each distinct suspect (problem, configuration) under the tuner's and the executor's conditions,
    and up to ``controls`` other eng4 configurations of its problem."""
    from convpass.core import kernel_file
    from convpass.core.problem import ProblemKey
    from convpass.native.cudnn import graph_api

    side = kernel_file.read(kernel_file.sidecar_path(tuned))
    stored = {k: e for (k, _), e in side.entries.items() if e.is_plan}
    out = []
    for item in distinct(suspects):
        key, config = ProblemKey.parse(item["key"]), graph_api.EngineConfig.parse(item["algo"])
        cases = [Case(key, config.fusion, seed) for seed in (11, 12, 13)]
        doc: dict[str, Any] = {"key": item["key"], "algo": item["algo"], "nodes": item["nodes"]}
        log(f"isolation {config.algo} for {key} (nodes {', '.join(label(n) for n in item['nodes'])})")
        enumerated = graph_api.enumerate_configs(key, config.fusion)
        doc["offered"] = enumerated.names
        doc["same_name_at"] = [i for i, n in enumerate(enumerated.names) if n == config.name]
        with contextlib.suppress(Exception):
            doc["behavior_notes"] = [str(n) for n in enumerated.graph.get_behavior_notes_for_plan_at_index(enumerated.names.index(config.name))]
        plans = {}
        plans["tuner"] = guarded("  build on the enumerated graph (tuner)", graph_api.EnginePlan, key, config, enumerated)
        plans["built"] = guarded("  build from its name (executor without side-car)", graph_api.EnginePlan, key, config)
        if plans["built"] is not None:
            blob = guarded("  serialize", plans["built"].serialize, False)
            plans["loaded_here"] = None if blob is None else guarded("  load it back", graph_api.EnginePlan.load, key, config, blob)
        entry = stored.get(graph_api.plan_id(key, config))
        plans["sidecar"] = None if entry is None else guarded("  load from the side-car", graph_api.EnginePlan.load, key, config, entry.payload)
        for name, plan in plans.items():
            if plan is None:
                continue
            which = ALL if name == "built" else (("nan", "multi_captured_other") if name == "tuner" else SHORT)
            res = iso_conditions(plan, cases, which)
            doc[name] = res
            log(f"  {name:<12} " + "  ".join(f"{c}={res['_verdict'][c]}" + _detail(res, c) for c in which))
        doc["controls"] = []
        for other in [c for c in enumerated.configs() if c.engine_id == config.engine_id and c.name != config.name][:controls]:
            plan = guarded(f"  control {other.name}", graph_api.EnginePlan, key, other, enumerated)
            if plan is None:
                continue
            res = iso_conditions(plan, cases, SHORT)
            doc["controls"].append({"algo": other.algo, **res})
            log(f"  control {other.name:<14} " + "  ".join(f"{c}={res['_verdict'][c]}" for c in SHORT))
        out.append(doc)
    return out


def _detail(res: dict[str, Any], cond: str) -> str:
    v = res["_verdict"][cond]
    if v == "WRONG":
        return f"({res[cond]['err']:.1e})"
    if v == "error":
        return f"({res[cond]['error'][:80]})"
    return ""


def label(node: str) -> str:
    """A node's short name: its last two path components, ``/Conv`` left off."""
    parts = [p for p in node.split("/") if p and p != "Conv"]
    return "/".join(parts[-2:]) if parts else node


def distinct(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(problem key, engine algo) -> the nodes that run it (they share one plan in the executor)."""
    from convpass.native.cudnn import graph_api

    by: dict[tuple[str, str], list[str]] = {}
    for r in records:
        algo = graph_api.EngineConfig.parse(r["engine"], r["fusion"]).algo
        by.setdefault((r["problem_key"], algo), []).append(r["node"])
    return [{"key": k, "algo": a, "nodes": n} for (k, a), n in by.items()]


# ---------------------------------------------------------------------------------------------
# 2b. the side-car's plans in a fresh process (the child)


def child_main(tuned: str, items: list[dict[str, Any]]) -> int:
    """Load each plan from the side-car before anything is built in this process, then check it."""
    from convpass.core import kernel_file
    from convpass.core.problem import ProblemKey
    from convpass.native.cudnn import graph_api

    side = kernel_file.read(kernel_file.sidecar_path(tuned))
    stored = {k: e for (k, _), e in side.entries.items() if e.is_plan}
    loaded = []
    for item in items:  # every load first: nothing built or run in between
        key, config = ProblemKey.parse(item["key"]), graph_api.EngineConfig.parse(item["algo"])
        entry = stored.get(graph_api.plan_id(key, config))
        t0 = time.perf_counter()
        try:
            plan = graph_api.EnginePlan.load(key, config, entry.payload) if entry is not None else None
            why = "" if entry is not None else "not in the side-car"
        except Exception as e:  # noqa: BLE001
            plan, why = None, f"{type(e).__name__}: {e}"
        loaded.append((item, key, config, plan, why, time.perf_counter() - t0))
    for item, key, config, plan, why, load_s in loaded:
        doc: dict[str, Any] = {"key": item["key"], "algo": item["algo"], "load_s": round(load_s, 4), "why": why}
        if plan is not None:
            res = iso_conditions(plan, [Case(key, config.fusion, seed) for seed in (11, 12, 13)], SHORT)
            doc.update(res)
        print("CHILD " + json.dumps(doc), flush=True)
    return 0


def _child(tuned: Path, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-load", str(tuned), "--items", json.dumps(items)],
                          capture_output=True, text=True, timeout=300)
    docs = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("CHILD ")]
    if done.returncode or not docs:
        log(f"fresh-process loads: exit {done.returncode}; stderr: {done.stderr.strip()[-800:]}")
    return docs


def fresh_process_loads(tuned: Path, suspects: list[dict[str, Any]]) -> dict[str, Any]:
    """Every suspect plan loaded from the side-car in one fresh process (all loads first, as the
    executor loads them), then checked; where one is wrong, each again alone in a process of its own
    (a plan loaded beside others of the same configuration against one loaded alone)."""
    items = [{"key": d["key"], "algo": d["algo"]} for d in distinct(suspects)]
    out: dict[str, Any] = {"together": _child(tuned, items), "alone": []}

    def show(d: dict[str, Any], how: str) -> None:
        v = d.get("_verdict", {})
        log(f"fresh process ({how}): {d['algo']} {'|'.join(d['key'].split('|')[1:6])} load {d['load_s'] * 1e3:.1f} ms {d['why']} "
            + "  ".join(f"{c}={v.get(c)}" for c in SHORT))

    for d in out["together"]:
        show(d, "together")
    if any(v != "ok" for d in out["together"] for v in d.get("_verdict", {}).values()):
        for item in items:
            for d in _child(tuned, [item]):
                out["alone"].append(d)
                show(d, "alone")
    return out


# ---------------------------------------------------------------------------------------------
# 6. the fence's scope (scripts/diag_fence.py)


def fence_scopes(tuned: Path, feeds: dict[str, Any], ref: list[np.ndarray], names: list[str], sidecar: bool, runs: int) -> list[dict[str, Any]]:
    """The model under each fence scope of ``names`` (the bench's condition: captured, side-car
    plans unless ``sidecar`` is False), each run's error and the scope's captured fused launches;
    with the control (no fence), the captured graph's edges (``edges``: diag_fence.edges_check)."""
    out = []
    for name in names:
        scope = FenceScope(name)
        how = "side-car" if sidecar else "built here"
        edges = None
        if name == CONTROL:
            edges = lambda ex: guarded("the captured graph's edges", edges_check, ex, feeds, lambda outs: model_error(outs, ref))  # noqa: E731
        doc = guarded(f"condition fence scope {name!r}", run_condition, f"{how}, captured, fence: {name}", tuned, feeds, ref,
                      graph=True, sidecar=sidecar, patches=tuple(scope.patches()), runs=runs, inspect=edges)
        doc = {"condition": f"fence: {name}", "errors": []} if doc is None else doc
        if name == CONTROL:
            doc["edges"] = doc.pop("inspected", None) or {"unavailable": "the check failed or did not run (see above)"}
        doc.update(scope.summary())
        log(scope_line(doc))
        out.append(doc)
    return out


# ---------------------------------------------------------------------------------------------
# the whole run


def diagnose(model: Path, args: argparse.Namespace, device: str, out: Path) -> dict[str, Any]:
    import onnx

    import convpass
    from convpass.bench.measure import make_feeds
    from convpass.bench.reference import reference_outputs
    from convpass.compiler.aot import compile_kernels
    from convpass.core.fusion import takes_residual
    from convpass.native import device as device_mod

    cp = _cp()
    doc: dict[str, Any] = {"model": model.stem, "batch": args.batch, "cache_device": device, "only": args.only}
    local = device_mod.detect()
    doc["local_device"] = str(local)
    made = guarded(f"{model.stem}: decisions from the cache ({device})", tune, model, args.batch, args.cache, device, out)
    if made is None:
        return doc
    tuned, shapes = made
    before = retarget(tuned, local)
    if before is not None:
        log(f"RETARGETED: the cache's device {before} is not this GPU ({local}): decisions replayed here as if tuned here"
            + ("" if before and before[0].split("|")[-1] == str(local).split("|")[-1] else " -- ANOTHER cuDNN: engine ids may mean other engines"))
    records = convpass.inspect(str(tuned))
    fused = [r for r in records if r["engine"] and r["fusion"]]
    suspects = [r for r in fused if takes_residual(r["fusion"])]
    doc["fused"] = [{k: r[k] for k in ("node", "problem_key", "engine", "fusion", "algo", "time_ms")} for r in fused]
    log(f"{len(records)} convs, {len(fused)} fused engine graphs, {len(suspects)} with the residual:")
    for d in distinct(suspects):
        log(f"  {d['algo']:<36} {'|'.join(d['key'].split('|')[1:8])}  x{len(d['nodes'])} (one plan shared by {len(d['nodes'])} node(s))")
    fence_only = args.only == "fence"
    side = guarded("kernel side-car (compile_kernels, a fresh process)", compile_kernels, tuned)
    doc["sidecar"] = None if side is None else side.line()
    if side is not None:
        log(side.line())
        if not fence_only:
            doc["fresh_process"] = guarded("suspect plans loaded from the side-car in a fresh process", fresh_process_loads, tuned, suspects)
    proto = onnx.load(str(model), load_external_data=False)
    feeds_host = make_feeds(proto, shapes, seed=0)
    ref, ref_label, note = reference_outputs(model, feeds_host)
    if ref is None:
        log(f"no reference: {note}")
        return doc
    log(f"reference: {ref_label}{f' ({note})' if note else ''}")
    feeds = {k: cp.asarray(v) for k, v in feeds_host.items()}
    scopes = [n.strip() for n in args.scopes.split(",") if n.strip()]
    if fence_only:
        if side is None:
            log("NO SIDE-CAR: the fence scopes run with plans built in this process (not the bench's condition)")
        doc["fence_scopes"] = fence_scopes(tuned, feeds, ref, scopes, side is not None, args.scope_runs)
        return doc
    nan, zero = (lambda y: y.fill(float("nan"))), (lambda y: y.fill(0))
    sync = lambda y: _cp().cuda.get_current_stream().synchronize()  # noqa: E731
    conds = [("side-car, eager", {"graph": False}),
             ("side-car, captured, one plan per node", {"graph": True, "patches": (one_plan_per_node(),)}),
             ("side-car, captured, no-op kernel before", {"graph": True, "patches": (before_engine_launch(noop_kernel),)}),
             ("side-car, eager, sync before", {"graph": False, "patches": (before_engine_launch(sync),)}),
             ("side-car, captured, y NaN before", {"graph": True, "patches": (before_engine_launch(nan),)}),
             ("side-car, captured, y zero before", {"graph": True, "patches": (before_engine_launch(zero),)}),
             ("side-car, captured, first-run checks ON", {"graph": True, "check": True})]
    if side is not None:  # the bench's condition first, as the bench's process met it (nothing built or loaded before)
        doc["conditions"] = [guarded("condition bench", run_condition, "bench: side-car, captured", tuned, feeds, ref, graph=True, runs=8)]
        doc["per_conv_captured"] = guarded("per fused conv, side-car, captured (warm-up and first replay)", per_conv, tuned, feeds, True)
        doc["per_conv_eager"] = guarded("per fused conv, side-car, eager", per_conv, tuned, feeds, False)
        report_per_conv(doc)
        doc["conditions"] += [guarded(f"condition {n}", run_condition, n, tuned, feeds, ref, **kw) for n, kw in conds]
    built = [("built here, captured", {"graph": True, "sidecar": False}), ("built here, eager", {"graph": False, "sidecar": False})]
    doc["conditions"] = doc.get("conditions", []) + [guarded(f"condition {n}", run_condition, n, tuned, feeds, ref, **kw) for n, kw in built]
    if side is not None:
        doc["isolation"] = guarded("suspects in isolation", isolation, tuned, suspects, args.controls)
    doc["fence_scopes"] = fence_scopes(tuned, feeds, ref, scopes, side is not None, args.scope_runs)
    return doc


def report_per_conv(doc: dict[str, Any]) -> None:
    cap, eag = doc.get("per_conv_captured") or {}, doc.get("per_conv_eager") or {}
    tol = 5e-3
    rows: dict[str, dict[str, Any]] = {}
    for what, items in (("eager", eag.get("eager", [])), ("warm-up", cap.get("eager", [])), ("replay", cap.get("replay", []))):
        for it in items:
            rows.setdefault(it["node"], {"algo": it["algo"]})[what] = it
    log(f"per fused conv (vs FMA reference on its own inputs; {cap.get('snapshots', 0)} snapshots, "
        f"{cap.get('captured_launches', 0)} captured launches):")
    wrong: dict[str, list[str]] = {"eager": [], "warm-up": [], "replay": []}
    plans: dict[int, list[str]] = {}
    for node, r in rows.items():
        first = r.get("warm-up") or r.get("eager") or {}
        plans.setdefault(first.get("plan", 0), []).append(node)
        for what in wrong:
            if r.get(what) is not None and not r[what]["err"] <= tol:
                wrong[what].append(node)
        line = "  ".join(f"{w}={short(r.get(w), tol)}" for w in ("eager", "warm-up", "replay"))
        flag = "WRONG" in line
        extra = f"  align {first.get('align')}" if flag else ""
        log(f"  {'!!' if flag else '  '} {node[:52]:<52} {r['algo']:<40} {line}{extra}")
    shared = [nodes for nodes in plans.values() if len(nodes) > 1]
    log(f"plans shared by several nodes: {len(shared)}" + "".join(f"\n      {[label(n) for n in g]}" for g in shared))
    doc["per_conv_wrong"] = wrong


def verdicts(doc: dict[str, Any]) -> None:
    if doc.get("only") != "fence":
        condition_verdicts(doc)
    if doc.get("fence_scopes"):
        doc["fence_verdict"] = scope_verdict(doc["fence_scopes"])
        log(verdict_line(f"model {doc['model']} b{doc['batch']}", doc["fence_verdict"]))
        edges = next((r["edges"] for r in doc["fence_scopes"] if r and r.get("edges")), None)
        if edges is not None:
            log(edges_verdict_line(f"model {doc['model']} b{doc['batch']}", edges))


def condition_verdicts(doc: dict[str, Any]) -> None:
    conds = {c["condition"]: c for c in doc.get("conditions", []) if c}

    def wrong(name: str, which: slice = slice(1, None)) -> bool | None:
        c = conds.get(name)
        return None if c is None else any(not e <= TOL_MODEL for e in c["errors"][which])

    bench = wrong("bench: side-car, captured")
    warm = conds.get("bench: side-car, captured", {}).get("errors", [None, None])[1]
    log(f"VERDICT model {doc['model']} b{doc['batch']}: bench condition {'WRONG' if bench else 'right' if bench is not None else 'n/a'}"
        + (f" (warm-up {warm:.2e}, replays {conds['bench: side-car, captured']['errors'][2:]})" if warm is not None else ""))
    hints = []
    if bench and warm is not None and warm <= TOL_MODEL:
        hints.append("the eager warm-up is right and the replays are wrong: a capture / replay problem")
    if bench and wrong("side-car, eager") is False:
        hints.append("eager runs are right: only the captured graph is wrong")
    if bench and wrong("built here, captured") is False:
        hints.append("plans built in this process are right: the side-car's (deserialized) plans are the cause")
    if bench and wrong("side-car, captured, one plan per node") is False:
        hints.append("one plan per node is right: state shared by the nodes of one plan")
    if bench and wrong("side-car, captured, no-op kernel before") is False:
        hints.append("a no-op kernel before each engine launch makes it right: the launch overlaps its producer (a stream-order race)")
    if wrong("side-car, eager") and wrong("side-car, eager, sync before") is False:
        hints.append("a sync before each engine launch makes the eager run right: a race with the producer kernel")
    nan_c = conds.get("side-car, captured, y NaN before")
    if nan_c and any(e == float("inf") for e in nan_c["errors"][1:]):
        hints.append("y NaN-filled before the launch gives non-finite outputs: the engine leaves part of y unwritten, or reads it")
    if bench and wrong("side-car, captured, y zero before") is False:
        hints.append("y zeroed before the launch makes it right: the engine accumulates into y")
    for what, nodes in (doc.get("per_conv_wrong") or {}).items():
        if nodes:
            hints.append(f"per conv, {what}: {len(nodes)} fused conv(s) wrong on their own inputs: {nodes}")
    guard = conds.get("side-car, captured, first-run checks ON")
    if guard:
        errs = ", ".join(f"{e:.1e}" for e in guard["errors"])
        hints.append(f"with the first-run checks: errors {errs}, {len(guard['warnings'])} warning(s)")
    for it in doc.get("isolation") or []:
        bad = {name: [c for c, v in it[name]["_verdict"].items() if v != "ok"] for name in ("tuner", "built", "loaded_here", "sidecar") if name in it}
        bad = {k: v for k, v in bad.items() if v}
        ctl = [f"{c['algo']}: {[k for k, v in c['_verdict'].items() if v != 'ok']}" for c in it.get("controls", [])]
        hints.append(f"isolation {it['algo']} {'|'.join(it['key'].split('|')[1:5])}: " + (f"not ok under {bad}" if bad else "ok everywhere")
                     + (f"; controls {ctl}" if ctl else "") + (f"; name offered at indices {it.get('same_name_at')}" if len(it.get("same_name_at", [])) > 1 else ""))
    fresh = doc.get("fresh_process") or {}
    for how in ("together", "alone"):
        for d in fresh.get(how, []):
            bad = [c for c, v in d.get("_verdict", {}).items() if v != "ok"]
            if bad or d.get("why"):
                hints.append(f"fresh-process side-car load ({how}) {d['algo']} {'|'.join(d['key'].split('|')[1:6])}: {d.get('why') or ''} "
                             f"not ok under {bad}")
    for h in hints:
        log(f"VERDICT   {h}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="the tuning cache (SQLite) the bench's decisions came from")
    ap.add_argument("--panel", default=".panel", help="folder of the exported panel models (models/export_panel.py --out)")
    ap.add_argument("--models", default="resnet50", help="comma-separated panel model names")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device-name", help="the cache's device to take decisions of (default: its only one)")
    ap.add_argument("--controls", type=int, default=3, help="other eng4 configurations per suspect problem, checked beside it")
    ap.add_argument("--only", choices=("all", "fence"), default="all",
                    help="fence: only the fence's cost and the model under each fence scope (decisions, side-car, reference, scopes)")
    ap.add_argument("--scopes", default=",".join(SCOPES), help=f"comma-separated fence scopes, narrow to wide (of {', '.join(SCOPES)})")
    ap.add_argument("--scope-runs", type=int, default=8, help="model runs per fence scope (1 op by op, 1 warm-up and capture, then replays)")
    ap.add_argument("--fence-n", type=int, default=200, help="fences (and no-op kernels) per graph in the fence's cost")
    ap.add_argument("--out", default=os.environ.get("OUT", "diag-out"), help="where diag-<model>.json goes")
    ap.add_argument("--work", default="/tmp/diag-engine-epilogue", help="where the tuned models and their side-cars go (large)")
    ap.add_argument("--child-load", help=argparse.SUPPRESS)
    ap.add_argument("--items", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_load:
        return child_main(args.child_load, json.loads(args.items))
    if not args.cache:
        ap.error("--cache is required")
    unknown = [n for n in args.scopes.split(",") if n.strip() and n.strip() not in SCOPES]
    if unknown:
        ap.error(f"--scopes: unknown {unknown} (known: {', '.join(SCOPES)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cp = _cp()
    from convpass.native import device as device_mod
    from convpass.native.cudnn import graph_api

    log(f"GPU {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, this device {device_mod.detect()}, "
        f"graph API {graph_api.unavailable() or graph_api.versions()}, CuPy {cp.__version__}")
    device = cache_device(args.cache, args.device_name)
    cost = guarded(f"the fence's cost ({args.fence_n} per graph)", fence_cost, args.fence_n)
    for line in cost_lines(cost) if cost else []:
        log(line)
    scopes: dict[str, list[dict[str, Any]]] = {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        started = time.perf_counter()
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        doc = diagnose(Path(args.panel) / f"{name}.onnx", args, device, work)
        verdicts(doc)
        doc["fence_cost"] = cost
        scopes[f"{name} b{args.batch}"] = doc.get("fence_scopes") or []
        doc["seconds"] = round(time.perf_counter() - started, 1)
        path = out / f"diag-{name}.json"
        path.write_text(json.dumps(doc, indent=1, default=str))
        log(f"{name}: {doc['seconds']} s; wrote {path}")
        write_fence_summary(out, cost, scopes, final=False)  # after each model: a call cut short keeps what it has
    write_fence_summary(out, cost, scopes, final=True)
    return 0


def write_fence_summary(out: Path, cost: dict[str, Any] | None, scopes: dict[str, list[dict[str, Any]]], final: bool) -> None:
    """``<out>/diag-fence.json``: the fence's cost, each model's scope results and the verdict over
    every model (printed when ``final``)."""
    summary: dict[str, Any] = {"fence_cost": cost, "scopes": {m: [{k: r.get(k) for k in ("scope", "errors", "graph", "fences", "fused", "after", "edges")}
                                                                  for r in rs] for m, rs in scopes.items()}}
    if len(scopes) > 1 and any(scopes.values()):
        summary["verdict"] = scope_verdict(across_models(scopes))
        if final:
            log(verdict_line(f"every model ({', '.join(scopes)})", summary["verdict"]))
    if final and cost:
        us = cost["us"]
        log(f"VERDICT fence cost: {us.get('graph_between_kernels', float('nan')):.2f} us per fence between kernels in a graph, "
            f"{us.get('graph_fences', float('nan')):.2f} us per fence alone in a graph, {us['eager_between_kernels']:.2f} us eagerly "
            f"(scope {DEFAULT!r} is the product's, {CONTROL!r} the control)")
    path = out / "diag-fence.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    tmp.replace(path)
    if final:
        log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
