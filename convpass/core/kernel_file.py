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
another model (or of a model changed since). ``verified`` is the writer's word only: the executor
still checks the model itself.

This module is the format only (no CUDA): writing is atomic, reading is bounded (:func:`read`),
checks everything and raises :class:`KernelFileError` with the reason.
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

from convpass.core.errors import ConvpassError, FileError
from convpass.core.files import check_output, os_error, read_bytes

__all__ = ["FORMAT", "PLAN_PREFIX", "SUFFIX", "KernelEntry", "KernelFile", "KernelFileError", "describe", "file_sha256", "read", "sidecar_path", "write"]

FORMAT = "convpass.kernels/1"
PLAN_PREFIX = "cudnn plan "  # the name of an entry that is a built cuDNN graph-API plan, not a kernel
SUFFIX = ".kernels"
_MANIFEST = "manifest.json"
FILE_LIMIT = 1 << 30  # the largest side-car convpass reads
MANIFEST_LIMIT = 16 << 20
MAX_ENTRIES = 100_000
MEMBER_LIMIT = 256 << 20  # one kernel binary or built plan
TOTAL_LIMIT = 1 << 30  # every binary of a side-car, unpacked


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

    out = check_output(path, "kernel side-car")
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
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    except OSError as e:
        raise os_error(out, e) from None
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(_MANIFEST, json.dumps(manifest, indent=1))
            for entry in entries:
                z.writestr(entry.file, entry.payload)
        os.replace(tmp, out)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise os_error(out, e) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def read(path: str | os.PathLike[str], *, model_sha256: str | None = None) -> KernelFile:
    """Read and check a side-car; ``model_sha256``: refuse it unless it was written for that model.

    Bounded: the file is a regular file of at most :data:`FILE_LIMIT` bytes, its manifest at most
    :data:`MANIFEST_LIMIT` with at most :data:`MAX_ENTRIES` entries, and each member is read in
    blocks, counted and hashed as it is decompressed: one larger than the manifest says (or than
    :data:`MEMBER_LIMIT`; all together :data:`TOTAL_LIMIT`) is refused at the first block past it,
    never unpacked whole."""
    p = Path(path)
    try:
        data = read_bytes(p, "kernel side-car", FILE_LIMIT)
    except FileError as e:
        raise KernelFileError(str(e)) from None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            manifest = _manifest(z, p)
            if len(manifest["kernels"]) > MAX_ENTRIES:
                raise KernelFileError(f"{p}: the manifest lists {len(manifest['kernels'])} kernels, more than the {MAX_ENTRIES} convpass reads")
            entries = {}
            budget = [TOTAL_LIMIT]
            for item in manifest["kernels"]:
                entry = _entry(z, p, item, budget)
                entries[(entry.key, entry.arch)] = entry
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
        verified=manifest.get("verified") is True,
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


def _member(z: zipfile.ZipFile, p: Path, name: str, limit: int, what: str) -> tuple[bytes, str]:
    """Member ``name``'s bytes and SHA-256, read in blocks; more than ``limit`` bytes is refused at
    the first block past it (the size the zip declares is not trusted either)."""
    h = hashlib.sha256()
    blocks: list[bytes] = []
    n = 0
    with z.open(name) as f:
        while block := f.read(min(1 << 20, limit + 1 - n)):
            n += len(block)
            if n > limit:
                raise KernelFileError(f"{p}: {what} {name} holds more than {limit} bytes: refused (a corrupt or hostile side-car)")
            h.update(block)
            blocks.append(block)
    return b"".join(blocks), h.hexdigest()


def _manifest(z: zipfile.ZipFile, p: Path) -> dict[str, Any]:
    try:
        text, _ = _member(z, p, _MANIFEST, MANIFEST_LIMIT, "the manifest")
        manifest = json.loads(text)
    except KeyError:
        raise KernelFileError(f"{p} has no {_MANIFEST}: not a convpass kernel side-car") from None
    except (ValueError, RecursionError, zipfile.BadZipFile, OSError, EOFError) as e:
        raise KernelFileError(f"{p}: {_MANIFEST} is unreadable ({type(e).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise KernelFileError(f"{p} has format {str(found)[:40]!r}; this convpass reads {FORMAT!r}")
    if not isinstance(manifest.get("model_sha256"), str) or not isinstance(manifest.get("kernels"), list):
        raise KernelFileError(f"{p}: the manifest lacks model_sha256 or kernels")
    return manifest


def _entry(z: zipfile.ZipFile, p: Path, item: Any, budget: list[int]) -> KernelEntry:
    """One manifest entry's kernel; ``budget``: the bytes all entries may still take (decremented)."""
    try:
        key, arch, name, file, digest = (str(item[k]) for k in ("key", "arch", "name", "file", "sha256"))
        size = item["size"]
    except (KeyError, TypeError):
        raise KernelFileError(f"{p}: a manifest entry lacks key / arch / name / file / sha256 / size: {str(item)[:200]!r}") from None
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= min(MEMBER_LIMIT, budget[0]):
        raise KernelFileError(f"{p}: kernel {name[:80]!r} declares {str(size)[:40]} bytes, more than convpass reads (or not a size)")
    try:
        payload, got = _member(z, p, file, size, f"the binary of kernel {name[:80]!r},")
    except KeyError:
        raise KernelFileError(f"{p}: the binary {file} of kernel {name} is missing") from None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:  # a truncated or corrupt member
        raise KernelFileError(f"{p}: the binary {file} of kernel {name} is unreadable ({e})") from None
    budget[0] -= len(payload)
    if len(payload) != size or got != digest:
        raise KernelFileError(f"{p}: the binary {file} of kernel {name} does not match its SHA-256 (corrupt or altered)")
    found = KernelEntry(key, arch, name, payload)
    if found.file != file:
        raise KernelFileError(f"{p}: entry {file} is not named after its key and arch")
    return found
