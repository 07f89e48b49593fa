"""What a cuda backend builds at start-up, and what it says about it.

A model's kernel side-car (:mod:`convpass.core.kernel_file`) holds the binaries its plans need,
compiled ahead of time; :func:`use_kernel_file` hands it to :mod:`convpass.native.prebuilt`, which
loads them in place of start-up compilation. What is compiled anyway (kernels the side-car lacks,
cuDNN graph-API plans whose engines cuDNN compiles when the plan is built) is said once, with why
and how to avoid it, as a :class:`~convpass.native.cuda.StartupCompileWarning`.

The functions take the backend (:class:`convpass.runtime.cuda.backend.CudaBackend`: its
``note_once``, ``kernel_file`` and ``_kernels_why``).
"""

from __future__ import annotations

from typing import Any

from convpass.kernels.convolution import ENGINE_BUILD_NOTE_S
from convpass.native import prebuilt
from convpass.native.cuda import StartupCompileWarning


def use_kernel_file(backend: Any, kernels: Any, why_none: str) -> None:
    """The model's kernel side-car: its binaries replace start-up compilation (:mod:`convpass.native.prebuilt`).
    A refused side-car, or one that cannot be loaded here (no compiler seam in this CuPy), is warned
    about now; kernels built anyway are warned about at the first run."""
    reason = prebuilt.install()
    if reason is not None:
        why_none = f"kernels cannot be loaded prebuilt here: {reason}"
    elif kernels is not None:
        prebuilt.use(kernels)
    backend.kernel_file = kernels if reason is None else None
    backend._kernels_why = why_none
    if kernels is None and why_none.startswith("the side-car was refused"):
        backend.note_once("kernels", f"kernel side-car: {why_none.removeprefix('the side-car was refused: ')}; kernels compile at start-up")
    elif kernels is not None and reason is not None:
        # without the seam nothing is counted as compiled, so the note at the first run never comes: said now
        backend.note_once("kernels", f"kernel side-car {kernels.path.name} is not used: {why_none}; kernels compile and "
                                     "cuDNN plans are built at start-up", category=StartupCompileWarning)


def note_startup_compilations(backend: Any, built: list[str]) -> None:
    """Kernels compiled at start-up (names, as :data:`convpass.native.prebuilt.COMPILATIONS` lists them), and why."""
    names = sorted(set(built))
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    kf = backend.kernel_file
    if kf is None:
        why = backend._kernels_why
    else:
        arch = prebuilt.device_arch()
        if arch not in kf.archs:
            why = f"{kf.path.name} holds binaries for sm_{', sm_'.join(kf.archs) or '-'} and this GPU is sm_{arch} (`convpass compile --arch {arch}` adds it)"
        else:
            why = (f"{kf.path.name} lacks them (written by convpass {kf.convpass_version}, CuPy {kf.cupy_version}; "
                   f"this is CuPy {backend.cp.__version__}): run `convpass compile` on the model again")
    backend.note_once("startup-compile", f"{len(built)} kernel(s) compiled at start-up ({listed}): {why}", category=StartupCompileWarning)


def note_engine_builds(backend: Any, builds: list[tuple[str, float, str]]) -> None:
    """cuDNN graph-API plans built at start-up (node, seconds, why), said once they take time."""
    seconds = sum(s for _, s, _ in builds)
    if seconds >= ENGINE_BUILD_NOTE_S:
        slow = sorted(builds, key=lambda b: -b[1])[:3]
        listed = ", ".join(f"{node!r} {s:.2f} s" for node, s, _ in slow)
        whys = sorted({why for _, _, why in builds})
        why = whys[0] if len(whys) == 1 else "; ".join(whys[:3])
        hint = "" if backend.kernel_file is not None else " (`convpass compile` on a GPU stores them)"
        backend.note_once("engine-build", f"{len(builds)} cuDNN graph-API plan(s) built at start-up in {seconds:.2f} s "
                          f"(slowest: {listed}): cuDNN compiles some engines when their plan is built, and {why}{hint}",
                          category=StartupCompileWarning)
