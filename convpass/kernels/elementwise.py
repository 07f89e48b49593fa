"""Element-wise fusion for the cuda backend: chains of element-wise ops as one generated kernel.

CuPy runs every NumPy-style call as its own kernel, and the op library writes activations as
NumPy expressions: Sigmoid is nine kernels over the whole tensor, HardSwish four, a GELU that
``torch.onnx.export`` decomposed (Div, Erf, Add, Mul, Mul) five, an inference BatchNormalization
that cannot be folded into a conv (pre-activation nets: BN -> ReLU -> Conv) six. On large
activations each kernel is a full read and write of memory, so those ops, not the convolutions,
dominated models such as efficientnet_b0 at batch 32. :func:`plan_groups` finds the element-wise
steps of a plan that can run as one kernel each; :class:`BroadcastKernel` builds that kernel
(:func:`kernel`: CuPy's, for shapes it does not take); :class:`FusedLaunch` runs it in a
compiled plan.

The kernel (:class:`BroadcastKernel`, float16 / float32 / float64) is generated per group code,
not per shape. Its launch geometry is worked out on the host (:func:`broadcast_geometry`): every
operand's strides are broadcast to the output's shape and put in the output's memory order, and
adjacent dimensions that every operand walks contiguously are merged (a per-channel parameter
over NCHW leaves three: N, C, H * W; over NHWC two: N * H * W, C; same-shape operands one). A
thread then splits its element index over those (at most :data:`MAX_DIMS`) with 32-bit
divisions and reads every operand at its own strides, so any layout works: a channels-last
operand next to a channels-first one, a Concat slice as the output. Offsets are computed once
per class of operands that share strides (:func:`broadcast_classes`: a BatchNormalization's
parameters), with the terms of absent dimensions compiled out (one entry per dimension count).
Each thread loads :data:`UNROLL` adjacent elements (:data:`UNROLL_HEAVY` for heavier math)
before it stores any. CuPy's ``ElementwiseKernel`` of the same code keeps one load in flight per
thread and indexes every operand on its own; on an H200, in one-op models replayed as graphs
(benchmarks/op_kernels.py), this kernel ran a bias Add 2.0x faster, ConvNeXt's layer scale +
residual 1.6x, bias + erf GELU 1.19x and BatchNormalization + Relu 1.5x (its parameters folded,
below; unfolded it was 1.18x in a raw-launch probe). CuPy's kernel still
runs the shapes this one does not take (more than :data:`MAX_DIMS` dimensions after merging,
2^31 elements or more).

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

Memory order: a group whose full-rank inputs are channels-last runs on the channels-last storage
(:func:`in_storage_order`), so its output stays channels-last; it can also write straight into a
slice of a Concat buffer (:attr:`FusedLaunch.supports_placement`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from convpass.native import nvrtc as compiler
from convpass.native.cuda import channels_last, elements
from convpass.kernels.launch import Launch
from convpass.ops import batchnorm_folding
from convpass.ops.registry import NodeInfo

__all__ = ["ENTRIES", "EXPRESSIONS", "MAX_DIMS", "UNROLL", "BroadcastKernel", "FusedGroup", "FusedLaunch", "Geometry",
           "broadcast_classes", "broadcast_geometry", "broadcast_source", "in_storage_order", "kernel", "needs_fallback", "plan_groups",
           "unroll_for"]

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


# ------------------------------------------------------------------ the broadcasting kernel

# elements per thread, all loaded before any is stored: 4 for groups of a few multiplies and adds,
# 2 where the math is heavier (erf, exp, division, ...): the best of 2, 4 and 8 for each kind in a
# raw-launch probe on an H200 (bias Add and layer scale 2.0x CuPy's kernel at 4; bias + erf GELU
# 1.19x and unfolded BatchNormalization + Relu 1.18x at 2, where 4 lost a third of that and 8 was
# slower than CuPy)
UNROLL = 4
UNROLL_HEAVY = 2
_HEAVY_MATH = ("erf", "exp", "log", "tanh", "sqrt", "pow", "/")
MAX_DIMS = 4  # dimensions after merging (rank 4 always fits; rank 5 when two dimensions merge)
_BLOCK = 256
_INDEX_LIMIT = 2**31  # indices and offsets are 32-bit in the kernel
_STORAGE = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
ENTRIES = tuple(f"convpass_broadcast_d{d}" for d in range(1, MAX_DIMS + 1))  # one per dimension count

_BROADCAST_SOURCE = r"""
#HEADER
#PREAMBLE
typedef #STORAGE T;
// D dimensions after merging: q0 the outermost index, q1 ... q3 the ones below it (extents e1 ... e3);
// the terms of the dimensions that are not there are compiled out.
template <int D>
__device__ __forceinline__ void broadcast(#PARAMS) {
    const unsigned base = (blockIdx.x * blockDim.x + threadIdx.x) * #UNROLL;
#ARRAYS
    int oy[#UNROLL];
    // every element's loads first, then the math and the stores: the loads are in flight together
    // (y may alias an input, so a store would hold back the loads after it)
#pragma unroll
    for (int j = 0; j < #UNROLL; ++j) {
        const unsigned i = base + j;
        if (i < n) {
            unsigned q0 = 0, q1 = 0, q2 = 0, q3 = i;
            if (D >= 2) {
                const unsigned t = i / e3;
                q3 = i - t * e3;
                if (D == 2) {
                    q0 = t;
                } else {
                    const unsigned u = t / e2;
                    q2 = t - u * e2;
                    if (D == 3) { q0 = u; } else { q0 = u / e1; q1 = u - q0 * e1; }
                }
            }
#OFFSETS
#LOADS
            oy[j] = oc_y;
        }
    }
#pragma unroll
    for (int j = 0; j < #UNROLL; ++j) {
        if (base + j < n) {
#VALUES
            T out0;
            {
#CODE
            }
            y[oy[j]] = out0;
        }
    }
}
#ENTRIES
"""


def broadcast_classes(plan: Any, group: FusedGroup) -> tuple[int, ...]:
    """Which of the group's inputs share their offsets (a class number per input, numbered in
    order of first appearance): constant inputs read as the same shape do (packed arrays of one
    shape have one set of strides: a BatchNormalization's four parameters are one class); every
    other input is a class of its own."""
    keys = []
    for k, slot in enumerate(group.inputs):
        const = plan.template[slot]
        keys.append(("constant", tuple(group.view_of(k) or const.shape)) if const is not None else ("value", k))
    first: dict[tuple, int] = {}
    return tuple(first.setdefault(key, len(first)) for key in keys)


def unroll_for(group: FusedGroup) -> int:
    """:data:`UNROLL`, or :data:`UNROLL_HEAVY` when the group's math has a transcendental or a division."""
    return UNROLL_HEAVY if any(f in group.code for f in _HEAVY_MATH) else UNROLL


def broadcast_source(group: FusedGroup, classes: Sequence[int] | None = None, unroll: int | None = None) -> compiler.KernelSource:
    """The group's broadcasting kernel (module docstring): entries :data:`ENTRIES` (by the number of
    merged dimensions), parameters ``(x0 ... x{n-1}, y, n, e1, e2, e3, strides...)``: the element
    count, the extents of the merged dimensions below the outermost, then the four strides
    (elements; :class:`Geometry`) of every offset class (``classes``: per input, from
    :func:`broadcast_classes`; default one per input), then the output's."""
    n = len(group.inputs)
    classes = tuple(range(n)) if classes is None else tuple(classes)
    default_unroll = unroll_for(group)
    unroll = default_unroll if unroll is None else unroll
    names = [f"c{c}" for c in dict.fromkeys(classes)] + ["y"]
    params = [f"const {group.type_of(k)}* x{k}" for k in range(n)] + ["T* y"]
    params += [f"unsigned {v}" for v in ("n", "e1", "e2", "e3")]
    params += [f"int s{a}_{d}" for a in names for d in range(4)]
    call = ", ".join(p.rsplit(" ", 1)[1].lstrip("*") for p in params)
    offsets = [f"            const int oc_{a} = (D >= 2 ? (int)q0 * s{a}_0 : 0) + (D == 4 ? (int)q1 * s{a}_1 : 0) "
               f"+ (D >= 3 ? (int)q2 * s{a}_2 : 0) + (int)q3 * s{a}_3;" for a in names]
    arrays_ = [f"    {group.type_of(k)} v{k}[{unroll}];" for k in range(n)]
    loads = [f"            v{k}[j] = x{k}[oc_c{classes[k]}];" for k in range(n)]
    values = [f"            const {group.type_of(k)} in{k} = v{k}[j];" for k in range(n)]
    entries = [f'extern "C" __global__ void {e}({", ".join(params)}) {{ broadcast<{d}>({call}); }}' for d, e in enumerate(ENTRIES, 1)]
    code = (_BROADCAST_SOURCE.replace("#HEADER", "#include <cuda_fp16.h>" if group.dtype == np.float16 else "")
            .replace("#PREAMBLE", PREAMBLE).replace("#STORAGE", _STORAGE[group.dtype]).replace("#PARAMS", ", ".join(params))
            .replace("#UNROLL", str(unroll)).replace("#ARRAYS", "\n".join(arrays_)).replace("#OFFSETS", "\n".join(offsets))
            .replace("#LOADS", "\n".join(loads)).replace("#VALUES", "\n".join(values)).replace("#CODE", group.code)
            .replace("#ENTRIES", "\n".join(entries)))
    tag = "" if classes == tuple(range(n)) else "_c" + "".join(map(str, classes))
    suffix = "" if unroll == default_unroll else f"_u{unroll}"
    return compiler.KernelSource("convpass_bcast_" + group.name.removeprefix("convpass_ew_") + tag + suffix, code, ENTRIES)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A broadcast element-wise launch: ``n`` elements in the output's memory order, over at most
    four merged dimensions; ``extents`` are the three below the outermost (``e1, e2, e3``, the
    innermost last; 1 where there are fewer dimensions), ``strides[k]`` array k's strides
    (elements) along the outermost dimension and those three (inputs first, the output last)."""

    n: int
    extents: tuple[int, int, int]
    strides: tuple[tuple[int, int, int, int], ...]

    @property
    def dims(self) -> int:
        """How many merged dimensions there are (the kernel entry that takes them)."""
        return 1 + sum(1 for e in self.extents if e > 1) if self.n > self.extents[2] else 1

    def launch(self, unroll: int) -> tuple[int, int]:
        """(blocks, threads per block): ``unroll`` adjacent elements per thread, one pass."""
        return max(1, -(-self.n // (_BLOCK * unroll))), _BLOCK


def broadcast_geometry(shape: Sequence[int], operands: Sequence[tuple[Sequence[int], Sequence[int]]],
                       out_strides: Sequence[int], channels_last_order: bool) -> Geometry | None:
    """The launch geometry of an element-wise kernel writing ``shape`` (module docstring).

    ``operands``: (shape, element strides) of every input, broadcast NumPy-style to ``shape``;
    ``out_strides``: the output's element strides; ``channels_last_order``: walk the elements in
    channels-last order (the output's memory order). None when more than :data:`MAX_DIMS`
    dimensions remain after merging, or an index or offset needs more than 31 bits."""
    r = len(shape)
    per_array: list[list[int]] = []
    for op_shape, op_strides in operands:
        pad = r - len(op_shape)
        if pad < 0:
            return None
        dims = [1] * pad + list(op_shape)
        st = [0] * pad + [int(v) for v in op_strides]
        per_array.append([0 if dims[d] == 1 and shape[d] != 1 else st[d] for d in range(r)])
    per_array.append([int(v) for v in out_strides])
    order = [0, *range(2, r), 1] if channels_last_order and 3 <= r <= 5 else list(range(r))
    extents: list[int] = []
    merged: list[list[int]] = [[] for _ in per_array]
    for d in order:
        size = int(shape[d])
        if size == 1:
            continue
        if extents and all(m[-1] == a[d] * size for m, a in zip(merged, per_array)):
            extents[-1] *= size
            for m, a in zip(merged, per_array):
                m[-1] = a[d]
            continue
        extents.append(size)
        for m, a in zip(merged, per_array):
            m.append(a[d])
    if not extents:  # one element
        extents = [1]
        merged = [[0] for _ in per_array]
    n = math.prod(extents)
    if len(extents) > MAX_DIMS or n >= _INDEX_LIMIT:
        return None
    for m in merged:
        if any(v < 0 for v in m) or sum((e - 1) * v for e, v in zip(extents, m)) >= _INDEX_LIMIT:
            return None
    # the outermost dimension, then up to three below it (e1 outermost of those): padded where
    # there are fewer, so that the kernel's divisions skip what is not there
    d = len(extents)
    index = [0, 1 if d == 4 else None, d - 2 if d >= 3 else None, d - 1 if d >= 2 else None]
    if d == 1:
        index = [None, None, None, 0]
    ext = tuple(extents[i] if i is not None else 1 for i in index[1:])
    strides = tuple(tuple(m[i] if i is not None else 0 for i in index) for m in merged)
    return Geometry(n, ext, strides)  # type: ignore[arg-type]


class BroadcastKernel:
    """A fused group's broadcasting kernel, compiled when built (at plan time); called with the
    group's input arrays and an optional output array (a Concat slice), it returns the output, or
    None for a geometry it does not take (:func:`broadcast_geometry`). ``classes``: inputs that
    share offsets (:func:`broadcast_classes`)."""

    def __init__(self, cupy: Any, group: FusedGroup, classes: Sequence[int] | None = None, entry: Callable[[str], Any] | None = None) -> None:
        self.cp = cupy
        self.group = group
        self.classes = tuple(range(len(group.inputs))) if classes is None else tuple(classes)
        self.unroll = unroll_for(group)
        self.source = broadcast_source(group, self.classes, self.unroll)
        # entry(name): a compiled entry point, called as fn(grid, block, args) (tests pass a host build)
        get = entry if entry is not None else (lambda name: compiler.function(cupy, self.source, name))
        self.entries = [get(name) for name in ENTRIES]
        self._plans: dict[tuple, Any] = {}

    def __call__(self, args: Sequence[Any], out: Any = None) -> Any | None:
        key = tuple((a.shape, a.strides) for a in args) + ((out.shape, out.strides) if out is not None else None,)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(args, out)
        if plan is False:
            return None
        fn, grid, block, scalars, alloc = plan
        if out is None:
            out = self.cp.empty(alloc[0], dtype=self.group.dtype).transpose(alloc[1])
        if out.size:
            fn((grid,), (block,), (*args, out, *scalars))
        return out

    def _plan(self, args: Sequence[Any], out: Any) -> Any:
        shape = tuple(np.broadcast_shapes(*(a.shape for a in args)))
        if out is not None and tuple(out.shape) != shape:
            return False
        r = len(shape)
        nhwc = 3 <= r <= 5 and (channels_last(out) if out is not None else any(a.ndim == r and channels_last(a) for a in args))
        alloc = None
        if out is None:
            perm = (0, *range(2, r), 1) if nhwc else tuple(range(r))
            inv = tuple(int(i) for i in np.argsort(perm))
            alloc = (tuple(shape[p] for p in perm), inv)  # allocated in memory order, then seen logically
            packed = _contiguous_strides(alloc[0])
            out_strides = tuple(packed[i] for i in inv)
        else:
            out_strides = elements(out.strides, out.itemsize)
        g = broadcast_geometry(shape, [(a.shape, elements(a.strides, a.itemsize)) for a in args], out_strides, nhwc)
        if g is None:
            return False
        per_class: dict[int, tuple[int, ...]] = {}
        for c, st in zip(self.classes, g.strides[:-1]):
            if per_class.setdefault(c, st) != st:  # a class whose members are not alike: not for this kernel
                return False
        grid, block = g.launch(self.unroll)
        u32, i32 = np.uint32, np.int32
        scalars = [u32(g.n), *(u32(e) for e in g.extents)]
        scalars += [i32(v) for st in [*per_class.values(), g.strides[-1]] for v in st]
        return self.entries[g.dims - 1], grid, block, tuple(scalars), alloc


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def in_storage_order(args: Sequence[Any], fn: Callable[..., Any], value_inputs: Sequence[int] = (), out: Any = None) -> Any:
    """``fn(*args)`` (or ``fn(*args, out)``), an element-wise computation, on the channels-last storage
    when a full-rank input has it: element-wise kernels over a channels-last array seen channels-first
    would read and write with a stride of C elements, and CuPy would allocate the result
    channels-first. Inputs listed in ``value_inputs`` (read as values, e.g. Clip's bounds) and 0-d
    ones are passed as they are."""
    r = max((a.ndim for a in args if a is not None), default=0)
    if not 3 <= r <= 5 or not any(a is not None and a.ndim == r and channels_last(a) for a in args):
        return fn(*args) if out is None else fn(*args, out)
    perm = (0, *range(2, r), 1)
    inv = (0, r - 1, *range(1, r - 1))
    moved = []
    for i, a in enumerate(args):
        if a is None or a.ndim == 0 or i in value_inputs:
            moved.append(a)
        else:
            full = a if a.ndim == r else a.reshape((1,) * (r - a.ndim) + tuple(a.shape))
            moved.append(full.transpose(perm))
    outs = fn(*moved) if out is None else fn(*moved, out.transpose(perm))
    if isinstance(outs, (tuple, list)):
        return [o.transpose(inv) if o is not None and o.ndim == r else o for o in outs]
    return outs.transpose(inv) if outs.ndim == r else outs


def needs_fallback(plan: Any, group: FusedGroup) -> bool:
    """Whether the group's output may take a shape :class:`BroadcastKernel` does not (rank above
    :data:`MAX_DIMS`, 2^31 elements or more, or unknown): then CuPy's kernel is built too."""
    info = plan.info(group.output)
    return info is None or len(info[0]) > MAX_DIMS or math.prod(info[0]) >= _INDEX_LIMIT


class FusedLaunch(Launch):
    """One fused group: its broadcasting kernel over the group's external inputs (CuPy's
    ``fallback`` kernel, when given, for shapes that kernel does not take)."""

    supports_placement = True

    def __init__(self, plan: Any, group: FusedGroup, broadcast: BroadcastKernel | None, fallback: Any, counters: dict[str, int]) -> None:
        node = plan.steps[group.root].node
        super().__init__(group.root, node, "fused " + "+".join(group.ops), (group.output,), absorbs=group.members[:-1])
        if broadcast is None and fallback is None:
            raise ValueError("a fused group needs a kernel")
        self.group = group
        self.broadcast = broadcast
        self.fallback = fallback
        self.counters = counters
        # constant inputs viewed once, here; computed ones at run time. Packed (C order), as
        # broadcast_classes assumes: constants read as one shape then have one set of strides.
        self._fixed = [None if plan.template[s] is None else _packed(_as_view(plan.template[s], group.view_of(k)))
                       for k, s in enumerate(group.inputs)]

    def run(self, env: list[Any]) -> None:
        g = self.group
        args = [f if f is not None else _as_view(env[s], g.view_of(k)) for k, (s, f) in enumerate(zip(g.inputs, self._fixed))]
        out = None
        if self.placement is not None:
            layout = "nhwc" if any(a is not None and a.ndim >= 3 and channels_last(a) for a in args) else "nchw"
            out = self.destination(env, layout)
        y = self.broadcast(args, out) if self.broadcast is not None else None
        if y is None:
            if self.fallback is None:
                raise RuntimeError(f"fused {'+'.join(g.ops)}: shape {[a.shape for a in args]} needs CuPy's kernel, which this plan did not build")
            y = in_storage_order(args, self.fallback, out=out)
        env[g.output] = y
        self.counters["fused_elementwise"] += 1


def _as_view(a: Any, view: tuple[int, ...] | None) -> Any:
    return a if view is None else a.reshape(view)


def _packed(a: Any) -> Any:
    """``a`` in C order (a copy when it is not: NumPy and CuPy arrays alike)."""
    return a if a.flags.c_contiguous else a.copy()
