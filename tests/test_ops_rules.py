"""Rules the op library keeps so that the GPU path stays fast to start.

An operator between a CuPy array and a scalar (``x > 0``, ``x * 0.5``) imports cupyx and, with it,
SciPy: 0.3-0.45 s of a fresh process's start-up, measured on the H200 machine. The ops use the
ufuncs instead (``xp.greater(x, 0)``, ``xp.multiply(x, s)``). Here the ops that real CNNs run
eagerly get arrays on which such operators raise, so a new one fails on the CPU. (Correctness of
these ops is the ONNX conformance suite's job: tests/test_backend_conformance.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

from convpass.kernels.backends import host_backend
from convpass.ops.registry import NodeInfo, OpContext, lookup


def _refuse_scalar(op):  # noqa: ANN001, ANN202
    def method(self, other):  # noqa: ANN001, ANN202
        if not isinstance(other, np.ndarray):
            raise AssertionError(f"an op applied {op.__name__} to an array and a scalar; use the ufunc (xp.multiply(x, s) ...)")
        return op(self, other)

    return method


class StrictArray(np.ndarray):
    """An array on which comparison operators raise, and arithmetic operators with a scalar
    (either side) raise; ufuncs, and arithmetic operators between two arrays, work."""

    def _refuse(self, other):  # noqa: ANN001
        raise AssertionError("an op compared arrays with an operator; use xp.less / xp.greater / xp.equal ...")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = None
    __add__ = _refuse_scalar(np.ndarray.__add__)
    __radd__ = _refuse_scalar(np.ndarray.__radd__)
    __sub__ = _refuse_scalar(np.ndarray.__sub__)
    __rsub__ = _refuse_scalar(np.ndarray.__rsub__)
    __mul__ = _refuse_scalar(np.ndarray.__mul__)
    __rmul__ = _refuse_scalar(np.ndarray.__rmul__)
    __truediv__ = _refuse_scalar(np.ndarray.__truediv__)
    __rtruediv__ = _refuse_scalar(np.ndarray.__rtruediv__)
    __pow__ = _refuse_scalar(np.ndarray.__pow__)
    __rpow__ = _refuse_scalar(np.ndarray.__rpow__)


def _strict(a) -> StrictArray:  # noqa: ANN001
    return np.asarray(a).view(StrictArray)


_X = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
_IDX = np.array([[0, -1], [1, -2]], dtype=np.int64)

# (op_type, opset, attributes, inputs)
CASES = [
    ("Sigmoid", 13, {}, [_X]),
    ("IsInf", 20, {"detect_negative": 0}, [np.array([-np.inf, 0.0, np.inf], np.float32)]),
    ("IsInf", 20, {"detect_positive": 0}, [np.array([-np.inf, 0.0, np.inf], np.float32)]),
    ("LeakyRelu", 16, {"alpha": 0.1}, [_X]),
    ("Elu", 6, {}, [_X]),
    ("Celu", 12, {}, [_X]),
    ("Selu", 6, {}, [_X]),
    ("ThresholdedRelu", 10, {"alpha": 0.5}, [_X]),
    ("Shrink", 9, {}, [_X]),
    ("Swish", 24, {}, [_X]),
    ("Gelu", 20, {}, [_X]),
    ("PRelu", 16, {}, [_X, np.full((3, 1), 0.2, np.float32)]),
    ("Div", 14, {}, [np.array([7, -7, 7, -7], np.int32), np.array([2, 2, -2, 0], np.int32)]),
    ("Gather", 13, {"axis": 1}, [_X, _IDX]),
    ("GatherElements", 13, {"axis": 2}, [_X, np.full((2, 3, 2), -1, np.int64)]),
    ("GatherND", 13, {}, [_X, np.array([[0, -1], [1, -2]], np.int64)]),
    ("OneHot", 11, {}, [_IDX, np.array(3, np.int64), np.array([0.0, 1.0], np.float32)]),
    ("LpNormalization", 1, {"p": 2}, [np.vstack([_X[0], np.zeros((1, 4), np.float32)])]),
    ("Softsign", 1, {}, [_X]),
    ("HardSigmoid", 6, {}, [_X]),
    ("HardSwish", 14, {}, [_X]),
    ("Gelu", 20, {"approximate": "tanh"}, [_X]),
    ("Gemm", 13, {"alpha": 0.5, "beta": 2.0}, [_X[0], _X[1].T, np.ones((3,), np.float32)]),
    ("Mean", 13, {}, [_X, _X]),
    ("ArgMax", 13, {"select_last_index": 1, "axis": 1}, [_X]),
    ("BatchNormalization", 15, {}, [_X, *[np.full((3,), v, np.float32) for v in (1.5, 0.1, 0.2, 2.0)]]),
    ("BatchNormalization", 15, {"training_mode": 1}, [_X, *[np.full((3,), v, np.float32) for v in (1.5, 0.1, 0.2, 2.0)]]),
    ("InstanceNormalization", 6, {}, [_X, np.full((3,), 1.5, np.float32), np.full((3,), 0.1, np.float32)]),
    ("LayerNormalization", 17, {}, [_X, np.full((4,), 1.5, np.float32), np.full((4,), 0.1, np.float32)]),
    ("RMSNormalization", 23, {}, [_X, np.full((4,), 1.5, np.float32)]),
    ("GroupNormalization", 21, {"num_groups": 3}, [_X, np.full((3,), 1.5, np.float32), np.full((3,), 0.1, np.float32)]),
    ("MeanVarianceNormalization", 13, {}, [_X.reshape(1, 2, 3, 4)]),
    ("LRN", 13, {"size": 3}, [_X]),
    ("LpPool", 18, {"kernel_shape": [2]}, [_X]),
    ("GlobalLpPool", 2, {}, [_X]),
    ("ReduceLogSumExp", 18, {}, [_X]),
]


@pytest.mark.parametrize("op_type,opset,attrs,inputs", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_device_ops_meet_scalars_in_ufuncs(op_type, opset, attrs, inputs):
    impl = lookup(op_type, "", opset)
    assert impl is not None, op_type
    node = NodeInfo(op_type.lower(), op_type, "", opset, dict(attrs), [f"i{k}" for k in range(len(inputs))], ["y"], impl)
    ctx = OpContext(host_backend())
    strict = impl.fn(ctx, node, *[_strict(a) for a in inputs])
    plain = impl.fn(ctx, node, *[np.asarray(a) for a in inputs])
    # the same numbers either way: the rule changes how ops compute, not what
    strict, plain = (r if isinstance(r, tuple) else (r,) for r in (strict, plain))
    assert len(strict) == len(plain)
    for got, want in zip(strict, plain):
        np.testing.assert_array_equal(np.asarray(got).view(np.ndarray), np.asarray(want))


def test_strict_arrays_refuse_operator_comparisons():
    with pytest.raises(AssertionError, match="xp.less"):
        _strict(_X) > 0  # noqa: B015
    with pytest.raises(AssertionError, match="ufunc"):
        _strict(_X) * 0.5  # noqa: B018
    with pytest.raises(AssertionError, match="ufunc"):
        1 + _strict(_X)  # noqa: B018
    assert np.greater(_strict(_X), 0).any() and (_strict(_X) * _strict(_X)).shape == _X.shape


def test_the_fused_kernels_folded_batchnorm_computes_on_the_host():
    """A pre-activation BatchNormalization (DenseNet) is folded into scale and shift when its fused
    group is built, at a fresh process's start-up: on host copies of the parameters, never with
    arithmetic on the template's (device) arrays, and uploaded once each."""
    from onnx import TensorProto, helper, numpy_helper

    from convpass.kernels import elementwise
    from convpass.runtime.executor import Executor

    params = [numpy_helper.from_array(np.full((3,), v, np.float32), n) for n, v in zip("sbmv", (1.5, 0.1, 0.2, 2.0))]
    graph = helper.make_graph([helper.make_node("BatchNormalization", ["x", *"sbmv"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])], params)
    ex = Executor(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8), device="cpu")
    (want,) = ex.run(None, {"x": _X})
    plan = ex.last_plan
    plan.template = [None if a is None else _strict(a) for a in plan.template]
    uploads = []
    x, scale, shift = elementwise._folded_batchnorm(plan, plan.steps[0], lambda a: np.asarray(a).view(np.ndarray), lambda a: uploads.append(a) or a)
    assert len(uploads) == 2
    got = _X * np.asarray(plan.template[scale]).reshape(3, 1) + np.asarray(plan.template[shift]).reshape(3, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ufunc", [np.add, np.multiply, np.maximum, np.minimum])
@pytest.mark.parametrize("index_rank", [1, 2, 3])
def test_a_scatter_reduction_without_ufunc_at_reduces_duplicates_in_order(ufunc, index_rank):
    """CuPy has ``ufunc.at`` for add, subtract, maximum and minimum only; ScatterND /
    ScatterElements with ``reduction="mul"`` reduce in rounds there. The rounds give what NumPy's
    ``ufunc.at`` gives, duplicate targets included, for index arrays over the leading dims
    (ScatterND) and over all of them (ScatterElements)."""
    from convpass.ops.indexing import _reduce_at_in_rounds

    rng = np.random.default_rng(index_rank)
    x = rng.uniform(0.5, 1.5, (4, 3, 5))
    keys = tuple(rng.integers(0, x.shape[d], (7, 2)) for d in range(index_rank))  # many repeats
    updates = rng.uniform(0.5, 1.5, (7, 2) + x.shape[index_rank:])
    want, got = x.copy(), x.copy()
    ufunc.at(want, keys, updates)
    _reduce_at_in_rounds(np, ufunc, got, keys, updates)
    np.testing.assert_allclose(got, want, rtol=1e-14)
