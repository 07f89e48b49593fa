"""The tuner times what runs when a conv writes its output into a channel slice of a Concat's
buffer (:mod:`convpass.tuning.shape_bench`), with cuDNN stood in for by NumPy: a key that names
the output slice is checked and timed with each set's output the slice view of a wider buffer,
passed to cuDNN with its strides, the buffer's other channels left as they were; where cuDNN
refuses that (any error of a strided write), every launch writes a packed buffer and copies it
into the slice, the copy in the timed launch, and the row says so; an object that writes packed
outputs is timed with the copy from the start; a launch that reads and writes slices learns what
cuDNN refuses in the executor's order and ends as the executor runs it. Slice-write rows decide
their own problem only; a key's workspace covers each strided call its launch may make."""

from __future__ import annotations

import collections
import types

import numpy as np
import pytest
from test_slice_reads import NOT_SUPPORTED, TOTAL, _geometry
from test_slice_tuning import _bench, bench_stand_in  # noqa: F401  (the fixture)

from convpass.core import annotation
from convpass.core.cudnn_enums import STATUS
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, InputSlice, OutputSlice
from convpass.kernels import conv_exec
from convpass.kernels.convolution import Convolutions
from convpass.native import cudnn
from convpass.native.cuda import elements
from convpass.ops.conv import ConvCall
from convpass.tuning import decide, harness
from convpass.tuning.shape_bench import make_row
from convpass.tuning.tuner import candidate_keys

YS = OutputSlice(5, TOTAL)  # the conv's K = 3 output channels are channels 5..8 of the buffer
XS = InputSlice(3, TOTAL)
INTERNAL = STATUS["CUDNN_STATUS_INTERNAL_ERROR"]


def _conv(key, cp):
    return conv_exec.conv_exec(key, "implicit_gemm", cp=cp, descs=cudnn.ConvDescriptors(key))


def _outside(group) -> np.ndarray:
    wide = group["y_buffer"]
    return np.concatenate([wide[:, :YS.first], wide[:, YS.first + 3:]], axis=1)


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_a_slice_write_key_is_timed_writing_the_slice_in_place(bench_stand_in, layout):
    fake = bench_stand_in(layout)
    bench = _bench(None)
    bench.y_slice = YS
    key = bench.shape.key(layout, "default", y_slice=YS)
    row = bench.check_and_time(_conv(key, bench_stand_in.cp), True, 0.0, None)
    assert row.status == "ok" and row.key == key and row.note.endswith("output written into its slice in place")
    assert [(c[1], c[2]) for c in fake.calls] == [(None, key.y_strides)] * 4  # the check and 3 timed launches, each the slice
    for group in bench.rotation(layout):
        y = group["y"]
        assert cudnn.channel_slice(y, layout) and elements(y.strides, 4) == key.y_strides
        assert np.isnan(_outside(group)).all()  # the other channels: never written
    np.testing.assert_allclose(bench.rotation(layout)[0]["y"], bench._reference, rtol=1e-5, atol=1e-5)
    assert len([c for c in bench_stand_in.copied if c[0] == key.y_strides]) == len(bench.rotation(layout))  # the sets' making only


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_a_refused_slice_write_is_timed_with_the_copy_into_the_slice(bench_stand_in, layout):
    fake = bench_stand_in(layout, refuse=lambda xs, ys: INTERNAL if ys is not None else None)  # a strided write: any error
    bench = _bench(None)
    bench.y_slice = YS
    key = bench.shape.key(layout, "default", y_slice=YS)
    row = bench.check_and_time(_conv(key, bench_stand_in.cp), True, 0.0, None)
    assert row.status == "ok" and "output copied into its slice after (cuDNN refuses the slice" in row.note
    strides = [c[2] for c in fake.calls]
    assert strides[0] == key.y_strides and strides[1:] == [None] * 4  # refused once, then packed
    into = [c for c in bench_stand_in.copied if c[0] == key.y_strides]
    assert len(into) - len(bench.rotation(layout)) == 4  # past the sets' making: one copy after each launch
    np.testing.assert_allclose(bench.rotation(layout)[0]["y"], bench._reference, rtol=1e-5, atol=1e-5)
    assert np.isnan(_outside(bench.rotation(layout)[0])).all()


def test_an_object_that_writes_packed_outputs_is_timed_with_the_copy_from_the_start(bench_stand_in):
    fake = bench_stand_in("nhwc")
    bench = _bench(None)
    bench.y_slice = YS
    key = bench.shape.key("nhwc", "default", y_slice=YS)
    conv = _conv(key, bench_stand_in.cp)
    conv.output_strides = "packed"  # as cuDNN's fused call or an engine's plan writes
    row = bench.check_and_time(conv, True, 0.0, None)
    assert "output copied into its slice after (the object writes packed outputs)" in row.note
    assert [c[2] for c in fake.calls] == [None] * 4


def test_a_write_outside_the_slice_fails_the_check(bench_stand_in, monkeypatch):
    fake = bench_stand_in("nhwc")
    bench = _bench(None)
    bench.y_slice = YS
    key = bench.shape.key("nhwc", "default", y_slice=YS)

    def strays(descs, direction, algo, x, w, y, **kw):
        fake.run(descs, direction, algo, x, w, y, **kw)
        bench.rotation("nhwc")[0]["y_buffer"][:, 0] = 1.0  # a kernel that writes past its slice

    monkeypatch.setattr(cudnn, "run", strays)
    row = bench.check_and_time(_conv(key, bench_stand_in.cp), True, 0.0, None)
    assert row.status == "wrong_result" and "outside its output slice" in row.note


def test_the_rotation_is_sized_by_the_wide_output_buffer(bench_stand_in, monkeypatch):
    bench_stand_in("nhwc")
    sized = []
    monkeypatch.setattr(harness, "rotation_sets", lambda nbytes, limit=64: sized.append(nbytes) or 2)
    packed, sliced = _bench(None), _bench(None)
    sliced.y_slice = YS
    packed.rotation("nhwc")
    sliced.rotation("nhwc")
    y = packed._base["y"]
    assert sized[1] - sized[0] == y.nbytes * (TOTAL - 3) // 3


REFUSED = {"read": (True, False), "write": (False, True), "both": (True, True), "neither": (False, False)}
# what the tuner's check launches pass cuDNN, (x strided, y strided), in the executor's order of tries
TRIES = {"read": [(True, True), (False, True)], "write": [(True, True), (False, True), (True, False)],
         "both": [(True, True), (False, True), (True, False), (False, False)], "neither": [(True, True)]}


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("refused", list(REFUSED))
def test_a_launch_that_reads_and_writes_slices_is_timed_as_the_executor_learns_to_run_it(bench_stand_in, layout, refused):
    """DenseNet's and RRDB's convs read a slice of one Concat buffer and write into another's."""
    no_read, no_write = REFUSED[refused]
    fake = bench_stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if (no_read and xs is not None) or (no_write and ys is not None) else None)
    bench = _bench(XS)
    bench.y_slice = YS
    key = bench.shape.key(layout, "default", XS, YS)
    row = bench.check_and_time(_conv(key, bench_stand_in.cp), True, 0.0, None)
    assert row.status == "ok"
    tried = [(c[1] is not None, c[2] is not None) for c in fake.calls]
    steady = (not no_read, not no_write)
    assert tried == TRIES[refused] + [steady] * 3, tried
    assert ("input slice read in place" in row.note) == (not no_read) and ("output written into its slice in place" in row.note) == (not no_write)
    np.testing.assert_allclose(bench.rotation(layout)[0]["y"], bench._reference, rtol=1e-5, atol=1e-5)

    # the executor, on the same stand-in: after its warm-up run, the same call as the tuner timed
    fake.calls.clear()
    rt = types.SimpleNamespace(cp=bench_stand_in.cp, fuse=True, counters=collections.Counter(), capturing=False, recorded_device="",
                               current_device=None, device_id=0, is_constant=lambda a: False, warn_node=lambda node, m: pytest.fail(m),
                               note_once=lambda *a, **k: None)
    convs = Convolutions(rt)
    decision = annotation.ConvDecision(problem_key=str(key), memory_format=layout.upper(), math_mode="default", algo="implicit_gemm")
    call = ConvCall("conv", _geometry(), decision)
    group = bench.rotation(layout)[1]
    for _ in range(2):
        convs.run(call, group["x"], group["w"], None, out=group["y"])
    assert [(c[1] is not None, c[2] is not None) for c in fake.calls][-1] == steady


def test_the_decision_of_a_slice_write_problem_takes_only_its_own_rows():
    """Rows of the packed write (faster: no strided rows) never decide the slice-write problem, nor
    those of the write alone the read-and-write one; the fastest of its own rows wins, a copied one included."""
    shape = _geometry().shapes[0]
    packed, write, both = shape.key("nhwc", "default"), shape.key("nhwc", "default", y_slice=YS), shape.key("nhwc", "default", XS, YS)
    rows = [make_row(packed, "implicit_precomp_gemm", "ok", 0.10, 0, True, 0.0, "measure"),
            make_row(write, "implicit_precomp_gemm", "ok", 0.30, 0, True, 0.0, "measure", note="output copied into its slice after"),
            make_row(write, "implicit_gemm", "ok", 0.20, 0, True, 0.0, "measure", note="output written into its slice in place"),
            make_row(both, "gemm", "ok", 0.25, 0, True, 0.0, "measure")]
    options = TuneOptions(layout="nhwc", tf32="on", engines="legacy")
    assert decide.select(rows, ConvProblem((shape,), y_slice=YS), options).algo == "implicit_gemm"
    assert decide.select(rows, ConvProblem((shape,), x_slice=XS, y_slice=YS), options).key == both
    assert decide.select(rows, ConvProblem((shape,)), options).key == packed
    assert decide.select(rows, ConvProblem((shape,), x_slice=XS), options) is None
    assert {k.y_slice for k in candidate_keys(ConvProblem((shape,), y_slice=YS), TuneOptions(tf32="on"))} == {YS}


def test_a_keys_workspace_covers_each_strided_call_its_launch_may_make(monkeypatch):
    """Both slices, and each alone (what runs after cuDNN refuses the other); a strided call cuDNN
    refuses is left out (the launch is refused and copies), any other error raised."""
    shape = _geometry().shapes[0]
    key = shape.key("nhwc", "default", XS, YS)
    asked = []

    def workspace_size(descs, direction, algo, handle=None, x_strides=None, y_strides=None):
        asked.append((x_strides, y_strides))
        if x_strides is not None and y_strides is not None:
            raise cudnn.CudnnError(NOT_SUPPORTED, "both")
        return {(None, None): 8, (key.x_strides, None): 64, (None, key.y_strides): 32}[(x_strides, y_strides)]

    monkeypatch.setattr(cudnn, "workspace_size", workspace_size)
    assert conv_exec.legacy_workspace(None, key, "implicit_gemm") == 64
    assert asked == [(None, None), (key.x_strides, key.y_strides), (key.x_strides, None), (None, key.y_strides)]
    asked.clear()
    assert conv_exec.legacy_workspace(None, shape.key("nhwc", "default", y_slice=YS), "implicit_gemm") == 32
    assert asked == [(None, None), (None, key.y_strides)]
    monkeypatch.setattr(cudnn, "workspace_size", lambda *a, **k: (_ for _ in ()).throw(cudnn.CudnnError(INTERNAL, "x")) if k.get("x_strides") else 0)
    with pytest.raises(cudnn.CudnnError):
        conv_exec.legacy_workspace(None, shape.key("nhwc", "default", XS), "implicit_gemm")

