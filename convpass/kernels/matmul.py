"""MatMul / Gemm with their epilogues as one cuBLASLt call (:meth:`convpass.native.cublas.Blas.matmul_epilogue`).

A Linear layer exported by ``torch.onnx`` is ``MatMul(x, W)`` then ``Add(bias)``; a transformer
block adds its residual right after; a classifier head is ``Gemm(x, W, b)`` then ``Relu``. Run op
by op, every one of those steps after the product is a full read and write of the activation.
cuBLASLt adds the bias, the residual (as matrix C, beta 1) and a ReLU in the product's own
epilogue, so they cost no pass of their own.

Rules (:func:`lower_matmul`):

* The product: a ``MatMul`` whose second operand is 2-D (``(..., m, k) @ (k, n)``), or a ``Gemm``
  with ``transA = 0`` and ``alpha = 1``, whose C (if any) is a bias of ``n`` values with ``beta = 1``
  (``transB`` is read in place); float32 or float16.
* Then, each the only reader of the value before it and not a graph output, in this order: an
  ``Add`` of a constant bias of ``n`` values (``(n,)`` or ``(1, ..., 1, n)``; not when the Gemm
  has its own), an ``Add`` of a residual of the result's exact shape and dtype that is computed
  before the product (so the launch, which runs at the product's step, can read it), a ``Relu``.
  That is cuBLASLt's ``relu(a @ b + residual + bias)``.
* Lowered only when there is an epilogue to fuse (a bias, a residual or a ReLU): a bare product
  stays with the op library's ``cublasGemmEx``. A bias read by an activation cuBLASLt does not
  have (ConvNeXt's erf GELU, a SiLU) joins the epilogue too, and the activation's fused group then
  runs over contiguous same-shape rows: ConvNeXt's first MLP Linear ran faster this way than as
  cuBLAS + the bias-and-GELU kernel (benchmarks/op_kernels.py;
  docs/measurements/2026-11-23-matmul-epilogues.md).
* A case cuBLASLt does not take at run time (no algorithm for the shape, an operand not 16-byte
  aligned, the library cannot be loaded) runs the product and the absorbed ops one by one, with
  the same result; a cuBLASLt call that fails in an eager run is noted once, and that launch runs
  its ops one by one from then on.

TF32 follows the plan's ``matmul_allow_tf32``, as for every Gemm / MatMul.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from convpass.kernels.launch import Launch
from convpass.kernels.plan import store_outputs

__all__ = ["MatmulLaunch", "lower_matmul"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class MatmulLaunch(Launch):
    """A MatMul / Gemm step and the bias, residual and ReLU steps it absorbs (module docstring)."""

    def __init__(self, plan: Any, index: int, output: int, absorbs: tuple[int, ...], *, transpose_b: bool,
                 bias: int, residual: int, relu: bool, rt: Any) -> None:
        step = plan.steps[index]
        label = step.node.op_type + "".join(f"+{p}" for p, on in (("bias", bias >= 0), ("residual", residual >= 0), ("relu", relu)) if on)
        super().__init__(index, step.node, label + " (cuBLASLt)", (output,), absorbs)
        self.a, self.b = step.inputs[0], step.inputs[1]
        self.transpose_b = transpose_b
        self.bias_slot, self.residual = bias, residual
        self.relu = relu
        self.allow_tf32 = bool(plan.matmul_allow_tf32)
        self.template = plan.template
        self.rt = rt
        self.bias: Any = None
        self.fused_calls = 0
        self.refused = False

    def prepare(self) -> None:
        if self.bias_slot >= 0:
            self.bias = self.rt.cp.ascontiguousarray(self.template[self.bias_slot].reshape(-1))

    def run(self, env: list[Any]) -> None:
        a, b = env[self.a], env[self.b]
        if self.transpose_b:
            b = b.T
        residual = env[self.residual] if self.residual >= 0 else None
        blas = self.rt.blas() if not self.refused else None
        out = None
        if blas:
            try:
                out = blas.matmul_epilogue(a, b, self.allow_tf32, bias=self.bias, residual=residual, relu=self.relu)
            except RuntimeError as e:
                if self.rt.capturing:
                    raise
                self.refused = True  # the eager run found it: this launch runs its ops one by one from now on
                self.rt.note_once(f"cublaslt-{self.node.name}", f"cuBLASLt failed for node {self.node.name!r} ({e}): "
                                  f"its {self.label.removesuffix(' (cuBLASLt)')} runs op by op")
        if out is None:  # not covered by cuBLASLt here: the same ops, one by one
            cp = self.rt.cp
            out = self.rt.xp.matmul(a, b)
            if self.bias is not None:
                out = out + self.bias
            if residual is not None:
                out = out + residual
            if self.relu:
                out = cp.maximum(out, 0, dtype=out.dtype)
        else:
            self.fused_calls += 1
        store_outputs(env, self.outputs, out)


def lower_matmul(plan: Any, index: int, claimed: list[Any], rt: Any) -> MatmulLaunch | None:
    """A :class:`MatmulLaunch` for plan step ``index`` when the rules of the module docstring
    allow one, else None."""
    steps = plan.steps
    st = steps[index]
    node = st.node
    if node.domain != "" or node.op_type not in ("MatMul", "Gemm") or len(st.inputs) < 2 or not st.outputs or st.outputs[0] < 0:
        return None
    a, b = plan.info(st.inputs[0]), plan.info(st.inputs[1])
    y = plan.info(st.outputs[0])
    if a is None or b is None or y is None or len(b[0]) != 2 or len(a[0]) < 2 or a[1] not in _DTYPES or b[1] != a[1] or y[1] != a[1]:
        return None
    dtype, n = a[1], y[0][-1]
    bias = -1
    transpose_b = False
    if node.op_type == "Gemm":
        if node.attr("transA", 0) or float(node.attr("alpha", 1.0)) != 1.0:
            return None
        transpose_b = bool(node.attr("transB", 0))
        c = st.inputs[2] if len(st.inputs) > 2 else -1
        if c >= 0:
            if float(node.attr("beta", 1.0)) != 1.0 or not _is_bias(plan, c, n, dtype):
                return None
            bias = c
    readers = plan.readers()
    outputs = set(plan.output_slots)
    producer = plan.producers()

    def next_step(slot: int, op_type: str) -> int | None:
        ks = readers.get(slot, ())
        if slot in outputs or len(ks) != 1:
            return None
        k = ks[0]
        s = steps[k]
        # before opset 7 an Add broadcasts by its ``broadcast`` / ``axis`` attributes, not numpy's rule
        ok = k > index and claimed[k] is None and s.node.op_type == op_type and s.node.domain == "" and s.node.opset >= 7 and s.outputs and s.outputs[0] >= 0
        return k if ok and plan.info(s.outputs[0]) == y else None

    value, absorbs, residual, relu = st.outputs[0], [], -1, False
    while True:
        k = next_step(value, "Add")
        if k is not None and len(steps[k].inputs) == 2:
            other = [s for s in steps[k].inputs if s != value]
            other = other[0] if len(other) == 1 else -1
            if bias < 0 and other >= 0 and _is_bias(plan, other, n, dtype):
                bias, value = other, steps[k].outputs[0]
                absorbs.append(k)
                continue
            if residual < 0 and other >= 0 and plan.template[other] is None and plan.info(other) == y and producer.get(other, -1) < index:
                residual, value = other, steps[k].outputs[0]
                absorbs.append(k)
                continue
        k = next_step(value, "Relu")
        if k is not None and len(steps[k].inputs) == 1:
            relu, value = True, steps[k].outputs[0]
            absorbs.append(k)
        break
    if bias < 0 and residual < 0 and not relu:
        return None
    return MatmulLaunch(plan, index, value, tuple(absorbs), transpose_b=transpose_b, bias=bias, residual=residual, relu=relu, rt=rt)


def _is_bias(plan: Any, slot: int, n: int, dtype: np.dtype) -> bool:
    """Whether ``slot`` is a constant of ``n`` values of ``dtype`` shaped ``(n,)`` or ``(1, ..., 1, n)``."""
    const = plan.template[slot]
    if const is None or np.dtype(const.dtype) != dtype or not const.shape:
        return False
    return const.shape[-1] == n and all(d == 1 for d in const.shape[:-1])
