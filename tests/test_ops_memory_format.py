"""Pad and Concat keep a channels-last input channels-last (the layout planner lets them pass NHWC
through), compute the same values as on channels-first arrays, and a Pad of zeros copies nothing.

The op library runs on numpy here; a channels-last numpy array (a transposed view of an NHWC
buffer) has the same strides as the CuPy arrays the cuda backend gives these ops."""

from __future__ import annotations

import numpy as np
import pytest

from convpass.core.layout import storage_order
from convpass.kernels.backends import host_backend
from convpass.ops.registry import NodeInfo, OpContext, lookup

_RNG = np.random.default_rng(7)


def _channels_last(a: np.ndarray) -> np.ndarray:
    """``a``'s values, stored channels-last (the logical shape stays channels-first)."""
    order = (0, *range(2, a.ndim), 1)
    return np.ascontiguousarray(a.transpose(order)).transpose(np.argsort(order))


def _run(op_type: str, opset: int, attrs: dict, *inputs):
    impl = lookup(op_type, "", opset)
    node = NodeInfo(op_type.lower(), op_type, "", opset, dict(attrs), [f"i{k}" for k in range(len(inputs))], ["y"], impl)
    return impl.fn(OpContext(host_backend()), node, *inputs)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 5), (1, 4, 2, 3, 3)])
def test_storage_order_tells_channels_last_from_channels_first(shape):
    a = _RNG.standard_normal(shape).astype(np.float32)
    assert storage_order(a) is None
    assert storage_order(_channels_last(a)) == (0, *range(2, a.ndim), 1)
    # a crop of a channels-last array is still channels-last; one channel is both formats
    assert storage_order(_channels_last(a)[:, :, 1:]) == (0, *range(2, a.ndim), 1)
    assert storage_order(_channels_last(a[:, :1])) is None


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_keeps_channels_last(mode):
    x = _RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    pads = np.array([0, 0, 1, 2, 0, 1, 2, 1], np.int64)  # begin N C H W, end N C H W
    want = _run("Pad", 13, {"mode": mode}, x, pads, np.array(1.5, np.float32))
    got = _run("Pad", 13, {"mode": mode}, _channels_last(x), pads, np.array(1.5, np.float32))
    np.testing.assert_array_equal(got, want)
    assert storage_order(got) == (0, 2, 3, 1) and storage_order(want) is None
    widths = [(0, 0), (0, 1), (1, 2), (2, 1)]
    kwargs = {"constant_values": 1.5} if mode == "constant" else {}
    np.testing.assert_array_equal(want, np.pad(x, widths, mode=mode, **kwargs))


def test_pad_crops_channels_last_and_a_pad_of_zeros_is_the_input():
    x = _channels_last(_RNG.standard_normal((1, 3, 6, 6)).astype(np.float32))
    crop = _run("Pad", 13, {}, x, np.array([0, 0, -1, 0, 0, 0, 0, 2], np.int64))
    np.testing.assert_array_equal(crop, np.pad(np.asarray(x)[:, :, 1:], [(0, 0), (0, 0), (0, 0), (0, 2)]))
    assert storage_order(crop) == (0, 2, 3, 1)
    zeros = _run("Pad", 13, {}, x, np.zeros(8, np.int64))
    assert zeros is x
    with pytest.raises(Exception, match="mode 'bogus'"):
        _run("Pad", 13, {"mode": "bogus"}, x, np.zeros(8, np.int64))


def test_concat_keeps_channels_last_when_every_input_has_it():
    a = _RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    b = _RNG.standard_normal((2, 2, 4, 5)).astype(np.float32)
    want = np.concatenate([a, b], axis=1)
    for axis in (1, -3):
        got = _run("Concat", 13, {"axis": axis}, _channels_last(a), _channels_last(b))
        np.testing.assert_array_equal(got, want)
        assert storage_order(got) == (0, 2, 3, 1)
    got = _run("Concat", 13, {"axis": 2}, _channels_last(a), _channels_last(a))
    np.testing.assert_array_equal(got, np.concatenate([a, a], axis=2))
    assert storage_order(got) == (0, 2, 3, 1)
    # mixed formats: channels-first, as before
    mixed = _run("Concat", 13, {"axis": 1}, _channels_last(a), b)
    np.testing.assert_array_equal(mixed, want)
    assert mixed.flags.c_contiguous


@pytest.mark.parametrize("src_channels_last", [True, False], ids=["nhwc-src", "nchw-src"])
def test_copy_into_a_channels_last_concat_slice(src_channels_last):
    """copy_into writes exactly the slice, whatever the source's format (channels-last pairs are
    copied in their channels-last view)."""
    from convpass.native.cuda import copy_into

    rng = np.random.default_rng(7)
    buf = np.ascontiguousarray(rng.standard_normal((2, 5, 6, 7)).astype(np.float32)).transpose(0, 3, 1, 2)  # (2, 7, 5, 6) NHWC
    before = buf.copy()
    src = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    if src_channels_last:
        src = np.ascontiguousarray(src.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    copy_into(buf[:, 2:5], src)
    np.testing.assert_array_equal(buf[:, 2:5], src)
    np.testing.assert_array_equal(buf[:, :2], before[:, :2])
    np.testing.assert_array_equal(buf[:, 5:], before[:, 5:])
