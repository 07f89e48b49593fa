"""A UNet's decoder Concat without copies (convpass.runtime.cuda.memory, convpass.kernels.convolution).

milesial's Pytorch-UNet joins the skip tensor and the upsampled one: ``Concat(skip,
Pad(ConvTranspose(x), widths))``, the widths computed from ``Shape`` arithmetic (zero where the
sizes match). The executor folds the widths to a constant; a Pad of zero widths is its input
itself, so the ConvTranspose is the launch that writes the upsampled half into its slice of the
Concat's buffer, through its bias pass (no copy after it), and the Concat copies nothing. Checked
on plans the CPU executor builds, with cuDNN stood in for by NumPy; every result against ONNX's.
"""

from __future__ import annotations

import collections
import sys
import types

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cuda_memory import _allocator, _Producer, _run

from convpass.core import annotation
from convpass.kernels import conv_exec, convolution
from convpass.kernels.backends import host_backend
from convpass.kernels.convolution import Convolutions, lower_convs
from convpass.native import cudnn
from convpass.ops.conv import ConvCall, conv_geometry, conv_transpose_reference
from convpass.ops.registry import OpContext
from convpass.runtime.cuda import memory
from convpass.runtime.cuda.lowering import OpLaunch
from convpass.runtime.executor import Executor

N, C, HW = 2, 4, 6  # the skip: (N, C, HW, HW); the upsampled half the same
NODE = helper.make_node


def _up_block(pads: str = "shape", hw: int = HW, source_readers: int = 1):
    """skip = Relu(x) (``hw`` square); u = ConvTranspose(MaxPool(skip)) + bias (2x2, stride 2);
    p = Pad(u, pads); cat = Concat(skip, p); y = Relu(cat). ``pads``: "shape" (the end widths from
    Shape arithmetic, as exported: zero for an even ``hw``, one row and column for an odd one) or
    "zeros" (a zero initializer); ``source_readers`` 2: u is also read by a Sigmoid (an output)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((C, C, 2, 2)) * 0.5).astype(np.float32), "wt"),
             numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "bt"),
             numpy_helper.from_array(np.zeros(4 if pads == "shape" else 8, np.int64), "zeros")]
    nodes = [NODE("Relu", ["x"], ["skip"]), NODE("MaxPool", ["skip"], ["m"], kernel_shape=[2, 2], strides=[2, 2]),
             NODE("ConvTranspose", ["m", "wt", "bt"], ["u"], kernel_shape=[2, 2], strides=[2, 2])]
    if pads == "shape":
        nodes += [NODE("Shape", ["skip"], ["s_skip"]), NODE("Shape", ["u"], ["s_u"]), NODE("Sub", ["s_skip", "s_u"], ["d"]),
                  NODE("Concat", ["zeros", "d"], ["pads"], axis=0)]
    nodes += [NODE("Pad", ["u", "pads" if pads == "shape" else "zeros"], ["p"]), NODE("Concat", ["skip", "p"], ["cat"], axis=1),
              NODE("Relu", ["cat"], ["y"])]
    outputs = ["y"]
    if source_readers == 2:
        nodes.append(NODE("Sigmoid", ["u"], ["su"]))
        outputs.append("su")
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C, hw, hw])]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["?"] * 4) for n in outputs]
    model = helper.make_model(helper.make_graph(nodes, "up", ins, outs, inits), opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    feeds = {"x": np.random.default_rng(1).standard_normal((N, C, hw, hw)).astype(np.float32)}
    ex = Executor(model, device="cpu")
    refs = ex.run(None, feeds)
    return ex.last_plan, feeds, refs


def _step(plan, op_type, output=None):
    """The step of ``op_type`` (that computes the value named ``output``)."""
    (i,) = [i for i, st in enumerate(plan.steps)
            if st.node.op_type == op_type and (output is None or plan.slot_names[st.outputs[0]] == output)]
    return i


def _launches(plan, convs_from_lowering: bool):
    """step -> launch, as the cuda lowering makes them: the ConvTranspose's ConvLaunch from
    :func:`lower_convs` (or a NumPy producer that honours placements), the Pad an :class:`OpLaunch`
    of the op library (it honours no placement), every other step a NumPy producer."""
    ctx = OpContext(host_backend())
    out = {}
    if convs_from_lowering:
        for launch in lower_convs(plan, types.SimpleNamespace(), True, True).values():
            for k in (launch.step, *launch.absorbs):
                out[k] = launch
    for i, st in enumerate(plan.steps):
        if i in out or st.node.op_type == "Concat":
            continue
        out[i] = OpLaunch(plan, i, ctx, False) if st.node.op_type == "Pad" else _Producer(plan, i)
    return out


def test_the_pad_widths_fold_to_a_zero_constant_of_the_plan():
    plan, _, _ = _up_block("shape")
    pad = plan.steps[_step(plan, "Pad")]
    assert [st.node.op_type for st in plan.steps if st.node.op_type in ("Shape", "Sub")] == []  # folded for these shapes
    assert plan.template[pad.inputs[1]] is not None and not np.any(plan.template[pad.inputs[1]])


def test_a_convtranspose_launch_honours_placements():
    plan, _, _ = _up_block("shape")
    (launch,) = [lc for lc in lower_convs(plan, types.SimpleNamespace(), True, True).values() if lc.node.op_type == "ConvTranspose"]
    assert launch.supports_placement


@pytest.mark.parametrize("pads", ["shape", "zeros"])
def test_the_convtranspose_writes_its_slice_through_a_zero_pad_and_the_concat_copies_nothing(pads):
    plan, feeds, refs = _up_block(pads)
    launches = _launches(plan, convs_from_lowering=True)
    concats = memory.plan_concats(plan, launches, _allocator)
    (cat,) = concats.values()
    up = launches[_step(plan, "ConvTranspose")]
    assert cat.copies == [] and cat.label == "Concat (in place)", cat.copies
    assert up.placement is not None and (up.placement.offset, up.placement.length) == (C, C)
    assert launches[_step(plan, "Relu", "skip")].placement is not None  # the skip, placed as before
    assert launches[_step(plan, "Pad")].placement is None  # the Pad passes its input (the slice) on


@pytest.mark.parametrize("pads", ["shape", "zeros"])
def test_running_the_placed_launches_gives_onnx_results(pads):
    """The ConvTranspose computed by a NumPy producer that honours its placement; the buffer is
    poisoned with NaN, so every element the Concat's result holds was written by a producer."""
    plan, feeds, refs = _up_block(pads)
    launches = _launches(plan, convs_from_lowering=False)
    concats = memory.plan_concats(plan, launches, _allocator)
    assert next(iter(concats.values())).copies == []
    outs = _run(plan, feeds, {**launches, **concats})
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["odd size", "read elsewhere"])
def test_a_pad_that_pads_or_an_upsampled_map_read_elsewhere_is_still_copied(case):
    plan, feeds, refs = _up_block("shape", hw=HW + 1) if case == "odd size" else _up_block("zeros", source_readers=2)
    launches = _launches(plan, convs_from_lowering=False)
    concats = memory.plan_concats(plan, launches, _allocator)
    (cat,) = concats.values()
    assert len(cat.copies) == 1 and launches[_step(plan, "ConvTranspose")].placement is None
    outs = _run(plan, feeds, {**launches, **concats})
    for out, ref in zip(outs, refs):
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the ConvTranspose launch writing into a slice, cuDNN stood in for


def _transpose_geometry():
    return conv_geometry("ConvTranspose", {"kernel_shape": [2, 2], "strides": [2, 2]}, (N, C, HW // 2, HW // 2), (C, C, 2, 2))


@pytest.fixture
def fake_cudnn(monkeypatch):
    """cuDNN's backward data by the reference (into the array it is given, which must be packed in
    the key's format); CuPy's epilogue kernel by NumPy; ``copy_into`` counted."""
    fake_cp = types.ModuleType("cupy")
    fake_cp.empty, fake_cp.uint8, fake_cp.ascontiguousarray, fake_cp.maximum = np.empty, np.uint8, np.ascontiguousarray, np.maximum
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: types.SimpleNamespace(key=key))
    monkeypatch.setattr(cudnn, "workspace_size", lambda *a, **k: 0)
    calls = collections.Counter()

    def run(descs, direction, algo, x, w, y, workspace=None, **strided):
        assert descs.key.shape.direction == "dgrad" and not strided and cudnn.layout_of(x) in (descs.key.layout, "both")
        calls["dgrad"] += 1
        x[...] = conv_transpose_reference(np, np.ascontiguousarray(y), w, None, _transpose_geometry())

    def kernel(cp, bias, residual, relu, source=False):
        calls["epilogue_from" if source else "epilogue"] += 1

        def apply(*args):
            *operands, y = args
            v = sum(operands) if source else y + sum(operands) if operands else y.copy()
            y[...] = np.where(v < 0, 0, v) if relu else v
        return apply

    real_copy = convolution.copy_into

    def copy_into(dst, src):
        calls["copy_into"] += 1
        real_copy(dst, src)

    monkeypatch.setattr(cudnn, "run", run)
    monkeypatch.setattr(conv_exec, "epilogue_kernel", kernel)
    monkeypatch.setattr(convolution, "copy_into", copy_into)
    return fake_cp, calls


def _convs(cp) -> Convolutions:
    rt = types.SimpleNamespace(cp=cp, fuse=True, counters=collections.Counter(), capturing=False, recorded_device="",
                               current_device=None, device_id=0, is_constant=lambda a: False,
                               warn_node=lambda node, m: pytest.fail(m), note_once=lambda tag, m: None)
    return Convolutions(rt)


def _transpose_call(layout: str) -> ConvCall:
    g = _transpose_geometry()
    key = g.shapes[0].key(layout, "default")
    decision = annotation.ConvDecision(problem_key=str(key), memory_format=layout.upper(), math_mode="default", algo="algo_1")
    return ConvCall("up", g, decision)


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("relu", [False, True])
def test_a_placed_convtranspose_writes_its_slice_in_its_bias_pass_without_a_copy(fake_cudnn, layout, relu):
    cp, calls = fake_cudnn
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N, C, HW // 2, HW // 2)).astype(np.float32)
    w = (rng.standard_normal((C, C, 2, 2)) * 0.5).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    if layout == "nhwc":
        buf = np.full((N, HW, HW, 2 * C), np.nan, np.float32).transpose(0, 3, 1, 2)
    else:
        buf = np.full((N, 2 * C, HW, HW), np.nan, np.float32)
    out = buf[:, C:]
    convs = _convs(cp)
    y = convs.run(_transpose_call(layout), x, w, b, relu=relu, out=out)
    want = conv_transpose_reference(np, x, w, b, _transpose_geometry())
    want = np.maximum(want, 0) if relu else want
    assert y is out and calls["dgrad"] == 1
    assert calls["copy_into"] == 0 and calls["epilogue_from"] == 1 and calls["epilogue"] == 0, calls
    assert convs.rt.counters["slice_writes"] == 1 and convs.rt.counters["slice_write_copies"] == 0
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert np.isnan(buf[:, :C]).all()  # the skip's half untouched


def test_an_unplaced_convtranspose_runs_its_bias_pass_in_place_as_before(fake_cudnn):
    cp, calls = fake_cudnn
    rng = np.random.default_rng(4)
    x = rng.standard_normal((N, C, HW // 2, HW // 2)).astype(np.float32)
    w = (rng.standard_normal((C, C, 2, 2)) * 0.5).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    y = _convs(cp).run(_transpose_call("nhwc"), x, w, b)
    assert calls["epilogue"] == 1 and calls["epilogue_from"] == 0 and calls["copy_into"] == 0, calls
    np.testing.assert_allclose(y, conv_transpose_reference(np, x, w, b, _transpose_geometry()), rtol=1e-5, atol=1e-5)


def test_a_placed_convtranspose_without_a_bias_pass_copies_into_its_slice_and_counts_it(fake_cudnn):
    """Backward data runs packed: with no pass to write the slice, the result is copied into it
    (the copy the Concat would make of an unplaced input), counted in ``slice_write_copies``."""
    cp, calls = fake_cudnn
    rng = np.random.default_rng(5)
    x = rng.standard_normal((N, C, HW // 2, HW // 2)).astype(np.float32)
    w = (rng.standard_normal((C, C, 2, 2)) * 0.5).astype(np.float32)
    buf = np.full((N, HW, HW, 2 * C), np.nan, np.float32).transpose(0, 3, 1, 2)
    convs = _convs(cp)
    y = convs.run(_transpose_call("nhwc"), x, w, None, out=buf[:, C:])
    assert y is not None and calls["copy_into"] == 1 and calls["epilogue_from"] == 0, calls
    assert convs.rt.counters["slice_write_copies"] == 1 and convs.rt.counters["slice_writes"] == 0
    np.testing.assert_allclose(buf[:, C:], conv_transpose_reference(np, x, w, None, _transpose_geometry()), rtol=1e-5, atol=1e-5)
    assert np.isnan(buf[:, :C]).all()
