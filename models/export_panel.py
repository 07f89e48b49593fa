#!/usr/bin/env python
"""Export the benchmark panel (torchvision, timm and torchaudio models, and three defined here) to ONNX.

The panel is 21 real architectures chosen so that together they cover the convolution families
and the surrounding op families a tuned executor meets in practice (``PANEL`` below names the
family each one covers; ``models/README.md`` has the table).

Needs torch and torchvision (written for torch 2.11 / torchvision 0.26 and checked with torch 2.9
/ torchvision 0.24); the two timm models need timm and ConvTasNet needs torchaudio, imported only
when those models are exported. Without torch it exits with status 2; a model whose library is
missing or whose export fails is reported on stderr and the exit status is 1 (the others are
still exported). Weights are random (``weights=None`` / ``pretrained=False``) after
``torch.manual_seed(0)``; models are exported in eval mode with the TorchScript exporter
(``dynamo=False``), opset 17, input ``input`` and output ``output`` with a dynamic batch axis
``batch``::

    python models/export_panel.py --out DIR [--models resnet50,r3d_18] [--opset 17] [--fp16]
    python models/export_panel.py --out DIR --sweep      # the CPU sweep (SWEEP below), not the panel
    python models/export_panel.py --out DIR --dynamo     # with torch.export (opset >= 18), not TorchScript

Writes ``DIR/<name>.onnx`` (``DIR/<name>_fp16.onnx`` with ``--fp16``) and ``DIR/panel.json``.
``panel.json`` is merged with an existing one: entries for other files are kept. Each entry
records the family, the input kind and the default benchmark batches next to the file facts.

A benchmark that wants the same torch module imports this file and calls
``build_torch_model(name) -> (module, example_input_shape)``. Every panel input is one float
tensor that a standard-normal sample of ``example_input_shape`` (batch replaced) feeds
correctly: an image or a clip (normalized pixels), a latent vector (DCGAN), a luminance plane
(ESPCN) or a mono waveform (ConvTasNet; white noise is a valid waveform). ``PANEL[name]["input_kind"]``
says which. Importing this file needs only the standard library (CI reads ``PANEL`` without torch).
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
PANEL_FORMAT = 2
DEFAULT_BATCHES = (1, 32)
INPUT_KINDS = ("image", "video", "audio", "latent")

# name -> spec. Keys:
#   builder      dotted path of the constructor: into torchvision, "timm.create_model",
#                torchaudio, or "export_panel.<fn>" for a model defined in this file
#   kwargs       its keyword arguments (random weights: weights=None / pretrained=False)
#   shape        example input shape, batch 1
#   input_kind   one of INPUT_KINDS (what the input is; every kind is fed standard-normal samples)
#   family       the architecture family the model stands for in the panel
#   batches      default benchmark batches (DEFAULT_BATCHES when absent)
#   output_key   for models returning a dict: the exported graph (and the module from
#                build_torch_model) return only this entry
# Every batch default is 1,32, the video and audio models included: on the target H200 (141 GB)
# the largest batch-32 case (r2plus1d_18: all its layers' fp32 outputs together 24 GB, with no
# buffer reuse at all; conv_tasnet_base 21 GB; the largest single tensor ESPCN's 1.9 GB) fits
# several times over, so no model needs a smaller batch for memory.
PANEL: Dict[str, Dict[str, Any]] = {
    # --- the first eight ---------------------------------------------------------------------
    "resnet50": {
        "builder": "torchvision.models.resnet50",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "residual bottlenecks (1x1-3x3-1x1 convs, BatchNorm folded), MaxPool, "
                  "GlobalAveragePool + Gemm classifier",
    },
    "mobilenet_v3_large": {
        "builder": "torchvision.models.mobilenet_v3_large",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "depthwise-separable inverted residuals, squeeze-excitation, hard-swish",
    },
    "efficientnet_b0": {
        "builder": "torchvision.models.efficientnet_b0",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "MBConv (depthwise 3x3 / 5x5) with squeeze-excitation and SiLU",
    },
    "convnext_tiny": {
        "builder": "torchvision.models.convnext_tiny",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "7x7 depthwise convs + LayerNorm + MLP (MatMul, GELU), patchify stem",
    },
    "r3d_18": {
        "builder": "torchvision.models.video.r3d_18",
        "kwargs": {"weights": None},
        "shape": (1, 3, 16, 112, 112),
        "input_kind": "video",
        "family": "3-D convolutions (3x3x3 residual video network)",
    },
    "fcn_resnet50": {
        "builder": "torchvision.models.segmentation.fcn_resnet50",
        "kwargs": {"weights": None, "weights_backbone": None, "aux_loss": False},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "dilated ResNet-50 backbone + FCN head, bilinear Resize to the input size",
        "output_key": "out",
    },
    "deeplabv3_mobilenet_v3_large": {
        "builder": "torchvision.models.segmentation.deeplabv3_mobilenet_v3_large",
        "kwargs": {"weights": None, "weights_backbone": None, "aux_loss": False},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "atrous spatial pyramid pooling (dilated convs, pooled branch), dilated depthwise "
                  "backbone, bilinear Resize",
        "output_key": "out",
    },
    "dcgan_generator": {
        "builder": "export_panel.dcgan_generator",
        "kwargs": {"nz": 100},
        "shape": (1, 100, 1, 1),
        "input_kind": "latent",
        "family": "ConvTranspose chain (image generator from a latent vector)",
    },
    # --- the wide panel ------------------------------------------------------------------------
    "densenet121": {
        "builder": "torchvision.models.densenet121",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "dense concatenation: every layer's Concat of all earlier features, BN-ReLU-conv "
                  "(pre-activation, BatchNorm not foldable into a conv), AveragePool transitions",
    },
    "inception_v3": {
        "builder": "torchvision.models.inception_v3",
        # init_weights=False: PyTorch's default layer init. Inception's own (truncated normal, std
        # 0.1 whatever the fan-in) grows random-weight activations ~4x per conv: logits ~1e12,
        # past float16's range, so the fp16 export computed inf / NaN.
        "kwargs": {"weights": None, "aux_logits": False, "init_weights": False},
        "shape": (1, 3, 299, 299),
        "input_kind": "image",
        "family": "Inception branches: parallel 1x1 / 3x3 / 5x5 / factorized 1x7-7x1 convs and "
                  "Max/AveragePool branches joined by Concat; unpadded (valid) strided convs",
    },
    "shufflenet_v2_x1_0": {
        "builder": "torchvision.models.shufflenet_v2_x1_0",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "channel shuffle (Reshape-Transpose-Reshape), channel Split, depthwise 3x3",
    },
    "resnext50_32x4d": {
        "builder": "torchvision.models.resnext50_32x4d",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "grouped convs, ResNeXt: 3x3 with 32 groups of 4-32 channels",
    },
    "regnet_y_800mf": {
        "builder": "torchvision.models.regnet_y_800mf",
        "kwargs": {"weights": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "grouped convs, RegNet: 3x3 with group width 16, squeeze-excitation",
    },
    "efficientnet_v2_s": {
        "builder": "torchvision.models.efficientnet_v2_s",
        "kwargs": {"weights": None},
        "shape": (1, 3, 384, 384),
        "input_kind": "image",
        "family": "fused-MBConv (full 3x3 expansion conv in the early stages) then MBConv with SE",
    },
    "ghostnet_100": {
        "builder": "timm.create_model",
        "kwargs": {"model_name": "ghostnet_100", "pretrained": False},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "ghost modules: a 1x1 conv's features plus cheap depthwise 'ghost' features, "
                  "Concat + Slice; SE with hard-sigmoid",
    },
    "mobilevit_s": {
        "builder": "timm.create_model",
        "kwargs": {"model_name": "mobilevit_s", "pretrained": False},
        "shape": (1, 3, 256, 256),
        "input_kind": "image",
        "family": "vision-transformer hybrid: MobileNetV2 blocks + transformer blocks (LayerNorm, "
                  "attention MatMul / Softmax), unfold / fold as Reshape-Transpose chains, Concat",
    },
    "conv_tasnet_base": {
        "builder": "torchaudio.models.conv_tasnet_base",
        "kwargs": {"num_sources": 2},
        "shape": (1, 1, 16000),
        "input_kind": "audio",
        "family": "1-D audio (speech separation): Conv1d encoder, dilated depthwise Conv1d blocks "
                  "with GroupNorm(1) (InstanceNormalization over a Reshape) and PReLU, "
                  "ConvTranspose1d decoder on batch x sources",
    },
    "r2plus1d_18": {
        "builder": "torchvision.models.video.r2plus1d_18",
        "kwargs": {"weights": None},
        "shape": (1, 3, 16, 112, 112),
        "input_kind": "video",
        "family": "(2+1)-D video: each 3x3x3 conv factorized into 1x3x3 spatial + 3x1x1 temporal",
    },
    "lraspp_mobilenet_v3_large": {
        "builder": "torchvision.models.segmentation.lraspp_mobilenet_v3_large",
        "kwargs": {"weights": None, "weights_backbone": None},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "segmentation head with Resize: LR-ASPP (GlobalAveragePool + Sigmoid gate, "
                  "bilinear Resize to the low-level features and to the input)",
        "output_key": "out",
    },
    "espcn": {
        "builder": "export_panel.espcn",
        "kwargs": {"upscale_factor": 3},
        "shape": (1, 1, 360, 640),
        "input_kind": "image",
        "family": "super-resolution by sub-pixel convolution: PixelShuffle exported as "
                  "DepthToSpace (CRD), 360x640 -> 1080x1920",
    },
    "unet": {
        "builder": "export_panel.unet",
        "kwargs": {"n_channels": 3, "n_classes": 2},
        "shape": (1, 3, 256, 256),
        "input_kind": "image",
        "family": "UNet: DoubleConv (conv-BN-ReLU x2) encoder with MaxPool, ConvTranspose 2x2 "
                  "stride-2 decoder, skip Concat, widths 64-1024",
    },
    # --- compute-bound classes: generative decoders, super-resolution, attention backbones ------
    "vae_decoder": {
        "builder": "export_panel.vae_decoder",
        "kwargs": {},
        "shape": (1, 4, 32, 32),
        "input_kind": "latent",
        "family": "diffusion-VAE-style decoder: GroupNorm(32) + SiLU residual blocks of 3x3 convs, "
                  "one self-attention block, nearest upsampling, 256 -> 64 channels, 32x32 -> 256x256",
        "batches": (1, 16),
    },
    "rrdb_sr": {
        "builder": "export_panel.rrdbnet",
        "kwargs": {"nb": 6},
        "shape": (1, 3, 64, 64),
        "input_kind": "image",
        "family": "ESRGAN-style RRDB super-resolution: dense blocks of 3x3 convs on 64 + 32k "
                  "channels, LeakyReLU, Concat, nearest upsampling x4 (64x64 -> 256x256)",
        "batches": (1, 16),
    },
    "ecaresnet50d": {
        "builder": "timm.create_model",
        "kwargs": {"model_name": "ecaresnet50d", "pretrained": False},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "ResNet-D with efficient channel attention (global pool -> 1-D conv -> sigmoid gate)",
        "batches": (1, 16),
    },
    "cspdarknet53": {
        "builder": "timm.create_model",
        "kwargs": {"model_name": "cspdarknet53", "pretrained": False},
        "shape": (1, 3, 256, 256),
        "input_kind": "image",
        "family": "YOLO-style CSP backbone: cross-stage partial blocks (split, Concat), LeakyReLU / Mish",
        "batches": (1, 16),
    },
    "hgnetv2_b0": {
        "builder": "timm.create_model",
        "kwargs": {"model_name": "hgnetv2_b0", "pretrained": False},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "HGNetV2: light conv blocks with aggregation Concat, ESE attention",
        "batches": (1, 16),
    },
    "skresnet18": {
        "builder": "timm.create_model",
        "kwargs": {"model_name": "skresnet18", "pretrained": False},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "selective-kernel attention: parallel 3x3 / dilated branches fused by a softmax gate",
        "batches": (1, 16),
    },
    "bit_resnetv2_50": {
        "builder": "timm.create_model",
        "kwargs": {"model_name": "resnetv2_50x1_bit", "pretrained": False},
        "shape": (1, 3, 224, 224),
        "input_kind": "image",
        "family": "BiT ResNet-v2: weight-standardized convs (the weight computed in the graph), GroupNorm",
        "batches": (1, 16),
    },
}


# Models a new user might bring, outside the benchmark panel: exported by ``--sweep`` and checked on
# the CPU (models/check_panel_cpu.py: optimize, ONNX Runtime on the tuned model, the CPU executor
# against it) to find unsupported ops and unresolved shapes before a user does. Not benchmarked.
# Same keys as PANEL; every one takes a 224x224 image except wav2letter (a 1-s mono waveform).
_SWEEP_TORCHVISION = {
    "squeezenet1_1": {}, "googlenet": {"aux_logits": False, "init_weights": True}, "mnasnet0_5": {},
    "mobilenet_v2": {}, "alexnet": {}, "vgg11_bn": {}, "resnet18": {}, "regnet_x_400mf": {},
    "efficientnet_b1": {}, "shufflenet_v2_x0_5": {}, "swin_t": {}, "maxvit_t": {},
}
_SWEEP_TIMM = (
    "repvgg_a0", "mobileone_s0", "poolformer_s12", "efficientformer_l1", "levit_128s", "resnest14d",
    "hrnet_w18_small", "cspresnet50", "dla34", "rexnet_100", "lcnet_050", "mixnet_s", "edgenext_xx_small",
    "res2net50_14w_8s", "dpn68", "selecsls42b", "ese_vovnet19b_dw", "fastvit_t8", "tiny_vit_5m_224",
    "mobilevitv2_050", "efficientvit_b0", "ghostnetv2_100", "inception_next_tiny", "nf_resnet26", "xception41",
)
SWEEP: Dict[str, Dict[str, Any]] = {
    **{name: {"builder": f"torchvision.models.{name}", "kwargs": {"weights": None, **kw}, "shape": (1, 3, 224, 224),
              "input_kind": "image", "family": "sweep (torchvision)"} for name, kw in _SWEEP_TORCHVISION.items()},
    **{name: {"builder": "timm.create_model", "kwargs": {"model_name": name, "pretrained": False}, "shape": (1, 3, 224, 224),
              "input_kind": "image", "family": "sweep (timm)"} for name in _SWEEP_TIMM},
    "wav2letter": {"builder": "torchaudio.models.Wav2Letter", "kwargs": {"num_classes": 40, "input_type": "waveform", "num_features": 1},
                   "shape": (1, 1, 16000), "input_kind": "audio", "family": "sweep (torchaudio)"},
}


def _spec(name: str) -> Dict[str, Any]:
    """The entry of a panel or sweep model."""
    if name in PANEL:
        return PANEL[name]
    if name in SWEEP:
        return SWEEP[name]
    raise KeyError(f"unknown panel model {name!r}; known: {', '.join(PANEL)} (and the sweep: {', '.join(SWEEP)})")


def panel_names() -> List[str]:
    """Every panel model, in panel order."""
    return list(PANEL)


def bench_batches(name: str) -> Tuple[int, ...]:
    """The default benchmark batches of panel model ``name``."""
    return tuple(_spec(name).get("batches", DEFAULT_BATCHES))


def _import_torch():
    """Return (torch, torchvision) or raise ImportError."""
    import torch  # noqa: F401
    import torchvision  # noqa: F401
    import torchvision.models  # noqa: F401
    import torchvision.models.segmentation  # noqa: F401
    import torchvision.models.video  # noqa: F401
    return torch, torchvision


# ---------------------------------------------------------------------------------------------
# models defined here


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


def espcn(upscale_factor: int = 3):
    """ESPCN super-resolution (Shi et al. 2016), as in PyTorch's ``examples/super_resolution``
    (``model.py``, ``Net``), the model of PyTorch's ONNX export tutorial: the luminance plane
    [N, 1, H, W] -> [N, 1, r*H, r*W].

    Conv 5x5 1->64, Conv 3x3 64->64, Conv 3x3 64->32 (each + ReLU), Conv 3x3 32->r^2, then
    PixelShuffle(r) (exported as DepthToSpace, mode CRD); orthogonal initialisation with the
    ReLU gain, as the example does. With r = 3 and a 360x640 input the output is 1080x1920.
    """
    import torch.nn as nn
    import torch.nn.init as init

    class Net(nn.Module):
        def __init__(self, r: int) -> None:
            super().__init__()
            self.relu = nn.ReLU()
            self.conv1 = nn.Conv2d(1, 64, (5, 5), (1, 1), (2, 2))
            self.conv2 = nn.Conv2d(64, 64, (3, 3), (1, 1), (1, 1))
            self.conv3 = nn.Conv2d(64, 32, (3, 3), (1, 1), (1, 1))
            self.conv4 = nn.Conv2d(32, r ** 2, (3, 3), (1, 1), (1, 1))
            self.pixel_shuffle = nn.PixelShuffle(r)
            init.orthogonal_(self.conv1.weight, init.calculate_gain("relu"))
            init.orthogonal_(self.conv2.weight, init.calculate_gain("relu"))
            init.orthogonal_(self.conv3.weight, init.calculate_gain("relu"))
            init.orthogonal_(self.conv4.weight)

        def forward(self, x):
            x = self.relu(self.conv1(x))
            x = self.relu(self.conv2(x))
            x = self.relu(self.conv3(x))
            return self.pixel_shuffle(self.conv4(x))

    return Net(upscale_factor)


def unet(n_channels: int = 3, n_classes: int = 2):
    """UNet (Ronneberger et al. 2015) in the structure of the widely used milesial/Pytorch-UNet
    (``unet/unet_model.py``, ``unet/unet_parts.py``) with ``bilinear=False``: [N, C, H, W] ->
    per-pixel class logits [N, n_classes, H, W] (H, W multiples of 16).

    DoubleConv = (Conv 3x3 no bias, BatchNorm, ReLU) x 2. Encoder: DoubleConv(C, 64), then four
    Down = MaxPool 2x2 + DoubleConv doubling the width to 1024. Decoder: four Up =
    ConvTranspose2d(k=2, s=2) halving the width, Pad to the skip's size (a no-op for sizes
    divisible by 16, as here; kept because it is part of the structure), Concat [skip, upsampled]
    on channels, DoubleConv. Head: Conv 1x1 -> n_classes. Default PyTorch initialisation.
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class DoubleConv(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.double_conv = nn.Sequential(
                nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            )

        def forward(self, x):
            return self.double_conv(x)

    class Down(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(cin, cout))

        def forward(self, x):
            return self.maxpool_conv(x)

    class Up(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(cin, cin // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(cin, cout)

        def forward(self, x1, x2):
            x1 = self.up(x1)
            dy = x2.size()[2] - x1.size()[2]
            dx = x2.size()[3] - x1.size()[3]
            x1 = F.pad(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
            return self.conv(torch.cat([x2, x1], dim=1))

    class UNet(nn.Module):
        def __init__(self, cin: int, classes: int) -> None:
            super().__init__()
            self.inc = DoubleConv(cin, 64)
            self.down1 = Down(64, 128)
            self.down2 = Down(128, 256)
            self.down3 = Down(256, 512)
            self.down4 = Down(512, 1024)
            self.up1 = Up(1024, 512)
            self.up2 = Up(512, 256)
            self.up3 = Up(256, 128)
            self.up4 = Up(128, 64)
            self.outc = nn.Conv2d(64, classes, kernel_size=1)

        def forward(self, x):
            x1 = self.inc(x)
            x2 = self.down1(x1)
            x3 = self.down2(x2)
            x4 = self.down3(x3)
            x5 = self.down4(x4)
            x = self.up1(x5, x4)
            x = self.up2(x, x3)
            x = self.up3(x, x2)
            x = self.up4(x, x1)
            return self.outc(x)

    return UNet(n_channels, n_classes)


def vae_decoder(latent_channels: int = 4, widths: Sequence[int] = (256, 256, 128, 64), blocks: int = 3):
    """A diffusion-VAE-style decoder (the structure of Stable Diffusion's ``AutoencoderKL`` decoder,
    narrower): latent [N, 4, H, W] -> image [N, 3, 8H, 8W].

    conv_in 3x3 -> mid block (ResnetBlock, single-head self-attention over H*W, ResnetBlock) -> one
    up block per width (``blocks`` ResnetBlocks, then nearest x2 upsampling + 3x3 conv, but after the
    last) -> GroupNorm(32) + SiLU -> conv_out 3x3. ResnetBlock = GroupNorm(32), SiLU, conv 3x3,
    GroupNorm(32), SiLU, conv 3x3, plus the input (through a 1x1 conv where the width changes).
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def norm(c):
        return nn.GroupNorm(32, c, eps=1e-6)

    class ResnetBlock(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.norm1, self.conv1 = norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.norm2, self.conv2 = norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x):
            h = self.conv1(F.silu(self.norm1(x)))
            h = self.conv2(F.silu(self.norm2(h)))
            return self.shortcut(x) + h

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.norm = norm(c)
            self.q, self.k, self.v, self.proj = (nn.Conv2d(c, c, 1) for _ in range(4))

        def forward(self, x):
            n, c, h, w = x.shape
            y = self.norm(x)
            q = self.q(y).reshape(n, c, h * w).transpose(1, 2)
            k = self.k(y).reshape(n, c, h * w)
            v = self.v(y).reshape(n, c, h * w).transpose(1, 2)
            a = torch.softmax(torch.bmm(q, k) * c ** -0.5, dim=-1)
            return x + self.proj(torch.bmm(a, v).transpose(1, 2).reshape(n, c, h, w))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            c = widths[0]
            self.conv_in = nn.Conv2d(latent_channels, c, 3, padding=1)
            self.mid = nn.Sequential(ResnetBlock(c, c), Attention(c), ResnetBlock(c, c))
            ups = []
            for i, width in enumerate(widths):
                layers = [ResnetBlock(c if j == 0 else width, width) for j in range(blocks)]
                c = width
                if i < len(widths) - 1:
                    layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, padding=1)]
                ups.append(nn.Sequential(*layers))
            self.up = nn.Sequential(*ups)
            self.norm_out, self.conv_out = norm(c), nn.Conv2d(c, 3, 3, padding=1)

        def forward(self, z):
            h = self.up(self.mid(self.conv_in(z)))
            return self.conv_out(F.silu(self.norm_out(h)))

    return Decoder()


def rrdbnet(in_nc: int = 3, out_nc: int = 3, nf: int = 64, nb: int = 23, gc: int = 32):
    """ESRGAN's RRDBNet (Wang et al. 2018, ``RRDBNet_arch.py``), x4: [N, 3, H, W] -> [N, 3, 4H, 4W].

    conv_first -> ``nb`` RRDBs (each three ResidualDenseBlocks of five 3x3 convs over the Concat of
    the block input and every earlier conv's output, growth ``gc``, LeakyReLU 0.2, residual scaled
    by 0.2) -> trunk conv + skip -> two (nearest x2, conv, LeakyReLU) -> HR conv, LeakyReLU ->
    conv_last.
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class DenseBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(nf + i * gc, gc if i < 4 else nf, 3, padding=1) for i in range(5))

        def forward(self, x):
            feats = [x]
            for i, conv in enumerate(self.convs):
                y = conv(torch.cat(feats, 1))
                if i < 4:
                    feats.append(F.leaky_relu(y, 0.2))
            return x + 0.2 * y

    class RRDB(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(DenseBlock(), DenseBlock(), DenseBlock())

        def forward(self, x):
            return x + 0.2 * self.blocks(x)

    class RRDBNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_first = nn.Conv2d(in_nc, nf, 3, padding=1)
            self.trunk = nn.Sequential(*(RRDB() for _ in range(nb)))
            self.trunk_conv = nn.Conv2d(nf, nf, 3, padding=1)
            self.up1, self.up2 = nn.Conv2d(nf, nf, 3, padding=1), nn.Conv2d(nf, nf, 3, padding=1)
            self.hr, self.last = nn.Conv2d(nf, nf, 3, padding=1), nn.Conv2d(nf, out_nc, 3, padding=1)

        def forward(self, x):
            fea = self.conv_first(x)
            fea = fea + self.trunk_conv(self.trunk(fea))
            fea = F.leaky_relu(self.up1(F.interpolate(fea, scale_factor=2, mode="nearest")), 0.2)
            fea = F.leaky_relu(self.up2(F.interpolate(fea, scale_factor=2, mode="nearest")), 0.2)
            return self.last(F.leaky_relu(self.hr(fea), 0.2))

    return RRDBNet()


# ---------------------------------------------------------------------------------------------
# building and exporting


def _resolve(dotted: str):
    if dotted.startswith("export_panel."):
        return globals()[dotted.split(".", 1)[1]]
    import importlib

    mod, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def build_torch_model(name: str) -> Tuple[Any, Tuple[int, ...]]:
    """Build panel model ``name`` as exported: seeded random weights, eval mode, on CPU, fp32.

    Returns ``(module, example_input_shape)``; the shape has batch 1. The module takes one float
    tensor of that shape (any batch) and returns one tensor: for the segmentation models the
    ``"out"`` entry only (as in the exported graph). A standard-normal input of the shape is a
    valid input for every model (``PANEL[name]["input_kind"]`` says what it stands for).
    Raises KeyError for an unknown name, ImportError when the model's library is missing.
    """
    spec = _spec(name)
    torch, _ = _import_torch()
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
    Resize gives 'Resizeoutput_dim_1', ConvTasNet's Reshape 'Reshapeoutput_dim_2', ...) by the
    sizes torch produced for the example; the input's non-batch dims are static, so those sizes
    are too. A missing batch name is set to ``batch``."""
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
            if d.dim_param != "batch":
                d.Clear()
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


def export_one(name: str, out_dir: str, opset: int, fp16: bool, dynamo: bool = False) -> Dict[str, Any]:
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
        # Python-level shape arithmetic in ConvTasNet / UNet / timm is traced as constants for
        # the non-batch dims, which are static here; the warnings say so for every such line.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        if dynamo:  # torch.export's exporter, torch.onnx.export's default since torch 2.9
            program = torch.onnx.export(
                module,
                (example,),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                opset_version=max(opset, 18),  # the lowest it writes
                dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},),
                dynamo=True,
            )
            program.save(path)
        else:
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

    spec = _spec(name)
    entry: Dict[str, Any] = {
        "name": name,
        "file": fname,
        "dtype": "float16" if fp16 else "float32",
        "family": spec["family"],
        "input_kind": spec["input_kind"],
        "input": INPUT_NAME,
        "input_shape": ["batch"] + list(shape[1:]),
        "outputs": [OUTPUT_NAME],
        "bench_batches": list(bench_batches(name)),
        "opset": max(opset, 18) if dynamo else opset,
        "exporter": "dynamo" if dynamo else "torchscript",
        "export_seconds": round(seconds, 3),
        "bytes": os.path.getsize(path),
        "sha256": _sha256(path),
        "builder": spec["builder"],
        "builder_kwargs": spec["kwargs"],
        "seed": SEED,
    }
    if spec.get("output_key"):
        entry["output_key"] = spec["output_key"]
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


def _library_versions() -> Dict[str, Optional[str]]:
    """Versions of the optional model libraries (None: not installed)."""
    from importlib import metadata

    out: Dict[str, Optional[str]] = {}
    for dist in ("timm", "torchaudio"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description="Export the convpass benchmark panel (torchvision, timm, torchaudio) to ONNX.")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--models", default=None,
                    help="comma-separated subset (default: all): " + ",".join(PANEL))
    ap.add_argument("--sweep", action="store_true",
                    help="export the sweep (models outside the panel, checked on the CPU) instead: " + ",".join(SWEEP))
    ap.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    ap.add_argument("--dynamo", action="store_true",
                    help="export with torch.export (dynamo=True, opset >= 18) instead of the TorchScript exporter")
    ap.add_argument("--fp16", action="store_true",
                    help="export model.half() with half inputs on CUDA (skipped without CUDA)")
    args = ap.parse_args(argv)

    models = SWEEP if args.sweep else PANEL
    names = [n.strip() for n in args.models.split(",") if n.strip()] if args.models \
        else list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        ap.error(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(models)}")

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
        **_library_versions(),
        "seed": SEED,
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
    }
    entries: List[Dict[str, Any]] = []
    failed: List[str] = []
    for name in names:
        try:
            entry = export_one(name, args.out, args.opset, args.fp16, args.dynamo)
        except Exception as e:  # keep going: one model's exporter failure is not fatal
            print(f"{name}: export FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        entries.append(entry)
        print(f"{name}: {entry['file']} {entry['bytes'] / 1e6:.1f} MB "
              f"in {entry['export_seconds']:.1f} s", flush=True)
    if entries:
        print(f"panel: {_write_panel(args.out, entries, header)}")
    if failed:
        print(f"export_panel: {len(failed)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
