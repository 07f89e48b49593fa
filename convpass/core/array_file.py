"""NumPy ``.npy`` and ``.npz`` files read within bounds: the arrays a file holds, and never more.

``np.load`` trusts the file: it opens a FIFO and waits, allocates whatever shape a header
declares, and inflates a compressed member however large it grows. :func:`read_arrays` reads the
same format by these rules, each refusal a :class:`~convpass.core.errors.FileError` naming the file:

1. The file is opened as convpass opens every file it reads (:func:`convpass.core.files.open_readable`):
   a regular file only (no FIFO, device or folder) of at most ``limit`` bytes.
2. An ``.npz`` is a zip archive of ``.npy`` members. The sizes its directory declares count against
   ``limit`` together before anything is inflated, and no member is read past its declared size:
   a small archive that would inflate without end is refused, not inflated.
3. An array's header must declare exactly the bytes its file or member holds: a header claiming
   10^12 elements over a few bytes is refused before anything is allocated.
4. Object arrays are refused (their data is a pickle, which runs code when loaded); so are
   members that are not ``.npy`` arrays.
5. A damaged file (truncated, a bad checksum, a compression zip cannot read) is refused in one line.

A ``.npy`` file gives one array under the name ``""``; an ``.npz`` gives each member's array under
its name less ``.npy`` (the names ``np.savez`` wrote).
"""

from __future__ import annotations

import lzma
import math
import os
import zipfile
import zlib
from typing import IO

import numpy as np

from convpass.core.errors import FileError
from convpass.core.files import open_readable

__all__ = ["ARRAY_LIMIT", "read_arrays"]

ARRAY_LIMIT = 1 << 30  # bytes of one file, and of the arrays it holds once inflated
_MAX_MEMBERS = 4096
# what a damaged archive raises from zipfile, zlib, lzma, bz2 and NumPy's header parser
_DAMAGED = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, EOFError, ValueError, OSError,
            zlib.error, lzma.LZMAError, KeyError)


def read_arrays(path: str | os.PathLike[str], what: str = "array file", limit: int = ARRAY_LIMIT) -> dict[str, np.ndarray]:
    """The arrays of the ``.npy`` or ``.npz`` file ``path`` by name (module docstring); ``what``
    says what the file is for, in messages (``--calibration``)."""
    label = os.fspath(path)
    f, st = open_readable(path, what, limit)
    with f:
        try:
            head = f.read(6)
            f.seek(0)
            if head.startswith(b"PK"):
                return _archive(f, label, what, limit)
            if head == np.lib.format.MAGIC_PREFIX:
                return {"": _array(f, st.st_size, label, what)}
        except FileError:
            raise
        except _DAMAGED as e:
            raise FileError(f"{what} {label} is a damaged NumPy file ({_reason(e)}): refused") from None
    raise FileError(f"{what} {label} is not a NumPy .npy or .npz file: refused")


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _archive(f: IO[bytes], label: str, what: str, limit: int) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(f) as z:
        members = z.infolist()
        if len(members) > _MAX_MEMBERS:
            raise FileError(f"{what} {label} holds {len(members)} members, more than the {_MAX_MEMBERS} convpass reads: refused")
        total = sum(m.file_size for m in members)
        if total > limit:
            raise FileError(f"{what} {label} inflates to {total} bytes, more than the {limit} convpass reads: refused")
        arrays = {}
        for m in members:
            name = m.filename.removesuffix(".npy")
            if m.is_dir() or not m.filename.endswith(".npy") or not name:
                raise FileError(f"{what} {label}: member {m.filename!r} is not a .npy array: refused")
            with z.open(m) as member:
                arrays[name] = _array(member, m.file_size, label, what, name)
        return arrays


def _array(f: IO[bytes], size: int, label: str, what: str, name: str = "") -> np.ndarray:
    """The array of one ``.npy`` stream of ``size`` bytes (rules 3, 4)."""
    where = f"{what} {label}" + (f", array {name!r}" if name else "")
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise FileError(f"{where}: .npy format version {version[0]}.{version[1]} is not read: refused")
    if dtype.hasobject:
        raise FileError(f"{where} holds Python objects (a pickle, which would run code when loaded): refused")
    if any(d < 0 for d in shape):
        raise FileError(f"{where} declares shape {tuple(shape)}, which has a negative dim: refused")
    header = f.tell()  # the data follows the header
    need = math.prod(shape) * dtype.itemsize
    if need != size - header:
        raise FileError(f"{where} declares shape {tuple(shape)} of {dtype} ({need} bytes) but holds {max(size - header, 0)} bytes: refused")
    data = bytearray(need)
    view, got = memoryview(data), 0
    while got < need:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]  # (every stream read here has it)
        if not n:
            raise FileError(f"{where}: the file ends {need - got} bytes early: refused")
        got += n
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")

