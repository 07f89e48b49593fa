"""The floor of a fresh process's start on this machine: what Python, numpy, CuPy, a CUDA context
and cuDNN cost before any model is read (issue 10: convpass's fresh start against ONNX Runtime's).

Each step is a fresh ``python -c`` process, timed from just before it is started to its exit
(which includes tearing a CUDA context down), ``--runs`` times (round-robin) after one unmeasured
run of each (bytecode written, files read once), with new empty CuPy and CUDA kernel-cache folders;
the medians and every run are printed. A step whose process fails (no GPU, no CuPy, no cuDNN) is
reported with its last line of error, never with a time. The cuDNN step loads ``libcudnn`` alone;
convpass also preloads its sub-libraries (``convpass.native.cudnn.library``), which this leaves out.

    python benchmarks/fresh_floor.py [--runs 3] [--cudnn PATH/libcudnn.so.9] [--json FILE]

``--cudnn`` defaults to the library convpass itself would load (``convpass.native.cudnn.library.path()``
in a helper process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

_CONTEXT = "import cupy; cupy.cuda.Device(0).use(); cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))"
_CUDNN = "import ctypes; lib = ctypes.CDLL({path!r}); h = ctypes.c_void_p(); assert lib.cudnnCreate(ctypes.byref(h)) == 0"


def steps(cudnn_path: str | None) -> list[tuple[str, str]]:
    """(what the process does, its ``-c`` code), cheapest first."""
    out = [
        ("start Python", "pass"),
        ("import numpy", "import numpy"),
        ("import numpy, convpass.runtime", "import numpy, convpass.runtime"),
        ("import numpy and CuPy, make a CUDA context", f"import numpy; {_CONTEXT}"),
    ]
    if cudnn_path:
        out += [
            ("load cuDNN and make its handle (ctypes; makes the context)", _CUDNN.format(path=cudnn_path)),
            ("all of the above but convpass", f"import numpy; {_CONTEXT}; {_CUDNN.format(path=cudnn_path)}"),
        ]
    return out


def cudnn_library() -> str | None:
    """The libcudnn path convpass would load here, or None (asked in a helper process, so that this
    one stays light)."""
    try:
        done = subprocess.run([sys.executable, "-c", "from convpass.native.cudnn import library; print(library.path())"],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else None


def time_step(code: str, timeout: float = 120.0) -> dict[str, Any]:
    """One fresh process running ``code``: ``{"status": "ok", "seconds": s}`` or ``{"status":
    "failed", "reason": ...}``."""
    caches = tempfile.mkdtemp(prefix="fresh-floor-")
    env = {**os.environ, "CUPY_CACHE_DIR": os.path.join(caches, "cupy"), "CUDA_CACHE_PATH": os.path.join(caches, "cuda")}
    try:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
        seconds = time.perf_counter() - started
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout:g} s"}
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"status": "failed", "reason": last}
    return {"status": "ok", "seconds": seconds}


def measure(runs: int, cudnn_path: str | None, log=print) -> list[dict[str, Any]]:
    """Every step ``runs`` times, round-robin; one record per step: ``what``, ``runs`` (seconds of
    each run that succeeded), ``median`` (None when none did) and ``failed`` (reasons)."""
    table = [{"what": what, "code": code, "runs": [], "failed": []} for what, code in steps(cudnn_path)]
    for row in table:  # unmeasured: bytecode written, the files read once
        time_step(row["code"])
    for i in range(runs):
        for row in table:
            rec = time_step(row["code"])
            if rec["status"] == "ok":
                row["runs"].append(rec["seconds"])
            else:
                row["failed"].append(rec["reason"])
            log(f"run {i + 1}/{runs} {row['what']}: " + (f"{rec['seconds']:.3f} s" if rec["status"] == "ok" else f"failed: {rec['reason']}"))
    for row in table:
        row["median"] = statistics.median(row["runs"]) if row["runs"] else None
    return table


def lines(table: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for row in table:
        if row["median"] is None:
            out.append(f"{row['what']:60s} failed: {row['failed'][0] if row['failed'] else 'not run'}")
        else:
            runs = ", ".join(f"{s:.3f}" for s in row["runs"])
            out.append(f"{row['what']:60s} median {row['median']:.3f} s  runs [{runs}]" + (f"  {len(row['failed'])} failed" if row["failed"] else ""))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fresh_floor.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="processes per step (default 3)")
    p.add_argument("--cudnn", metavar="PATH", help="the libcudnn to load (default: the one convpass loads)")
    p.add_argument("--json", metavar="FILE", help="write the table here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    path = args.cudnn or cudnn_library()
    if path is None:
        print("fresh_floor.py: no cuDNN found for convpass here: the cuDNN steps are left out", file=sys.stderr)
    table = measure(args.runs, path, log=lambda s: print(s, file=sys.stderr, flush=True))
    print("\n".join(lines(table)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
