"""Rules the op library keeps so that the GPU path stays fast to start.

Comparison operators on a CuPy array (``x > 0``) import cupyx and, with it, SciPy: 0.3 s of a fresh
process's start-up, measured on the H200 machine. The ops compare with the ufuncs instead
(``xp.greater(x, 0)``). Here every op that compares runs on arrays whose comparison operators
raise, so a new ``x > 0`` in a device path fails on the CPU. (Correctness of these ops is the ONNX
conformance suite's job: tests/test_backend_conformance.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

from convpass.runtime.backends import host_backend
from convpass.runtime.registry import NodeInfo, OpContext, lookup


class NoOperatorCompare(np.ndarray):
    """An array whose ``<``, ``<=``, ``>``, ``>=``, ``==`` and ``!=`` raise (ufuncs still work)."""

    def _refuse(self, other):  # noqa: ANN001
        raise AssertionError("an op compared arrays with an operator; use xp.less / xp.greater / xp.equal ...")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = None


def _strict(a) -> NoOperatorCompare:  # noqa: ANN001
    return np.asarray(a).view(NoOperatorCompare)


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
]


@pytest.mark.parametrize("op_type,opset,attrs,inputs", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_device_ops_compare_with_ufuncs(op_type, opset, attrs, inputs):
    impl = lookup(op_type, "", opset)
    assert impl is not None, op_type
    node = NodeInfo(op_type.lower(), op_type, "", opset, dict(attrs), [f"i{k}" for k in range(len(inputs))], ["y"], impl)
    ctx = OpContext(host_backend())
    strict = impl.fn(ctx, node, *[_strict(a) for a in inputs])
    plain = impl.fn(ctx, node, *[np.asarray(a) for a in inputs])
    # the same numbers either way: the rule changes how ops compare, not what they compute
    np.testing.assert_array_equal(np.asarray(strict).view(np.ndarray), np.asarray(plain))


def test_strict_arrays_refuse_operator_comparisons():
    with pytest.raises(AssertionError, match="ufunc|xp.less"):
        _strict(_X) > 0  # noqa: B015
    assert np.greater(_strict(_X), 0).any()
