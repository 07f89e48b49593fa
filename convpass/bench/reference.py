"""The reference every output of ``convpass bench`` is checked against: ONNX Runtime's CPU EP on
the original model and the same input, its result-changing rewrites off
(:mod:`convpass.core.ort_reference`); the convpass CPU executor, said so, when onnxruntime is
not installed or fails.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from convpass.bench.peers import first_line
from convpass.core.ort_reference import cpu_session


def reference_outputs(path: str | os.PathLike, feeds: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray] | None, str | None, str | None]:
    """(outputs, label, note): ONNX Runtime CPU on the original model, else the convpass CPU executor."""
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if ort is not None:
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            sess = cpu_session(ort, os.fspath(path), so)
            outs = sess.run(None, dict(feeds))
            return [np.asarray(o) for o in outs], f"onnxruntime {ort.__version__} CPU", None
        except Exception as e:  # noqa: BLE001
            note = f"onnxruntime CPU reference failed ({first_line(e)}); "
    else:
        note = "onnxruntime is not installed; "
    try:
        from convpass.runtime.executor import Executor

        ex = Executor(os.fspath(path), device="cpu")
        outs = ex.run(None, dict(feeds))
        return [np.asarray(o) for o in outs], "convpass CPU executor (NumPy)", note + "reference is the convpass CPU executor"
    except Exception as e:  # noqa: BLE001
        return None, None, note + f"the convpass CPU executor failed too ({first_line(e)}): outputs are unchecked"
