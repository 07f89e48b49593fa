"""One layout conversion for the convs that read one tensor in a format it is not stored in
(convpass.runtime.cuda.shared_layouts), on the CPU: launches over NumPy arrays standing in for
CuPy's. The GPU side: tests/gpu/test_shared_layouts_gpu.py."""

from __future__ import annotations

import collections
import sys
import types

import numpy as np
import pytest
from fused_models import qkv

from convpass.kernels.convolution import ConvLaunch
from convpass.kernels.launch import Launch, Placement
from convpass.native import cudnn
from convpass.runtime.cuda.shared_layouts import LayoutLaunch, share_conversions

SHAPE = (2, 8, 6, 5)


@pytest.fixture
def numpy_cupy(monkeypatch):
    """NumPy as the CuPy the conversion allocates from."""
    fake = types.ModuleType("cupy")
    fake.empty = np.empty
    monkeypatch.setitem(sys.modules, "cupy", fake)


class _Producer(Launch):
    def __init__(self, step: int, slot: int, array: np.ndarray) -> None:
        super().__init__(step, types.SimpleNamespace(name=f"p{step}", op_type="Relu"), "Relu", (slot,))
        self.array = array

    def run(self, env):
        env[self.outputs[0]] = self.array


def _conv(step: int, x: int, layout: str, op_type: str = "Conv", seen: list | None = None) -> ConvLaunch:
    """A ConvLaunch that records (its step, the array it read) instead of running a conv."""
    launch = ConvLaunch.__new__(ConvLaunch)
    Launch.__init__(launch, step, types.SimpleNamespace(name=f"conv{step}", op_type=op_type), op_type, (100 + step,))
    launch.inputs = (x, -1)
    launch.exec = types.SimpleNamespace(layout=layout, op_type=op_type, insert_axis=None,
                                        geometry=types.SimpleNamespace(extra_pads=(0, 0, 0, 0)))
    launch.run = lambda env: seen.append((step, env[launch.inputs[0]]))
    return launch


def _plan(slots: int = 200):
    return types.SimpleNamespace(slot_names=[f"v{i}" for i in range(slots)], template=[None] * slots, value_info={0: (SHAPE, np.float32)})


def _run(launches, free, slots: int):
    env = [None] * slots
    for launch, release in zip(launches, free):
        if launch is not None:
            launch.run(env)
        for s in release:
            env[s] = None
    return env


def test_three_convs_reading_one_tensor_in_another_format_share_one_conversion(numpy_cupy):
    """q, k and v want NHWC, the tensor is NCHW: one conversion before q, all three read it, and
    its slot is released after v (the copy inside each conv launch is gone)."""
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    seen: list = []
    plan = _plan()
    launches = [_Producer(0, 0, x), None, _conv(2, 0, "nhwc", seen=seen), _conv(3, 0, "nhwc", seen=seen), _conv(4, 0, "nhwc", seen=seen)]
    free = [(), (), (), (), (0,)]
    counters = collections.Counter()
    out, released = share_conversions(plan, launches, free, counters)
    (conversion,) = [launch for launch in out if isinstance(launch, LayoutLaunch)]
    assert out.index(conversion) == 2 and len(out) == len(released) == 6
    target = conversion.outputs[0]
    assert target == 200 and plan.slot_names[target] == "v0@nhwc" and plan.value_info[target] == (SHAPE, np.float32)
    assert [launch.inputs[0] for launch in out if isinstance(launch, ConvLaunch)] == [target] * 3
    assert target in released[-1] and all(target not in r for r in released[:-1])
    env = _run(out, released, len(plan.template))
    assert counters["layout_conversions"] == 1 and env[target] is None
    assert [step for step, _ in seen] == [2, 3, 4] and all(a is seen[0][1] for _, a in seen)
    assert cudnn.layout_of(seen[0][1]) == "nhwc"
    np.testing.assert_array_equal(seen[0][1], x)


def test_a_tensor_already_in_the_readers_format_is_not_copied(numpy_cupy):
    x = np.zeros(SHAPE, np.float32)
    seen: list = []
    launches = [_Producer(0, 0, x), _conv(1, 0, "nchw", seen=seen), _conv(2, 0, "nchw", seen=seen)]
    counters = collections.Counter()
    plan = _plan()
    out, released = share_conversions(plan, launches, [(), (), ()], counters)
    _run(out, released, len(plan.template))
    assert len(out) == 4 and counters["layout_conversions"] == 0 and all(a is x for _, a in seen)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_channel_slice_in_the_readers_order_reaches_them_itself(numpy_cupy, layout):
    """A Split's output (a channel-slice view) already stored in the readers' order: no copy, so
    each reader may still read its slice in place."""
    n, c, h, w = SHAPE
    buffer = np.zeros((n, h, w, 3 * c), np.float32).transpose(0, 3, 1, 2) if layout == "nhwc" else np.zeros((n, 3 * c, h, w), np.float32)
    x = buffer[:, c:2 * c]
    assert cudnn.channel_slice(x, layout)
    seen: list = []
    launches = [_Producer(0, 0, x), _conv(1, 0, layout, seen=seen), _conv(2, 0, layout, seen=seen)]
    counters = collections.Counter()
    plan = _plan()
    out, released = share_conversions(plan, launches, [(), (), ()], counters)
    _run(out, released, len(plan.template))
    assert counters["layout_conversions"] == 0 and [a is x for _, a in seen] == [True, True]


@pytest.mark.parametrize("case", ["one reader per format", "conv transpose", "concat slice", "constant"])
def test_no_conversion_is_shared_where_no_two_convs_would_copy(case):
    """One reader in each format (each converts, or not, as before), ConvTranspose readers, a
    tensor written into a Concat slice (read in place where cuDNN can), a constant: nothing added."""
    plan = _plan()
    op = "ConvTranspose" if case == "conv transpose" else "Conv"
    layouts = ("nchw", "nhwc") if case == "one reader per format" else ("nhwc", "nhwc")
    producer = _Producer(0, 0, None)
    if case == "concat slice":
        producer.placement = Placement(7, 1, 0, 8, lambda layout: None)
    if case == "constant":
        plan.template[0] = np.zeros(SHAPE, np.float32)
    launches = [producer, *(_conv(i + 1, 0, layout, op) for i, layout in enumerate(layouts))]
    out, released = share_conversions(plan, launches, [(), (), ()], collections.Counter())
    assert out == launches and released == [(), (), ()] and len(plan.template) == 200
    assert [launch.inputs[0] for launch in out[1:]] == [0, 0]


def test_the_layout_plan_charges_one_transpose_for_a_groupnorm_read_by_q_k_v():
    """x -> GroupNorm -> q, k, v (NHWC cheaper): the plan converts once (the graph input, before the
    fused step), not once per conv; the executor's one shared conversion is that one."""
    import onnx_ir as ir

    from convpass.compiler.fusions import find_units
    from convpass.compiler.passes.plan_layouts import plan_layouts

    model = ir.serde.deserialize_model(qkv(SHAPE))
    shapes = {v.name: SHAPE for n in model.graph for v in n.outputs} | {"x": SHAPE, "norm_r": (2, 4, 60), "norm_in": (2, 4, 60), "norm_shape": (4,)}
    (units,) = find_units(model, [shapes])
    convs = {n: {"nchw": 1.0, "nhwc": 0.5} for n in model.graph if n.op_type == "Conv"}
    plan = plan_layouts(model.graph, convs, lambda v: 0.4 if len(shapes.get(v.name, ())) == 4 else 0.0, [u.nodes for u in units], shapes)
    assert set(plan.layouts.values()) == {"nhwc"}
    assert plan.transposes == 2  # the graph's input (one conversion for q, k and v) and its output
    assert plan.cost_ms == pytest.approx(3 * 0.5 + 2 * 0.4)


def test_the_qkv_test_model_itself_runs_as_onnx_runtime_does_on_the_cpu():
    """The model the GPU test shares a conversion in (tests/gpu/test_shared_layouts_gpu.py) is
    sound: the CPU executor has no layout conversions to share, so this checks only the model."""
    from conftest import run_ort

    from convpass.runtime import Executor

    model = qkv(SHAPE)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    (got,) = Executor(model, device="cpu").run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
