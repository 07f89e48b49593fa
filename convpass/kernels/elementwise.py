"""Element-wise fusion for the cuda backend: chains of element-wise ops as one generated kernel.

CuPy runs every NumPy-style call as its own kernel, and the op library writes activations as
NumPy expressions: Sigmoid is nine kernels over the whole tensor, HardSwish four, a GELU that
``torch.onnx.export`` decomposed (Div, Erf, Add, Mul, Mul) five, an inference BatchNormalization
that cannot be folded into a conv (pre-activation nets: BN -> ReLU -> Conv) six. On large
activations each kernel is a full read and write of memory, so those ops, not the convolutions,
dominated models such as efficientnet_b0 at batch 32. :func:`plan_groups` finds the element-wise
steps of a plan that can run as one kernel each and writes each group's code (:class:`FusedGroup`);
:class:`~convpass.kernels.broadcast.BroadcastKernel` generates and builds that kernel
(:func:`kernel`: CuPy's, for shapes it does not take);
:class:`~convpass.kernels.elementwise_launch.FusedLaunch` runs it in a compiled plan.

Rules (``plan_groups``):

* A step is *fusible* when its op has an expression below (:data:`EXPRESSIONS`), it has one used
  output, the op's registration is one this module knows (Clip's attribute and input forms; the
  legacy ``broadcast`` attribute of opset < 7 excluded; BatchNormalization in inference mode only),
  nothing else already claimed it (conv fusions), and every input and its output have one
  floating-point dtype.
* A fusible step's output is *internal* when every reader of it is a fusible step of one and the
  same group and it is not a graph output: the group computes it once per element, in a register,
  and it is never stored. Groups are built from the last step backwards, so they are DAGs with one
  root (their last step, which runs the kernel); their other members are skipped. (A GELU's input
  ``x`` read by both ``x / sqrt(2)`` and ``x * (...)`` is internal to the GELU's group, so a MatMul's
  bias Add fuses into the GELU that follows it.)
* A group's external inputs are the slots its members read that no member computes (constants
  included, as 0-d or broadcastable arrays). Element-wise ops commute with broadcasting, so the
  kernel broadcasts the external inputs to the root's output shape and computes every member per
  output element, which gives the root's value exactly as the ops one by one would (smaller
  intermediates such as a squeeze-excite gate are recomputed per element: cheap next to a read).
  BatchNormalization's per-channel parameters are viewed as ``(C, 1, ..., 1)`` for that (an input
  with a *view*); constant ones are folded into one scale and one shift first
  (:func:`_folded_batchnorm`).
* Math in float32 for float16 and float32 tensors, float64 for float64; the result is rounded to
  the tensor's dtype once, at the end (op-by-op float16 rounds after every op: results differ in
  the last float16 bit at most, well inside the 1e-2 tolerance of float16 checks).
* An Expand joins a group as the broadcast it is (its value read at the group's output shape;
  its target shape a constant of the plan), never as a root: a squeeze-excitation / ECA gate's
  ``Mul(x, Expand(gate, Shape(x)))`` reads the gate per channel instead of a copy of it per element.
* A group of one step is formed only for ops CuPy runs as several kernels (Sigmoid, HardSwish,
  Clip, BatchNormalization, ...), or for an op with an operand it broadcasts (a bias Add, a
  per-channel Mul: the kernel's row geometry beats CuPy's per-element indexing); a lone Add or
  Relu over same-shape operands is one fast CuPy kernel already.
* Slots a member frees (last read) are freed after the root runs instead, since the root reads them.
NaN and infinity follow NumPy's element-wise semantics (``maximum`` / ``minimum`` / ``clip``
propagate NaN).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from convpass.ops import batchnorm_folding
from convpass.ops.registry import NodeInfo

__all__ = ["EXPRESSIONS", "PREAMBLE", "FusedGroup", "kernel", "plan_groups"]

Expr = Callable[[NodeInfo, Sequence["str | None"]], "str | None"]

# Helpers the generated kernels use: NumPy's NaN-propagating maximum / minimum / clip.
PREAMBLE = """
template <typename X> __device__ __forceinline__ X cp_max(X a, X b) { return (a != a || a > b) ? a : b; }
template <typename X> __device__ __forceinline__ X cp_min(X a, X b) { return (a != a || a < b) ? a : b; }
template <typename X> __device__ __forceinline__ X cp_clamp(X v, X lo, X hi) { return v < lo ? lo : (v > hi ? hi : v); }
"""


def _lit(value: Any) -> str | None:
    """A floating-point literal in the kernel's math type, or None when not finite."""
    v = float(value)
    return f"A({v!r})" if np.isfinite(v) else None


def _fmt(template: str) -> Expr:
    return lambda node, a: template.format(*a)


def _softplus(x: str) -> str:
    return f"(cp_max({x}, A(0)) + log1p(exp(-fabs({x}))))"


def _hard_sigmoid(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    alpha, beta = _lit(node.attr("alpha", 0.2)), _lit(node.attr("beta", 0.5))
    if alpha is None or beta is None:
        return None
    return f"cp_clamp({alpha} * {a[0]} + {beta}, A(0), A(1))"


def _hard_swish(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    return f"({a[0]} * cp_clamp({a[0]} * {_lit(1 / 6)} + A(0.5), A(0), A(1)))"


def _leaky_relu(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    alpha = _lit(node.attr("alpha", 0.01))
    return None if alpha is None else f"({a[0]} >= A(0) ? {a[0]} : {a[0]} * {alpha})"


def _elu(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    alpha = _lit(node.attr("alpha", 1.0))
    return None if alpha is None else f"({a[0]} > A(0) ? {a[0]} : {alpha} * expm1({a[0]}))"


def _clip(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    x = a[0]
    if node.impl is not None and node.impl.since < 11:  # bounds are attributes
        lo, hi = float(node.attr("min", -np.inf)), float(node.attr("max", np.inf))
        lo_s = _lit(lo) if lo != -np.inf else ""
        hi_s = _lit(hi) if hi != np.inf else ""
        if lo_s is None or hi_s is None:
            return None
    else:
        lo_s = a[1] if len(a) > 1 and a[1] else ""
        hi_s = a[2] if len(a) > 2 and a[2] else ""
    y = f"cp_max({x}, {lo_s})" if lo_s else x
    return f"cp_min({y}, {hi_s})" if hi_s else f"({y})"


def _gelu(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    x = a[0]
    if node.attr("approximate", "none") == "tanh":
        return f"(A(0.5) * {x} * (A(1) + tanh({_lit(np.sqrt(2 / np.pi))} * ({x} + A(0.044715) * {x} * {x} * {x}))))"
    return f"(A(0.5) * {x} * (A(1) + erf({x} * {_lit(1 / np.sqrt(2))})))"


def _swish(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    alpha = _lit(node.attr("alpha", 1.0))
    return None if alpha is None else f"({a[0]} / (A(1) + exp(-{alpha} * {a[0]})))"


def _batch_norm(node: NodeInfo, a: Sequence[str | None]) -> str | None:
    """Inference BatchNormalization: ``(x - mean) * scale / sqrt(var + eps) + bias`` per channel."""
    if not batchnorm_folding.is_inference(node) or len(a) < 5 or not all(a[:5]):
        return None
    eps = _lit(node.attr("epsilon", 1e-5))
    x, scale, bias, mean, var = a[:5]
    return None if eps is None else f"(({x} - {mean}) * ({scale} / sqrt({var} + {eps})) + {bias})"


def _two(template: str) -> Expr:
    """Variadic Max / Min: fused only with exactly two operands."""
    return lambda node, a: template.format(*a) if len(a) == 2 and all(a) else None


# op_type -> C expression in the math type ``A`` over its operands' names (None: not fusible here).
EXPRESSIONS: dict[str, Expr] = {
    "Add": _fmt("({0} + {1})"),
    "Sub": _fmt("({0} - {1})"),
    "Mul": _fmt("({0} * {1})"),
    "Div": _fmt("({0} / {1})"),
    "Pow": _fmt("pow({0}, {1})"),
    "Max": _two("cp_max({0}, {1})"),
    "Min": _two("cp_min({0}, {1})"),
    "Neg": _fmt("(-{0})"),
    "Abs": _fmt("fabs({0})"),
    "Exp": _fmt("exp({0})"),
    "Log": _fmt("log({0})"),
    "Sqrt": _fmt("sqrt({0})"),
    "Reciprocal": _fmt("(A(1) / {0})"),
    "Tanh": _fmt("tanh({0})"),
    "Erf": _fmt("erf({0})"),
    "Relu": _fmt("cp_max({0}, A(0))"),
    "Sigmoid": _fmt("({0} >= A(0) ? A(1) / (A(1) + exp(-{0})) : exp({0}) / (A(1) + exp({0})))"),
    "Softsign": _fmt("({0} / (A(1) + fabs({0})))"),
    "Softplus": lambda node, a: _softplus(a[0]),
    "Mish": lambda node, a: f"({a[0]} * tanh({_softplus(a[0])}))",
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish,
    "LeakyRelu": _leaky_relu,
    "Elu": _elu,
    "Clip": _clip,
    "PRelu": _fmt("({0} < A(0) ? {0} * {1} : {0})"),
    "Gelu": _gelu,
    "Swish": _swish,
    "BatchNormalization": _batch_norm,
    # a broadcast: its input read at the group's output shape is its value (only inside a group:
    # a group's root writes the broadcast shape of its inputs, not Expand's target shape)
    "Expand": lambda node, a: f"({a[0]})",
}

# Inputs that are values an op reads on the host (shapes), not operands of its expression.
_VALUE_INPUTS = {("Expand", 1)}

# Inputs an op broadcasts along the channel axis (1) rather than NumPy-style: (op, input index).
_CHANNEL_INPUTS = {("BatchNormalization", k) for k in (1, 2, 3, 4)}

# Ops CuPy already runs as one kernel: alone, fusing them gains nothing.
_ONE_KERNEL = frozenset("Add Sub Mul Div Pow Max Min Neg Abs Exp Log Sqrt Reciprocal Tanh Relu".split())

_MATH_TYPE = {np.dtype(np.float16): "float", np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


@dataclasses.dataclass(frozen=True)
class FusedGroup:
    """Steps of a plan that run as one generated kernel at the root step."""

    root: int  # step index that runs the kernel
    members: tuple[int, ...]  # step indices, in plan order, root last
    inputs: tuple[int, ...]  # external input slots, kernel parameter order
    output: int  # the root's output slot
    dtype: np.dtype
    code: str  # kernel body
    ops: tuple[str, ...]  # member op types, for notes
    views: tuple[tuple[int, ...] | None, ...] = ()  # per input: the shape it is read as (None: as is)
    input_types: tuple[str, ...] = ()  # per input: its C type, "T" (the output's storage type; the default) or "float"

    def view_of(self, k: int) -> tuple[int, ...] | None:
        return self.views[k] if k < len(self.views) else None

    def type_of(self, k: int) -> str:
        return self.input_types[k] if k < len(self.input_types) else "T"

    @property
    def name(self) -> str:
        types = "" if all(t == "T" for t in self.input_types) else "|" + ",".join(self.input_types)
        return "convpass_ew_" + hashlib.sha1(f"{self.dtype}|{self.code}{types}".encode()).hexdigest()[:12]


def _slot_dtype(plan: Any, slot: int) -> np.dtype | None:
    info = plan.value_info.get(slot)
    if info is not None:
        return np.dtype(info[1])
    const = plan.template[slot]
    return None if const is None else np.dtype(const.dtype)


def _placeholders(step: Any) -> list[str | None]:
    return [f"v{k}" if s >= 0 and (step.node.op_type, k) not in _VALUE_INPUTS else None for k, s in enumerate(step.inputs)]


def _operand_slots(step: Any) -> list[int]:
    """The step's inputs that are operands of its expression (-1: absent or a host value)."""
    return [-1 if (step.node.op_type, k) in _VALUE_INPUTS else s for k, s in enumerate(step.inputs)]


def _fusible(plan: Any, step: Any) -> np.dtype | None:
    """The step's dtype when it may join a group (module rules), else None."""
    node = step.node
    expr = EXPRESSIONS.get(node.op_type)
    used = [o for o in step.outputs if o >= 0]
    if expr is None or node.domain != "" or node.opset < 7 or len(used) != 1 or step.outputs[0] < 0:
        return None
    if node.op_type in ("Max", "Min") and node.opset < 8:  # no broadcasting before opset 8
        return None
    dtype = _slot_dtype(plan, step.outputs[0])
    if dtype not in _MATH_TYPE:
        return None
    operands = _operand_slots(step)
    for s in operands:
        if s >= 0 and _slot_dtype(plan, s) != dtype:
            return None
    if node.op_type == "Expand" and (len(step.inputs) < 2 or plan.template[step.inputs[1]] is None):
        return None  # a target shape computed at run time
    if not any(s >= 0 for s in operands) or expr(node, _placeholders(step)) is None:
        return None
    return dtype


def plan_groups(plan: Any, claimed: Sequence[Any], to_host: Callable[[Any], np.ndarray] = np.asarray,
                upload: Callable[[np.ndarray], Any] = lambda a: a) -> list[FusedGroup]:
    """The fused groups of ``plan`` (module rules); ``claimed[i]`` not None: step i is taken.
    ``to_host`` / ``upload``: the backend's constant transfers (a folded BatchNormalization's
    parameters are computed on the host)."""
    steps = plan.steps
    readers = plan.readers()
    dtypes = [None if claimed[i] is not None else _fusible(plan, st) for i, st in enumerate(steps)]
    graph_outputs = set(plan.output_slots)
    root_of: dict[int, int] = {}
    for i in range(len(steps) - 1, -1, -1):  # readers first: their groups are known
        if dtypes[i] is None:
            continue
        out = steps[i].outputs[0]
        rd = readers.get(out, [])
        roots = {root_of.get(r) for r in rd}
        internal = (
            out not in graph_outputs
            and rd
            and all(r > i and dtypes[r] == dtypes[i] for r in rd)
            and len(roots) == 1
            and None not in roots
        )
        if not internal and steps[i].node.op_type == "Expand":
            dtypes[i] = None  # never a root (EXPRESSIONS): the op library runs it
            continue
        root_of[i] = roots.pop() if internal else i
    members_of: dict[int, list[int]] = {}
    for i, root in root_of.items():
        members_of.setdefault(root, []).append(i)
    groups = []
    for root in sorted(members_of):
        members = sorted(members_of[root])
        if len(members) == 1 and steps[root].node.op_type in _ONE_KERNEL and not _broadcasts(plan, steps[root]):
            continue
        groups.append(_build(plan, members, dtypes[root], to_host, upload))
    return groups


def _broadcasts(plan: Any, step: Any) -> bool:
    """Whether ``step`` reads an operand of more than one element that it broadcasts."""
    out = plan.info(step.outputs[0])
    if out is None:
        return False
    for s in step.inputs:
        info = plan.info(s) if s >= 0 else None
        if info is not None and math.prod(info[0]) > 1 and tuple(info[0]) != tuple(out[0]):
            return True
    return False


def _channel_view(plan: Any, step: Any) -> tuple[int, ...] | None:
    """The shape per-channel parameters of ``step`` are read as: (C, 1, ..., 1) for X's rank."""
    x = plan.info(step.inputs[0])
    if x is None or len(x[0]) < 2:
        return None
    return (int(x[0][1]),) + (1,) * (len(x[0]) - 2)


def _folded_batchnorm(plan: Any, step: Any, to_host: Callable[[Any], np.ndarray], upload: Callable[[np.ndarray], Any]) -> tuple[int, int, int] | None:
    """(x, scale, shift) slots of an inference BatchNormalization whose four parameters are
    constants: ``scale = gamma / sqrt(var + eps)`` and ``shift = beta - mean * scale``
    (:func:`convpass.ops.batchnorm_folding.affine`), computed once on the host in float64 and uploaded as constants of the plan (on the device arrays, CuPy's
    arithmetic with a scalar would import cupyx and SciPy at start-up: convpass/runtime/ops.py).
    The kernel then reads two parameters per element instead of four and has no square root or
    division (x * scale + shift: within a rounding of the op-by-op formula, as a conv's folded
    BatchNormalization is)."""
    consts = [plan.template[s] if s >= 0 else None for s in step.inputs[1:5]]
    if len(consts) < 4 or any(c is None for c in consts):
        return None
    scale, shift = batchnorm_folding.affine(*(to_host(c) for c in consts), step.node.attr("epsilon", 1e-5))
    dtype = consts[0].dtype
    name = plan.slot_names[step.outputs[0]]
    return (step.inputs[0], plan.add_constant(f"{name}::bn_scale", upload(scale.astype(dtype))),
            plan.add_constant(f"{name}::bn_shift", upload(shift.astype(dtype))))


def _build(plan: Any, members: list[int], dtype: np.dtype, to_host: Callable[[Any], np.ndarray], upload: Callable[[np.ndarray], Any]) -> FusedGroup:
    steps = plan.steps
    computed = {steps[i].outputs[0] for i in members}
    folded = {i: f for i in members if steps[i].node.op_type == "BatchNormalization" and (f := _folded_batchnorm(plan, steps[i], to_host, upload))}
    inputs: list[tuple[int, tuple[int, ...] | None]] = []  # (slot, view)
    operands: dict[tuple[int, int], tuple[int, tuple[int, ...] | None]] = {}  # (step, input index) -> input
    for i in members:
        st = steps[i]
        for k, s in enumerate(folded.get(i, _operand_slots(st))):
            if s < 0 or s in computed:
                continue
            view = _channel_view(plan, st) if (st.node.op_type, k) in _CHANNEL_INPUTS else None
            if (s, view) not in inputs:
                inputs.append((s, view))
            operands[(i, k)] = (s, view)
    arg = {key: f"a{k}" for k, key in enumerate(inputs)}
    names: dict[int, str] = {}
    lines = [f"typedef {_MATH_TYPE[dtype]} A;"]
    lines += [f"const A a{k} = (A)in{k};" for k in range(len(inputs))]
    for i in members:
        st = steps[i]
        slots = folded.get(i, _operand_slots(st))
        ops = [None if s < 0 else (names[s] if s in computed else arg[operands[(i, k)]]) for k, s in enumerate(slots)]
        expr = f"({ops[0]} * {ops[1]} + {ops[2]})" if i in folded else EXPRESSIONS[st.node.op_type](st.node, ops)
        names[st.outputs[0]] = f"t{i}"
        lines.append(f"const A t{i} = {expr};")
    root = members[-1]
    lines.append(f"out0 = (T)t{root};")
    return FusedGroup(
        root=root,
        members=tuple(members),
        inputs=tuple(s for s, _ in inputs),
        output=steps[root].outputs[0],
        dtype=dtype,
        code="\n".join(lines),
        ops=tuple(steps[i].node.op_type for i in members),
        views=tuple(v for _, v in inputs),
    )


_KERNELS: dict[str, Any] = {}


def kernel(cupy: Any, group: FusedGroup) -> Any:
    """The group's ``cupy.ElementwiseKernel`` (one per distinct code and dtype, compiled on first
    use): for shapes :class:`BroadcastKernel` does not take."""
    k = _KERNELS.get(group.name)
    if k is None:
        params = ", ".join(f"T in{j}" for j in range(len(group.inputs)))
        k = cupy.ElementwiseKernel(params, "T out0", group.code, group.name, preamble=PREAMBLE)
        _KERNELS[group.name] = k
    return k
