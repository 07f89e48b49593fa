"""The channel-slice rule (:mod:`convpass.core.concat_slices`) and the problems it gives: an
RRDB-like dense block's convs that read a Concat family's buffer are problems that name their
slice (:class:`~convpass.core.problem.InputSlice`), the root's reader and the stem are packed; an
SK block's paths read the slices of their Split; keys that name a slice round-trip and are other
keys than the packed ones."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler.pipeline import OptimizeReport, prepare_model
from convpass.core.concat_slices import ConcatInfo, SplitInfo, channel_slices, families
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvShape, InputSlice, ProblemKey

N, C, G, HW = 2, 16, 8, 6  # batch, stem channels, growth, spatial size


def _dense_block():
    """stem conv -> LeakyRelu = x0; f1 = LeakyRelu(conv1(x0)); f2 = LeakyRelu(conv2(cat(x0, f1)));
    y = conv3(cat(x0, f1, f2)): RRDB's dense block, three convs deep."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def w(name, shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name))
        return name

    nodes.append(helper.make_node("Conv", ["x", w("ws", (C, 3, 3, 3)), w("bs", (C,))], ["s"], name="stem", pads=[1] * 4))
    nodes.append(helper.make_node("LeakyRelu", ["s"], ["x0"], name="stem_act", alpha=0.2))
    feats, channels = ["x0"], C
    for k in (1, 2):
        src = feats[0] if k == 1 else f"cat{k - 1}"
        nodes.append(helper.make_node("Conv", [src, w(f"w{k}", (G, channels, 3, 3)), w(f"b{k}", (G,))], [f"c{k}"], name=f"conv{k}", pads=[1] * 4))
        nodes.append(helper.make_node("LeakyRelu", [f"c{k}"], [f"f{k}"], name=f"act{k}", alpha=0.2))
        feats.append(f"f{k}")
        channels += G
        nodes.append(helper.make_node("Concat", list(feats), [f"cat{k}"], name=f"cat{k}", axis=1))
    nodes.append(helper.make_node("Conv", ["cat2", w("w3", (C, channels, 3, 3)), w("b3", (C,))], ["y"], name="conv3", pads=[1] * 4))
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3, HW, HW])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, C, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _split_block():
    """stem conv -> Relu -> Split in two on the channels -> a 3x3 conv on each half -> Add."""
    rng = np.random.default_rng(1)
    inits = []

    def w(name, shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name))
        return name

    nodes = [helper.make_node("Conv", ["x", w("ws", (2 * C, 3, 3, 3))], ["s"], name="stem", pads=[1] * 4),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Split", ["r"], ["h0", "h1"], name="split", axis=1),
             helper.make_node("Conv", ["h0", w("w0", (C, C, 3, 3))], ["p0"], name="path0", pads=[1] * 4),
             helper.make_node("Conv", ["h1", w("w1", (C, C, 3, 3))], ["p1"], name="path1", pads=[2] * 4, dilations=[2, 2]),
             helper.make_node("Add", ["p0", "p1"], ["y"], name="sum")]
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3, HW, HW])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, C, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _slices_by_node(model) -> dict[str, InputSlice | None]:
    m = ir.serde.deserialize_model(model)
    problems = prepare_model(m, TuneOptions(engines="legacy"), [], OptimizeReport())
    return {use.node.name: p.x_slice for p, uses in problems.items() for use in uses}


def test_a_dense_blocks_convs_read_slices_of_the_familys_buffer_and_its_roots_reader_reads_it_packed():
    total = C + 2 * G
    assert _slices_by_node(_dense_block()) == {
        "stem": None,  # a graph input
        "conv1": InputSlice(0, total),  # x0, written in place into the root's buffer
        "conv2": InputSlice(0, total),  # cat1, a view of the root's buffer
        "conv3": None,  # cat2 is the root: the whole buffer, packed
    }


def test_the_paths_of_a_split_read_its_halves():
    assert _slices_by_node(_split_block()) == {"stem": None, "path0": InputSlice(0, 2 * C), "path1": InputSlice(C, 2 * C)}


def test_a_slice_problem_is_another_problem_than_the_packed_one():
    """The same geometry read packed and read as a slice: two problems, decided apart."""
    model = _dense_block()
    m = ir.serde.deserialize_model(model)
    problems = prepare_model(m, TuneOptions(engines="legacy"), [], OptimizeReport())
    conv1 = next(p for p, uses in problems.items() if uses[0].node.name == "conv1")
    packed = type(conv1)(conv1.candidates, conv1.fusion)
    assert conv1 != packed and "reading xslice=0/32" in str(conv1)


# ---------------------------------------------------------------------------------------------
# the rule over plain data


def test_only_channel_families_give_slices_and_a_value_two_families_read_is_not_placed():
    infos = {
        "cat_a": ConcatInfo(1, ("u", "v"), (4, 4)),
        "cat_b": ConcatInfo(1, ("u", "v", "w"), (4, 4, 2)),  # cat_a's root
        "cat_c": ConcatInfo(1, ("v", "z"), (4, 3)),  # v is read by a second family: not placed
        "cat_h": ConcatInfo(2, ("p", "q"), (5, 5)),  # along H: no channel slices
    }
    outputs = {k: f"{k}_out" for k in infos}
    fams = families(infos)
    assert [f.root for f in fams] == ["cat_b", "cat_c", "cat_h"] and fams[0].members == {"cat_a": 0, "cat_b": 0}
    slices = channel_slices(infos, outputs, aliasable=lambda v: v != "w", writer=lambda v: None if v == "z" else v)
    assert slices == {"cat_a_out": InputSlice(0, 10), "u": InputSlice(0, 10)}


def test_a_split_of_a_slice_gives_no_slices_and_one_along_h_neither():
    infos = {"cat": ConcatInfo(1, ("a", "b"), (4, 4)), "inner": ConcatInfo(1, ("a",), (4,))}
    splits = [SplitInfo(1, "a", ("a0", "a1"), (2, 2)), SplitInfo(1, "t", ("t0", "t1"), (3, 5)), SplitInfo(2, "t", ("s0", "s1"), (3, 3))]
    slices = channel_slices(infos, {"cat": "cat_out", "inner": "inner_out"}, lambda v: True, lambda v: v, splits)
    assert "a0" not in slices and "s0" not in slices  # a is itself a slice of cat's buffer; s splits H
    assert slices["t0"] == InputSlice(0, 8) and slices["t1"] == InputSlice(3, 8) and slices["a"] == InputSlice(0, 8)


# ---------------------------------------------------------------------------------------------
# keys


SHAPE = ConvShape("fwd", 16, 96, 32, (64, 64), (3, 3), (1, 1), (1, 1), (1, 1))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_key_that_reads_a_slice_round_trips_and_differs_from_the_packed_key(layout):
    key = SHAPE.key(layout, "default", InputSlice(0, 192))
    assert str(key).endswith(f"|{layout}|default|xslice=0/192")
    assert ProblemKey.parse(str(key)) == key and key != SHAPE.key(layout, "default") and key.packed == SHAPE.key(layout, "default")
    assert ProblemKey.parse(str(SHAPE.key(layout, "default"))).x_slice is None  # the old form reads as it did


def test_slice_strides_are_those_of_a_numpy_view_of_the_buffer():
    for layout in ("nchw", "nhwc"):
        buf = np.empty((16, 192, 64, 64), np.float32) if layout == "nchw" else np.empty((16, 64, 64, 192), np.float32).transpose(0, 3, 1, 2)
        view = buf[:, 64:160]
        assert SHAPE.key(layout, "default", InputSlice(64, 192)).x_strides == tuple(s // 4 for s in view.strides)


@pytest.mark.parametrize("bad", [InputSlice(0, 96), InputSlice(100, 192), InputSlice(-1, 192)])
def test_a_slice_that_is_none_is_refused(bad):
    with pytest.raises(ValueError, match="no channel slice"):
        SHAPE.key("nhwc", "default", bad)
    with pytest.raises(ValueError, match="forward"):
        SHAPE.with_direction("dgrad").key("nhwc", "default", InputSlice(0, 192))
