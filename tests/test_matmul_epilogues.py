"""MatMul / Gemm epilogues of the cuda backend (convpass.kernels.matmul), checked on the CPU.

The lowering rules run on plans the CPU executor builds; the launch runs with a NumPy stand-in
for the backend, both through a stand-in of cuBLASLt's fused call (``relu(a @ b + bias + z)``:
the arguments the launch passes) and through its op-by-op fallback, against the CPU executor.
cuBLASLt itself is checked on the GPU (tests/gpu/test_executor_cuda.py, the same cases).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from convpass.kernels import matmul as cuda_matmul
from convpass.ops.registry import OpContext
from convpass.runtime.executor import Executor

N = helper.make_node
M, K, C = 6, 8, 5  # rows, inner size, output features


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _inits(dtype=np.float32, gemm=False):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((C, K) if gemm else (K, C))
    return [_const("W", w, dtype), _const("bias", rng.standard_normal(C), dtype), _const("half", 0.5, dtype),
            _const("bias3", rng.standard_normal((1, 1, C)), dtype), _const("full", rng.standard_normal((M, C)), dtype)]


# name -> (nodes, extra inputs beyond X ("MK"), expected label or None (not lowered), absorbed op types)
CASES = {
    "linear_bias_then_transpose": ([N("MatMul", ["X", "W"], ["m"]), N("Add", ["m", "bias"], ["a"]), N("Transpose", ["a"], ["Y"])],
                                   [], "MatMul+bias (cuBLASLt)", ["Add"]),
    "bias_first_operand": ([N("MatMul", ["X", "W"], ["m"]), N("Add", ["bias", "m"], ["Y"])], [], "MatMul+bias (cuBLASLt)", ["Add"]),
    "linear_bias_residual_relu": ([N("MatMul", ["X", "W"], ["m"]), N("Add", ["m", "bias"], ["a"]), N("Add", ["Z", "a"], ["r"]), N("Relu", ["r"], ["Y"])],
                                  [("Z", "MC")], "MatMul+bias+residual+relu (cuBLASLt)", ["Add", "Add", "Relu"]),
    "residual_then_bias": ([N("MatMul", ["X", "W"], ["m"]), N("Add", ["m", "Z"], ["r"]), N("Add", ["r", "bias"], ["Y"])],
                           [("Z", "MC")], "MatMul+bias+residual (cuBLASLt)", ["Add", "Add"]),
    "gemm_transb_bias_relu": ([N("Gemm", ["X", "W", "bias"], ["g"], transB=1), N("Relu", ["g"], ["Y"])], [], "Gemm+bias+relu (cuBLASLt)", ["Relu"]),
    "gemm_bias_only": ([N("Gemm", ["X", "W", "bias"], ["Y"], transB=1)], [], "Gemm+bias (cuBLASLt)", []),
    "matmul_relu": ([N("MatMul", ["X", "W"], ["m"]), N("Relu", ["m"], ["Y"])], [], "MatMul+relu (cuBLASLt)", ["Relu"]),
    # the bias feeds an element-wise op cuBLASLt has no epilogue for (a GELU): the bias is taken
    "bias_then_elementwise": ([N("MatMul", ["X", "W"], ["m"]), N("Add", ["m", "bias"], ["a"]), N("Mul", ["a", "half"], ["Y"])], [],
                              "MatMul+bias (cuBLASLt)", ["Add"]),
    "bare_matmul": ([N("MatMul", ["X", "W"], ["Y"])], [], None, []),
    "gemm_alpha": ([N("Gemm", ["X", "W", "bias"], ["Y"], transB=1, alpha=0.5)], [], None, []),
    "gemm_full_c": ([N("Gemm", ["X", "W", "full"], ["Y"], transB=1)], [], None, []),
    # a bias that broadcasts the result to a higher rank is not an epilogue
    "bias_of_higher_rank": ([N("MatMul", ["X", "W"], ["m"]), N("Add", ["m", "bias3"], ["Y"])], [], None, []),
}
GEMM_CASES = {name for name, case in CASES.items() if case[0][0].op_type == "Gemm"}


def _shape(dims: str) -> tuple[int, ...]:
    """Shapes named by the module's sizes ("MC": (M, C)), read when used: the GPU test changes them."""
    return tuple(globals()[d] for d in dims)


def model(name, dtype=np.float32):
    nodes, extra, _, _ = CASES[name]
    tp = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.float64: TensorProto.DOUBLE}[dtype]
    ins = [helper.make_tensor_value_info(n, tp, _shape(s)) for n, s in [("X", "MK"), *extra]]
    rank = 3 if any("bias3" in n.input for n in nodes) else 2
    out = helper.make_tensor_value_info("Y", tp, [f"d{i}" for i in range(rank)])
    graph = helper.make_graph(nodes, "g", ins, [out], initializer=_inits(dtype, name in GEMM_CASES))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def feeds(name, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    out = {"X": rng.standard_normal((M, K)).astype(dtype)}
    for n, s in CASES[name][1]:
        out[n] = rng.standard_normal(_shape(s)).astype(dtype)
    return out


def _plan(m, f):
    ex = Executor(m, device="cpu")
    ref = ex.run(None, f)[0]
    plan = ex.last_plan
    plan.ctx = OpContext(ex._backend)  # runs the other steps in _run
    return plan, ref


class _Blas:
    """cuBLASLt's fused call in NumPy: what the launch asks for, computed the way cuBLASLt defines it."""

    def __init__(self):
        self.calls = []

    def matmul_epilogue(self, a, b, allow_tf32, *, bias=None, residual=None, relu=False):
        self.calls.append((a.shape, b.shape, bias is not None, residual is not None, relu))
        y = a.astype(np.float64) @ b.astype(np.float64)
        if bias is not None:
            y = y + bias
        if residual is not None:
            y = y + residual
        return (np.maximum(y, 0) if relu else y).astype(a.dtype)


class _FailingBlas:
    def matmul_epilogue(self, *args, **kwargs):
        raise RuntimeError("cublasLtMatmul failed: cuBLAS status 14")


class _Runtime:
    cp = np
    xp = np
    capturing = False

    def __init__(self, blas):
        self._blas = blas
        self.notes = []

    def blas(self):
        return self._blas

    def note_once(self, key, text):
        self.notes.append(text)


def _lower(plan):
    claimed = [None] * len(plan.steps)
    launches = []
    for i in range(len(plan.steps)):
        launch = cuda_matmul.lower_matmul(plan, i, claimed, None)
        if launch is not None:
            launches.append(launch)
            for k in (launch.step, *launch.absorbs):
                claimed[k] = launch
    return launches


def _run(plan, launch, rt, f):
    launch.rt = rt
    launch.prepare()
    env = list(plan.template)
    for name, s in plan.feed_slots.items():
        env[s] = f[name]
    for i, st in enumerate(plan.steps):  # every other step by the op library, the launch at its step
        if i == launch.step:
            launch.run(env)
        elif i not in launch.absorbs:
            args = [env[s] if s >= 0 else None for s in st.inputs]
            out = st.fn(plan.ctx, st.node, *args)
            env[st.outputs[0]] = out
    return env[plan.output_slots[0]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowering_rules(name):
    plan, _ = _plan(model(name), feeds(name))
    _, _, label, absorbed = CASES[name]
    launches = _lower(plan)
    if label is None:
        assert launches == []
        return
    (launch,) = launches
    assert launch.label == label
    assert [plan.steps[k].node.op_type for k in launch.absorbs] == absorbed
    assert launch.outputs[0] == (plan.steps[launch.absorbs[-1]].outputs[0] if absorbed else plan.steps[launch.step].outputs[0])


@pytest.mark.parametrize("fused", [True, False], ids=["cublaslt", "fallback"])
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2] is not None))
def test_launch_matches_the_cpu_executor(name, fused):
    f = feeds(name)
    plan, ref = _plan(model(name), f)
    (launch,) = _lower(plan)
    blas = _Blas() if fused else False
    got = _run(plan, launch, _Runtime(blas), f)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    if fused:
        assert len(blas.calls) == 1 and launch.fused_calls == 1
        _, _, bias, residual, relu = blas.calls[0]
        assert (bias, residual, relu) == ("bias" in launch.label, "residual" in launch.label, "relu" in launch.label)
    else:
        assert launch.fused_calls == 0


def test_a_residual_computed_after_the_product_is_not_taken():
    """The launch runs at the product's step, so it cannot read a value computed later."""
    nodes = [N("MatMul", ["X", "W"], ["m"]), N("Sigmoid", ["Z"], ["z"]), N("Add", ["m", "bias"], ["a"]), N("Add", ["a", "z"], ["Y"])]
    CASES["_late_residual"] = (nodes, [("Z", "MC")], None, [])
    try:
        f = feeds("_late_residual")
        plan, ref = _plan(model("_late_residual"), f)
        (launch,) = _lower(plan)
        assert launch.label == "MatMul+bias (cuBLASLt)"
        np.testing.assert_allclose(_run(plan, launch, _Runtime(_Blas()), f), ref, rtol=1e-5, atol=1e-5)
    finally:
        del CASES["_late_residual"]


def test_float64_and_graph_output_intermediates_are_not_lowered():
    plan, _ = _plan(model("linear_bias_then_transpose", np.float64), feeds("linear_bias_then_transpose", np.float64))
    assert _lower(plan) == []
    m = model("matmul_relu")
    m.graph.output.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, [M, C]))
    plan, _ = _plan(m, feeds("matmul_relu"))
    assert _lower(plan) == []


def test_a_failing_cublaslt_call_is_noted_and_the_ops_run_one_by_one():
    f = feeds("linear_bias_residual_relu")
    plan, ref = _plan(model("linear_bias_residual_relu"), f)
    (launch,) = _lower(plan)
    rt = _Runtime(_FailingBlas())
    for _ in range(2):
        np.testing.assert_allclose(_run(plan, launch, rt, f), ref, rtol=1e-5, atol=1e-5)
    assert launch.refused and launch.fused_calls == 0
    assert len(rt.notes) == 1 and "status 14" in rt.notes[0] and "MatMul+bias+residual+relu runs op by op" in rt.notes[0]
    rt.capturing, launch.refused = True, False  # inside a capture the error is the capture's to report
    with pytest.raises(RuntimeError, match="status 14"):
        _run(plan, launch, rt, f)


class _Lib:
    def __init__(self):
        self.destroyed = []

    def cublasDestroy_v2(self, h):
        self.destroyed.append(("cublas", h.value))

    def cublasLtDestroy(self, h):
        self.destroyed.append(("cublasLt", h.value))


def _blas_with_handles(lib):
    from ctypes import c_void_p

    from convpass.native import cublas as blas

    b = blas.Blas.__new__(blas.Blas)  # the handles without a GPU: only their destruction is checked
    b.lib, b.handle, b._lt, b._lt_problems = lib, c_void_p(7), (lib, c_void_p(8)), {}
    return b


def test_a_collected_blas_destroys_its_handles_later_never_inside_the_collection():
    """A garbage collection may run inside another plan's stream capture: destroying cuBLAS
    handles there would invalidate it, so __del__ only queues the destruction."""
    from convpass.native import cublas as blas

    blas.reap()  # what earlier tests' collected Blas objects left
    lib = _Lib()
    b = _blas_with_handles(lib)
    b.__del__()
    assert lib.destroyed == [] and len(blas._RETIRED) == 1
    blas.reap()
    assert lib.destroyed == [("cublasLt", 8), ("cublas", 7)] and blas._RETIRED == []
    b.close()  # nothing left to destroy twice
    assert len(lib.destroyed) == 2
    explicit = _Lib()
    _blas_with_handles(explicit).close()
    assert explicit.destroyed == [("cublasLt", 8), ("cublas", 7)]


def test_an_add_with_legacy_broadcasting_is_not_taken_as_a_bias():
    """Before opset 7, Add(m, b, broadcast=1, axis=0) adds b per row: not cuBLASLt's per-column bias."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.arange(4, dtype=np.float32) * 10, "bias")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["m"]), helper.make_node("Add", ["m", "bias"], ["a"], broadcast=1, axis=0),
             helper.make_node("Relu", ["a"], ["Y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, (4, 4))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, (4, 4))], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 6)], ir_version=4)
    f = {"X": rng.standard_normal((4, 4)).astype(np.float32)}
    plan, ref = _plan(m, f)
    assert _lower(plan) == []
    np.testing.assert_allclose(ref, np.maximum(f["X"] @ numpy_helper.to_array(w) + np.arange(4)[:, None] * 10, 0), rtol=1e-5, atol=1e-5)


class _DescLib:
    """cuBLASLt's descriptor calls, the second matrix layout failing."""

    def __init__(self):
        self.made, self.destroyed = 0, []

    def _make(self, ref):
        self.made += 1
        ref._obj.value = 100 + self.made
        return 0

    def cublasLtMatmulDescCreate(self, ref, compute, scale):
        return self._make(ref)

    def cublasLtMatmulDescSetAttribute(self, *args):
        return 0

    def cublasLtMatrixLayoutCreate(self, ref, *args):
        return 15 if self.made == 2 else self._make(ref)

    def cublasLtMatrixLayoutDestroy(self, layout):
        self.destroyed.append(layout.value)

    def cublasLtMatmulDescDestroy(self, desc):
        self.destroyed.append(desc.value)


def test_a_cublaslt_problem_that_fails_half_built_destroys_what_it_made():
    from ctypes import c_void_p

    from convpass.native import cublas as blas

    lib = _DescLib()
    key = (8, 4, 6, blas.CUBLAS_OP_N, 8, blas.CUBLAS_OP_N, 6, 0, 68, 1, None)
    with pytest.raises(RuntimeError, match="cublasLtMatrixLayoutCreate failed: cuBLAS status 15"):
        blas._LtProblem(lib, c_void_p(1), key, 0, 0)
    assert sorted(lib.destroyed) == [101, 102]  # the descriptor and the one layout made
