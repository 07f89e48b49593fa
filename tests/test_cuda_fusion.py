"""Element-wise fusion of the cuda backend (convpass.kernels.elementwise), checked on the CPU.

The grouping rules run on plans the CPU executor builds. The generated kernel bodies are plain
C++ over ``float`` / ``double``: here they are compiled with the host C++ compiler (``__device__``
defined away) and run on the same inputs as the NumPy op library, so every expression in
``EXPRESSIONS`` is checked against the reference implementation of its op without a GPU. The
kernels themselves, on CuPy, are checked in tests/gpu/test_executor_cuda.py.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from conftest import host_args
from onnx import TensorProto, helper, numpy_helper

from convpass.kernels import broadcast, elementwise_launch
from convpass.kernels import elementwise as cuda_fusion
from convpass.runtime.executor import Executor

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")

X_SHAPE = (2, 3, 4, 5)


def _model(nodes, inputs, output, dtype=TensorProto.FLOAT, inits=(), opset=20):
    ins = [helper.make_tensor_value_info(n, dtype, s) for n, s in inputs]
    out = helper.make_tensor_value_info(output, dtype, X_SHAPE)
    graph = helper.make_graph(nodes, "g", ins, [out], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11 if opset >= 23 else 9)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


N = helper.make_node

# name -> (nodes, extra inputs beyond X, initializers, opset, expected group op types)
CASES = {
    "silu": ([N("Sigmoid", ["X"], ["s"]), N("Mul", ["X", "s"], ["Y"])], [], [], 17),
    "gelu_decomposed": (
        [
            N("Div", ["X", "sqrt2"], ["d"]),
            N("Erf", ["d"], ["e"]),
            N("Add", ["e", "one"], ["a"]),
            N("Mul", ["X", "a"], ["m"]),
            N("Mul", ["m", "half"], ["Y"]),
        ],
        [],
        [_const("sqrt2", 1.4142135), _const("one", 1.0), _const("half", 0.5)],
        17,
    ),
    "se_gate": ([N("HardSigmoid", ["G"], ["h"], alpha=1 / 6, beta=0.5), N("Mul", ["X", "h"], ["Y"])], [("G", (2, 3, 1, 1))], [], 17),
    "hard_swish": ([N("HardSwish", ["X"], ["Y"])], [], [], 17),
    "activations": (
        [
            N("LeakyRelu", ["X"], ["l"], alpha=0.1),
            N("Elu", ["l"], ["e"], alpha=0.7),
            N("Softplus", ["e"], ["p"]),
            N("Mish", ["p"], ["m"]),
            N("Softsign", ["m"], ["q"]),
            N("Tanh", ["q"], ["t"]),
            N("Relu", ["t"], ["Y"]),
        ],
        [],
        [],
        18,
    ),
    "arithmetic": (
        [
            N("Abs", ["X"], ["a"]),
            N("Sqrt", ["a"], ["s"]),
            N("Neg", ["s"], ["n"]),
            N("Exp", ["n"], ["e"]),
            N("Log", ["e"], ["l"]),
            N("Reciprocal", ["X"], ["r"]),
            N("Sub", ["l", "r"], ["d"]),
            N("Pow", ["X", "two"], ["p"]),
            N("Div", ["d", "p"], ["q"]),
            N("Max", ["q", "B"], ["mx"]),
            N("Min", ["mx", "X"], ["Y"]),
        ],
        [("B", (1, 3, 1, 5))],
        [_const("two", 2.0)],
        17,
    ),
    "clip_inputs": ([N("Clip", ["X", "lo", "hi"], ["c"]), N("Clip", ["c", "", "hi2"], ["Y"])], [], [_const("lo", -0.5), _const("hi", 0.75), _const("hi2", 0.5)], 17),
    "clip_attrs": ([N("Clip", ["X"], ["c"], min=-0.25), N("Clip", ["c"], ["Y"], max=0.3)], [], [], 10),
    "prelu": ([N("PRelu", ["X", "slope"], ["Y"])], [], [_const("slope", np.array([0.1, -0.2, 0.3]).reshape(3, 1, 1))], 17),
    "gelu_ops": ([N("Gelu", ["X"], ["g"]), N("Gelu", ["g"], ["Y"], approximate="tanh")], [], [], 20),
    "sigmoid_chain": ([N("Sigmoid", ["X"], ["s"]), N("Mul", ["s", "X"], ["m"]), N("Sigmoid", ["m"], ["Y"])], [], [], 17),
    "swish": ([N("Swish", ["X"], ["Y"], alpha=0.8)], [], [], 24),
    # an ECA / squeeze-excitation gate broadcast by an Expand: read per channel, not copied per element
    "expand_gate": ([N("Sigmoid", ["G"], ["s"]), N("Expand", ["s", "shape"], ["e"]), N("Mul", ["X", "e"], ["Y"])], [("G", (2, 3, 1, 1))],
                    [_const("shape", X_SHAPE, np.int64)], 17),
    # a MatMul's bias Add read twice by the decomposed GELU after it: internal to one group (a DAG)
    "bias_gelu": (
        [
            N("Add", ["X", "B"], ["a"]),
            N("Div", ["a", "sqrt2"], ["d"]),
            N("Erf", ["d"], ["e"]),
            N("Add", ["e", "one"], ["e1"]),
            N("Mul", ["a", "e1"], ["m"]),
            N("Mul", ["m", "half"], ["Y"]),
        ],
        [("B", (5,))],
        [_const("sqrt2", 1.4142135), _const("one", 1.0), _const("half", 0.5)],
        17,
    ),
    # pre-activation: an inference BatchNormalization that no conv precedes, then Relu; the
    # per-channel parameters are read as (C, 1, 1) views
    "batchnorm_relu": (
        [N("BatchNormalization", ["X", "scale", "bias", "mean", "var"], ["b"], epsilon=1e-3), N("Relu", ["b"], ["Y"])],
        [],
        [_const("scale", [0.5, -1.5, 2.0]), _const("bias", [0.1, 0.0, -0.3]), _const("mean", [0.2, -0.1, 1.0]), _const("var", [0.7, 1.3, 0.05])],
        15,
    ),
}


def _plan(model, feeds):
    ex = Executor(model, device="cpu")
    ref = ex.run(None, feeds)[0]
    return ex.last_plan, ref


def _feeds(extra, dtype, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {"X": (rng.standard_normal(X_SHAPE) * 2).astype(dtype)}
    for name, shape in extra:
        feeds[name] = (rng.standard_normal(shape) * 2).astype(dtype)
    # exact zeros and NaN / inf take the branches and propagation paths
    feeds["X"].flat[:4] = [0.0, -0.0, np.nan, np.inf]
    return feeds


def _host_program(groups) -> str:
    lines = [
        "#include <cmath>",
        "#include <cstdio>",
        "#include <cstdlib>",
        "#include <vector>",
        "using namespace std;",
        "#define __device__",
        "#define __forceinline__ inline",
        cuda_fusion.PREAMBLE,
    ]
    for k, (group, ctype) in enumerate(groups):
        params = ", ".join(f"{ctype} in{j}" for j in range(len(group.inputs)))
        lines.append(f"static {ctype} group{k}({params}) {{ typedef {ctype} T; T out0;\n{group.code}\nreturn out0; }}")
    lines.append("int main(int argc, char** argv) { int g = atoi(argv[1]); long n = atol(argv[2]); int k = atoi(argv[3]); int size = atoi(argv[4]);")
    lines.append("  std::vector<char> buf((size_t)n * k * size); fread(buf.data(), 1, buf.size(), stdin);")
    for k, (group, ctype) in enumerate(groups):
        args = ", ".join(f"(({ctype}*)buf.data())[{j} * n + i]" for j in range(len(group.inputs)))
        lines.append(f"  if (g == {k}) for (long i = 0; i < n; ++i) {{ {ctype} y = group{k}({args}); fwrite(&y, sizeof y, 1, stdout); }}")
    lines.append("  return 0; }")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every case's groups, in float32 and float64, compiled into one host program."""
    if CXX is None:
        pytest.fail("no C++ compiler (g++, c++ or clang++) to check the generated kernel code with")
    entries = []
    for case, (nodes, extra, inits, opset) in CASES.items():
        for dtype, tp in ((np.float32, TensorProto.FLOAT), (np.float64, TensorProto.DOUBLE)):
            cast_inits = [_const(t.name, numpy_helper.to_array(t), dtype) if t.data_type != TensorProto.INT64 else t for t in inits]
            model = _model(nodes, [("X", X_SHAPE), *extra], "Y", tp, cast_inits, opset)
            feeds = _feeds(extra, dtype)
            plan, ref = _plan(model, feeds)
            groups = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
            entries.append((case, dtype, plan, feeds, ref, groups))
    flat = [(g, "float" if e[1] == np.float32 else "double") for e in entries for g in e[5]]
    d = tmp_path_factory.mktemp("fusion")
    (d / "groups.cpp").write_text(_host_program(flat))
    subprocess.run([CXX, "-O1", "-std=c++14", "-o", str(d / "groups"), str(d / "groups.cpp")], check=True, capture_output=True)
    return entries, d / "groups"


def _run_group(binary, index, group, plan, feeds, dtype):
    env = dict(zip(plan.slot_names, plan.template))
    env.update(feeds)
    values = [np.reshape(env[plan.slot_names[s]], group.view_of(k)) if group.view_of(k) else env[plan.slot_names[s]]
              for k, s in enumerate(group.inputs)]
    shape = np.broadcast_shapes(*(np.shape(v) for v in values))
    flat = np.concatenate([np.broadcast_to(np.asarray(v, dtype=dtype), shape).ravel() for v in values])
    n = int(np.prod(shape))
    size = np.dtype(dtype).itemsize
    out = subprocess.run([str(binary), str(index), str(n), str(len(values)), str(size)], input=flat.tobytes(), capture_output=True, check=True)
    return np.frombuffer(out.stdout, dtype=dtype).reshape(shape)


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_kernel_matches_the_numpy_ops(compiled, case):
    entries, binary = compiled
    index = 0
    for name, dtype, plan, feeds, ref, groups in entries:
        if name == case:
            assert len(groups) == 1, f"{case}: expected one group, got {[g.ops for g in groups]}"
            group = groups[0]
            assert group.members == tuple(range(len(plan.steps))), f"{case}: every step fuses"
            got = _run_group(binary, index, group, plan, feeds, dtype)
            rtol = 1e-5 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * 1e-3, equal_nan=True, err_msg=f"{case} {np.dtype(dtype)}")
        index += len(groups)


def test_every_expression_is_covered_by_a_case():
    covered = {n.op_type for nodes, *_ in CASES.values() for n in nodes}
    assert set(cuda_fusion.EXPRESSIONS) <= covered


def _steps(plan):
    return [s.node.op_type for s in plan.steps]


def test_values_read_outside_a_group_or_graph_outputs_are_not_fused_away():
    # s = Sigmoid(X) is read by Mul and by Transpose (not element-wise): s is stored, so Sigmoid is
    # its own group and Mul, a lone one-kernel op, is not fused.
    nodes = [N("Sigmoid", ["X"], ["s"]), N("Mul", ["X", "s"], ["Y"]), N("Transpose", ["s"], ["T"], perm=[0, 1, 3, 2])]
    ins = [helper.make_tensor_value_info("X", TensorProto.FLOAT, X_SHAPE)]
    outs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, X_SHAPE), helper.make_tensor_value_info("T", TensorProto.FLOAT, (2, 3, 5, 4))]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs), opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    plan, _ = _plan(model, _feeds([], np.float32))
    groups = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    assert [g.ops for g in groups] == [("Sigmoid",)]


def test_claimed_steps_integer_math_and_lone_one_kernel_ops_stay_out():
    nodes = [N("Relu", ["X"], ["r"]), N("Add", ["r", "X"], ["Y"])]
    plan, _ = _plan(_model(nodes, [("X", X_SHAPE)], "Y"), _feeds([], np.float32))
    assert [g.ops for g in cuda_fusion.plan_groups(plan, [None, None])] == [("Relu", "Add")]
    # the Relu claimed (as a conv fusion would): the Add alone is one CuPy kernel, no group
    assert cuda_fusion.plan_groups(plan, ["skip", None]) == []
    ints = _model([N("Abs", ["X"], ["a"]), N("Neg", ["a"], ["Y"])], [("X", X_SHAPE)], "Y", TensorProto.INT32)
    plan, _ = _plan(ints, {"X": np.arange(120, dtype=np.int32).reshape(X_SHAPE)})
    assert cuda_fusion.plan_groups(plan, [None, None]) == []


def test_group_kernel_names_depend_on_code_and_dtype_only():
    nodes, extra, inits, opset = CASES["silu"]
    a, _ = _plan(_model(nodes, [("X", X_SHAPE)], "Y"), _feeds([], np.float32))
    b, _ = _plan(_model(nodes, [("X", (1, 8, 2, 2))], "Y"), {"X": np.ones((1, 8, 2, 2), np.float32)})
    c, _ = _plan(_model(nodes, [("X", X_SHAPE)], "Y", TensorProto.DOUBLE), {"X": np.ones(X_SHAPE)})
    ga, gb, gc = (cuda_fusion.plan_groups(p, [None] * len(p.steps))[0] for p in (a, b, c))
    assert ga.name == gb.name != gc.name
    assert "typedef float A;" in ga.code and "typedef double A;" in gc.code


# ---------------------------------------------------------------------------------------------
# the broadcasting kernel: its launch geometry, and its CUDA source run on the host


def test_geometry_merges_what_every_operand_walks_contiguously():
    geo = broadcast.broadcast_geometry
    # BatchNormalization's (C, 1, 1) parameters over NCHW: N, C, H * W
    g = geo((2, 3, 4, 5), [((2, 3, 4, 5), (60, 20, 5, 1)), ((3, 1, 1), (1, 1, 1))], (60, 20, 5, 1), False)
    assert (g.n, g.extents) == (120, (1, 3, 20))
    assert g.strides == ((60, 0, 20, 1), (0, 0, 1, 0), (60, 0, 20, 1))
    # the same over channels-last storage: N * H * W, C; the parameters follow the inner index
    g = geo((2, 3, 4, 5), [((2, 3, 4, 5), (60, 1, 15, 3)), ((3, 1, 1), (1, 1, 1))], (60, 1, 15, 3), True)
    assert (g.n, g.extents) == (120, (1, 1, 3))
    assert g.strides == ((3, 0, 0, 1), (0, 0, 0, 1), (3, 0, 0, 1))
    # same-shape contiguous operands: one dimension
    g = geo((2, 3, 4, 5), [((2, 3, 4, 5), (60, 20, 5, 1))] * 2, (60, 20, 5, 1), False)
    assert (g.extents, g.strides[0]) == ((1, 1, 120), (0, 0, 0, 1))
    # a squeeze-excite gate (N, C, 1, 1) over channels-last storage: N, H * W, C
    g = geo((2, 3, 4, 5), [((2, 3, 4, 5), (60, 1, 15, 3)), ((2, 3, 1, 1), (3, 1, 1, 1))], (60, 1, 15, 3), True)
    assert (g.extents, g.strides[1]) == ((1, 20, 3), (3, 0, 0, 1))
    # four dimensions: a (C, 1, W) operand; (C, H, 1) would merge C and H
    g = geo((2, 3, 4, 5), [((2, 3, 4, 5), (60, 20, 5, 1)), ((3, 1, 5), (5, 5, 1))], (60, 20, 5, 1), False)
    assert (g.extents, g.strides[1]) == ((3, 4, 5), (0, 5, 0, 1))
    assert geo((2, 3, 4, 5), [((3, 4, 1), (4, 1, 1))], (60, 20, 5, 1), False).extents == (1, 12, 5)
    # into a Concat slice: the output's stride keeps N apart
    g = geo((2, 3, 4, 5), [((2, 3, 4, 5), (60, 20, 5, 1))], (140, 20, 5, 1), False)
    assert (g.extents, g.strides[1]) == ((1, 1, 60), (140, 0, 0, 1))
    # one element; more dimensions than the kernel has; offsets beyond 31 bits
    assert geo((1, 1), [((1,), (1,))], (1, 1), False).n == 1
    shape = (2, 3, 2, 3, 2)
    transposed = (1, 2, 6, 12, 36)  # np.empty(shape[::-1]).T: no two dimensions merge
    assert geo(shape, [(shape, transposed)], (36, 12, 6, 2, 1), False) is None
    assert geo((2, 4), [((2, 4), (2**31, 1))], (4, 1), False) is None


def test_launch_and_entry_follow_the_geometry():
    g = broadcast.Geometry(10**6, (1, 1, 10**6), ((0, 0, 0, 1),))
    assert g.launch(4) == (-(-10**6 // 1024), 256) and g.launch(2) == (-(-10**6 // 512), 256) and g.dims == 1
    assert broadcast.Geometry(100, (1, 1, 100), ((0, 0, 0, 1),)).launch(4) == (1, 256)
    assert [broadcast.Geometry(120, e, ()).dims for e in ((1, 1, 40), (1, 3, 20), (3, 4, 5))] == [2, 3, 4]


def test_constants_of_one_shape_share_their_offsets():
    nodes, extra, inits, opset = CASES["batchnorm_relu"]
    plan, _ = _plan(_model(nodes, [("X", X_SHAPE)], "Y", inits=inits, opset=opset), _feeds([], np.float32))
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    assert broadcast.broadcast_classes(plan, group) == (0, 1, 1)  # x, the folded scale and shift
    source = broadcast.broadcast_source(group, (0, 1, 1))
    assert source.name != broadcast.broadcast_source(group).name
    assert source.code.count("const int oc_") == 3  # x, the parameters, the output
    # folded: multiplies and adds only, so more elements per thread than for heavier math
    assert broadcast.unroll_for(group) == broadcast.UNROLL
    assert f"T v0[{broadcast.UNROLL}];" in source.code


def test_batchnorm_with_constant_parameters_is_folded_to_a_scale_and_shift():
    nodes, extra, inits, opset = CASES["batchnorm_relu"]
    plan, ref = _plan(_model(nodes, [("X", X_SHAPE)], "Y", inits=inits, opset=opset), _feeds([], np.float32))
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    assert len(group.inputs) == 3 and "sqrt" not in group.code
    scale, shift = (plan.template[s] for s in group.inputs[1:])
    gamma, beta, mean, var = (numpy_helper.to_array(t).astype(np.float64) for t in inits)
    np.testing.assert_allclose(scale, gamma / np.sqrt(var + 1e-3), rtol=1e-7)
    np.testing.assert_allclose(shift, beta - mean * gamma / np.sqrt(var + 1e-3), rtol=1e-6)
    # a parameter that is a graph input is not a constant: the op's own formula, five inputs
    ins = [("X", X_SHAPE), ("scale", (3,))]
    plan, _ = _plan(_model(nodes, ins, "Y", inits=inits[1:], opset=opset), {**_feeds([], np.float32), "scale": np.ones(3, np.float32)})
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    assert len(group.inputs) == 5 and "sqrt" in group.code


def _host_launcher(lib, entry):
    kernel = getattr(lib, entry)

    def launch(grid, block, args):
        conv = host_args(args)
        (gx,), (bx,) = grid, block
        for bx_ in range(gx):
            for tx in range(bx):
                lib.set_index(bx_, 0, tx, bx, gx, 1)
                kernel(*conv)

    return launch


_SETTER = ('\nextern "C" void set_index(unsigned bx, unsigned by, unsigned tx, unsigned bdx, unsigned gdx, unsigned gdy) '
           '{ blockIdx.x = bx; blockIdx.y = by; threadIdx.x = tx; blockDim.x = bdx; gridDim.x = gdx; gridDim.y = gdy; }\n')


def _stored_channels_last(a):
    if a.ndim != 4:
        return a
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "mixed", "concat-slice", "concat-slice-nhwc"])
@pytest.mark.parametrize("case", ["batchnorm_relu", "bias_gelu", "se_gate", "expand_gate", "prelu", "arithmetic", "silu"])
def test_broadcasting_kernel_source_matches_the_numpy_ops(tmp_path, case, layout):
    """The generated kernel, compiled as host C++ and run thread by thread over its real launch
    grid, on operands stored channels-first, channels-last, both, and into a Concat slice (of a
    channels-first or a channels-last buffer, walked in the slice's memory order: its innermost
    step one element)."""
    from conftest import host_library

    nodes, extra, inits, opset = CASES[case]
    model = _model(nodes, [("X", X_SHAPE), *extra], "Y", TensorProto.FLOAT, inits, opset)
    feeds = _feeds(extra, np.float32)
    plan, ref = _plan(model, feeds)
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    classes = broadcast.broadcast_classes(plan, group)
    source = broadcast.broadcast_source(group, classes)
    lib = host_library(tmp_path, "using namespace std;\n" + source.code + _SETTER, "bcast")
    env = dict(zip(plan.slot_names, plan.template))
    env.update(feeds)
    args = [np.asarray(env[plan.slot_names[s]], np.float32) for s in group.inputs]
    args = [a.reshape(group.view_of(k)) if group.view_of(k) else a for k, a in enumerate(args)]
    if layout in ("nhwc", "mixed"):
        args = [_stored_channels_last(a) if (layout == "nhwc" or k == 0) else a for k, a in enumerate(args)]
    out = buffer = None
    if layout.startswith("concat-slice"):
        buffer = np.full((2, 7, 4, 5), -7.0, np.float32)
        if layout.endswith("nhwc"):
            buffer = _stored_channels_last(buffer)
        out = buffer[:, 2:5]
    kern = broadcast.BroadcastKernel(np, group, classes, entry=lambda name: _host_launcher(lib, name))
    got = kern(args, out)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"{case} {layout}")
    if layout == "nhwc" and got.ndim == 4:
        assert got.strides[1] == 4, "the output keeps the inputs' channels-last storage"
    if buffer is not None:
        assert got.base is buffer.base or np.shares_memory(got, buffer)
        if got.ndim == 4:
            [(_, _, _, scalars, _)] = kern._plans.values()
            assert int(scalars[-1]) == 1, "the output walked in its memory order"
        assert (buffer[:, :2] == -7).all() and (buffer[:, 5:] == -7).all(), "nothing written outside the slice"


def test_lone_ops_that_broadcast_form_a_group():
    nodes = [N("Add", ["X", "B"], ["Y"])]
    plan, _ = _plan(_model(nodes, [("X", X_SHAPE), ("B", (5,))], "Y"), _feeds([("B", (5,))], np.float32))
    assert [g.ops for g in cuda_fusion.plan_groups(plan, [None])] == [("Add",)]
    nodes = [N("Mul", ["X", "s"], ["Y"])]
    plan, _ = _plan(_model(nodes, [("X", X_SHAPE)], "Y", inits=[_const("s", 2.0)]), _feeds([], np.float32))
    assert cuda_fusion.plan_groups(plan, [None]) == [], "a scalar operand: CuPy's kernel is fast already"


def test_cupys_kernel_is_built_only_for_shapes_the_broadcasting_kernel_may_not_take():
    nodes, extra, inits, opset = CASES["silu"]
    plan, _ = _plan(_model(nodes, [("X", X_SHAPE)], "Y"), _feeds([], np.float32))
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    assert not broadcast.needs_fallback(plan, group)
    five = (1, 2, 3, 4, 5)
    plan5, _ = _plan(_model(nodes, [("X", five)], "Y"), {"X": np.ones(five, np.float32)})
    (group5,) = cuda_fusion.plan_groups(plan5, [None] * len(plan5.steps))
    assert broadcast.needs_fallback(plan5, group5)  # rank 5 may leave five dimensions after merging


def test_a_fused_launch_runs_the_broadcasting_kernel_and_falls_back_to_cupys():
    nodes, extra, inits, opset = CASES["silu"]
    feeds = _feeds([], np.float32)
    plan, ref = _plan(_model(nodes, [("X", X_SHAPE)], "Y"), feeds)
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    calls = []

    def broadcasting(args, out=None):
        calls.append("broadcast")
        return None if len(calls) > 1 else np.asarray(ref)  # takes the first shape only

    def fallback(*args):
        calls.append("cupy")
        return np.asarray(ref)

    env = list(plan.template)
    env[group.inputs[0]] = feeds["X"]
    counters = {"fused_elementwise": 0}
    elementwise_launch.FusedLaunch(plan, group, broadcasting, fallback, counters).run(env)
    elementwise_launch.FusedLaunch(plan, group, broadcasting, fallback, counters).run(env)
    assert calls == ["broadcast", "broadcast", "cupy"] and counters["fused_elementwise"] == 2
    with pytest.raises(RuntimeError, match="needs CuPy's kernel"):
        elementwise_launch.FusedLaunch(plan, group, broadcasting, None, counters).run(env)
    with pytest.raises(ValueError):
        elementwise_launch.FusedLaunch(plan, group, None, None, counters)


def test_constant_inputs_are_packed_so_a_class_has_one_set_of_strides():
    nodes = [N("Mul", ["X", "a"], ["m"]), N("Add", ["m", "b"], ["Y"])]
    a = np.arange(20, dtype=np.float32).reshape(4, 5)
    inits = [_const("a", a), _const("b", np.ones((4, 5)))]
    plan, _ = _plan(_model(nodes, [("X", X_SHAPE)], "Y", inits=inits), _feeds([], np.float32))
    (group,) = cuda_fusion.plan_groups(plan, [None] * len(plan.steps))
    assert broadcast.broadcast_classes(plan, group) == (0, 1, 1)
    slot = group.inputs[1]
    plan.template[slot] = np.asfortranarray(plan.template[slot])  # a constant stored column-major
    launch = elementwise_launch.FusedLaunch(plan, group, lambda args, out=None: None, None, {"fused_elementwise": 0})
    fixed = [f for f in launch._fixed if f is not None]
    assert all(f.flags.c_contiguous for f in fixed) and len({f.strides for f in fixed}) == 1
    np.testing.assert_array_equal(fixed[0], plan.template[slot])
