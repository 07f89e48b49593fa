"""The cuda backend's memory plan (convpass.runtime.cuda.memory), on plans the CPU executor builds.

Concat families (DenseNet's growing feature lists share one buffer), which inputs are written in
place by their producers and which are copied once, the aliasing rules (graph inputs and outputs,
constants, values read by two families, repeated inputs are never placed), and that running the
resulting launches on NumPy arrays gives exactly ONNX's Concat results.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from convpass.kernels.launch import Launch
from convpass.runtime.cuda import memory
from convpass.runtime.executor import Executor

N = helper.make_node


def _plan(nodes, inputs, outputs, inits=()):
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["?"] * 4) for n in outputs]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs, list(inits)), opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs}
    ex = Executor(model, device="cpu")
    refs = ex.run(None, feeds)
    return ex.last_plan, feeds, refs


class _Producer(Launch):
    """Runs the plan step with NumPy; honours a placement like the cuda launches do."""

    supports_placement = True

    def __init__(self, plan, index):
        st = plan.steps[index]
        super().__init__(index, st.node, st.node.op_type, st.outputs)
        self.st = st
        self.ctx = None

    def run(self, env):
        from convpass.kernels.backends import host_backend
        from convpass.ops.registry import OpContext

        out = self.st.fn(OpContext(host_backend()), self.st.node, *[env[s] if s >= 0 else None for s in self.st.inputs])
        dst = self.destination(env)
        if dst is not None:
            dst[...] = out
            out = dst
        env[self.outputs[0]] = out


def _allocator(shape, dtype):
    return lambda layout: np.full(shape, np.nan, dtype=dtype)  # poisoned: every element must be written


def _run(plan, feeds, launches):
    env = list(plan.template)
    for name, s in plan.feed_slots.items():
        env[s] = feeds[name]
    for i, st in enumerate(plan.steps):
        launches[i].run(env)
        for s in st.free:
            env[s] = None
    return [env[s] for s in plan.output_slots]


def _plan_and_run(plan, feeds):
    producers = {i: _Producer(plan, i) for i, st in enumerate(plan.steps) if st.node.op_type != "Concat"}
    concats = memory.plan_concats(plan, producers, _allocator)
    launches = {**producers, **concats}
    return concats, producers, _run(plan, feeds, launches)


def _dense_block():
    """x0 = Relu(x); f_k = Sigmoid(cat_{k-1}); cat_k = Concat(x0, f1, ..., f_k), as DenseNet does."""
    nodes = [N("Relu", ["x"], ["x0"])]
    feats = ["x0"]
    prev = "x0"
    for k in range(1, 4):
        nodes.append(N("Neg", [prev], [f"f{k}"]))
        feats.append(f"f{k}")
        nodes.append(N("Concat", list(feats), [f"cat{k}"], axis=1))
        prev = f"cat{k}"
    nodes.append(N("Exp", ["cat3"], ["y"]))
    return nodes


def test_dense_block_is_one_family_with_every_feature_written_in_place():
    plan, feeds, refs = _plan(_dense_block(), [("x", (2, 3, 4, 4))], ["y"])
    fams = memory.families(plan)
    assert len(fams) == 1
    (fam,) = fams
    concat_steps = [i for i, st in enumerate(plan.steps) if st.node.op_type == "Concat"]
    assert fam.root == concat_steps[-1] and sorted(fam.members) == concat_steps
    assert set(fam.members.values()) == {0}
    concats, producers, outs = _plan_and_run(plan, feeds)
    # x0, f1, f2, f3 all written by their producers into the one buffer: no Concat copies anything
    assert sum(p.placement is not None for p in producers.values()) == 4 and all(c.copies == [] for c in concats.values())
    np.testing.assert_array_equal(outs[0], refs[0])


def test_inputs_that_cannot_be_placed_are_copied_once():
    # a graph input, a constant, a value read by two families and a graph output are copied
    c = numpy_helper.from_array(np.ones((2, 1, 4, 4), np.float32), "c")
    nodes = [
        N("Relu", ["x"], ["a"]),
        N("Neg", ["x"], ["b"]),
        N("Concat", ["x", "a", "c"], ["cat1"], axis=1),  # x: graph input, c: constant
        N("Concat", ["b", "a", "b"], ["cat2"], axis=1),  # a: read by two families, b twice
        N("Sigmoid", ["cat1"], ["y1"]),
        N("Sigmoid", ["cat2"], ["y2"]),
    ]
    plan, feeds, refs = _plan(nodes, [("x", (2, 3, 4, 4))], ["y1", "y2", "a"], [c])
    concats, producers, outs = _plan_and_run(plan, feeds)
    assert len(concats) == 2
    placed = [p for p in producers.values() if p.placement is not None]
    assert placed == []  # every candidate breaks a rule
    copied = sorted(len(launch.copies) for launch in concats.values())
    assert copied == [3, 3]
    for got, want in zip(outs, refs):
        np.testing.assert_array_equal(got, want)


def test_a_concat_inside_another_is_a_view_and_nested_concats_are_placed():
    # Inception-E style: inner = Concat(p, q) is one input of outer = Concat(r, inner, s)
    nodes = [
        N("Relu", ["x"], ["p"]),
        N("Neg", ["x"], ["q"]),
        N("Exp", ["x"], ["r"]),
        N("Sigmoid", ["x"], ["s"]),
        N("Concat", ["p", "q"], ["inner"], axis=1),
        N("Concat", ["r", "inner", "s"], ["outer"], axis=1),
        N("Tanh", ["outer"], ["y"]),
    ]
    plan, feeds, refs = _plan(nodes, [("x", (1, 2, 3, 3))], ["y"])
    concats, producers, outs = _plan_and_run(plan, feeds)
    inner = next(launch for launch in concats.values() if launch.node.outputs[0] == "inner")
    # the inner concat's inputs p and q write into its buffer; so it cannot itself be placed in outer
    assert inner.placement is None and inner.copies == []
    outer = next(launch for launch in concats.values() if launch.node.outputs[0] == "outer")
    assert [s for s, _, _ in outer.copies] == [plan.slot_names.index("inner")]
    np.testing.assert_array_equal(outs[0], refs[0])


def test_concat_on_another_axis_with_channels_last_sources():
    nodes = [N("Relu", ["x"], ["a"]), N("Neg", ["x"], ["b"]), N("Concat", ["a", "b"], ["y"], axis=-1)]
    plan, feeds, refs = _plan(nodes, [("x", (2, 3, 4, 5))], ["y"])
    (fam,) = memory.families(plan)
    assert fam.axis == 3
    concats, producers, outs = _plan_and_run(plan, feeds)
    # y is a graph output: its inputs are still placed (the buffer is the output)
    assert sorted(p.placement.offset for p in producers.values() if p.placement is not None) == [0, 5]
    np.testing.assert_array_equal(outs[0], refs[0])


def test_run_at_finds_contiguous_runs_only():
    from convpass.core.concat_slices import _run_at

    assert _run_at([1, 2], [0, 1, 2, 3]) == 1
    assert _run_at([1, 3], [0, 1, 2, 3]) is None
    assert _run_at([0, 1, 2, 3], [0, 1, 2]) is None
