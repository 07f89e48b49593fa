"""A forward conv run by cuDNN's legacy API reads a channel slice of a Concat buffer in place
(:mod:`convpass.kernels.convolution`, "Reading slices"), with cuDNN stood in for by NumPy: the
slice reaches ``cudnn.run`` (or the fused call) with its strides and nothing is copied; a refusal
falls back to the copy once and is remembered, said once at debug level; a launch that read and
wrote slices learns which one cuDNN refuses; a refusal while capturing breaks the capture; an input
neither packed nor such a slice is still copied. Every output is checked against the reference
convolution of the packed input."""

from __future__ import annotations

import collections
import logging
import sys
import types

import numpy as np
import pytest

from convpass.core import annotation
from convpass.core.cudnn_enums import STATUS, CudnnError
from convpass.core.problem import InputSlice, ProblemKey
from convpass.kernels import conv_exec
from convpass.kernels.conv_exec import refuses_slice
from convpass.kernels.convolution import Convolutions
from convpass.native import cudnn
from convpass.native.cuda import CaptureBreak, elements
from convpass.ops.conv import ConvCall, conv_geometry, conv_reference

N, C, TOTAL, K, HW = 2, 4, 10, 3, 5  # a conv of C channels reading channels of a TOTAL-channel buffer
NOT_SUPPORTED = STATUS["CUDNN_STATUS_NOT_SUPPORTED"]


def _geometry():
    return conv_geometry("Conv", {"pads": [1, 1, 1, 1]}, (N, C, HW, HW), (K, C, 3, 3))


def _buffer(layout: str, channels: int = TOTAL, seed: int = 0) -> np.ndarray:
    """A float32 buffer of logical shape (N, channels, HW, HW) stored in ``layout``."""
    data = np.random.default_rng(seed).standard_normal((N, channels, HW, HW)).astype(np.float32)
    if layout == "nchw":
        return data
    out = np.empty((N, HW, HW, channels), np.float32).transpose(0, 3, 1, 2)
    out[...] = data
    return out


class Cudnn:
    """cuDNN's forward calls stood in for: each call's strides recorded; the arrays checked against
    them as :func:`convpass.native.cudnn.arrays.checked_pointer` does; ``refuse(x_strides,
    y_strides)`` names the status of a refusal (None: run); the conv computed by the reference."""

    def __init__(self, layout: str, refuse=lambda xs, ys: None, workspace: int = 0) -> None:
        self.layout, self.refuse, self.workspace = layout, refuse, workspace
        self.calls: list[tuple[str, tuple | None, tuple | None]] = []

    def _check(self, a, strides):
        if strides is None:
            assert cudnn.layout_of(a) in (self.layout, "both"), (a.shape, a.strides)
        else:
            assert elements(a.strides, a.itemsize) == strides

    def _conv(self, call, x, w, y, x_strides, y_strides):
        self.calls.append((call, x_strides, y_strides))
        for a, strides in ((x, x_strides), (y, y_strides)):
            self._check(a, strides)
        status = self.refuse(x_strides, y_strides)
        if status is not None:
            raise CudnnError(status, call)
        return conv_reference(np, x, w, None, _geometry())

    def run(self, descs, direction, algo, x, w, y, workspace=None, x_strides=None, y_strides=None):
        y[...] = self._conv("cudnnConvolutionForward", x, w, y, x_strides, y_strides)

    def fused(self, descs, algo, x, w, y, bias, z=None, activation="relu", workspace=None, x_strides=None, y_strides=None):
        v = self._conv("cudnnConvolutionBiasActivationForward", x, w, y, x_strides, y_strides) + bias.reshape(1, -1, 1, 1)
        if z is not None:
            self._check(z, None)  # the residual reaches cuDNN packed in the conv's format
            v = v + z
        y[...] = np.maximum(v, 0) if activation == "relu" else v

    def workspace_size(self, descs, direction, algo, handle=None, x_strides=None, y_strides=None):
        return self.workspace if x_strides is not None or y_strides is not None else 0


@pytest.fixture
def stand_in(monkeypatch):
    """Install a :class:`Cudnn` for ``layout`` (and the NumPy CuPy the executor's arrays come from)."""
    fake_cp = types.ModuleType("cupy")
    fake_cp.empty, fake_cp.uint8, fake_cp.ascontiguousarray = np.empty, np.uint8, np.ascontiguousarray
    fake_cp.maximum = np.maximum
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: types.SimpleNamespace(key=key))
    monkeypatch.setattr(conv_exec, "epilogue_kernel", _numpy_epilogue)

    def install(layout: str, **kw) -> Cudnn:
        fake = Cudnn(layout, **kw)
        monkeypatch.setattr(cudnn, "run", fake.run)
        monkeypatch.setattr(cudnn, "conv_bias_activation_forward", fake.fused)
        monkeypatch.setattr(cudnn, "workspace_size", fake.workspace_size)
        return fake

    install.cp = fake_cp
    return install


def _numpy_epilogue(cp, bias, residual, relu):
    def run(*args):
        *operands, y = args
        v = y + sum(operands) if operands else y.copy()
        y[...] = np.where(v < 0, 0, v) if relu else v

    return run


def _convs(cp) -> Convolutions:
    """The conv state of a stand-in backend whose ``notes`` keep what :meth:`note_once` was told,
    as ``(tag, message, warned)``, once per tag (the backend's rule)."""
    notes: list[tuple[str, str, bool]] = []

    def note_once(tag, message, warn=True, category=None):
        if tag not in {t for t, _, _ in notes}:
            notes.append((tag, message, warn))

    rt = types.SimpleNamespace(cp=cp, fuse=True, counters=collections.Counter(), capturing=False, recorded_device="",
                               current_device=None, device_id=0, is_constant=lambda a: False,
                               warn_node=lambda node, m: pytest.fail(m), note_once=note_once, notes=notes)
    return Convolutions(rt)


def _warned(convs) -> list[str]:
    return [m for _, m, warn in convs.rt.notes if warn]


def _call(layout: str, algo: str = "implicit_gemm", fusion: str | None = None, x_slice=None) -> ConvCall:
    key = _geometry().shapes[0].key(layout, "default", x_slice)
    decision = annotation.ConvDecision(problem_key=str(key), memory_format=layout.upper(), math_mode="default", algo=algo, fusion=fusion)
    return ConvCall("conv", _geometry(), decision)


def _weight() -> np.ndarray:
    return (np.random.default_rng(1).standard_normal((K, C, 3, 3)) * 0.3).astype(np.float32)


def _want(x, w, b=None, relu=False):
    y = conv_reference(np, np.ascontiguousarray(x), w, b, _geometry())
    return np.maximum(y, 0) if relu else y


LAYOUTS = ["nhwc", "nchw"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("first", [0, 3], ids=["leading", "inner"])
def test_a_channel_slice_reaches_cudnn_with_its_strides_and_is_not_copied(stand_in, layout, first):
    fake = stand_in(layout)
    convs = _convs(stand_in.cp)
    buf, w = _buffer(layout), _weight()
    x = buf[:, first:first + C]
    assert cudnn.channel_slice(x, layout) and cudnn.layout_of(x) not in (layout, "both")
    y = convs.run(_call(layout), x, w, None)
    assert fake.calls == [("cudnnConvolutionForward", elements(x.strides, 4), None)]
    assert convs.rt.counters["layout_copies"] == 0 and convs.rt.counters["slice_reads"] == 1
    np.testing.assert_allclose(y, _want(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refused_slice_read_falls_back_to_the_copy_once_and_is_remembered(stand_in, layout, caplog):
    fake = stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer(layout)[:, 2:2 + C], _weight()
    call = _call(layout)
    with caplog.at_level(logging.DEBUG, logger="convpass"):
        first = convs.run(call, x, w, None)
        second = convs.run(call, x, w, None)
    strided = elements(x.strides, 4)
    assert [c[1] for c in fake.calls] == [strided, None, None]  # tried once, then copied every time
    assert convs.resolve(call, x.dtype).strided_input_ok is False
    assert convs.rt.counters["layout_copies"] == 2 and convs.rt.counters["slice_reads"] == 0
    said = [r for r in caplog.records if "refuses to read from a Concat slice" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG and "'conv'" in said[0].getMessage()
    # the decision was timed reading a packed input: a copy on every run it never priced, said once
    (warning,) = _warned(convs)
    assert "node 'conv'" in warning and "'implicit_gemm'" in warning and "copied on every run" in warning
    for y in (first, second):
        np.testing.assert_allclose(y, _want(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refusal_the_tuner_priced_is_not_warned(stand_in, layout, caplog):
    """A decision whose problem key names the slice was timed reading it (or with the copy cuDNN's
    refusal needs): the refusal is expected, said at debug level only; the strided workspace was
    asked of cuDNN for the key."""
    fake = stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer(layout)[:, 2:2 + C], _weight()
    call = _call(layout, x_slice=InputSlice(2, TOTAL))
    assert ProblemKey.parse(call.decision.problem_key).x_strides == elements(x.strides, 4)
    with caplog.at_level(logging.DEBUG, logger="convpass"):
        y = convs.run(call, x, w, None)
    assert [c[1] for c in fake.calls] == [elements(x.strides, 4), None]
    assert _warned(convs) == [] and any("refuses to read from a Concat slice" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(y, _want(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refused_slice_is_counted_as_a_slice_copy(stand_in, layout):
    stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer(layout)[:, 2:2 + C], _weight()
    for _ in range(2):
        convs.run(_call(layout), x, w, None)
    assert convs.rt.counters["slice_copies"] == 2 and convs.rt.counters["slice_reads"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_slice_of_other_strides_than_the_key_timed_is_an_unpriced_copy(stand_in, layout):
    """The key names a slice of a TOTAL-channel buffer; the runtime's slice is of a wider one (an
    outer Concat's): the copy cuDNN's refusal needs was not the one the tuner timed, so it is said."""
    stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer(layout, channels=TOTAL + 6)[:, 2:2 + C], _weight()
    y = convs.run(_call(layout, x_slice=InputSlice(2, TOTAL)), x, w, None)
    (warning,) = _warned(convs)
    assert "node 'conv'" in warning and "copied on every run" in warning
    np.testing.assert_allclose(y, _want(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_residual_slice_is_copied_counted_and_noted(stand_in, layout):
    stand_in(layout)
    convs = _convs(stand_in.cp)
    x, w = np.ascontiguousarray(_buffer(layout)[:, :C]), _weight()
    x = cudnn.as_layout(x, layout)
    b = np.linspace(-1, 1, K).astype(np.float32)
    z = cudnn.as_layout(_buffer(layout, channels=K + 4, seed=3), layout)[:, 1:1 + K]
    z = z[:, :, 1:-1, 1:-1] if z.shape[2] > _geometry().output_shape[2] else z
    assert cudnn.channel_slice(z, layout)
    y = convs.run(_call(layout, fusion="bias+add"), x, w, b, z=z)
    assert convs.rt.counters["residual_copies"] == 1
    assert any(tag == "residual-copy:conv" and not warn for tag, _, warn in convs.rt.notes)
    np.testing.assert_allclose(y, _want(x, w, b) + z, rtol=1e-5, atol=1e-5)


def test_an_epilogue_with_a_residual_and_none_given_is_an_error(stand_in):
    stand_in("nhwc")
    convs = _convs(stand_in.cp)
    with pytest.raises(ValueError, match="adds a residual"):
        convs._activate(np.zeros((1, 2, 3, 3), np.float32), "bias+swish+add", None)


def test_two_refused_convs_warn_once_per_model(stand_in):
    stand_in("nhwc", refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer("nhwc")[:, 2:2 + C], _weight()
    for name in ("conv_a", "conv_b"):
        call = _call("nhwc")
        convs.run(ConvCall(name, call.geometry, call.decision), x, w, None)
    assert len(_warned(convs)) == 1 and "conv_a" in _warned(convs)[0]
    assert sum("conv_b" in m for _, m, _ in convs.rt.notes) == 1  # in the notes, not warned


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refusal_while_capturing_breaks_the_capture(stand_in, layout):
    stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    convs = _convs(stand_in.cp)
    convs.rt.capturing = True
    call = _call(layout)
    with pytest.raises(CaptureBreak, match="refused to read from a Concat slice during capture"):
        convs.run(call, _buffer(layout)[:, :C], _weight(), None)
    assert convs.resolve(call, np.float32).strided_input_ok  # nothing learned: the warm-up run learns


@pytest.mark.parametrize("layout", LAYOUTS)
def test_another_cudnn_error_of_a_slice_read_is_no_refusal(stand_in, layout):
    internal = STATUS["CUDNN_STATUS_INTERNAL_ERROR"]
    assert refuses_slice(CudnnError(NOT_SUPPORTED, "c"), False) and refuses_slice(CudnnError(STATUS["CUDNN_STATUS_BAD_PARAM"], "c"), False)
    assert not refuses_slice(CudnnError(internal, "c"), False) and not refuses_slice(ValueError("v"), True)
    assert refuses_slice(CudnnError(internal, "c"), True)  # a strided write: any error, as ever


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["spatial crop", "other memory order", "one sample packed"])
def test_an_input_that_is_no_slice_in_the_convs_order_is_still_copied(stand_in, layout, case):
    fake = stand_in(layout)
    convs = _convs(stand_in.cp)
    w = _weight()
    if case == "spatial crop":  # not a channel slice: its rows lie apart
        big = conv_geometry("Conv", {"pads": [1, 1, 1, 1]}, (N, C, HW + 2, HW + 2), (K, C, 3, 3))
        assert big.shapes
        buf = np.empty((N, HW + 2, HW + 2, TOTAL), np.float32).transpose(0, 3, 1, 2) if layout == "nhwc" else np.empty((N, TOTAL, HW + 2, HW + 2), np.float32)
        buf[...] = np.random.default_rng(3).standard_normal(buf.shape)
        x = buf[:, :C, 1:1 + HW, 1:1 + HW]
    elif case == "other memory order":
        x = _buffer("nchw" if layout == "nhwc" else "nhwc")[:, :C]
    else:  # a slice of one sample of a channels-first buffer is packed: nothing to copy or describe
        x = _buffer(layout, channels=C)
    assert not cudnn.channel_slice(x, layout)
    y = convs.run(_call(layout), x, w, None)
    assert [c[1] for c in fake.calls] == [None]
    packed = cudnn.layout_of(x) in (layout, "both")
    assert convs.rt.counters["layout_copies"] == (0 if packed else 1) and convs.rt.counters["slice_reads"] == 0
    np.testing.assert_allclose(y, _want(x, w), rtol=1e-5, atol=1e-5)


REFUSED = {"read": (True, False), "write": (False, True), "both": (True, True), "neither": (False, False)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("refused", list(REFUSED))
def test_a_launch_that_reads_and_writes_slices_learns_which_one_cudnn_refuses(stand_in, layout, refused):
    """DenseNet's and RRDB's convs read a slice of one Concat buffer and write into another's."""
    no_read, no_write = REFUSED[refused]
    fake = stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if (no_read and xs is not None) or (no_write and ys is not None) else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer(layout)[:, 1:1 + C], _weight()
    out_buf = _buffer(layout, seed=5)
    out = out_buf[:, 4:4 + K]
    call = _call(layout)
    y = convs.run(call, x, w, None, out=out)
    assert y is out
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)
    ex = convs.resolve(call, x.dtype)
    assert (ex.strided_input_ok, ex.strided_output_ok) == (not no_read, not no_write)
    xs, ys = elements(x.strides, 4), elements(out.strides, 4)
    fake.calls.clear()
    out[...] = 0
    convs.run(call, x, w, None, out=out)  # as learned: one call
    assert fake.calls == [("cudnnConvolutionForward", None if no_read else xs, None if no_write else ys)]
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.delete(out_buf, np.s_[4:4 + K], axis=1), np.delete(_buffer(layout, seed=5), np.s_[4:4 + K], axis=1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cudnns_fused_call_reads_a_slice_too_and_falls_back_to_the_copy_alone(stand_in, layout):
    """A recorded fused conv + bias + ReLU call reads the slice; when cuDNN refuses that, the same
    fused call runs on a copy (the fusion is not what it refused)."""
    fake = stand_in(layout)
    convs = _convs(stand_in.cp)
    x, w = _buffer(layout)[:, 3:3 + C], _weight()
    b = np.random.default_rng(2).standard_normal(K).astype(np.float32)
    call = _call(layout, "implicit_precomp_gemm", fusion="bias+relu")
    y = convs.run(call, x, w, b, relu=True, fusion="")
    assert fake.calls == [("cudnnConvolutionBiasActivationForward", elements(x.strides, 4), None)]
    assert convs.rt.counters["fused_relu"] == 1 and convs.rt.counters["layout_copies"] == 0
    want = _want(x, w, b, relu=True)
    assert 0.2 < (want > 0).mean() < 0.8
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)

    refusing = stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    convs = _convs(stand_in.cp)
    y = convs.run(call, x, w, b, relu=True, fusion="")
    assert [(c[0], c[1] is not None) for c in refusing.calls] == [("cudnnConvolutionBiasActivationForward", True),
                                                                  ("cudnnConvolutionBiasActivationForward", False)]
    ex = convs.resolve(call, x.dtype, "")
    assert ex.strided_input_ok is False and ex.fuse_relu_ok and ex.fused_call == "bias+relu"
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_strided_call_that_needs_more_workspace_is_refused_before_cudnn_runs(stand_in, layout, caplog):
    """cuDNN is asked the workspace of the strided call once; more than the decision's is a refusal."""
    fake = stand_in(layout, workspace=1 << 20)
    convs = _convs(stand_in.cp)
    x, w = _buffer(layout)[:, :C], _weight()
    call = _call(layout)
    with caplog.at_level(logging.DEBUG, logger="convpass"):
        y = convs.run(call, x, w, None)
    assert [c[1] for c in fake.calls] == [None]  # cuDNN never got the slice
    assert convs.resolve(call, x.dtype).strided_input_ok is False
    assert any("1048576 B of workspace needed, 0 B given" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(y, _want(x, w), rtol=1e-5, atol=1e-5)


def test_channel_slices_are_told_from_other_strided_arrays():
    for layout in LAYOUTS:
        buf = _buffer(layout)
        assert cudnn.channel_slice(buf[:, :C], layout) and cudnn.channel_slice(buf[:, 6:], layout)
        assert not cudnn.channel_slice(buf, layout)  # packed: no slice
        assert not cudnn.channel_slice(buf[:, :C, 1:4], layout)  # a crop
        assert not cudnn.channel_slice(buf[:, ::2], layout)  # every other channel
        other = "nchw" if layout == "nhwc" else "nhwc"
        assert not cudnn.channel_slice(buf[:, :C], other)
    one = _buffer("nhwc")[:1, 2:6]  # one channels-last sample: its pixels the buffer's channels apart
    assert cudnn.channel_slice(one, "nhwc") and not cudnn.channel_slice(_buffer("nchw")[:1, 2:6], "nchw")  # the latter is packed
