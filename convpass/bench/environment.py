"""The environment record of a ``convpass bench`` run: the device, driver, CUDA and cuDNN versions
and the versions of every package the numbers depend on.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from convpass.bench import measure
from convpass.bench.peers import first_line


def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _module_version(name: str) -> str | None:
    mod = sys.modules.get(name)
    return getattr(mod, "__version__", None) if mod is not None else None


def package_versions() -> dict[str, str | None]:
    """Versions of everything the numbers depend on (None: not installed)."""
    from convpass.core.version import __version__

    out = {
        "python": platform.python_version(),
        "convpass": __version__,
        "numpy": np.__version__,
        "onnx": onnx.__version__,
        "onnx-ir": _dist_version("onnx-ir", "onnx_ir"),
        "onnxruntime": _dist_version("onnxruntime") or None,
        "onnxruntime-gpu": _dist_version("onnxruntime-gpu"),
        "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy") or _module_version("cupy"),
        "nvidia-cudnn": _dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
        "torch": _dist_version("torch") or _module_version("torch"),
        "torchvision": _dist_version("torchvision") or _module_version("torchvision"),
        "triton": _dist_version("triton"),
        "matplotlib": _dist_version("matplotlib"),
    }
    ort = sys.modules.get("onnxruntime")
    if ort is None:
        try:
            import onnxruntime as ort  # noqa: F811
        except ImportError:
            ort = None
    if ort is not None:
        version = getattr(ort, "__version__", None)
        if out["onnxruntime-gpu"] is None and out["onnxruntime"] is None:
            out["onnxruntime"] = version
        try:
            out["onnxruntime-providers"] = ",".join(ort.get_available_providers())
        except Exception:  # noqa: BLE001
            out["onnxruntime-providers"] = None
    return out


def driver_version() -> str | None:
    """The NVIDIA kernel driver release (e.g. 580.159.04)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False)
        line = res.stdout.strip().splitlines()
        return line[0].strip() if res.returncode == 0 and line else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def environment() -> dict[str, Any]:
    """Device, driver, CUDA, cuDNN and package versions."""
    cp = measure.cupy()
    rt = cp.cuda.runtime
    dev = cp.cuda.Device()
    props = rt.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    env: dict[str, Any] = {
        "device": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": int(props["multiProcessorCount"]),
        "memory_bytes": int(props["totalGlobalMem"]),
        "driver": driver_version(),
        "cuda_runtime": _cuda_version(int(rt.runtimeGetVersion())),
        "cuda_driver_api": _cuda_version(int(rt.driverGetVersion())),
        "cudnn": None,
        "cudnn_path": None,
        "host": platform.node(),
    }
    try:
        from convpass.core.device import cudnn_version_string
        from convpass.native.cudnn import library

        env["cudnn"] = cudnn_version_string(library.version())
        env["cudnn_path"] = library.path()
    except Exception as e:  # noqa: BLE001
        env["cudnn"] = None
        env["cudnn_error"] = first_line(e)
    env["packages"] = package_versions()
    return env
