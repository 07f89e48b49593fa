"""Problem keys: normalization, derived shapes, the stable string form."""

from __future__ import annotations

import pytest

from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ConvShape, ProblemKey, layout_from_memory_format, memory_format_name

SHAPE = ConvShape("fwd", 32, 64, 128, (56, 56), (3, 3), (1, 1), (2, 2), (1, 1), 1, "float16")


def test_derived_shapes_and_flops():
    assert SHAPE.x_shape == (32, 64, 56, 56) and SHAPE.w_shape == (128, 64, 3, 3) and SHAPE.y_shape == (32, 128, 28, 28)
    assert SHAPE.flops == 2 * 32 * 128 * 28 * 28 * 64 * 9
    dw = ConvShape("fwd", 1, 32, 32, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1), 32)
    assert dw.is_depthwise and dw.w_shape == (32, 1, 3, 3)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("math", ["default", "tensor_op", "fma"])
def test_key_string_round_trips(layout, math):
    key = SHAPE.with_direction("wgrad").key(layout, math)
    assert ProblemKey.parse(str(key)) == key
    assert hash(ProblemKey.parse(str(key))) == hash(key)


def test_key_is_readable_and_tf32_is_derived():
    key = ConvShape("fwd", 1, 3, 64, (224, 224), (7, 7), (3, 3), (2, 2), (1, 1)).key("nchw", "default")
    assert str(key) == "fwd|n=1|c=3|k=64|in=224x224|ker=7x7|pad=3x3|str=2x2|dil=1x1|g=1|float32|nchw|default"
    assert key.tf32 and not key.shape.key("nchw", "fma").tf32 and not SHAPE.key("nchw", "default").tf32


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"groups": 3}, "does not divide"),
        ({"pads": (-1, 0)}, "pads >= 0"),
        ({"strides": (0, 1)}, "strides"),
        ({"spatial": (2, 2), "pads": (0, 0)}, "larger than padded input"),
        ({"dtype": "float64"}, "dtype"),
        ({"kernel": (3,)}, "kernel has 1 entries"),
        ({"direction": "bwd"}, "direction"),
    ],
)
def test_invalid_shapes_are_refused(kwargs, message):
    base = dict(direction="fwd", n=1, c=4, k=8, spatial=(8, 8), kernel=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1))
    with pytest.raises(ValueError, match=message):
        ConvShape(**{**base, **kwargs})


@pytest.mark.parametrize("text", ["", "fwd|n=1", str(SHAPE) + "|nchw", str(SHAPE) + "|nchw|tf32"])
def test_parse_refuses_non_keys(text):
    with pytest.raises(ValueError, match="not a convpass problem key"):
        ProblemKey.parse(text)


def test_memory_format_names():
    assert [memory_format_name(r, layout) for r in (1, 2, 3) for layout in ("nchw", "nhwc")] == ["NCW", "NWC", "NCHW", "NHWC", "NCDHW", "NDHWC"]
    assert layout_from_memory_format("ndhwc") == (3, "nhwc")
    with pytest.raises(ValueError):
        layout_from_memory_format("CHWN")


def test_device_fingerprint():
    fp = DeviceFingerprint("NVIDIA H100 80GB HBM3", "9.0", 132, 91900)
    assert DeviceFingerprint.parse(str(fp)) == fp and fp.cudnn_version_str == "9.19.0"
    assert fp.matches_name("h100") and fp.matches_name(str(fp)) and not fp.matches_name("H200")
