"""The files convpass reads and writes: refused when special, read within bounds, never overwritten
by mistake.

Reading (:func:`check_readable`, :func:`open_readable`, :func:`read_bytes`, :func:`read_text`):

1. Only regular files are read. A FIFO, a device (``/dev/zero``), a socket or a folder is refused
   before anything could block on it or read it without end: the check is made on the open file
   (opened non-blocking, so a FIFO with no writer does not hang the open), not on the path alone.
2. Every read has a size limit; a larger file is refused with its size and the limit.

Writing (:func:`check_output`, :func:`write_bytes_atomically`, :func:`write_text_atomically`):

3. An output path must be a file path: not empty, not a folder, in a folder that exists.
4. An existing output must be a regular file: a device node, a FIFO or a socket is never
   replaced (a rename onto ``/dev/null`` as root would replace the device node).
5. An output must not be one of the files the same command reads (the input model, its external
   data, the tuning cache): writing it would destroy the input the output is made from.

6. An output is written to a temporary file beside it, then renamed into place: a reader, or an
   interrupted run, never sees half a file, and a failure leaves whatever was there before and no
   temporary file.

OS errors while writing are turned into one line with :func:`os_error`.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from convpass.core.errors import FileError

__all__ = ["MODEL_LIMIT", "check_output", "check_readable", "kind_of", "open_readable", "os_error", "read_bytes", "read_text",
           "same_file", "write_bytes_atomically", "write_text_atomically"]

MODEL_LIMIT = 2**31 - 1  # protobuf's limit on one serialized message: no ONNX file can be larger


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def os_error(path: str | os.PathLike[str], e: OSError, doing: str = "write") -> FileError:
    """One line for an OS error on ``path``: ``cannot write out.onnx: No space left on device``."""
    reason = e.strerror or str(e) or type(e).__name__
    if e.errno == errno.ENOSPC:
        reason += " (the disk is full; nothing was written)"
    return FileError(f"cannot {doing} {path if isinstance(path, str) else os.fspath(path) if isinstance(path, os.PathLike) else ''}: {reason}")


def check_readable(path: str | os.PathLike[str], what: str = "file", limit: int | None = None) -> os.stat_result:
    """The ``stat`` of a regular file ``path`` that may be read (rules 1, 2 on the path; for readers
    that open the file themselves, such as SQLite or the ONNX checker); :class:`FileError` otherwise."""
    label = os.fspath(path)
    try:
        st = os.stat(label)
    except FileNotFoundError:
        raise FileError(f"{what} {label}: no such file") from None
    except OSError as e:
        raise os_error(label, e, "read") from None
    _check_stat(st, label, what, limit)
    return st


def _check_stat(st: os.stat_result, label: str, what: str, limit: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FileError(f"{what} {label} is {kind_of(st.st_mode)}, not a regular file: refused")
    if limit is not None and st.st_size > limit:
        raise FileError(f"{what} {label} is {_size(st.st_size)}, more than the {_size(limit)} convpass reads: refused")


def open_readable(path: str | os.PathLike[str], what: str = "file", limit: int = MODEL_LIMIT) -> tuple[BinaryIO, os.stat_result]:
    """The regular file ``path`` opened for binary reading, and its ``stat`` (rules 1, 2, checked on
    the open file): for readers that stream it (an archive). The caller closes it."""
    label = os.fspath(path)
    try:
        fd = os.open(label, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileError(f"{what} {label}: no such file") from None
    except IsADirectoryError:
        raise FileError(f"{what} {label} is a folder, not a regular file: refused") from None
    except OSError as e:
        raise os_error(label, e, "read") from None
    try:
        st = os.fstat(fd)
        _check_stat(st, label, what, limit)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), st


def read_bytes(path: str | os.PathLike[str], what: str = "file", limit: int = MODEL_LIMIT) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (rules 1, 2)."""
    label = os.fspath(path)
    f, st = open_readable(path, what, limit)
    with f:
        try:
            data = f.read(min(st.st_size, limit) + 1)  # a file that grew since the check is still cut at the limit
        except OSError as e:
            raise os_error(label, e, "read") from None
    if len(data) > st.st_size:
        raise FileError(f"{what} {label} grew while it was read: refused")
    return data


def read_text(path: str | os.PathLike[str], what: str = "file", limit: int = 1 << 30) -> str:
    """The UTF-8 text of the regular file ``path`` (:func:`read_bytes`)."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(f"{what} {os.fspath(path)} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file: the same inode when both exist, else the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        pass
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):  # a link loop: no file to be the same as
        return os.path.abspath(a) == os.path.abspath(b)


def check_output(
    path: str | os.PathLike[str] | None,
    what: str = "output",
    protect: Iterable[tuple[str | os.PathLike[str], str]] = (),
) -> Path:
    """``path`` as an output that may be written (rules 3 to 5), or :class:`FileError`.

    ``protect``: ``(path, what it is)`` of every file the command reads, which it must not write.
    """
    label = "" if path is None else os.fspath(path)
    if not label.strip():
        raise FileError(f"{what}: an empty path; give a file name")
    out = Path(label).expanduser()
    try:
        st = os.stat(out)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise os_error(out, e, "write") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise FileError(f"{what} {label} is {kind_of(st.st_mode)}, not a regular file: refusing to replace it")
    folder = out.parent
    if not folder.is_dir():
        raise FileError(f"{what} {label}: the output directory {folder} does not exist")
    for other, name in protect:
        if other is not None and os.fspath(other) and same_file(out, other):
            raise FileError(f"{what} {label} is {name}: refusing to overwrite it; choose another output path")
    return out


def write_bytes_atomically(
    path: str | os.PathLike[str],
    data: bytes,
    what: str = "output",
    protect: Iterable[tuple[str | os.PathLike[str], str]] = (),
) -> Path:
    """``data`` written to ``path`` (rules 3 to 6; ``what`` and ``protect`` as for
    :func:`check_output`); :class:`FileError` on a refusal or an OS error."""
    out = check_output(path, what, protect)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp"
    try:  # (created as open() creates files, the umask applied: the output's mode is any new file's)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        raise os_error(out, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, out)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise os_error(out, e) from None
        raise
    return out


def write_text_atomically(
    path: str | os.PathLike[str],
    text: str,
    what: str = "output",
    protect: Iterable[tuple[str | os.PathLike[str], str]] = (),
) -> Path:
    """``text`` written to ``path`` as UTF-8 (:func:`write_bytes_atomically`)."""
    return write_bytes_atomically(path, text.encode("utf-8"), what, protect)
