"""The kernel side-car: the GPU kernels a tuned model's plan needs, compiled ahead of time.

``model.onnx`` travels with ``model.onnx.kernels`` (:func:`sidecar_path`), a zip file:

* ``manifest.json``: ``{"format": "convpass.kernels/1", "convpass": version, "cupy": version,
  "model_sha256": the SHA-256 of the model file's bytes, "verified": true when the writer ran the
  model on the GPU before writing, "kernels": [{"key", "arch", "name", "file", "sha256", "size"},
  ...]}``
* ``bin/<key>.sm<arch>``: one binary (cubin) per kernel and GPU architecture, exactly as CuPy's
  compiler produced it; or a built cuDNN graph-API plan, serialized
  (:meth:`convpass.native.cudnn.graph_api.EnginePlan.serialize`), named ``cudnn plan <configuration>``
  (:data:`PLAN_PREFIX`) and keyed by :func:`convpass.native.cudnn.graph_api.plan_id`, for the
  architecture it was built on only.

``key`` is the hash of everything a binary depends on (source, compiler options, CuPy version),
computed by the loader (:mod:`convpass.native.prebuilt`): a binary is only ever used for the
exact source it was compiled from, so a stale entry cannot give a wrong result, only a start-up
compilation. ``model_sha256`` ties the file to one model: the executor refuses the side-car of
another model (or of a model changed since), and trusts a model whose hash matches a verified
side-car without re-running ``onnx.checker`` on it.

This module is the format only (no CUDA): writing is atomic, reading checks everything and raises
:class:`KernelFileError` with the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from convpass.core.errors import ConvpassError

__all__ = ["FORMAT", "PLAN_PREFIX", "SUFFIX", "KernelEntry", "KernelFile", "KernelFileError", "describe", "file_sha256", "read", "sidecar_path", "write"]

FORMAT = "convpass.kernels/1"
PLAN_PREFIX = "cudnn plan "  # the name of an entry that is a built cuDNN graph-API plan, not a kernel
SUFFIX = ".kernels"
_MANIFEST = "manifest.json"


class KernelFileError(ConvpassError):
    """A kernel side-car that cannot be used: unreadable, of another format, corrupt, or of another model."""


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """One compiled kernel: ``key`` (the loader's hash of its source and options), the GPU
    architecture ``arch`` (compute capability digits, e.g. ``"90"``), a readable ``name`` and the
    binary ``payload``."""

    key: str
    arch: str
    name: str
    payload: bytes

    @property
    def file(self) -> str:
        return f"bin/{self.key}.sm{self.arch}"

    @property
    def is_plan(self) -> bool:
        """Whether this entry is a built cuDNN plan rather than a kernel binary."""
        return self.name.startswith(PLAN_PREFIX)


@dataclasses.dataclass(frozen=True)
class KernelFile:
    """A read side-car: its manifest fields and its entries by (key, arch)."""

    path: Path
    model_sha256: str
    verified: bool
    convpass_version: str
    cupy_version: str
    entries: Mapping[tuple[str, str], KernelEntry]
    # the GPU architecture the plans were built and run on ("" when not recorded), and whether
    # they were built for the model's own shape profiles (False: shapes given to `convpass compile`)
    recorded_arch: str = ""
    model_profiles: bool = False

    @property
    def archs(self) -> list[str]:
        return sorted({arch for _, arch in self.entries}, key=int)


def sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    """Where the kernels of the model at ``model_path`` live: ``<model path>.kernels``."""
    return Path(os.fspath(model_path) + SUFFIX)


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write(
    path: str | os.PathLike[str],
    entries: Iterable[KernelEntry],
    *,
    model_sha256: str,
    verified: bool,
    cupy_version: str,
    recorded_arch: str = "",
    model_profiles: bool = False,
) -> Path:
    """Write a side-car atomically (a temporary file in the same folder, then a rename).
    ``recorded_arch``, ``model_profiles``: see :class:`KernelFile`."""
    from convpass.core.version import __version__

    out = Path(path)
    entries = sorted({(e.key, e.arch): e for e in entries}.values(), key=lambda e: (e.name, e.key, e.arch))
    manifest = {
        "format": FORMAT,
        "convpass": __version__,
        "cupy": cupy_version,
        "model_sha256": model_sha256,
        "verified": bool(verified),
        "recorded_arch": str(recorded_arch),
        "model_profiles": bool(model_profiles),
        "kernels": [
            {"key": e.key, "arch": e.arch, "name": e.name, "file": e.file, "sha256": hashlib.sha256(e.payload).hexdigest(), "size": len(e.payload)}
            for e in entries
        ],
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent if str(out.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(_MANIFEST, json.dumps(manifest, indent=1))
            for e in entries:
                z.writestr(e.file, e.payload)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def read(path: str | os.PathLike[str], *, model_sha256: str | None = None) -> KernelFile:
    """Read and check a side-car; ``model_sha256``: refuse it unless it was written for that model."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise KernelFileError(f"cannot read the kernel side-car {p}: {e.strerror or e}") from None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            manifest = _manifest(z, p)
            entries = {}
            for item in manifest["kernels"]:
                e = _entry(z, p, item)
                entries[(e.key, e.arch)] = e
    except zipfile.BadZipFile as e:
        raise KernelFileError(f"{p} is not a convpass kernel side-car (not a zip file: {e}); delete it or run `convpass compile` again") from None
    if model_sha256 is not None and manifest["model_sha256"] != model_sha256:
        raise KernelFileError(
            f"{p} was written for another model (SHA-256 {manifest['model_sha256'][:12]}..., this model "
            f"{model_sha256[:12]}...): the model changed after its kernels were compiled; run `convpass compile` on it again"
        )
    return KernelFile(
        path=p,
        model_sha256=manifest["model_sha256"],
        verified=bool(manifest.get("verified")),
        convpass_version=str(manifest.get("convpass", "")),
        cupy_version=str(manifest.get("cupy", "")),
        entries=entries,
        recorded_arch=str(manifest.get("recorded_arch", "")),
        model_profiles=manifest.get("model_profiles") is True,
    )


def describe(model_path: str | os.PathLike[str]) -> str:
    """One line on the side-car of the model at ``model_path``, as the executor would take it."""
    path = sidecar_path(model_path)
    if not path.exists():
        return f"kernels: no {path.name} beside the model (`convpass compile {os.fspath(model_path)}` writes one on a GPU)"
    try:
        kf = read(path, model_sha256=file_sha256(model_path))
    except KernelFileError as e:
        return f"kernels: refused, {e}"
    kernels = [e for e in kf.entries.values() if not e.is_plan]
    per_arch = ", ".join(f"sm_{a}: {n}" for a in kf.archs if (n := sum(1 for e in kernels if e.arch == a))) or "none"
    plans = len(kf.entries) - len(kernels)
    with_plans = f" and {plans} built cuDNN plan(s)" if plans else ""
    trust = "verified on the GPU before writing" if kf.verified else "not verified"
    return (f"kernels: {path.name}, {len({e.key for e in kernels})} kernel(s) ({per_arch}){with_plans}, {trust}; "
            f"convpass {kf.convpass_version}, CuPy {kf.cupy_version}")


def _manifest(z: zipfile.ZipFile, p: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(z.read(_MANIFEST))
    except KeyError:
        raise KernelFileError(f"{p} has no {_MANIFEST}: not a convpass kernel side-car") from None
    except (ValueError, zipfile.BadZipFile, OSError) as e:
        raise KernelFileError(f"{p}: {_MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise KernelFileError(f"{p} has format {found!r}; this convpass reads {FORMAT!r}")
    if not isinstance(manifest.get("model_sha256"), str) or not isinstance(manifest.get("kernels"), list):
        raise KernelFileError(f"{p}: the manifest lacks model_sha256 or kernels")
    return manifest


def _entry(z: zipfile.ZipFile, p: Path, item: Any) -> KernelEntry:
    try:
        key, arch, name, file, digest = (str(item[k]) for k in ("key", "arch", "name", "file", "sha256"))
    except (KeyError, TypeError):
        raise KernelFileError(f"{p}: a manifest entry lacks key / arch / name / file / sha256: {item!r}") from None
    try:
        payload = z.read(file)
    except KeyError:
        raise KernelFileError(f"{p}: the binary {file} of kernel {name} is missing") from None
    except (zipfile.BadZipFile, OSError, ValueError) as e:  # a truncated or corrupt member
        raise KernelFileError(f"{p}: the binary {file} of kernel {name} is unreadable ({e})") from None
    if hashlib.sha256(payload).hexdigest() != digest:
        raise KernelFileError(f"{p}: the binary {file} of kernel {name} does not match its SHA-256 (corrupt or altered)")
    e = KernelEntry(key, arch, name, payload)
    if e.file != file:
        raise KernelFileError(f"{p}: entry {file} is not named after its key and arch")
    return e
