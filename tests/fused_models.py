"""Small ONNX models with the normalization patterns exporters write, for the fusion tests (CPU and GPU).

* ``gn17``: ``torch.onnx.export`` (TorchScript, opset < 18) of ``nn.GroupNorm``: Reshape(x, [0, G, -1]) ->
  InstanceNormalization(ones, zeros) -> Reshape(Shape(x)) -> Mul(gamma[C, 1, 1]) -> Add(beta[C, 1, 1]);
* ``gn18`` / ``gn21``: GroupNormalization (per-group scale and bias / per-channel);
* ``instance``: InstanceNormalization of the tensor itself;

each followed by an activation (``silu`` = Sigmoid + Mul, or any ONNX activation op) and optionally
a residual Add, around 3x3 convs; and ECA's channel-attention gate (:func:`eca`). One unit alone
with a gate and a residual as inputs (:func:`unit`) and its float64 reference written from the
definitions (:func:`unit_reference64`).
"""

from __future__ import annotations

import math

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


UNIT_EPS = 1e-6  # the epsilon of :func:`unit`'s normalization


def unit(form: str, act: str, shape, groups: int, gate: bool = False, residual: bool = False, dtype=np.float32, nhwc: bool = False):
    """One unit: normalization (``form``) + ``act``, times a gate input ``gate`` (N, C, 1, ..) and
    plus a residual input ``z`` where asked. ``nhwc``: ``x`` and ``z`` are given as channels-last
    inputs ``x_nhwc``, ``z_nhwc`` read through a Transpose (a view on the GPU: the unit sees
    channels-last storage, also from a captured graph)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(0)
    c, r = shape[1], len(shape)
    tp = _TP[dtype]
    nodes, ins = [], []
    for v in ["x", "z"] if residual else ["x"]:
        if nhwc:
            nodes.append(N("Transpose", [f"{v}_nhwc"], [v], perm=[0, r - 1, *range(1, r - 1)], name=f"{v}/to_logical"))
            ins.append(helper.make_tensor_value_info(f"{v}_nhwc", tp, [shape[0], *shape[2:], c]))
        else:
            ins.append(helper.make_tensor_value_info(v, tp, shape))
    more, inits, t = norm(form, "n1", "x", c, groups, rng, dtype, eps=UNIT_EPS, rank=r)
    act_nodes, t = activation(act, "a1", t)
    nodes += more + act_nodes
    if gate:
        nodes.append(N("Mul", [t, "gate"], ["gated"], name="apply_gate"))
        ins.append(helper.make_tensor_value_info("gate", tp, [shape[0], c] + [1] * (r - 2)))
        t = "gated"
    if residual:
        nodes.append(N("Add", [t, "z"], ["y"], name="residual"))
        t = "y"
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info(t, tp, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset_of(form, act))], ir_version=9)


def unit_inputs(shape, dtype=np.float32, seed: int = 1, offset: float = 3.0, scale: float = 2.0) -> dict[str, np.ndarray]:
    """Values for :func:`unit`'s inputs (logical order): ``x`` (mean ``offset``, deviation
    ``scale``), ``gate`` in (0, 1), ``z``."""
    rng = np.random.default_rng(seed)
    n, c = shape[:2]
    return {"x": (rng.standard_normal(shape) * scale + offset).astype(dtype),
            "gate": rng.random((n, c) + (1,) * (len(shape) - 2)).astype(dtype),
            "z": rng.standard_normal(shape).astype(dtype)}


def unit_feeds(model, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's feeds from :func:`unit_inputs` (channels-last copies for ``*_nhwc`` inputs)."""
    out = {}
    for i in model.graph.input:
        if i.name.endswith("_nhwc"):
            out[i.name] = np.ascontiguousarray(np.moveaxis(values[i.name.removesuffix("_nhwc")], 1, -1))
        else:
            out[i.name] = values[i.name]
    return out


ACTIVATIONS64 = {
    "silu": lambda v: v / (1 + np.exp(-v)),
    "Relu": lambda v: np.maximum(v, 0),
    "LeakyRelu": lambda v: np.where(v >= 0, v, 0.2 * v),
    "HardSwish": lambda v: v * np.clip(v / 6 + 0.5, 0, 1),
    "Gelu": lambda v: 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2))),
    "Mish": lambda v: v * np.tanh(np.log1p(np.exp(v))),
}


def unit_reference64(model, form: str, act: str, groups: int, values: dict[str, np.ndarray]) -> np.ndarray:
    """:func:`unit` in float64 from its definition: standardize per (sample, group) (the variance
    of the centred values), scale and shift per channel, the activation, the gate, the residual."""
    p = {i.name: numpy_helper.to_array(i).astype(np.float64).reshape(-1) for i in model.graph.initializer}
    x = values["x"].astype(np.float64)
    n, c, r = x.shape[0], x.shape[1], x.ndim
    g = x.reshape(n, groups, -1)
    y = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + UNIT_EPS)).reshape(x.shape)
    view = (1, c) + (1,) * (r - 2)
    scale, shift = (p["n1_gamma"], p["n1_beta"]) if form == "gn17" else (p["n1_s"], p["n1_b"])
    y = ACTIVATIONS64[act](y * scale.reshape(view) + shift.reshape(view))
    names = {i.name for i in model.graph.input}
    if "gate" in names:
        y = y * values["gate"].astype(np.float64)
    if names & {"z", "z_nhwc"}:
        y = y + values["z"].astype(np.float64)
    return y


def qkv(shape=(2, 8, 6, 5), groups: int = 4, seed: int = 0):
    """An attention block's input side: x -> GroupNorm (``gn17``) -> three 1x1 convs q, k, v that
    read its output -> y = q * k + v: one tensor read by several convs."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    nodes, inits, t = norm("gn17", "norm", "x", c, groups, rng)
    for name in ("q", "k", "v"):
        nodes.append(N("Conv", [t, f"{name}_w", f"{name}_b"], [name], name=name))
        inits += [const(f"{name}_w", rng.standard_normal((c, c, 1, 1)) / math.sqrt(c)), const(f"{name}_b", rng.standard_normal(c) * 0.1)]
    nodes += [N("Mul", ["q", "k"], ["qk"], name="mul"), N("Add", ["qk", "v"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
