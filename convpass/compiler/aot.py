"""Ahead-of-time kernels: ``convpass compile MODEL`` and the last step of ``optimize`` on a GPU.

The kernels a plan compiles at run time (generated element-wise groups, normalization, pooling
and Resize kernels, CuPy's own copies and reductions) are only known once the plan is built, and
building it needs the GPU: cuDNN descriptors, the layouts each conv runs in. So :func:`compile_kernels`
builds and runs the model's plans, once per shape profile, **in a fresh Python process** — in a
process that already holds compiled kernels CuPy would not ask for them again and they would be
missed — with :func:`convpass.native.prebuilt.recording` on, compiles the recorded kernels
for any other GPU architectures asked for (NVRTC needs no GPU of that architecture), and writes
``<model>.kernels`` (:mod:`convpass.core.kernel_file`) atomically, marked verified: the model ran on
the GPU before the file was written, so the executor trusts this exact file without re-checking it.
The cuDNN graph-API plans the model's engine decisions build go into the same file, serialized
(for this GPU's architecture only), so the executor loads them instead of building them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convpass.core import kernel_file
from convpass.core.errors import ConvpassError
from convpass.core.files import check_output, check_readable

logger = logging.getLogger("convpass")

__all__ = ["SHOWN_SLOW", "KernelReport", "compile_kernels", "current_sidecar", "parse_archs"]

SHOWN_SLOW = 5  # slow convs printed by name; the rest are counted (every one is in the JSON)


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What :func:`compile_kernels` wrote: the side-car, its kernels per architecture, the profiles
    it ran, the kernels that did not build for an extra architecture, and the seconds it took."""

    path: Path
    kernels: int
    archs: dict[str, int]
    profiles: list[str]
    failed: list[str]
    seconds: float
    plans: int = 0  # built cuDNN graph-API plans stored beside the kernels
    in_place: tuple[dict[str, Any], ...] = ()  # per profile: convpass.runtime.in_place.InPlaceReport.to_json()

    def slow_convs(self) -> list[str]:
        """A line per tuned conv that ran more than the in-place check allows over its tuned time,
        the one with the most excess time (in place less tuned) first."""
        from convpass.runtime.in_place import SLOW_RATIO

        slow = [c for doc in self.in_place if doc.get("reliable") for c in doc["convs"] if c["ratio"] > SLOW_RATIO]
        slow.sort(key=lambda c: c["tuned_ms"] - c["in_place_ms"])
        return [f"conv {c['node']!r} (profile {c['profile']}) runs {c['in_place_ms']:.4f} ms in place against "
                f"{c['tuned_ms']:.4f} ms tuned ({c['ratio']:.2f}x > {SLOW_RATIO}x; {c['algo']}, {c['memory_format']})"
                + (f"; timed {c['raw_ms']:.4f} ms less the {c['floor_ms']:.4f} ms floor" if "raw_ms" in c else "")
                for c in slow]

    def slow_shown(self, model: str | os.PathLike[str]) -> list[str]:
        """What ``optimize`` prints of :meth:`slow_convs`: the :data:`SHOWN_SLOW` worst, then how
        many more and where each one is shown."""
        slow = self.slow_convs()
        more = len(slow) - SHOWN_SLOW
        tail = [f"... and {more} more (convpass account {shlex.quote(str(model))} shows every conv)"] if more > 0 else []
        return slow[:SHOWN_SLOW] + tail

    def in_place_line(self) -> str | None:
        """How many tuned convs were timed in place, how many ran slow, and the floor taken off."""
        if not self.in_place:
            return None
        timed = sum(len(d["convs"]) for d in self.in_place)
        unreliable = sum(1 for d in self.in_place if not d.get("reliable"))
        note = f"; {unreliable} profile(s) timed with host gaps, not judged" if unreliable else ""
        floors = [d["floor_ms"] for d in self.in_place if d.get("floor_ms") is not None]  # absent in older records
        span = sorted({f"{min(floors):.4f}", f"{max(floors):.4f}"}, key=float) if floors else []
        floor = f" (each less the timing's own {'-'.join(span)} ms per launch)" if span else ""
        return (f"in place: {timed} tuned conv launch(es) timed inside the plan, {len(self.slow_convs())} more than 15% "
                f"over their tuned time{floor}{note}")

    def line(self) -> str:
        per = ", ".join(f"sm_{a}: {n}" for a, n in sorted(self.archs.items(), key=lambda x: int(x[0])))
        extra = f"; {len(self.failed)} did not build: {'; '.join(self.failed[:3])}" if self.failed else ""
        plans = f" and {self.plans} built cuDNN plan(s)" if self.plans else ""
        return (f"{self.path}: {self.kernels} kernel(s) compiled ahead of time ({per}){plans} for {len(self.profiles)} "
                f"profile(s) in {self.seconds:.1f} s{extra}")


def current_sidecar(model: str | os.PathLike[str]) -> str | None:
    """Why the side-car beside ``model`` needs no rebuild, or None when :func:`compile_kernels`
    must write it: kept only when it was written for this exact file (its SHA-256), built and
    verified on a GPU of this architecture for the model's own profiles, by this convpass and
    CuPy, and every cuDNN plan in it is of this cuDNN and frontend. A cached re-run of
    ``optimize`` writes the same model again, and compiling its kernels again would take most of
    the run (docs/measurements/2026-11-26-tuning-time-cached-rerun.md). Never raises: a side-car
    it cannot judge is None."""
    try:
        return _current_sidecar(model)
    except Exception as e:  # noqa: BLE001  (compiled again: what was asked is still written)
        logger.debug("the side-car beside %s could not be judged (%s): compiled again", model, e)
        return None


def _current_sidecar(model: str | os.PathLike[str]) -> str | None:
    path = kernel_file.sidecar_path(model)
    if not path.is_file():
        return None
    try:
        kf = kernel_file.read(path, model_sha256=kernel_file.file_sha256(model))
    except kernel_file.KernelFileError:
        return None
    import cupy

    from convpass.core.version import __version__
    from convpass.native import prebuilt

    arch = prebuilt.device_arch()
    if (not kf.verified or not kf.model_profiles or kf.recorded_arch != arch
            or kf.convpass_version != __version__ or kf.cupy_version != cupy.__version__):
        return None
    plans = [e for e in kf.entries.values() if e.is_plan]
    if plans and not _plans_current(plans):
        return None
    kernels = len({e.key for e in kf.entries.values() if not e.is_plan})
    with_plans = f" and {len(plans)} cuDNN plan(s)" if plans else ""
    return (f"{path}: kept, written for this exact model by this convpass and CuPy "
            f"({kernels} kernel(s){with_plans} for sm_{arch})")


def _plans_current(plans: Sequence[kernel_file.KernelEntry]) -> bool:
    """Whether every stored plan was built by this cuDNN and frontend (its header says)."""
    from convpass.native.cudnn import graph_api

    if graph_api.unavailable() is not None:
        return False
    want = graph_api.versions()
    for e in plans:
        head = e.payload.partition(b"\n")[0]
        try:
            header = json.loads(head)
        except ValueError:
            return False
        if not isinstance(header, dict) or any(header.get(k) != v for k, v in want.items()):
            return False
    return True


def parse_archs(text: str | Sequence[str] | None) -> list[str]:
    """``"80,sm_90"`` -> ``["80", "90"]`` (compute capability digits, as CuPy names them)."""
    items = text.split(",") if isinstance(text, str) else list(text or ())
    out = []
    for item in items:
        a = str(item).strip().lower().removeprefix("sm_").removeprefix("sm").replace(".", "")
        if not a:
            continue
        if not a.isdigit() or not 2 <= len(a) <= 3:
            raise ConvpassError(f"--arch: {item!r} is not a GPU architecture (e.g. 80, 90, sm_100)")
        out.append(a)
    return list(dict.fromkeys(out))


def compile_kernels(
    model: str | os.PathLike[str],
    *,
    archs: Sequence[str] = (),
    shapes: Sequence[Mapping[str, Sequence[int]]] = (),
    timeout: float = 900.0,
) -> KernelReport:
    """Write ``<model>.kernels`` for this GPU (and ``archs``); see the module docstring.

    ``shapes``: the input shapes to build plans for (default: the profiles recorded in the tuned
    model, else its static input shapes). Raises :class:`ConvpassError` with the reason when there
    is no usable GPU or the model does not run.
    """
    from convpass.runtime.cuda import unavailable_reason

    path = Path(model)
    if not path.exists():
        raise ConvpassError(f"model file not found: {path}")
    check_readable(path, "model")
    check_output(kernel_file.sidecar_path(path), "kernel side-car")
    reason = unavailable_reason()
    if reason is not None:
        raise ConvpassError(
            f"compiling kernels ahead of time needs a GPU: which kernels a plan needs is only known once it is built "
            f"with cuDNN ({reason}); run `convpass compile {path}` on a GPU machine (it can add other architectures with --arch)"
        )
    request = {"model": str(path), "archs": parse_archs(archs), "shapes": [{k: list(v) for k, v in s.items()} for s in shapes]}
    cmd = [sys.executable, "-m", "convpass.compiler.aot", json.dumps(request)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ConvpassError(f"compiling the kernels of {path} took over {timeout:g} s; nothing was written") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise ConvpassError(f"compiling the kernels of {path} failed (nothing was written):\n{tail}")
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    return KernelReport(Path(doc["path"]), doc["kernels"], doc["archs"], doc["profiles"], doc["failed"], doc["seconds"], doc.get("plans", 0),
                        tuple(doc.get("in_place", ())))


def _profiles(executor: Any, shapes: Sequence[Mapping[str, Sequence[int]]]) -> list[dict[str, tuple[int, ...]]]:
    if shapes:
        return [{k: tuple(v) for k, v in s.items()} for s in shapes]
    info = executor.model_info
    if info is not None and info.profiles:
        return [dict(p.inputs) for p in info.profiles]
    static = {a.name: a.shape for a in executor.get_inputs()}
    if all(s is not None and all(isinstance(d, int) for d in s) for s in static.values()):
        return [{k: tuple(v) for k, v in static.items()}]
    raise ConvpassError("the model records no shape profiles and its inputs are not static: give --shape (e.g. input=1x3x224x224)")


def _feeds(executor: Any, shapes: Mapping[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in executor.get_inputs():
        if arg.name not in shapes:
            raise ConvpassError(f"no shape for input {arg.name!r} (inputs: {', '.join(a.name for a in executor.get_inputs())})")
        shape, dtype = shapes[arg.name], arg.dtype
        feeds[arg.name] = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else rng.integers(0, 2, shape).astype(dtype)
    return feeds


def _record(request: Mapping[str, Any]) -> dict[str, Any]:
    """The child's work: build and run every profile's plan while recording, then write the side-car."""
    import time
    import warnings

    import cupy

    from convpass.native import prebuilt
    from convpass.runtime import Executor

    warnings.filterwarnings("ignore", message=r".*compiled at start-up")  # what this process is for
    started = time.perf_counter()
    path = Path(request["model"])
    digest = kernel_file.file_sha256(path)
    # recording from before the executor exists: loading it may build kernels too (weight layouts)
    with prebuilt.recording() as recorder:
        executor = Executor(path, device="cuda", kernels=False)
        profiles = _profiles(executor, request["shapes"])
        for shapes in profiles:
            feeds = _feeds(executor, shapes)
            executor.prepare(feeds)  # the plan: built (its eager run), compiled, warmed up, captured
            for out in executor.run(None, feeds):  # and replayed, as a deployment's first run
                if out.dtype.kind == "f" and not np.isfinite(out).all():
                    raise ConvpassError(f"the model gives non-finite outputs for {shapes} on random inputs: not written")
        local = prebuilt.device_arch()
        failed = prebuilt.compile_for(recorder, [a for a in request["archs"] if a != local])
    if kernel_file.file_sha256(path) != digest:
        raise ConvpassError(f"{path} changed while its kernels were compiled: not written")
    entries = list(recorder.entries.values())
    out = kernel_file.write(kernel_file.sidecar_path(path), entries, model_sha256=digest, verified=True, cupy_version=cupy.__version__,
                            recorded_arch=local, model_profiles=not request["shapes"])
    in_place = _check_in_place(path, profiles)
    kernels = [e for e in entries if not e.is_plan]
    archs: dict[str, int] = {}
    for e in kernels:
        archs[e.arch] = archs.get(e.arch, 0) + 1
    return {
        "path": str(out),
        "kernels": len({e.key for e in kernels}),
        "plans": len(entries) - len(kernels),
        "archs": archs,
        "profiles": ["x".join(map(str, next(iter(s.values())))) if len(s) == 1 else json.dumps(s) for s in profiles],
        "failed": failed,
        "seconds": round(time.perf_counter() - started, 2),
        "in_place": in_place,
    }


def _check_in_place(path: Path, profiles: Sequence[Mapping[str, Sequence[int]]]) -> list[dict[str, Any]]:
    """Every tuned conv timed inside the plan it runs in (:mod:`convpass.runtime.in_place`), per
    profile, with the kernels just written: the launches the captured graph replays."""
    import cupy

    from convpass.runtime import Executor
    from convpass.runtime.in_place import check_in_place

    executor = Executor(path, device="cuda", cuda_graph=False)
    out = []
    for i, shapes in enumerate(profiles):
        feeds = {k: cupy.asarray(v) for k, v in _feeds(executor, shapes).items()}  # on the GPU: no copy inside a timed run
        out.append(check_in_place(executor, feeds, i).to_json())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="(internal) the fresh process of `convpass compile`")
    ap.add_argument("request", help="JSON: model, archs, shapes")
    args = ap.parse_args(argv)
    try:
        doc = _record(json.loads(args.request))
    except ConvpassError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
