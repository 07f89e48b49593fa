"""How each peer runtime is set up, in one place for the two ways ``convpass bench`` runs it: in the
bench's own process (:mod:`convpass.bench.contenders`) and in a fresh process of its own
(:mod:`convpass.bench.fresh`).

* ONNX Runtime's CUDA EP: ``cudnn_conv_algo_search`` EXHAUSTIVE / HEURISTIC x ``prefer_nhwc`` 0 / 1,
  ``use_tf32`` as convpass was asked, IOBinding (:func:`ort_configs`, :func:`ort_provider_options`);
  the same four with ``enable_cuda_graph`` 1 (``graph=True``: family ``ort-graph``).
* PyTorch eager: ``cudnn.benchmark``, ``inference_mode``, channels_last off / on, TF32 for convs and
  matmuls as convpass was asked (:func:`torch_configs`, :func:`torch_flags`,
  :func:`torch_memory_format`), the module built by ``models/export_panel.py``
  (:func:`panel_entry`, :func:`load_export_panel`).
* torch.compile: one configuration per mode (:data:`COMPILE_MODES`; :func:`compile_configs`),
  ``dynamic=False``, the same flags as eager, in eager's faster memory format.

Standard library only: a fresh child imports this before it imports its runtime, and its measured
import time must be the runtime's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ORT_CONFIGS: tuple[tuple[str, int], ...] = (("EXHAUSTIVE", 0), ("EXHAUSTIVE", 1), ("HEURISTIC", 0), ("HEURISTIC", 1))
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
DEFAULT_COMPILE_MODES = ("default", "reduce-overhead")
CUDA_EP_DID_NOT_LOAD = "the CUDA EP did not load (the session fell back to CPU; check CUDA / cuDNN libraries)"


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``: how a failure is reported."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---------------------------------------------------------------------------------------------
# ONNX Runtime


def ort_name(search: str, nhwc: int, graph: bool = False) -> str:
    return f"{'ort-graph' if graph else 'ort'} {search} {'nhwc' if nhwc else 'nchw'}"


def ort_configs(use_tf32: bool, graph: bool = False) -> list[dict[str, Any]]:
    """The four CUDA EP configurations, in the bench's order; ``graph``: with CUDA graphs."""
    return [
        {"cudnn_conv_algo_search": s, "prefer_nhwc": n, "use_tf32": int(use_tf32), "io_binding": True, "enable_cuda_graph": int(graph)}
        for s, n in ORT_CONFIGS
    ]


def ort_label(cfg: Mapping[str, Any]) -> str:
    """The configuration's name on a fresh child's command line: ``EXHAUSTIVE-nhwc``."""
    return f"{cfg['cudnn_conv_algo_search']}-{'nhwc' if cfg['prefer_nhwc'] else 'nchw'}"


def ort_provider_options(cfg: Mapping[str, Any], device_id: int) -> dict[str, str]:
    """The CUDA EP's provider options of a configuration (``enable_cuda_graph`` only when on)."""
    options = {
        "device_id": str(device_id),
        "cudnn_conv_algo_search": cfg["cudnn_conv_algo_search"],
        "prefer_nhwc": str(cfg["prefer_nhwc"]),
        "use_tf32": str(cfg["use_tf32"]),
    }
    if cfg.get("enable_cuda_graph"):
        options["enable_cuda_graph"] = "1"
    return options


# ---------------------------------------------------------------------------------------------
# PyTorch


def torch_name(channels_last: bool) -> str:
    return "torch channels_last" if channels_last else "torch nchw"


def torch_configs(tf32: bool) -> list[dict[str, Any]]:
    """channels_last off and on, in the bench's order."""
    return [{"cudnn_benchmark": True, "channels_last": cl, "inference_mode": True, "allow_tf32": bool(tf32)} for cl in (False, True)]


def compile_name(mode: str) -> str:
    return f"torch.compile {mode}"


def parse_compile_modes(text: str) -> tuple[str, ...]:
    """``default,reduce-overhead``: the torch.compile modes to run, in order; ValueError naming a bad one."""
    modes = tuple(dict.fromkeys(m.strip().lower() for m in (text or "").split(",") if m.strip()))
    bad = [m for m in modes if m not in COMPILE_MODES]
    if bad or not modes:
        raise ValueError(f"expected a comma-separated list of {', '.join(COMPILE_MODES)}, got {text!r}")
    return modes


def compile_configs(tf32: bool, modes: tuple[str, ...], channels_last: bool) -> list[dict[str, Any]]:
    """One torch.compile configuration per mode, in the memory format eager ran faster in."""
    return [{"mode": m, "dynamic": False, "fullgraph": False, "cudnn_benchmark": True, "channels_last": channels_last,
             "grad_mode": "no_grad", "allow_tf32": bool(tf32)} for m in modes]


def torch_label(cfg: Mapping[str, Any]) -> str:
    """The configuration's name on a fresh child's command line: ``nchw`` / ``channels_last``."""
    return "channels_last" if cfg["channels_last"] else "nchw"


@contextlib.contextmanager
def torch_flags(torch: Any, cfg: Mapping[str, Any]) -> Iterator[None]:
    """``cudnn.benchmark`` and TF32 (convs and matmuls) as ``cfg`` says; the previous flags after."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32)
    cudnn.benchmark = bool(cfg["cudnn_benchmark"])
    cudnn.allow_tf32 = matmul.allow_tf32 = bool(cfg["allow_tf32"])
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = saved


def torch_memory_format(torch: Any, ndim: int) -> Any:
    """channels_last for rank-4 inputs, channels_last_3d for rank 5, None where it does not apply."""
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(ndim)


def first_tensor(y: Any) -> Any:
    """The output the bench compares: the ``"out"`` entry of a dict, the first of a tuple."""
    if isinstance(y, Mapping):
        y = y.get("out", next(iter(y.values())))
    if isinstance(y, (tuple, list)):
        y = y[0]
    return y


# ---------------------------------------------------------------------------------------------
# the PyTorch builder of a model


def panel_entry(model_path: str | os.PathLike, panel_json: str | os.PathLike | None = None) -> tuple[dict | None, str | None]:
    """The ``panel.json`` entry of ``model_path`` (written by ``models/export_panel.py``) or (None, why not).

    ``panel_json`` defaults to ``panel.json`` in the model's folder. The entry is the one whose
    ``file`` is the model's file name (or whose ``name`` is its stem).
    """
    model_path = Path(model_path)
    pj = Path(panel_json) if panel_json else model_path.parent / "panel.json"
    if not pj.is_file():
        return None, f"no {pj} (export the model with models/export_panel.py, or give --panel-json)"
    try:
        doc = json.loads(pj.read_text())
        entries = list(doc.get("models", []))
    except (OSError, ValueError, AttributeError) as e:
        return None, f"cannot read {pj}: {first_line(e)}"
    for e in entries:
        if isinstance(e, dict) and e.get("file") == model_path.name:
            return e, None
    for e in entries:
        if isinstance(e, dict) and e.get("name") == model_path.stem:
            return e, None
    return None, f"{model_path.name} is not listed in {pj}: no known PyTorch builder"


def export_panel_candidates() -> list[Path]:
    here = Path(__file__).resolve().parents[2]
    return [here / "models" / "export_panel.py", Path.cwd() / "models" / "export_panel.py"]


def load_export_panel() -> Any:
    """Import ``models/export_panel.py`` (it defines ``build_torch_model``); ImportError when not found."""
    mod = sys.modules.get("export_panel")
    if mod is not None and hasattr(mod, "build_torch_model"):
        return mod
    for path in export_panel_candidates():
        if path.is_file():
            spec = importlib.util.spec_from_file_location("export_panel", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules["export_panel"] = mod
            try:
                spec.loader.exec_module(mod)  # type: ignore[union-attr]
            except BaseException:
                sys.modules.pop("export_panel", None)
                raise
            return mod
    raise ImportError(f"models/export_panel.py not found (looked in {', '.join(map(str, export_panel_candidates()))})")
