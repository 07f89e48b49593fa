"""Small ONNX models with the normalization patterns exporters write, for the fusion tests (CPU and GPU).

* ``gn17``: ``torch.onnx.export`` (TorchScript, opset < 18) of ``nn.GroupNorm``: Reshape(x, [0, G, -1]) ->
  InstanceNormalization(ones, zeros) -> Reshape(Shape(x)) -> Mul(gamma[C, 1, 1]) -> Add(beta[C, 1, 1]);
* ``gn18`` / ``gn21``: GroupNormalization (per-group scale and bias / per-channel);
* ``instance``: InstanceNormalization of the tensor itself;

each followed by an activation (``silu`` = Sigmoid + Mul, or any ONNX activation op) and optionally
a residual Add, around 3x3 convs; and ECA's channel-attention gate (:func:`eca`).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

N = helper.make_node
_TP = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float64): TensorProto.DOUBLE}


def const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def norm(form: str, p: str, x: str, c: int, groups: int, rng, dtype=np.float32, eps: float = 1e-6, rank: int = 4):
    """(nodes, initializers, output) of one normalization in ``form``, with its affine parameters."""
    gamma = rng.standard_normal(c) * 0.5 + 1
    beta = rng.standard_normal(c) * 0.2
    if form == "gn17":
        nodes = [N("Reshape", [x, f"{p}_g"], [f"{p}_r"], name=f"{p}/Reshape"),
                 N("InstanceNormalization", [f"{p}_r", f"{p}_ones", f"{p}_zeros"], [f"{p}_in"], epsilon=eps, name=f"{p}/InstanceNormalization"),
                 N("Shape", [x], [f"{p}_shape"], name=f"{p}/Shape"),
                 N("Reshape", [f"{p}_in", f"{p}_shape"], [f"{p}_back"], name=f"{p}/Reshape_1"),
                 N("Mul", [f"{p}_back", f"{p}_gamma"], [f"{p}_m"], name=f"{p}/Mul"),
                 N("Add", [f"{p}_m", f"{p}_beta"], [f"{p}_out"], name=f"{p}/Add")]
        inits = [const(f"{p}_g", [0, groups, -1], np.int64), const(f"{p}_ones", np.ones(groups), dtype), const(f"{p}_zeros", np.zeros(groups), dtype),
                 const(f"{p}_gamma", gamma.reshape((c,) + (1,) * (rank - 2)), dtype), const(f"{p}_beta", beta.reshape((c,) + (1,) * (rank - 2)), dtype)]
        return nodes, inits, f"{p}_out"
    if form in ("gn18", "gn21"):
        size = groups if form == "gn18" else c
        node = N("GroupNormalization", [x, f"{p}_s", f"{p}_b"], [f"{p}_out"], num_groups=groups, epsilon=eps, name=f"{p}/GroupNormalization")
        return [node], [const(f"{p}_s", gamma[:size], dtype), const(f"{p}_b", beta[:size], dtype)], f"{p}_out"
    if form == "instance":
        node = N("InstanceNormalization", [x, f"{p}_s", f"{p}_b"], [f"{p}_out"], epsilon=eps, name=f"{p}/InstanceNormalization")
        return [node], [const(f"{p}_s", gamma, dtype), const(f"{p}_b", beta, dtype)], f"{p}_out"
    raise ValueError(form)


def activation(kind: str, p: str, x: str):
    """(nodes, output) of an activation: ``silu`` (Sigmoid + Mul, as exporters write F.silu), or an op."""
    if kind == "silu":
        return [N("Sigmoid", [x], [f"{p}_s"], name=f"{p}/Sigmoid"), N("Mul", [x, f"{p}_s"], [f"{p}_y"], name=f"{p}/Mul")], f"{p}_y"
    if kind == "none":
        return [], x
    attrs = {"LeakyRelu": {"alpha": 0.2}, "Gelu": {}, "Mish": {}, "HardSwish": {}, "Relu": {}}[kind]
    return [N(kind, [x], [f"{p}_y"], name=f"{p}/{kind}", **attrs)], f"{p}_y"


def opset_of(form: str, act: str) -> int:
    return {"gn18": 18, "gn21": 21}.get(form, 20 if act == "Gelu" else 17)


def block(form: str = "gn17", act: str = "silu", shape=(2, 8, 5, 6), groups: int = 4, residual: bool = True, seed: int = 0,
          dtype=np.float32):
    """x -> norm + act -> conv 3x3 -> norm + act (+ x) -> y: two normalization units, the second
    with the residual Add."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    c = shape[1]
    nodes, inits, t = norm(form, "n1", "x", c, groups, rng, dtype, rank=len(shape))
    more, t = activation(act, "a1", t)
    nodes += more
    r = len(shape) - 2
    nodes.append(N("Conv", [t, "w", "b"], ["h"], pads=[1] * (2 * r), name="conv"))
    inits += [const("w", rng.standard_normal((c, c, *(3,) * r)) * 0.1, dtype), const("b", rng.standard_normal(c) * 0.1, dtype)]
    n2, i2, t = norm(form, "n2", "h", c, groups, rng, dtype, rank=len(shape))
    more, t = activation(act, "a2", t)
    nodes += n2 + more
    inits += i2
    if residual:
        nodes.append(N("Add", ["x", t], ["y"], name="residual"))
        t = "y"
    tp = _TP[dtype]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", tp, ["n", *shape[1:]])],
                              [helper.make_tensor_value_info(t, tp, ["n", *shape[1:]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset_of(form, act))], ir_version=9)


def eca(shape=(2, 64, 7, 7), k: int = 5, residual: bool = True):
    """ECA's channel-attention gate as torch exports it: ReduceMean over H, W (keepdims 0) -> 1-D conv
    across channels (kernel ``k``) -> Sigmoid -> Reshape -> Expand to x's shape -> Mul (then Add x and
    Relu if ``residual``)."""
    rng = np.random.default_rng(0)
    nodes = [
        N("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=0, name="pool"),
        N("Reshape", ["m", "s1"], ["m1"], name="to_1d"),
        N("Conv", ["m1", "w"], ["c1"], pads=[k // 2, k // 2], name="eca_conv"),
        N("Sigmoid", ["c1"], ["g"], name="gate"),
        N("Reshape", ["g", "s2"], ["g4"], name="to_4d"),
        N("Shape", ["x"], ["xs"], name="shape"),
        N("Expand", ["g4", "xs"], ["ge"], name="expand"),
        N("Mul", ["x", "ge"], ["y0"], name="apply"),
    ]
    out = "y0"
    if residual:
        nodes += [N("Add", ["y0", "x"], ["y1"], name="residual"), N("Relu", ["y1"], ["y"], name="relu")]
        out = "y"
    inits = [const("s1", [0, 1, -1], np.int64), const("s2", [0, -1, 1, 1], np.int64), const("w", rng.standard_normal((1, 1, k)))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def feeds(shape, seed: int = 1, dtype=np.float32, offset: float = 2.0) -> dict[str, np.ndarray]:
    """Inputs with a mean well away from zero (the variance must not cancel)."""
    return {"x": (np.random.default_rng(seed).standard_normal(shape) + offset).astype(dtype)}


def channels_last(a: np.ndarray) -> np.ndarray:
    """``a`` (rank 3-5) stored channels-last, seen channels-first."""
    r = a.ndim
    return np.ascontiguousarray(a.transpose(0, *range(2, r), 1)).transpose(0, r - 1, *range(1, r - 1))
