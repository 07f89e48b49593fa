"""Canonicalization: the cuDNN form (symmetric pads + extra pads, 1-D as 2-D, ConvTranspose as
backward data) must compute exactly what ONNX Runtime computes for the original node."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import conv_model, random_input, run_ort

from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.core.errors import ConvAttributeError


def _windows(spatial_out, kernel, strides, dilations):
    for offs in itertools.product(*(range(k) for k in kernel)):
        yield offs, tuple(
            slice(o * d, o * d + s * (n - 1) + 1, s) for o, d, s, n in zip(offs, dilations, strides, spatial_out)
        )


def np_conv_fwd(x, w, pads, strides, dilations, groups):
    """float64 forward cross-correlation with symmetric pads (the cuDNN problem)."""
    n, c = x.shape[:2]
    k = w.shape[0]
    x = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pads])
    out = [(s - (kk - 1) * d - 1) // st + 1 for s, kk, d, st in zip(x.shape[2:], w.shape[2:], dilations, strides)]
    y = np.zeros((n, k, *out))
    cg, kg = c // groups, k // groups
    for offs, sl in _windows(out, w.shape[2:], strides, dilations):
        for g in range(groups):
            patch = x[(slice(None), slice(g * cg, (g + 1) * cg), *sl)]
            y[:, g * kg : (g + 1) * kg] += np.einsum("nc...,kc->nk...", patch, w[(slice(g * kg, (g + 1) * kg), slice(None), *offs)])
    return y


def np_conv_dgrad(dy, w, dx_spatial, pads, strides, dilations, groups):
    """float64 backward data: the dx whose forward conv (symmetric pads) gives dy."""
    n, k = dy.shape[:2]
    c = w.shape[1] * groups
    dx = np.zeros((n, c, *(s + 2 * p for s, p in zip(dx_spatial, pads))))
    cg, kg = c // groups, k // groups
    for offs, sl in _windows(dy.shape[2:], w.shape[2:], strides, dilations):
        for g in range(groups):
            contrib = np.einsum("nk...,kc->nc...", dy[:, g * kg : (g + 1) * kg], w[(slice(g * kg, (g + 1) * kg), slice(None), *offs)])
            dx[(slice(None), slice(g * cg, (g + 1) * cg), *sl)] += contrib
    crop = tuple(slice(p, p + s) for p, s in zip(pads, dx_spatial))
    return dx[(slice(None), slice(None), *crop)]


def canonical_reference(op_type, x, w, b, attrs):
    """Run the canonical form in float64 NumPy and map back to the ONNX output."""
    can = canonicalize_conv(op_type, attrs, x.shape, w.shape)
    shape = can.shapes[0]
    rank = can.spatial_rank
    begin, end = can.extra_pads[:rank], can.extra_pads[rank:]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    if rank == 1:  # the (1, W) mapping
        x64, w64 = x64[:, :, None, :], w64[:, :, None, :]
        begin, end = (0, *begin), (0, *end)
    if op_type == "Conv":
        x64 = np.pad(x64, [(0, 0), (0, 0)] + list(zip(begin, end)))
        assert x64.shape[2:] == shape.spatial
        y = np_conv_fwd(x64, w64, shape.pads, shape.strides, shape.dilations, shape.groups)
    else:
        assert shape.direction == "dgrad" and shape.output_spatial == tuple(x64.shape[2:])
        y = np_conv_dgrad(x64, w64, shape.spatial, shape.pads, shape.strides, shape.dilations, shape.groups)
        crop = tuple(slice(bg, s - e) for bg, e, s in zip(begin, end, y.shape[2:]))
        y = y[(slice(None), slice(None), *crop)]
    if rank == 1:
        y = y[:, :, 0, :]
    assert y.shape == can.output_shape
    return np.maximum(y + b.reshape(1, -1, *[1] * rank), 0), can


CASES = [
    # (op, x_shape, w_shape, attrs)
    ("Conv", (2, 3, 9, 9), (4, 3, 3, 3), {}),
    ("Conv", (1, 3, 9, 10), (4, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("Conv", (1, 3, 10, 10), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ("Conv", (1, 3, 10, 10), (4, 3, 4, 4), {"auto_pad": "SAME_LOWER"}),
    ("Conv", (1, 3, 11, 10), (4, 3, 2, 2), {"auto_pad": "SAME_UPPER"}),
    ("Conv", (1, 3, 10, 10), (4, 3, 3, 3), {"auto_pad": "VALID", "strides": [3, 2]}),
    ("Conv", (1, 3, 12, 12), (4, 3, 3, 3), {"pads": [0, 1, 2, 1], "strides": [2, 2]}),
    ("Conv", (1, 3, 12, 12), (4, 3, 3, 3), {"dilations": [2, 3], "pads": [2, 3, 2, 3]}),
    ("Conv", (1, 4, 8, 8), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    ("Conv", (1, 6, 8, 8), (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}),  # depthwise
    ("Conv", (2, 2, 30), (3, 2, 5), {"pads": [1, 3], "strides": [2]}),  # 1-D asymmetric
    ("Conv", (1, 4, 17), (4, 1, 3), {"group": 4, "auto_pad": "SAME_UPPER", "strides": [2]}),  # 1-D depthwise
    ("Conv", (1, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"pads": [1, 1, 0, 1, 1, 2]}),  # 3-D asymmetric
    ("Conv", (1, 4, 4, 6, 6), (4, 2, 1, 3, 3), {"group": 2, "strides": [1, 2, 2], "pads": [0, 1, 1, 0, 1, 1]}),
    ("ConvTranspose", (1, 4, 5, 5), (4, 3, 3, 3), {}),
    ("ConvTranspose", (1, 4, 5, 5), (4, 3, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("ConvTranspose", (1, 4, 5, 5), (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}),
    ("ConvTranspose", (1, 4, 5, 6), (4, 3, 3, 3), {"strides": [2, 2], "pads": [0, 1, 2, 1]}),
    ("ConvTranspose", (1, 4, 5, 5), (4, 3, 3, 3), {"strides": [2, 2], "output_shape": [10, 11]}),
    ("ConvTranspose", (1, 4, 5, 5), (4, 3, 3, 3), {"strides": [2, 2], "output_shape": [10, 10], "auto_pad": "SAME_UPPER"}),
    ("ConvTranspose", (1, 4, 5, 5), (4, 3, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("ConvTranspose", (1, 4, 5, 5), (4, 2, 3, 3), {"group": 2, "dilations": [2, 2], "pads": [1, 1, 1, 1]}),
    ("ConvTranspose", (1, 2, 7), (2, 3, 4), {"strides": [3], "pads": [1, 2], "output_padding": [2]}),  # 1-D
    ("ConvTranspose", (1, 2, 3, 4, 4), (2, 2, 2, 3, 3), {"strides": [1, 2, 2], "pads": [0, 1, 1, 0, 1, 1]}),  # 3-D
]


@pytest.mark.parametrize("op_type,x_shape,w_shape,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_canonical_form_matches_onnxruntime(op_type, x_shape, w_shape, attrs):
    model = conv_model(op_type, x_shape, w_shape, **attrs)
    x = random_input(x_shape)
    (expected,) = run_ort(model, {"x": x})
    from onnx import numpy_helper

    w, b = (numpy_helper.to_array(t) for t in model.graph.initializer)
    got, can = canonical_reference(op_type, x, w, b, attrs)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert all(p >= 0 for p in can.pads + can.extra_pads)
    if len(x_shape) == 3:
        # both 2-D mappings are kept as candidates for measuring
        assert [s.spatial for s in can.shapes] == [(1, can.shapes[0].spatial[1]), (can.shapes[0].spatial[1], 1)]


def test_extra_pads_only_where_asymmetric():
    can = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (1, 3, 8, 8), (4, 3, 3, 3))
    assert can.pads == (1, 1) and not can.has_extra_pads
    can = canonicalize_conv("Conv", {"pads": [0, 1, 2, 1]}, (1, 3, 8, 8), (4, 3, 3, 3))
    assert can.pads == (0, 1) and can.extra_pads == (0, 0, 2, 0)
    # SAME_UPPER on a stride-2 conv: a one-sided pre-pad, trimmed to what windows read
    can = canonicalize_conv("Conv", {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (1, 3, 224, 224), (8, 3, 3, 3))
    assert can.output_shape == (1, 8, 112, 112) and can.extra_pads == (0, 0, 1, 1)


def test_fp16_and_problem_geometry():
    can = canonicalize_conv("ConvTranspose", {"strides": [2, 2], "pads": [1, 1, 1, 1]}, (2, 8, 4, 4), (8, 3, 4, 4), "float16")
    (shape,) = can.shapes
    assert (shape.direction, shape.n, shape.c, shape.k, shape.dtype) == ("dgrad", 2, 3, 8, "float16")
    assert shape.output_spatial == (4, 4) and can.output_shape == (2, 3, 8, 8)


@pytest.mark.parametrize(
    "op_type,attrs,x_shape,w_shape,message",
    [
        ("Conv", {"pads": [-1, 0, 0, 0]}, (1, 3, 8, 8), (4, 3, 3, 3), "negative pads"),
        ("Conv", {"pads": [1, 1]}, (1, 3, 8, 8), (4, 3, 3, 3), "pads has 2 entries"),
        ("Conv", {"strides": [0, 1]}, (1, 3, 8, 8), (4, 3, 3, 3), "strides must be >= 1"),
        ("Conv", {"dilations": [1]}, (1, 3, 8, 8), (4, 3, 3, 3), "dilations has 1 entries"),
        ("Conv", {}, (1, 3, 2, 2), (4, 3, 3, 3), "larger than the padded input"),
        ("Conv", {"group": 2}, (1, 3, 8, 8), (4, 1, 3, 3), "weight expects"),
        ("Conv", {"group": 3}, (1, 3, 8, 8), (4, 1, 3, 3), "does not divide"),
        ("Conv", {"kernel_shape": [5, 5]}, (1, 3, 8, 8), (4, 3, 3, 3), "kernel_shape"),
        ("Conv", {"auto_pad": "SAME"}, (1, 3, 8, 8), (4, 3, 3, 3), "unknown auto_pad"),
        ("ConvTranspose", {"strides": [2, 2], "output_padding": [2, 0]}, (1, 4, 5, 5), (4, 3, 3, 3), "output_padding"),
        ("ConvTranspose", {"pads": [3, 3, 3, 3]}, (1, 4, 2, 2), (4, 3, 3, 3), "empty output"),
    ],
)
def test_invalid_attributes_are_named(op_type, attrs, x_shape, w_shape, message):
    with pytest.raises(ConvAttributeError, match=message) as info:
        canonicalize_conv(op_type, attrs, x_shape, w_shape, node_name="block/conv")
    assert "block/conv" in str(info.value)


def test_oversized_conv_transpose_output_is_left_untuned(caplog):
    import onnx
    from conftest import conv_model

    import convpass
    from convpass.core.errors import UnsupportedConvError

    with pytest.raises(UnsupportedConvError, match="larger than"):
        canonicalize_conv("ConvTranspose", {"output_shape": [9, 9]}, (1, 4, 5, 5), (4, 3, 3, 3))
    model = conv_model("ConvTranspose", (1, 4, 5, 5), (4, 3, 3, 3), output_shape=[9, 9])
    tuned = convpass.optimize(model, quiet=True)
    assert tuned.graph.node[0].domain == "" and "left untuned" in caplog.text
    onnx.checker.check_model(tuned, full_check=True)  # (ONNX Runtime 1.31 itself refuses this case)


def test_one_geometry_for_the_compiler_and_the_executor():
    """What cuDNN cannot run still has its ONNX geometry (the reference kernels run it), with the
    reason; the compiler's entry refuses it. One rule, one type."""
    import pytest

    from convpass.core.errors import UnsupportedConvError
    from convpass.core.geometry import ConvGeometry, canonicalize_conv, conv_geometry
    from convpass.ops.conv import conv_geometry as executor_geometry

    g = conv_geometry("Conv", {"pads": [1] * 8}, (1, 2, 4, 4, 4, 4), (3, 2, 3, 3, 3, 3))
    assert isinstance(g, ConvGeometry) and g.shapes == () and "4-D convolution" in g.refusal
    assert g.output_shape == (1, 3, 4, 4, 4, 4)
    with pytest.raises(UnsupportedConvError, match="4-D convolution"):
        canonicalize_conv("Conv", {"pads": [1] * 8}, (1, 2, 4, 4, 4, 4), (3, 2, 3, 3, 3, 3))
    wide = conv_geometry("ConvTranspose", {"strides": [2, 2], "output_shape": [10, 10]}, (1, 4, 4, 4), (4, 2, 3, 3))
    assert wide.shapes == () and "larger than the transposed conv produces" in wide.refusal
    assert wide.output_shape == (1, 2, 10, 10) and min(wide.extra_pads) < 0  # zeros ONNX adds
    same = executor_geometry("Conv", {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (1, 3, 9, 10), (4, 3, 4, 3))
    assert same == canonicalize_conv("Conv", {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (1, 3, 9, 10), (4, 3, 4, 3))
