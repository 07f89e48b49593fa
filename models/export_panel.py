#!/usr/bin/env python
"""Export the benchmark panel (torchvision models and a DCGAN generator) to ONNX.

Needs torch and torchvision (written for torch 2.11 / torchvision 0.26); without them it
exits with status 2. Weights are random (``weights=None``) after ``torch.manual_seed(0)``;
models are exported in eval mode with the TorchScript exporter (``dynamo=False``), opset 17,
input ``input`` and output ``output`` with a dynamic batch axis ``batch``::

    python models/export_panel.py --out DIR [--models resnet50,r3d_18] [--opset 17] [--fp16]

Writes ``DIR/<name>.onnx`` (``DIR/<name>_fp16.onnx`` with ``--fp16``) and ``DIR/panel.json``.
``panel.json`` is merged with an existing one: entries for other files are kept.

A benchmark that wants the same torch module imports this file and calls
``build_torch_model(name) -> (module, example_input_shape)``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

SEED = 0
DEFAULT_OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "output"
PANEL_FILE = "panel.json"
PANEL_FORMAT = 1

# name -> (builder, builder kwargs, example input shape with batch 1, note)
# The builder is a dotted path into torchvision, or "export_panel.dcgan_generator" for the
# generator defined here. Segmentation models return a dict; they are wrapped so that the
# exported graph (and the module from build_torch_model) returns only ``["out"]``.
PANEL: Dict[str, Dict[str, Any]] = {
    "resnet50": {
        "builder": "torchvision.models.resnet50",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
    },
    "mobilenet_v3_large": {
        "builder": "torchvision.models.mobilenet_v3_large",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
    },
    "efficientnet_b0": {
        "builder": "torchvision.models.efficientnet_b0",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
    },
    "convnext_tiny": {
        "builder": "torchvision.models.convnext_tiny",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
    },
    "r3d_18": {
        "builder": "torchvision.models.video.r3d_18",
        "kwargs": {"weights": None},
        "shape": (1, 3, 16, 112, 112),
    },
    "fcn_resnet50": {
        "builder": "torchvision.models.segmentation.fcn_resnet50",
        "kwargs": {"weights": None, "weights_backbone": None, "aux_loss": False},
        "shape": (1, 3, 224, 224),
        "output_key": "out",
    },
    "deeplabv3_mobilenet_v3_large": {
        "builder": "torchvision.models.segmentation.deeplabv3_mobilenet_v3_large",
        "kwargs": {"weights": None, "weights_backbone": None, "aux_loss": False},
        "shape": (1, 3, 224, 224),
        "output_key": "out",
    },
    "dcgan_generator": {
        "builder": "export_panel.dcgan_generator",
        "kwargs": {"nz": 100},
        "shape": (1, 100, 1, 1),
    },
}


def _import_torch():
    """Return (torch, torchvision) or raise ImportError."""
    import torch  # noqa: F401
    import torchvision  # noqa: F401
    import torchvision.models  # noqa: F401
    import torchvision.models.segmentation  # noqa: F401
    import torchvision.models.video  # noqa: F401
    return torch, torchvision


def dcgan_generator(nz: int = 100, ngf: int = 64, nc: int = 3):
    """DCGAN generator (Radford et al.): latent [N, nz, 1, 1] -> image [N, 3, 64, 64].

    ConvTranspose2d 4x4 chain nz->512->256->128->64->3 (stride 1 then 2), BatchNorm + ReLU
    between, Tanh at the end; DCGAN initialisation (N(0, 0.02) convs, N(1, 0.02) BN scale).
    """
    import torch.nn as nn

    model = nn.Sequential(
        nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),      # 1 -> 4
        nn.BatchNorm2d(ngf * 8),
        nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),  # 4 -> 8
        nn.BatchNorm2d(ngf * 4),
        nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),  # 8 -> 16
        nn.BatchNorm2d(ngf * 2),
        nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),      # 16 -> 32
        nn.BatchNorm2d(ngf),
        nn.ReLU(True),
        nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),           # 32 -> 64
        nn.Tanh(),
    )

    def init(m):
        if isinstance(m, nn.ConvTranspose2d):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)

    model.apply(init)
    return model


def _resolve(dotted: str):
    if dotted.startswith("export_panel."):
        return globals()[dotted.split(".", 1)[1]]
    import importlib

    mod, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def build_torch_model(name: str) -> Tuple[Any, Tuple[int, ...]]:
    """Build panel model ``name`` as exported: seeded random weights, eval mode, on CPU, fp32.

    Returns ``(module, example_input_shape)``; the shape has batch 1. For the segmentation
    models the module returns the ``"out"`` tensor only (as in the exported graph).
    """
    if name not in PANEL:
        raise KeyError(f"unknown panel model {name!r}; known: {', '.join(PANEL)}")
    torch, _ = _import_torch()
    spec = PANEL[name]
    torch.manual_seed(SEED)
    module = _resolve(spec["builder"])(**spec["kwargs"])
    key = spec.get("output_key")
    if key is not None:
        module = _select_output(module, key)
    module.eval()
    return module, tuple(spec["shape"])


def _select_output(module, key: str):
    import torch.nn as nn

    class SelectOutput(nn.Module):
        """Wraps a model returning a dict so that it returns ``out[key]``."""

        def __init__(self, inner: nn.Module, k: str) -> None:
            super().__init__()
            self.model = inner
            self.key = k

        def forward(self, x):
            return self.model(x)[self.key]

    return SelectOutput(module, key)


def _pin_output_dims(path: str, out_shape: List[int]) -> None:
    """Replace symbolic non-batch output dims left by the exporter (the segmentation heads'
    Resize gives 'Resizeoutput_dim_1', ...) by the sizes torch produced for the example; the
    input's non-batch dims are static, so those sizes are too."""
    try:
        import onnx
    except ImportError:
        return
    m = onnx.load(path)
    (out,) = m.graph.output
    dims = out.type.tensor_type.shape.dim
    if len(dims) != len(out_shape):
        return
    changed = False
    for i, d in enumerate(dims):
        if i == 0:
            if not d.dim_param:
                d.dim_param = "batch"
                changed = True
        elif not d.HasField("dim_value"):
            d.dim_value = int(out_shape[i])
            changed = True
    if changed:
        onnx.save(m, path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_one(name: str, out_dir: str, opset: int, fp16: bool) -> Dict[str, Any]:
    torch, _ = _import_torch()
    module, shape = build_torch_model(name)
    device = "cuda" if fp16 else "cpu"
    dtype = torch.float16 if fp16 else torch.float32
    module = module.to(device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    example = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    fname = f"{name}_fp16.onnx" if fp16 else f"{name}.onnx"
    path = os.path.join(out_dir, fname)

    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        torch.onnx.export(
            module,
            (example,),
            path,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            opset_version=opset,
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            do_constant_folding=True,
            dynamo=False,
        )
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        out_shape = list(module(example).shape)
    _pin_output_dims(path, out_shape)

    entry: Dict[str, Any] = {
        "name": name,
        "file": fname,
        "dtype": "float16" if fp16 else "float32",
        "input": INPUT_NAME,
        "input_shape": ["batch"] + list(shape[1:]),
        "outputs": [OUTPUT_NAME],
        "opset": opset,
        "export_seconds": round(seconds, 3),
        "bytes": os.path.getsize(path),
        "sha256": _sha256(path),
        "builder": PANEL[name]["builder"],
        "builder_kwargs": PANEL[name]["kwargs"],
        "seed": SEED,
    }
    if PANEL[name].get("output_key"):
        entry["output_key"] = PANEL[name]["output_key"]
    # Read back what the file really holds (names, output shapes) when onnx is available.
    try:
        import onnx

        m = onnx.load(path, load_external_data=False)
        inits = {i.name for i in m.graph.initializer}
        entry["input"] = [i.name for i in m.graph.input if i.name not in inits][0]
        entry["outputs"] = [o.name for o in m.graph.output]
        entry["output_shapes"] = [
            [d.dim_param if d.dim_param else d.dim_value for d in o.type.tensor_type.shape.dim]
            for o in m.graph.output
        ]
        entry["ir_version"] = m.ir_version
        entry["conv_count"] = sum(n.op_type in ("Conv", "ConvTranspose") for n in m.graph.node)
    except ImportError:
        pass
    return entry


def _write_panel(out_dir: str, entries: List[Dict[str, Any]], header: Dict[str, Any]) -> str:
    path = os.path.join(out_dir, PANEL_FILE)
    old: List[Dict[str, Any]] = []
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f).get("models", [])
        except (OSError, ValueError, AttributeError):
            old = []
    new_files = {e["file"] for e in entries}
    merged = [e for e in old if e.get("file") not in new_files] + entries
    order = {n: i for i, n in enumerate(PANEL)}
    merged.sort(key=lambda e: (order.get(e.get("name"), len(order)), e.get("file", "")))
    doc = dict(header)
    doc["models"] = merged
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description="Export the convpass benchmark panel (torchvision) to ONNX.")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--models", default=None,
                    help="comma-separated subset (default: all): " + ",".join(PANEL))
    ap.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    ap.add_argument("--fp16", action="store_true",
                    help="export model.half() with half inputs on CUDA (skipped without CUDA)")
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.models.split(",") if n.strip()] if args.models \
        else list(PANEL)
    unknown = [n for n in names if n not in PANEL]
    if unknown:
        ap.error(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(PANEL)}")

    try:
        torch, torchvision = _import_torch()
    except ImportError as e:
        print(f"export_panel: torch and torchvision are required but not importable ({e}); "
              "install them (pip install torch torchvision) and rerun.", file=sys.stderr)
        return 2

    if args.fp16 and not torch.cuda.is_available():
        print("export_panel: --fp16 needs a CUDA device (torch.cuda.is_available() is False); "
              "skipping fp16 export.", file=sys.stderr)
        return 0

    os.makedirs(args.out, exist_ok=True)
    header = {
        "format": PANEL_FORMAT,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "seed": SEED,
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
    }
    entries: List[Dict[str, Any]] = []
    failed: List[str] = []
    for name in names:
        try:
            entry = export_one(name, args.out, args.opset, args.fp16)
        except Exception as e:  # keep going: one model's exporter failure is not fatal
            print(f"{name}: export FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        entries.append(entry)
        print(f"{name}: {entry['file']} {entry['bytes'] / 1e6:.1f} MB "
              f"in {entry['export_seconds']:.1f} s")
    if entries:
        print(f"panel: {_write_panel(args.out, entries, header)}")
    if failed:
        print(f"export_panel: {len(failed)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
