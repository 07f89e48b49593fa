"""cuDNN's forward calls given slices (:mod:`convpass.native.cudnn.api`), with the library stood in
for: ``x_strides`` / ``y_strides`` become tensor descriptors of those strides (one per strides),
used by the call and by the workspace query; an array whose strides are not the ones described is
refused before cuDNN is called; strides are for the forward direction only."""

from __future__ import annotations

import itertools
import types

import pytest

from convpass.core.problem import ConvShape
from convpass.native.cudnn import api, library
from convpass.native.cudnn.descriptors import ConvDescriptors

SHAPE = ConvShape("fwd", 2, 4, 3, (5, 5), (3, 3), (1, 1), (1, 1), (1, 1))
KEY = SHAPE.key("nhwc", "default")
X_SLICE = (250, 1, 50, 10)  # channels 0:4 of a 10-channel NHWC buffer of 5x5 pixels
Y_SLICE = (200, 1, 40, 8)


class FakeLibrary:
    """The cuDNN functions the descriptors and the forward calls use: descriptors numbered, tensor
    descriptors' dims and strides kept, every other call recorded with its arguments."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.tensors: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.calls: list[tuple[str, tuple]] = []

    def function(self, name: str):
        def fn(*args):
            if name.startswith("cudnnCreate") and name.endswith("Descriptor"):
                args[0]._obj.value = next(self.ids)
            elif name == "cudnnSetTensorNdDescriptor":
                h, _, nd, dims, strides = args
                self.tensors[h] = (tuple(dims[:nd]), tuple(strides[:nd]))
            elif name == "cudnnGetConvolutionNdForwardOutputDim":
                out = args[-1]
                for i, d in enumerate(SHAPE.y_shape):
                    out[i] = d
            elif name == "cudnnGetConvolutionForwardWorkspaceSize":
                args[-1]._obj.value = 64
                self.calls.append((name, args))
            elif not name.startswith(("cudnnSet", "cudnnDestroy")):
                self.calls.append((name, args))
            return 0

        return fn

    def strides_of(self, desc: int) -> tuple[int, ...]:
        return self.tensors[desc][1]


class Array:
    """What :func:`~convpass.native.cudnn.arrays.checked_pointer` reads of a CuPy array."""

    def __init__(self, shape, strides, ptr=4096):
        self.shape, self.dtype, self.itemsize = tuple(shape), "float32", 4
        self.strides = tuple(4 * s for s in strides)
        self.data = types.SimpleNamespace(ptr=ptr)


@pytest.fixture
def lib(monkeypatch):
    fake = FakeLibrary()
    monkeypatch.setattr(library, "function", fake.function)
    return fake


def _packed(shape):
    from convpass.native.cudnn.descriptors import strides_for

    return strides_for(shape, "nhwc")


def test_slices_are_described_with_their_strides_in_the_call_and_the_workspace_query(lib):
    descs = ConvDescriptors(KEY)
    x, y = Array(SHAPE.x_shape, X_SLICE), Array(SHAPE.y_shape, Y_SLICE)
    w = Array(SHAPE.w_shape, _packed(SHAPE.w_shape))
    assert api.workspace_size(descs, None, "implicit_gemm", handle=1, x_strides=X_SLICE, y_strides=Y_SLICE) == 64
    api.run(descs, None, "implicit_gemm", x, w, y, workspace=(0, 0), handle=1, x_strides=X_SLICE, y_strides=Y_SLICE)
    api.run(descs, None, "implicit_gemm", x, w, y, workspace=(0, 0), handle=1, x_strides=X_SLICE, y_strides=Y_SLICE)
    [(_, query), (_, first), (_, second)] = lib.calls
    assert (lib.strides_of(query[1]), lib.strides_of(query[4])) == (X_SLICE, Y_SLICE)
    assert (lib.strides_of(first[2]), lib.strides_of(first[11])) == (X_SLICE, Y_SLICE)
    assert (first[2], first[11]) == (second[2], second[11]) == (query[1], query[4])  # made once per strides
    assert (first[2], first[11]) != (descs.x, descs.y)
    assert lib.strides_of(descs.x) == _packed(SHAPE.x_shape)  # the packed descriptors stay as they were
    lib.calls.clear()
    packed = Array(SHAPE.x_shape, _packed(SHAPE.x_shape))
    api.run(descs, None, "implicit_gemm", packed, w, y, workspace=(0, 0), handle=1, y_strides=Y_SLICE)
    [(_, call)] = lib.calls
    assert call[2] == descs.x and lib.strides_of(call[11]) == Y_SLICE


def test_the_fused_call_reads_a_slice_through_its_descriptor(lib):
    descs = ConvDescriptors(KEY)
    x, y = Array(SHAPE.x_shape, X_SLICE), Array(SHAPE.y_shape, _packed(SHAPE.y_shape))
    w, b = Array(SHAPE.w_shape, _packed(SHAPE.w_shape)), Array((3,), (1,))
    api.conv_bias_activation_forward(descs, "implicit_precomp_gemm", x, w, y, b, activation="identity", workspace=(0, 0), handle=1, x_strides=X_SLICE)
    [(name, args)] = lib.calls
    assert name == "cudnnConvolutionBiasActivationForward"
    assert lib.strides_of(args[2]) == X_SLICE and args[11] == args[16] == descs.y


def test_an_array_whose_strides_are_not_the_ones_described_is_refused(lib):
    descs = ConvDescriptors(KEY)
    w = Array(SHAPE.w_shape, _packed(SHAPE.w_shape))
    y = Array(SHAPE.y_shape, _packed(SHAPE.y_shape))
    other = Array(SHAPE.x_shape, (300, 1, 60, 12))  # a slice of a 12-channel buffer
    with pytest.raises(ValueError, match=r"x: element strides \(300, 1, 60, 12\) do not match the descriptor's \(250, 1, 50, 10\)"):
        api.run(descs, None, "implicit_gemm", other, w, y, workspace=(0, 0), handle=1, x_strides=X_SLICE)
    with pytest.raises(ValueError, match="do not match the descriptor's"):  # a slice described as packed
        api.run(descs, None, "implicit_gemm", other, w, y, workspace=(0, 0), handle=1)
    assert lib.calls == []


def test_strides_are_for_the_forward_direction(lib):
    dkey = SHAPE.with_direction("dgrad").key("nhwc", "default")
    descs = ConvDescriptors(dkey)
    with pytest.raises(ValueError, match="forward direction"):
        api.workspace_size(descs, None, "algo_1", handle=1, x_strides=X_SLICE)
    x = Array(SHAPE.x_shape, X_SLICE)
    with pytest.raises(ValueError, match="forward direction"):
        api.run(descs, None, "algo_1", x, Array(SHAPE.w_shape, _packed(SHAPE.w_shape)), Array(SHAPE.y_shape, _packed(SHAPE.y_shape)),
                workspace=(0, 0), handle=1, x_strides=X_SLICE)
