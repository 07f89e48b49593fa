"""A forward conv writes its output into its channel slice of a Concat buffer
(:mod:`convpass.kernels.conv_slices`, rule 1), with cuDNN stood in for by NumPy: the slice reaches
``cudnn.run`` with its strides and is counted in ``slice_writes``; where cuDNN refuses it, or the
object writes packed outputs (cuDNN's fused call), the conv writes a packed buffer copied into the
slice, counted in ``slice_write_copies``; such a copy under a decision whose problem key does not
name that slice (the tuner timed a packed write) is warned once per model, apart from the reads'
warning; one under a key that names it (the tuner timed the copy) only said at debug level; a
slice in another memory format is a transpose the layout plan prices: counted, not said. Every
output is checked against the reference convolution, and the buffer's other channels untouched."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_slice_reads import LAYOUTS, NOT_SUPPORTED, TOTAL, C, K, _buffer, _convs, _geometry, _want, _warned, _weight, stand_in  # noqa: F401

from convpass.core import annotation
from convpass.core.cudnn_enums import STATUS
from convpass.core.problem import InputSlice, OutputSlice
from convpass.native import cudnn
from convpass.native.cuda import elements
from convpass.ops.conv import ConvCall
from convpass.runtime.cuda.backend import launch_counters

FIRST = 5  # the conv's K = 3 outputs are channels 5..8 of the TOTAL-channel buffer
INTERNAL = STATUS["CUDNN_STATUS_INTERNAL_ERROR"]


def _call(layout: str, algo: str = "implicit_gemm", fusion: str | None = None, x_slice=None, y_slice=None, name: str = "conv") -> ConvCall:
    key = _geometry().shapes[0].key(layout, "default", x_slice, y_slice)
    decision = annotation.ConvDecision(problem_key=str(key), memory_format=layout.upper(), math_mode="default", algo=algo, fusion=fusion)
    return ConvCall(name, _geometry(), decision)


def _out(layout: str, seed: int = 5):
    """(buffer, the conv's slice of it) of a TOTAL-channel Concat buffer in ``layout``."""
    buf = _buffer(layout, seed=seed)
    return buf, buf[:, FIRST:FIRST + K]


def _others_untouched(buf, layout, seed: int = 5) -> None:
    np.testing.assert_array_equal(np.delete(buf, np.s_[FIRST:FIRST + K], axis=1), np.delete(_buffer(layout, seed=seed), np.s_[FIRST:FIRST + K], axis=1))


def _x(layout):
    return cudnn.as_layout(np.ascontiguousarray(_buffer(layout, channels=C, seed=2)), layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_slice_write_reaches_cudnn_with_its_strides_and_is_counted(stand_in, layout):
    fake = stand_in(layout)
    convs = _convs(stand_in.cp)
    buf, out = _out(layout)
    x, w = _x(layout), _weight()
    y = convs.run(_call(layout, y_slice=OutputSlice(FIRST, TOTAL)), x, w, None, out=out)
    assert y is out and fake.calls == [("cudnnConvolutionForward", None, elements(out.strides, 4))]
    assert convs.rt.counters["slice_writes"] == 1 and convs.rt.counters["slice_write_copies"] == 0
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)
    _others_untouched(buf, layout)
    assert _warned(convs) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refused_slice_write_the_tuner_priced_is_copied_counted_and_not_warned(stand_in, layout, caplog):
    fake = stand_in(layout, refuse=lambda xs, ys: INTERNAL if ys is not None else None)  # a strided write: any error
    convs = _convs(stand_in.cp)
    buf, out = _out(layout)
    x, w = _x(layout), _weight()
    call = _call(layout, y_slice=OutputSlice(FIRST, TOTAL))
    with caplog.at_level(logging.DEBUG, logger="convpass"):
        for _ in range(2):
            convs.run(call, x, w, None, out=out)
    assert [c[2] for c in fake.calls] == [elements(out.strides, 4), None, None]  # tried once, then packed every time
    assert convs.resolve(call, x.dtype).strided_output_ok is False
    assert convs.rt.counters["slice_write_copies"] == 2 and convs.rt.counters["slice_writes"] == 0
    assert _warned(convs) == [] and any("refuses to write into a Concat slice" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)
    _others_untouched(buf, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refused_slice_write_under_a_packed_decision_is_warned_once(stand_in, layout):
    stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if ys is not None else None)
    convs = _convs(stand_in.cp)
    _, out = _out(layout)
    x, w = _x(layout), _weight()
    for name in ("conv_a", "conv_b"):
        convs.run(_call(layout, name=name), x, w, None, out=out)
    (warning,) = _warned(convs)
    assert "node 'conv_a'" in warning and "its output is a channel slice" in warning and "copied on every run" in warning
    assert sum("conv_b" in m for _, m, _ in convs.rt.notes) == 1  # in the notes, not warned
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_wider_buffer_than_the_key_timed_is_an_unpriced_copy(stand_in, layout):
    stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if ys is not None else None)
    convs = _convs(stand_in.cp)
    out = _buffer(layout, channels=TOTAL + 6)[:, FIRST:FIRST + K]
    convs.run(_call(layout, y_slice=OutputSlice(FIRST, TOTAL)), _x(layout), _weight(), None, out=out)
    (warning,) = _warned(convs)
    assert "its output is a channel slice" in warning


@pytest.mark.parametrize("priced", [False, True])
def test_cudnns_fused_call_writes_packed_and_its_copy_is_counted(stand_in, priced):
    """A recorded fused conv + bias + ReLU call writes a packed output (cuDNN's fused call takes no
    output strides here): copied into the slice, warned unless the key names the slice."""
    fake = stand_in("nhwc")
    convs = _convs(stand_in.cp)
    buf, out = _out("nhwc")
    x, w = _x("nhwc"), _weight()
    b = np.random.default_rng(2).standard_normal(K).astype(np.float32)
    call = _call("nhwc", "implicit_precomp_gemm", fusion="bias+relu", y_slice=OutputSlice(FIRST, TOTAL) if priced else None)
    convs.run(call, x, w, b, relu=True, out=out, fusion="")
    assert fake.calls == [("cudnnConvolutionBiasActivationForward", None, None)]
    assert convs.rt.counters["slice_write_copies"] == 1 and convs.rt.counters["fused_relu"] == 1
    assert len(_warned(convs)) == (0 if priced else 1)
    if not priced:
        assert "writes packed outputs only" in _warned(convs)[0]
    np.testing.assert_allclose(out, _want(x, w, b, relu=True), rtol=1e-5, atol=1e-5)
    _others_untouched(buf, "nhwc")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_slice_in_another_memory_format_is_copied_and_counted_not_warned(stand_in, layout):
    fake = stand_in(layout)
    convs = _convs(stand_in.cp)
    other = "nchw" if layout == "nhwc" else "nhwc"
    buf, out = _out(other)
    x, w = _x(layout), _weight()
    convs.run(_call(layout), x, w, None, out=out)
    assert [c[2] for c in fake.calls] == [None]
    assert convs.rt.counters["slice_write_copies"] == 1 and _warned(convs) == []
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)
    _others_untouched(buf, other)


def test_an_unpriced_read_and_an_unpriced_write_are_each_said_once(stand_in):
    """DenseNet's or RRDB's conv reads a slice and writes one; cuDNN refuses both, the decision timed
    packed: one warning for the input, one for the output."""
    stand_in("nhwc", refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None or ys is not None else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer("nhwc")[:, 2:2 + C], _weight()
    buf, out = _out("nhwc", seed=7)
    convs.run(_call("nhwc"), x, w, None, out=out)
    warned = _warned(convs)
    assert len(warned) == 2 and "its input" in warned[0] and "its output" in warned[1]
    assert convs.rt.counters["slice_copies"] == 1 and convs.rt.counters["slice_write_copies"] == 1
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)
    _others_untouched(buf, "nhwc", seed=7)


def test_a_read_and_write_key_priced_both_copies(stand_in):
    stand_in("nhwc", refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None or ys is not None else None)
    convs = _convs(stand_in.cp)
    x, w = _buffer("nhwc")[:, 2:2 + C], _weight()
    _, out = _out("nhwc", seed=7)
    convs.run(_call("nhwc", x_slice=InputSlice(2, TOTAL), y_slice=OutputSlice(FIRST, TOTAL)), x, w, None, out=out)
    assert _warned(convs) == [] and convs.rt.counters["slice_write_copies"] == 1
    np.testing.assert_allclose(out, _want(x, w), rtol=1e-5, atol=1e-5)


def test_the_backend_counts_slice_writes_from_zero():
    counters = launch_counters()
    assert counters["slice_writes"] == 0 and counters["slice_write_copies"] == 0
