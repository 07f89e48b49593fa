"""A dense block at batch 16: the layout plan puts its pre-activation steps in NHWC, and the cuda
backend's element-wise kernels keep that storage when they read a channel slice of the block's
channels-last Concat buffer (convpass.kernels.broadcast, convpass.kernels.elementwise_launch).

DenseNet's layer reads the features so far, a channel slice of the block's buffer, through
BatchNormalization + Relu into its 1x1 conv. The plan passes the buffer's format through those
steps and prices no copy before the conv; a channels-first result of the BatchNormalization + Relu
would make the channels-last conv copy its input inside its launch (and the kernel itself would
read the slice with a stride of the buffer's channels). The kernel is compiled as host C++ and run
over its real launch grid (as in tests/test_cuda_fusion.py), its output checked against NumPy.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from conftest import host_args
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler.passes.plan_layouts import plan_layouts
from convpass.kernels import broadcast, elementwise_launch
from convpass.kernels import elementwise as cuda_fusion
from convpass.kernels.launch import Placement
from convpass.native import cudnn
from convpass.runtime.executor import Executor

BATCH, GROWTH, X0 = 16, 2, 4  # a block's first features (X0 channels) and two layers of GROWTH
SLICE = X0 + GROWTH  # the second layer reads x0 and f1 ...
TOTAL = X0 + 2 * GROWTH  # ... of the buffer that holds f2 too
HW = (3, 3)


# ---------------------------------------------------------------------------------------------
# the plan


def _node(op, *inputs, name, **attrs):
    node = ir.Node("", op, list(inputs), attributes=[ir.AttrInt64(k, v) for k, v in attrs.items()], name=name)
    node.outputs[0].name = f"{name}_out"
    return node


def _dense_block():
    """x -> stem conv -> Relu -> x0; layer k: Concat(x0, f1, ..., f_{k-1}) -> BatchNormalization ->
    Relu -> 1x1 conv -> Relu -> 3x3 conv = f_k; the block's Concat(x0, f1, f2) -> BatchNormalization
    -> Relu -> y: torchvision's DenseNet, two layers."""
    x = ir.Value(name="x")
    nodes = [_node("Conv", x, name="stem")]
    nodes.append(_node("Relu", nodes[-1].outputs[0], name="stem_relu"))
    feats, convs, norms = [nodes[-1].outputs[0]], [nodes[0]], []
    for k in (1, 2, 3):
        nodes.append(_node("Concat", *feats, name=f"cat{k}", axis=1))
        nodes.append(_node("BatchNormalization", nodes[-1].outputs[0], name=f"norm{k}"))
        norms.append(nodes[-1])
        nodes.append(_node("Relu", nodes[-1].outputs[0], name=f"relu{k}"))
        if k == 3:
            break
        for part in ("a", "b"):  # the 1x1 conv (its BatchNormalization folded in) and the 3x3 conv
            nodes.append(_node("Conv", nodes[-1].outputs[0], name=f"conv{k}{part}"))
            convs.append(nodes[-1])
            if part == "a":
                nodes.append(_node("Relu", nodes[-1].outputs[0], name=f"relu{k}a"))
        feats.append(nodes[-1].outputs[0])
    graph = ir.Graph([x], [nodes[-1].outputs[0]], nodes=nodes)
    return graph, convs, norms


def test_the_plan_keeps_a_dense_block_at_batch_16_channels_last_with_no_copy_before_its_convs():
    """Every conv 5 ms in NHWC and 10 in NCHW, a transpose 1 ms: all NHWC, and the plan pays the
    graph input's and the graph output's transposes only (5 x 5 + 2 = 27 ms). Its BatchNormalization
    + Relu steps read the Concat buffer in NHWC and give the 1x1 convs an NHWC tensor: no copy is
    priced there, which the element-wise kernels below make true."""
    graph, convs, _ = _dense_block()
    shapes = {v.name: (BATCH, TOTAL, *HW) for node in graph for v in node.outputs} | {"x": (BATCH, 3, *HW)}
    plan = plan_layouts(graph, {n: {"nchw": 10.0, "nhwc": 5.0} for n in convs}, lambda v: 1.0, shapes=shapes)
    assert set(plan.layouts.values()) == {"nhwc"} and len(plan.layouts) == 5
    assert plan.transposes == 2 and plan.cost_ms == pytest.approx(27.0)


# ---------------------------------------------------------------------------------------------
# the cuda backend's BatchNormalization + Relu on the buffer's slice


def _norm_relu_plan():
    """BatchNormalization + Relu of SLICE channels at batch 16 (the second layer's pre-activation):
    the CPU executor's plan, its one fused group, and the reference output for ``x``."""
    rng = np.random.default_rng(0)
    params = [rng.uniform(0.5, 1.5, SLICE), rng.standard_normal(SLICE), rng.standard_normal(SLICE), rng.uniform(0.5, 1.5, SLICE)]
    inits = [numpy_helper.from_array(np.asarray(p, np.float32), n) for n, p in zip(("scale", "bias", "mean", "var"), params)]
    shape = (BATCH, SLICE, *HW)
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["b"]), helper.make_node("Relu", ["b"], ["y"])],
        "norm_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=9)
    x = rng.standard_normal(shape).astype(np.float32)
    ex = Executor(model, device="cpu")
    ref = ex.run(None, {"x": x})[0]
    plan = ex.last_plan
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    return plan, group, x, ref


def _channels_last_buffer(x):
    """A (BATCH, TOTAL, *HW) buffer stored channels-last, ``x`` in its first channels; returns the
    buffer and that channel slice."""
    buffer = np.full((BATCH, *HW, TOTAL), -7.0, np.float32).transpose(0, 3, 1, 2)
    view = buffer[:, : x.shape[1]]
    view[...] = x
    return buffer, view


def _host_kernel(tmp_path, group, classes):
    from conftest import host_library

    setter = ('\nextern "C" void set_index(unsigned bx, unsigned tx, unsigned bdx, unsigned gdx) '
              '{ blockIdx.x = bx; blockIdx.y = 0; threadIdx.x = tx; blockDim.x = bdx; gridDim.x = gdx; gridDim.y = 1; }\n')
    source = broadcast.broadcast_source(group, classes)
    lib = host_library(tmp_path, "using namespace std;\n" + source.code + setter, "dense_bcast")

    def entry(name):
        kernel = getattr(lib, name)

        def launch(grid, block, args):
            conv = host_args(args)
            (gx,), (bx,) = grid, block
            for b in range(gx):
                for t in range(bx):
                    lib.set_index(b, t, bx, gx)
                    kernel(*conv)

        return launch

    return broadcast.BroadcastKernel(np, group, classes, entry=entry)


def test_norm_relu_of_a_channels_last_slice_writes_a_packed_channels_last_tensor(tmp_path):
    """The kernel reads the slice in its rows of channels (two merged dimensions: N * H * W, C) and
    allocates its result channels-last, so the NHWC 1x1 conv after it reads it as it is
    (``as_layout`` gives the array itself: nothing copied in the conv's launch)."""
    plan, group, x, ref = _norm_relu_plan()
    kern = _host_kernel(tmp_path, group, broadcast.broadcast_classes(plan, group))
    buffer, view = _channels_last_buffer(x)
    env = list(plan.template)
    env[group.inputs[0]] = view
    counters = {"fused_elementwise": 0}
    elementwise_launch.FusedLaunch(plan, group, kern, None, counters).run(env)
    y = env[group.output]
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert cudnn.layout_of(y) == "nhwc", "the result keeps the buffer's channels-last storage"
    assert cudnn.as_layout(y, "nhwc") is y, "an NHWC conv reads it without a copy"
    assert kern.planned_dims() == {2}, "the slice walked in its memory order: N * H * W rows of C channels"
    assert (buffer[:, SLICE:] == -7).all() and counters["fused_elementwise"] == 1


def test_a_packed_channels_first_input_still_gives_a_channels_first_result(tmp_path):
    plan, group, x, ref = _norm_relu_plan()
    kern = _host_kernel(tmp_path, group, broadcast.broadcast_classes(plan, group))
    env = list(plan.template)
    env[group.inputs[0]] = x
    elementwise_launch.FusedLaunch(plan, group, kern, None, {"fused_elementwise": 0}).run(env)
    y = env[group.output]
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert cudnn.layout_of(y) == "nchw"


def test_cupys_kernel_runs_on_a_channels_last_slice_in_its_storage_order():
    """The fallback path (CuPy's kernel, which allocates its result in C order of what it is given)
    is handed the slice's channels-last view, so its result is channels-last too."""
    _, view = _channels_last_buffer(np.ones((BATCH, SLICE, *HW), np.float32))
    seen = []

    def cupy_like(a):
        seen.append(a.strides)
        return np.ascontiguousarray(np.negative(a))

    y = elementwise_launch.in_storage_order([view], cupy_like)
    assert seen == [view.transpose(0, 2, 3, 1).strides], "given the channels-last view"
    assert cudnn.layout_of(y) == "nhwc" and (y == -1).all()


def test_a_group_reading_a_channels_last_slice_allocates_its_own_concat_buffer_channels_last():
    """A placed group whose buffer does not exist yet asks for it in its inputs' storage: the
    channels-last slice it reads makes it channels-last."""
    plan, group, x, ref = _norm_relu_plan()
    _, view = _channels_last_buffer(x)
    asked = []

    def allocate(layout):
        asked.append(layout)
        return np.empty((BATCH, *HW, 2 * SLICE), np.float32).transpose(0, 3, 1, 2) if layout == "nhwc" else np.empty((BATCH, 2 * SLICE, *HW), np.float32)

    def kernel(args, out=None):
        out[...] = ref
        return out

    launch = elementwise_launch.FusedLaunch(plan, group, kernel, None, {"fused_elementwise": 0})
    launch.placement = Placement(slot=len(plan.template), axis=1, offset=0, length=SLICE, allocate=allocate)
    env = [*plan.template, None]
    env[group.inputs[0]] = view
    launch.run(env)
    assert asked == ["nhwc"]
    np.testing.assert_array_equal(env[group.output], ref)
