"""The output side of the channel-slice rule (:mod:`convpass.core.concat_slices`, rules 3 and 4):
a forward Conv whose step writes its output into its slice of a Concat family's buffer is a
problem that names that slice (:class:`~convpass.core.problem.OutputSlice`), by the same rule the
runtime's memory planner places the conv's launch by (checked side by side on the same graphs: the
compiler over onnx-ir, the planner over the CPU executor's plan); a conv that reads one slice and
writes another names both; keys that name an output slice round-trip, older keys read as before."""

from __future__ import annotations

import types

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cuda_memory import _allocator, _Producer

from convpass.compiler.pipeline import OptimizeReport, prepare_model
from convpass.core.concat_slices import ConcatInfo, conv_step_writes_slice, families, output_slices, place, times_in_families
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, ConvShape, InputSlice, OutputSlice, ProblemKey, keyed_slice
from convpass.kernels.backends import host_backend
from convpass.kernels.convolution import lower_convs
from convpass.ops.registry import OpContext
from convpass.runtime.cuda import memory
from convpass.runtime.cuda.lowering import OpLaunch
from convpass.runtime.executor import Executor

N, C, G, HW = 2, 16, 8, 6  # batch, stem channels, growth, spatial size
NODE = helper.make_node


class _Model:
    """A hand-built model: ``w(name, shape)`` adds a random initializer, ``build`` the graph."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.inits: list = []
        self.nodes: list = []

    def w(self, name: str, shape: tuple[int, ...], scale: float = 0.1) -> str:
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def build(self, x_shape, outputs):
        graph = helper.make_graph(self.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                                  [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["?"] * len(x_shape)) for o in outputs], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _dense_relu_block():
    """stem = Relu(conv(x) + b) = x0; f_k = Relu(conv_k(cat_{k-1}) + b_k) for k = 1, 2 (cat_0 = x0);
    cat_k = Concat(x0, f1, .. f_k); y = conv3(cat2): every conv's step (bias+relu) writes its
    slice of the family's buffer, and conv1 and conv2 read one of it too."""
    m = _Model()
    m.nodes.append(NODE("Conv", ["x", m.w("ws", (C, 3, 3, 3)), m.w("bs", (C,))], ["s"], name="stem", pads=[1] * 4))
    m.nodes.append(NODE("Relu", ["s"], ["x0"], name="stem_act"))
    feats, channels = ["x0"], C
    for k in (1, 2):
        src = "x0" if k == 1 else f"cat{k - 1}"
        m.nodes.append(NODE("Conv", [src, m.w(f"w{k}", (G, channels, 3, 3)), m.w(f"b{k}", (G,))], [f"c{k}"], name=f"conv{k}", pads=[1] * 4))
        m.nodes.append(NODE("Relu", [f"c{k}"], [f"f{k}"], name=f"act{k}"))
        feats.append(f"f{k}")
        channels += G
        m.nodes.append(NODE("Concat", list(feats), [f"cat{k}"], name=f"cat{k}", axis=1))
    m.nodes.append(NODE("Conv", ["cat2", m.w("w3", (C, channels, 3, 3)), m.w("b3", (C,))], ["y"], name="conv3", pads=[1] * 4))
    return m.build((N, 3, HW, HW), ["y"])


def _mixed_family():
    """One Concat of five inputs, each written another way: ``a`` by a bare conv that another conv
    reads too; ``r`` by a conv whose step adds a residual (writes packed); ``p`` a zero-width Pad
    of a conv's output (the Pad passes the slice on); ``t`` by a ConvTranspose; ``q`` by a Relu of
    the input. y = Relu(cat); b = conv_b(a) a second output."""
    m = _Model(1)
    m.nodes += [
        NODE("Relu", ["x"], ["z"], name="z_act"),
        NODE("Conv", ["x", m.w("wa", (C, C, 3, 3))], ["a"], name="conv_a", pads=[1] * 4),
        NODE("Conv", ["a", m.w("wb", (G, C, 1, 1))], ["b"], name="conv_b"),
        NODE("Conv", ["x", m.w("wc", (C, C, 3, 3)), m.w("bc", (C,))], ["c"], name="conv_c", pads=[1] * 4),
        NODE("Add", ["c", "z"], ["r"], name="residual"),
        NODE("Conv", ["x", m.w("wd", (G, C, 1, 1)), m.w("bd", (G,))], ["d"], name="conv_d"),
        NODE("Pad", ["d", "zeros"], ["p"], name="pad"),
        NODE("MaxPool", ["x"], ["mp"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        NODE("ConvTranspose", ["mp", m.w("wt", (C, G, 2, 2)), m.w("bt", (G,))], ["t"], name="up", kernel_shape=[2, 2], strides=[2, 2]),
        NODE("Relu", ["x"], ["q"], name="q_act"),
        NODE("Concat", ["a", "r", "p", "t", "q"], ["cat"], name="cat", axis=1),
        NODE("Relu", ["cat"], ["y"], name="out_act"),
    ]
    m.inits.append(numpy_helper.from_array(np.zeros(8, np.int64), "zeros"))
    return m.build((N, C, HW, HW), ["y", "b"])


def _problems(model) -> dict[str, ConvProblem]:
    m = ir.serde.deserialize_model(model)
    problems = prepare_model(m, TuneOptions(engines="legacy"), [], OptimizeReport())
    return {use.node.name: p for p, uses in problems.items() for use in uses}


def _runtime_placements(model) -> dict[str, OutputSlice]:
    """conv node -> the slice its launch writes, as the cuda backend's memory planner places it on
    the CPU executor's plan of ``model`` (ConvLaunches from the cuda lowering, the Pad an op-library
    launch, every other step a NumPy producer that honours placements)."""
    ex = Executor(model, device="cpu")
    ex.run(None, {"x": np.random.default_rng(2).standard_normal(tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim)).astype(np.float32)})
    plan = ex.last_plan
    launches = {}
    for launch in lower_convs(plan, types.SimpleNamespace(), True, True).values():
        for k in (launch.step, *launch.absorbs):
            launches[k] = launch
    ctx = OpContext(host_backend())
    for i, st in enumerate(plan.steps):
        if i not in launches and st.node.op_type != "Concat":
            launches[i] = OpLaunch(plan, i, ctx, False) if st.node.op_type == "Pad" else _Producer(plan, i)
    memory.plan_concats(plan, launches, _allocator)
    out = {}
    for launch in set(launches.values()):
        if launch.placement is not None and launch.node.op_type in ("Conv", "ConvTranspose"):
            total = plan.info(launch.placement.slot)[0][1]
            out[launch.node.name] = OutputSlice(launch.placement.offset, total)
    return out


def test_a_dense_blocks_convs_write_their_slices_and_read_the_familys():
    total = C + 2 * G
    problems = _problems(_dense_relu_block())
    assert {name: (p.x_slice, p.y_slice) for name, p in problems.items()} == {
        "stem": (None, OutputSlice(0, total)),  # x is a graph input; x0 written in place
        "conv1": (InputSlice(0, total), OutputSlice(C, total)),  # reads x0 in place, writes f1 in place
        "conv2": (InputSlice(0, total), OutputSlice(C + G, total)),  # reads cat1 (a view), writes f2
        "conv3": (None, None),  # the root: packed; y a graph output
    }
    assert "reading xslice=0/32 writing yslice=16/32" in str(problems["conv1"])


def test_each_way_of_writing_into_a_family_and_the_convs_that_name_it():
    total = C + C + G + G + C
    problems = _problems(_mixed_family())
    assert {name: (p.x_slice, p.y_slice) for name, p in problems.items()} == {
        "conv_a": (None, OutputSlice(0, total)),  # its output has another reader too: still placed
        "conv_b": (InputSlice(0, total), None),  # that reader reads the slice
        "conv_c": (None, None),  # its step adds the residual: a packed output the Concat copies
        "conv_d": (None, OutputSlice(2 * C % 32, total)),  # through the zero-width Pad (its key: 2C float32s in, mod 128 bytes)
        "up": (None, None),  # a ConvTranspose: backward data runs packed, its bias pass writes the slice
    }
    assert problems["up"].direction == "dgrad"


@pytest.mark.parametrize("model", [_dense_relu_block, _mixed_family], ids=["dense", "mixed"])
def test_the_compiler_names_the_slices_the_runtimes_memory_planner_places_the_convs_in(model):
    """One rule in one place: the convs whose problems name an output slice are the conv launches
    the cuda backend's planner gives that placement, a ConvTranspose placed too (no slice in its
    dgrad problem)."""
    named = {name: p.y_slice for name, p in _problems(model()).items() if p.y_slice is not None}
    placed = _runtime_placements(model())
    assert named and {k: keyed_slice(v, "float32") for k, v in placed.items() if k != "up"} == named
    assert ("up" in placed) == (model is _mixed_family)


def test_a_slice_key_keeps_the_first_channel_modulo_128_bytes():
    """Where a slice starts matters to a conv's speed only through its first element's alignment:
    a key keeps ``first`` modulo 128 bytes of channels, so the layers of a dense block (each writing
    the next 32 channels of one buffer) share one problem, and two starts of different alignment
    stay apart; the buffer's width (the strides) always stays."""
    firsts = [64 + 32 * k for k in range(6)]
    assert {keyed_slice(OutputSlice(f, 256), "float32") for f in firsts} == {OutputSlice(0, 256)}
    assert keyed_slice(OutputSlice(48, 256), "float32") == OutputSlice(16, 256) != keyed_slice(OutputSlice(64, 256), "float32")
    assert keyed_slice(InputSlice(96, 256), "float16") == InputSlice(32, 256)  # 64 half-floats a class
    assert keyed_slice(InputSlice(128, 256), "bfloat16") == InputSlice(0, 256) and keyed_slice(InputSlice(5, 9), "float32").channels == 9


def test_a_one_dimensional_conv_or_a_family_along_h_names_no_output_slice():
    m = _Model(3)
    m.nodes += [NODE("Conv", ["x", m.w("w1", (G, C, 3))], ["a"], name="conv1d", pads=[1, 1]),
                NODE("Relu", ["x"], ["q"], name="act"), NODE("Concat", ["a", "q"], ["y"], name="cat", axis=1)]
    assert _problems(m.build((N, C, HW), ["y"]))["conv1d"].y_slice is None  # run as a 2-D mapping: copied packed
    m = _Model(4)
    m.nodes += [NODE("Conv", ["x", m.w("w2", (C, C, 3, 3))], ["a"], name="conv", pads=[1] * 4),
                NODE("Relu", ["x"], ["q"], name="act"), NODE("Concat", ["a", "q"], ["cat"], name="cat", axis=2),
                NODE("Relu", ["cat"], ["y"], name="out")]
    assert _problems(m.build((N, C, HW, HW), ["y"]))["conv"].y_slice is None


# ---------------------------------------------------------------------------------------------
# the rule over plain data


def test_a_conv_step_writes_a_slice_with_no_residual():
    for epilogue in ("", "bias", "relu", "bias+relu"):
        assert conv_step_writes_slice("Conv", epilogue) and conv_step_writes_slice("ConvTranspose", epilogue)
    for epilogue in ("bias+swish", "bias+leakyrelu0.2"):  # a graph-API activation alone: the engine's plan writes the slice
        assert conv_step_writes_slice("Conv", epilogue) and not conv_step_writes_slice("ConvTranspose", epilogue)
    for epilogue in ("bias+add", "bias+add+relu", "bias+swish+add", "bias+leakyrelu0.2+add"):
        assert not conv_step_writes_slice("Conv", epilogue)
    assert not conv_step_writes_slice("Relu", "")


def test_placements_take_the_writer_the_pad_passes_to_and_nothing_else():
    infos = {"cat": ConcatInfo(1, ("a", "p", "q", "s", "wide"), (4, 2, 2, 3, 1)), "other": ConcatInfo(1, ("u2", "k"), (2, 2))}
    fams = families(infos)
    writers = {"a": "conv_a", "u": "conv_u", "u2": "conv_u2", "v": "conv_v"}
    pads = {"p": "u", "q": "u2", "s": "v"}  # p = Pad(u), q = Pad(u2) (u2 read by another family), s = Pad(v)
    placed = place(fams[0], infos, times_in_families(infos, fams), aliasable=lambda v: v != "v", writer=writers.get, pad_input=pads.get)
    assert [(p.value, p.written, p.writer, p.offset, p.total) for p in placed] == [("a", "a", "conv_a", 0, 12), ("p", "u", "conv_u", 4, 12)]
    slices = output_slices(infos, lambda v: v != "v", writers.get, pads.get)
    assert slices == {"conv_a": OutputSlice(0, 12), "conv_u": OutputSlice(4, 12), "conv_u2": OutputSlice(0, 4)}
    one = {"cat": ConcatInfo(1, ("a",), (4,))}  # as wide as its buffer: packed
    assert output_slices(one, lambda v: True, writers.get) == {}


# ---------------------------------------------------------------------------------------------
# keys


SHAPE = ConvShape("fwd", 16, 128, 32, (28, 28), (3, 3), (1, 1), (1, 1), (1, 1))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_key_that_writes_a_slice_round_trips_alone_and_with_a_read(layout):
    write = SHAPE.key(layout, "default", y_slice=OutputSlice(160, 256))
    both = SHAPE.key(layout, "default", InputSlice(0, 256), OutputSlice(160, 256))
    assert str(write).endswith(f"|{layout}|default|yslice=160/256") and str(both).endswith("|xslice=0/256|yslice=160/256")
    for key in (write, both):
        assert ProblemKey.parse(str(key)) == key and key.packed == SHAPE.key(layout, "default")
    assert write != SHAPE.key(layout, "default") and write != both
    assert ProblemKey.parse(str(SHAPE.key(layout, "default", InputSlice(0, 256)))).y_slice is None  # the older forms read as they did
    assert ProblemKey.parse(str(SHAPE.key(layout, "default"))).y_slice is None
    with pytest.raises(ValueError, match="not a convpass problem key"):
        ProblemKey.parse(str(SHAPE.key(layout, "default")) + "|yslice=160/256|xslice=0/256")  # one order


def test_output_slice_strides_are_those_of_a_numpy_view_of_the_buffer():
    for layout in ("nchw", "nhwc"):
        buf = np.empty((16, 256, 28, 28), np.float32) if layout == "nchw" else np.empty((16, 28, 28, 256), np.float32).transpose(0, 3, 1, 2)
        view = buf[:, 160:192]
        assert SHAPE.key(layout, "default", y_slice=OutputSlice(160, 256)).y_strides == tuple(s // 4 for s in view.strides)


@pytest.mark.parametrize("bad", [OutputSlice(0, 32), OutputSlice(230, 256), OutputSlice(-1, 256)])
def test_an_output_slice_that_is_none_is_refused(bad):
    with pytest.raises(ValueError, match="no channel slice"):
        SHAPE.key("nhwc", "default", y_slice=bad)
    with pytest.raises(ValueError, match="forward"):
        SHAPE.with_direction("dgrad").key("nhwc", "default", y_slice=OutputSlice(0, 256))
    assert InputSlice(0, 256) != OutputSlice(0, 256) and str(OutputSlice(0, 256)) == "yslice=0/256"
