"""The tuner times what runs when a conv reads a channel slice (:mod:`convpass.tuning.shape_bench`),
with cuDNN stood in for by NumPy: a key that names the slice is checked and timed with each set's
input the slice view of a wider buffer, passed to cuDNN with its strides; where cuDNN refuses
that, every launch copies the input into a packed buffer first (the executor's copy), the copy
inside the timed launch, and the row says so; a candidate whose object reads packed inputs is
timed with the copy from the start; a packed key is timed as ever. The decision of a slice
problem takes only its own rows."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from test_slice_reads import NOT_SUPPORTED, Cudnn, _geometry, _numpy_epilogue

from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, InputSlice
from convpass.kernels import conv_exec
from convpass.native import cuda, cudnn
from convpass.native.cuda import elements
from convpass.ops.conv import conv_reference
from convpass.tuning import decide, harness
from convpass.tuning.shape_bench import ShapeBench, make_row

TOTAL = 10
SLICE = InputSlice(3, TOTAL)


@pytest.fixture
def bench_stand_in(monkeypatch):
    """NumPy in place of CuPy and cuDNN for one ShapeBench: ``install(layout, refuse=...)`` gives
    the :class:`~test_slice_reads.Cudnn` stand-in; ``copies`` / ``copied`` record every
    ``copy_into`` (the source's strides / the destination's and the source's)."""
    fake_cp = types.ModuleType("cupy")
    fake_cp.empty, fake_cp.uint8, fake_cp.float32 = np.empty, np.uint8, np.float32
    fake_cp.ascontiguousarray, fake_cp.maximum, fake_cp.isnan = np.ascontiguousarray, np.maximum, np.isnan
    fake_cp.cuda = types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: types.SimpleNamespace(key=key))
    monkeypatch.setattr(conv_exec, "epilogue_kernel", _numpy_epilogue)
    rng = np.random.default_rng(7)
    monkeypatch.setattr(harness, "random_array", lambda shape, dtype, layout, seed, scale=1.0: _stored(
        (rng.standard_normal(shape) * scale).astype(np.float32), layout))
    monkeypatch.setattr(harness, "rotation_sets", lambda nbytes, limit=64: 3)
    monkeypatch.setattr(harness, "to_float32", lambda a, dtype: a.astype(np.float32))
    monkeypatch.setattr(harness, "relative_error", lambda out, ref: float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))

    def first_launch_ms(launch):
        launch()
        return 1.0

    def time_launches(launch, sets, best_ms=None, first_ms=None, **kw):
        for i in range(sets):
            launch(i)
        return harness.Timing(time_ms=0.5, launches=sets, spread=0.0)

    monkeypatch.setattr(harness, "first_launch_ms", first_launch_ms)
    monkeypatch.setattr(harness, "time_launches", time_launches)
    copies, copied = [], []  # the source's strides of each copy; (destination's, source's)
    real_copy = cuda.copy_into

    def copy_into(dst, src):
        copies.append(elements(src.strides, 4))
        copied.append((elements(dst.strides, 4), elements(src.strides, 4)))
        real_copy(dst, src)

    monkeypatch.setattr(cuda, "copy_into", copy_into)

    def install(layout: str, **kw) -> Cudnn:
        fake = Cudnn(layout, **kw)
        monkeypatch.setattr(cudnn, "run", fake.run)
        monkeypatch.setattr(cudnn, "workspace_size", fake.workspace_size)
        return fake

    install.copies, install.copied, install.cp = copies, copied, fake_cp
    return install


def _stored(data: np.ndarray, layout: str) -> np.ndarray:
    if layout == "nchw" or data.ndim != 4:
        return data
    out = np.empty((data.shape[0], *data.shape[2:], data.shape[1]), np.float32).transpose(0, 3, 1, 2)
    out[...] = data
    return out


def _bench(x_slice) -> ShapeBench:
    shape = _geometry().shapes[0]
    bench = ShapeBench(shape, x_slice)
    bench._reference = conv_reference(np, bench._base["x"], bench._base["w"], None, _geometry())
    return bench


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_a_slice_key_is_timed_reading_the_slice_in_place(bench_stand_in, layout):
    fake = bench_stand_in(layout)
    bench = _bench(SLICE)
    key = bench.shape.key(layout, "default", SLICE)
    conv = conv_exec.conv_exec(key, "implicit_gemm", cp=sys.modules["cupy"], descs=cudnn.ConvDescriptors(key))
    row = bench.check_and_time(conv, True, 0.0, None)
    assert row.status == "ok" and row.key == key and row.note.endswith("input slice read in place")
    assert {c[1] for c in fake.calls} == {key.x_strides}  # every launch: the slice, with its strides
    x = bench.rotation(layout)[0]["x"]
    assert cudnn.channel_slice(x, layout) and elements(x.strides, 4) == key.x_strides
    assert np.isnan(x.base if x.base is not None else x).any()  # the other channels: NaN, never read


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_a_refused_slice_read_is_timed_with_the_copy_the_executor_makes(bench_stand_in, layout):
    fake = bench_stand_in(layout, refuse=lambda xs, ys: NOT_SUPPORTED if xs is not None else None)
    bench = _bench(SLICE)
    key = bench.shape.key(layout, "default", SLICE)
    conv = conv_exec.conv_exec(key, "implicit_gemm", cp=sys.modules["cupy"], descs=cudnn.ConvDescriptors(key))
    row = bench.check_and_time(conv, True, 0.0, None)
    assert row.status == "ok" and "input copied first (cuDNN refuses the slice" in row.note
    strides = [c[1] for c in fake.calls]
    assert strides[0] == key.x_strides and strides[1:] == [None] * (len(strides) - 1)  # refused once, then packed
    # each launch after the refusal copied its set's slice first: the check's and the 3 timed ones
    assert bench_stand_in.copies.count(key.x_strides) == len(strides) - 1 == 4


def test_an_object_that_reads_packed_inputs_is_timed_with_the_copy_from_the_start(bench_stand_in):
    fake = bench_stand_in("nhwc")
    bench = _bench(SLICE)
    key = bench.shape.key("nhwc", "default", SLICE)
    conv = conv_exec.conv_exec(key, "implicit_gemm", cp=sys.modules["cupy"], descs=cudnn.ConvDescriptors(key))
    conv.input_strides = "packed"  # as an engine's plan or convpass's kernel reads
    row = bench.check_and_time(conv, True, 0.0, None)
    assert "input copied first (the object reads packed inputs)" in row.note
    assert [c[1] for c in fake.calls] == [None] * 4 and bench_stand_in.copies.count(key.x_strides) == 4


def test_the_rotation_is_sized_by_the_wide_buffer_a_slice_set_holds(bench_stand_in, monkeypatch):
    bench_stand_in("nhwc")
    sized = []
    monkeypatch.setattr(harness, "rotation_sets", lambda nbytes, limit=64: sized.append(nbytes) or 2)
    packed, sliced = _bench(None), _bench(SLICE)
    packed.rotation("nhwc")
    sliced.rotation("nhwc")
    x = packed._base["x"]
    assert sized[1] - sized[0] == x.nbytes * (SLICE.channels - x.shape[1]) // x.shape[1]


def test_a_packed_key_is_timed_as_ever(bench_stand_in):
    fake = bench_stand_in("nhwc")
    bench = _bench(None)
    key = bench.shape.key("nhwc", "default")
    conv = conv_exec.conv_exec(key, "implicit_gemm", cp=sys.modules["cupy"], descs=cudnn.ConvDescriptors(key))
    row = bench.check_and_time(conv, True, 0.0, None)
    assert row.status == "ok" and "input" not in row.note and [c[1] for c in fake.calls] == [None] * 4
    assert bench_stand_in.copies == []


def test_the_decision_of_a_slice_problem_takes_only_its_own_rows():
    """Cached rows of the packed read (faster: no slice) never decide the slice problem, nor the
    reverse; the fastest total of the slice rows wins, a copied one included."""
    shape = _geometry().shapes[0]
    packed, sliced = shape.key("nhwc", "default"), shape.key("nhwc", "default", SLICE)
    rows = [make_row(packed, "implicit_precomp_gemm", "ok", 0.10, 0, True, 0.0, "measure"),
            make_row(sliced, "implicit_precomp_gemm", "ok", 0.30, 0, True, 0.0, "measure", note="input copied first (cuDNN refuses the slice)"),
            make_row(sliced, "implicit_gemm", "ok", 0.20, 0, True, 0.0, "measure", note="input slice read in place")]
    options = TuneOptions(layout="nhwc", tf32="on", engines="legacy")
    assert decide.select(rows, ConvProblem((shape,), x_slice=SLICE), options).algo == "implicit_gemm"
    assert decide.select(rows, ConvProblem((shape,)), options).key == packed
