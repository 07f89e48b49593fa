#!/usr/bin/env python
"""The cuda backend's kernels between the convolutions, each timed against its alternatives.

For every op family on shapes from the wide panel, the same single-op model is run by the
executor in its variants — the op library over CuPy (``kernels=False``: what convpass ran before),
convpass's kernel, cuDNN's where it has one (pooling; softmax and InstanceNormalization through
cuDNN's legacy softmax / batch-norm calls) — each captured as a CUDA graph and replayed back to
back, timed with CUDA events (median of ``--batches`` groups of ``--reps`` replays), outputs
checked against the first variant. A hand-written kernel stays the default only where it beats
the library; this table is where that is shown. MatMul / Gemm with bias, residual and ReLU are
timed as cuBLAS plus the fused element-wise kernel (``matmul_epilogues=False``) and as one
cuBLASLt call with those epilogues (the default; a bias before an erf GELU: cuBLASLt's bias epilogue,
then the GELU's fused kernel). Fused element-wise groups are timed with
convpass's broadcasting kernel (the default) and with CuPy's ``ElementwiseKernel`` of the same
code (``CuPy's kernel``: what ran before the broadcasting kernel). A normalization unit (a VAE
decoder's GroupNorm + SiLU and a BiT ResNet's GroupNorm + ReLU, in their exported form) is timed
as its fused step run as three kernels (statistics, finalize, apply: ``three kernels``) and as
one launch (a block per sample and group: ``one launch``), each forced whatever the group size
(the executor picks by :data:`convpass.kernels.group_norm_onepass.MAX_GROUP_ELEMENTS` and ``MIN_PAIRS``), as the
unfused ops' kernels (``fusions=False``) and by the op library; its row names the kernel that ran
the apply. Rows marked ``nhwc`` read an NHWC input through a Transpose (a view), so their first
op sees channels-last storage in the captured graph too.

    python benchmarks/op_kernels.py [--json FILE] [--reps 50] [--batches 7] [--only TEXT[,TEXT...]]
    python benchmarks/op_kernels.py --only "GroupNorm+"   # the normalization units: BiT and VAE shapes

Prints one row per case and variant: median microseconds, effective bandwidth (input + output
bytes / time), speedup over the op library, the relative error against it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N = helper.make_node


def _model(nodes, x_shape, inits=(), opset=19, dtype=np.float32):
    tp = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    ins = [helper.make_tensor_value_info("x", tp, x_shape)]
    outs = [helper.make_tensor_value_info("y", tp, [f"d{i}" for i in range(len(x_shape))])]
    return helper.make_model(helper.make_graph(nodes, "g", ins, outs, list(inits)), opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _replay_us(run_once: Callable[[], None], reps: int, batches: int) -> float:
    """Median microseconds per call of ``run_once`` (stream work), captured once as a graph."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        run_once()
        stream.synchronize()
        stream.begin_capture()
        run_once()
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        times = []
        for _ in range(batches):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for _ in range(reps):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / reps)
    return statistics.median(times)


CUPY_FUSED = "cupy_fused"  # variant option: fused groups run CuPy's ElementwiseKernel


@contextlib.contextmanager
def _cupy_fused_groups() -> Iterator[None]:
    """Plans compiled inside run their fused groups with CuPy's kernel, not the broadcasting one."""
    from convpass.kernels import broadcast

    saved = broadcast.BroadcastKernel.__call__, broadcast.needs_fallback
    broadcast.BroadcastKernel.__call__ = lambda self, args, out=None: None
    broadcast.needs_fallback = lambda plan, group: True
    try:
        yield
    finally:
        broadcast.BroadcastKernel.__call__, broadcast.needs_fallback = saved


def _nhwc_input(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` reading its input ``x`` through a Transpose of an NHWC input ``x_nhwc``: on the GPU
    the Transpose is a view, so the first op reads channels-last storage, also when the plan is
    replayed from a CUDA graph (whose input buffers are packed copies of the feeds: a channels-last
    feed of ``x`` itself would arrive channels-first)."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    x = next(i for i in m.graph.input if i.name == "x")
    dims = x.type.tensor_type.shape.dim
    r = len(dims)
    values = [d.dim_value for d in dims]
    for d, v in zip(dims, [values[0], *values[2:], values[1]]):
        d.dim_value = v
    x.name = "x_nhwc"
    m.graph.node.insert(0, N("Transpose", ["x_nhwc"], ["x"], perm=[0, r - 1, *range(1, r - 1)], name="to_logical"))
    return m


def _label(launch: Any) -> str:
    """A launch's label, with the kernels its apply pass ran (a fused normalization step)."""
    paths = getattr(launch, "apply_paths", None)
    return launch.label + (f" [{','.join(sorted(paths()))}]" if paths is not None else "")


def _executor_variant(model, x, reps: int, batches: int, channels_last: bool, **options) -> tuple[float, Any]:
    """Time the compiled plan of ``model`` (one graph) on device input ``x`` (stored channels-last:
    :func:`_nhwc_input`); returns (us, (output, launch labels))."""
    if options.pop(CUPY_FUSED, False):
        with _cupy_fused_groups():
            return _executor_variant(model, x, reps, batches, channels_last, **options)
    import cupy as cp

    from convpass.runtime import Executor
    from convpass.runtime.cuda import CudaBackend

    feed = {"x": cp.asarray(x)}
    if channels_last:
        model = _nhwc_input(model)
        feed = {"x_nhwc": cp.asarray(np.ascontiguousarray(np.moveaxis(x, 1, -1)))}
    fusions = options.pop("fusions", None)
    ex = Executor(model, device=CudaBackend(**options), output_kind="device", fusions=fusions)
    for _ in range(3):
        (y,) = ex.run(None, feed)
    status = ex.graph_status()
    if not status.captured:
        raise RuntimeError(status.describe())
    state = ex.last_plan.backend_state
    graph = state.segments[0]
    stream = cp.cuda.get_current_stream()

    def once() -> None:
        graph.launch(stream)

    # the plan's graph replays on the caller's stream; time it the same way as the library calls
    times = []
    for _ in range(3):
        once()
    for _ in range(batches):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            once()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / reps)
    labels = [_label(launch) for launch in state.launch_list()]
    return statistics.median(times), (cp.asnumpy(y), labels)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cases() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []

    def pool(name, op, shape, **attrs):
        out.append({"name": name, "family": "pooling", "model": _model([N(op, ["x"], ["y"], **attrs)], shape), "shape": shape,
                    "variants": {"op library": {"kernels": False}, "convpass kernel": {"pooling": "kernel"}, "cuDNN": {"pooling": "cudnn"}}})

    for cl in (False, True):
        tag = " nhwc" if cl else ""
        pool(f"MaxPool 3x3/2 p1 32x64x112x112{tag}", "MaxPool", (32, 64, 112, 112), kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
        pool(f"AveragePool 3x3/1 p1 incl. pad 32x192x35x35{tag}", "AveragePool", (32, 192, 35, 35), kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=1)
        pool(f"AveragePool 2x2/2 32x256x56x56{tag}", "AveragePool", (32, 256, 56, 56), kernel_shape=[2, 2], strides=[2, 2])
        for c in out[-3:]:
            c["channels_last"] = cl
    pool("MaxPool 3x3/2 ceil_mode 32x64x112x112", "MaxPool", (32, 64, 112, 112), kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    for shape in ((32, 96, 112, 112), (32, 480, 14, 14), (32, 1152, 7, 7)):  # EfficientNet-B0's squeeze-excitation inputs, batch 32
        for cl in (False, True):
            out.append({"name": f"GlobalAveragePool {'x'.join(map(str, shape))}{' nhwc' if cl else ''}", "family": "pooling", "shape": shape,
                        "model": _model([N("GlobalAveragePool", ["x"], ["y"])], shape), "channels_last": cl, "reduces": True,
                        "variants": {"op library": {"kernels": False}, "convpass kernel": {}}})
    c = 256
    bn = [_const(k, v) for k, v in (("s", 1 + 0.1 * rng.standard_normal(c)), ("b", rng.standard_normal(c)), ("m", rng.standard_normal(c)), ("v", 0.5 + rng.random(c)))]
    fused = {"op library": {"kernels": False, "fuse": False}, "CuPy's kernel": {CUPY_FUSED: True}, "fused kernel": {}}
    for cl in (False, True):
        out.append({"name": f"BatchNormalization+Relu 32x256x28x28{' nhwc' if cl else ''}", "family": "normalization", "shape": (32, c, 28, 28),
                    "model": _model([N("BatchNormalization", ["x", "s", "b", "m", "v"], ["n"]), N("Relu", ["n"], ["y"])], (32, c, 28, 28), bn, 15),
                    "variants": fused, "channels_last": cl})
    # ConvNeXt's MLP at batch 32, stage 1: the first Linear's bias and the exported (erf) GELU ...
    h = (32, 56, 56, 384)
    gelu = [N("Add", ["x", "bias"], ["a"]), N("Div", ["a", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["e1"]),
            N("Mul", ["a", "e1"], ["m"]), N("Mul", ["m", "half"], ["y"])]
    out.append({"name": "bias + GELU (ConvNeXt MLP) 32x56x56x384", "family": "elementwise", "shape": h, "variants": fused,
                "model": _model(gelu, h, [_const("bias", rng.standard_normal(384)), _const("sqrt2", np.sqrt(2)), _const("one", 1.0), _const("half", 0.5)])})
    # ... the second Linear's bias alone (a Transpose follows), and layer scale + residual
    out.append({"name": "bias Add 32x56x56x96", "family": "elementwise", "shape": (32, 56, 56, 96), "variants": fused,
                "model": _model([N("Add", ["x", "bias"], ["y"])], (32, 56, 56, 96), [_const("bias", rng.standard_normal(96))])})
    out.append({"name": "layer scale + residual 32x96x56x56 nhwc", "family": "elementwise", "shape": (32, 96, 56, 56), "variants": fused,
                "channels_last": True, "model": _model([N("Mul", ["x", "gamma"], ["g"]), N("Add", ["g", "x"], ["y"])], (32, 96, 56, 56),
                                                       [_const("gamma", rng.standard_normal((96, 1, 1)))])})
    # squeeze-excitation's gate (EfficientNet-B0, batch 32): x * sigmoid(per-(n, c) value)
    se = (32, 672, 14, 14)
    for cl in (False, True):
        out.append({"name": f"SE gate x * sigmoid(g) 32x672x14x14{' nhwc' if cl else ''}", "family": "elementwise", "shape": se, "variants": fused,
                    "channels_last": cl, "model": _model([N("GlobalAveragePool", ["x"], ["p"]), N("Sigmoid", ["p"], ["s"]), N("Mul", ["x", "s"], ["y"])], se)})
    for shape, _groups, name in (((1, 1, 512 * 2000), None, "InstanceNormalization (GroupNorm(1, 512) of a 1-D audio net, b1) 1x1x1024000"),
                                ((16, 1, 512 * 2000), None, "InstanceNormalization (GroupNorm(1, 512), b16) 16x1x1024000"),
                                ((32, 64, 56 * 56), None, "InstanceNormalization 32x64x3136")):
        cc = shape[1]
        inits = [_const("s", 1 + 0.1 * rng.standard_normal(cc)), _const("b", rng.standard_normal(cc))]
        out.append({"name": name, "family": "normalization", "shape": shape, "cudnn": "instance_norm",
                    "model": _model([N("InstanceNormalization", ["x", "s", "b"], ["y"])], shape, inits, 17),
                    "variants": {"op library": {"kernels": False}, "convpass kernel": {}}})
    gshape = (8, 256, 64, 64)
    out.append({"name": "GroupNormalization 32 groups 8x256x64x64", "family": "normalization", "shape": gshape,
                "model": _model([N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=32)], gshape,
                                [_const("s", np.ones(256)), _const("b", np.zeros(256))], 21),
                "variants": {"op library": {"kernels": False}, "convpass kernel": {}}})
    # normalization units as torch.onnx.export writes them (opset < 18): a VAE decoder's GroupNorm(32)
    # + SiLU at batch 16 and 1 (128 channels at 256 x 256: 262,144 elements a group; at batch 1 also
    # 512 x 32 x 32 and 256 x 128 x 128), a BiT ResNet's GroupNorm(32) + ReLU at batch 16 (its four
    # stages' widths, 3,136 to 25,088 elements a group); each as the fusion unit's step in three
    # kernels and in one launch, as the unfused ops' kernels, and by the op library
    norm_units = {"op library": {"kernels": False}, "unfused kernels": {"fusions": False},
                  "three kernels": {"fusions": True, NORM_PATH: "three"}, "one launch": {"fusions": True, NORM_PATH: "one"}}
    for gshape, act, tag in [((16, 128, 256, 256), "silu", "SiLU"), ((1, 128, 256, 256), "silu", "SiLU"), ((1, 256, 128, 128), "silu", "SiLU"),
                             ((1, 512, 32, 32), "silu", "SiLU"), ((16, 256, 56, 56), "relu", "Relu (BiT"), ((16, 512, 28, 28), "relu", "Relu (BiT"),
                             ((16, 1024, 14, 14), "relu", "Relu (BiT"), ((16, 2048, 7, 7), "relu", "Relu (BiT")]:
        for cl in (False, True):
            head = f"GroupNorm+{tag}{', ' if '(' in tag else ' ('}exported, 32 groups)"
            out.append({"name": f"{head} {'x'.join(map(str, gshape))}{' nhwc' if cl else ''}", "family": "normalization",
                        "shape": gshape, "channels_last": cl, "model": _exported_group_norm(gshape, 32, rng, act), "variants": norm_units})
    lshape = (32, 56, 56, 96)
    out.append({"name": "LayerNormalization last axis (ConvNeXt) 32x56x56x96", "family": "normalization", "shape": lshape,
                "model": _model([N("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], lshape, [_const("g", np.ones(96)), _const("b", np.zeros(96))], 17),
                "variants": {"op library": {"kernels": False}, "convpass kernel": {}}})
    sshape = (32, 12, 197, 197)
    out.append({"name": "Softmax last axis (ViT attention) 32x12x197x197", "family": "softmax", "shape": sshape,
                "model": _model([N("Softmax", ["x"], ["y"], axis=-1)], sshape, opset=13),
                "variants": {"op library": {"kernels": False}, "cuDNN (the runtime's path)": {}}})
    # MatMul / Gemm epilogues: ConvNeXt's MLP (batch 32 and 1, stage 1), a MobileViT-style Linear
    # with its residual, a classifier's Gemm + Relu
    lt = {"cuBLAS + element-wise": {"matmul_epilogues": False}, "cuBLASLt epilogue": {}}

    def linear(name, x_shape, n, extra, inits_extra=(), variants=lt, gemm=False):
        k = x_shape[-1]
        w = _const("W", rng.standard_normal((n, k) if gemm else (k, n)) / np.sqrt(k))
        head = [N("Gemm", ["x", "W", "bias"], ["a"], transB=1)] if gemm else [N("MatMul", ["x", "W"], ["m"]), N("Add", ["m", "bias"], ["a"])]
        out.append({"name": name, "family": "matmul", "shape": x_shape, "variants": variants,
                    "nbytes": 4 * (int(np.prod(x_shape)) + k * n + int(np.prod(x_shape[:-1])) * n * (2 if "residual" in name else 1)),
                    "model": _model(head + extra, x_shape, [w, _const("bias", rng.standard_normal(n)), *inits_extra])})

    for b in (32, 1):
        linear(f"Linear + bias (ConvNeXt fc2) {b}x56x56x384 -> 96", (b, 56, 56, 384), 96, [N("Transpose", ["a"], ["y"], perm=[0, 3, 1, 2])])
    gelu_tail = [N("Div", ["a", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["e1"]), N("Mul", ["a", "e1"], ["g"]), N("Mul", ["g", "half"], ["y"])]
    linear("Linear + bias + erf GELU (ConvNeXt fc1) 32x56x56x96 -> 384", (32, 56, 56, 96), 384, gelu_tail,
           [_const("sqrt2", np.sqrt(2)), _const("one", 1.0), _const("half", 0.5)],
           {"cuBLAS + fused bias+GELU": {"matmul_epilogues": False}, "cuBLASLt bias, GELU kernel": {}})
    linear("Linear + bias + residual (MobileViT) 128x256x144", (128, 256, 144), 144, [N("Add", ["a", "x"], ["y"])])
    linear("Gemm + bias + Relu (classifier) 32x4096 -> 4096", (32, 4096), 4096, [N("Relu", ["a"], ["y"])], gemm=True)
    rshape = (32, 64, 56, 56)
    for mode in ("nearest", "linear"):
        out.append({"name": f"Resize {mode} 2x 32x64x56x56", "family": "resize", "shape": rshape,
                    "model": _model([N("Resize", ["x", "", "scales"], ["y"], mode=mode)], rshape, [_const("scales", [1, 1, 2, 2])]),
                    "variants": {"op library": {"kernels": False}, "convpass kernel": {}}})
    # a diffusion VAE decoder's (and an SR net's) nearest x2 upsampling of 128 channels, batch 16
    # and 1: the nearest kernel against the generic resize_2d and the op library. nhwc rows read
    # an NHWC input through a Transpose in the model (a view), so the Resize sees channels-last
    # storage in the captured graph too (its input buffers are packed copies of the feeds).
    for b in (16, 1):
        for cl in (False, True):
            logical = (b, 128, 128, 128)
            shape = (b, *logical[2:], logical[1]) if cl else logical
            head = [N("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2])] if cl else []
            nodes = head + [N("Resize", ["xt" if cl else "x", "", "scales"], ["y"], mode="nearest")]
            out.append({"name": f"Resize nearest x2 {'x'.join(map(str, logical))} -> 256x256{' nhwc' if cl else ''}", "family": "resize",
                        "shape": shape, "nbytes": 4 * 5 * int(np.prod(logical)),  # read the input, write 4x its size
                        "model": _model(nodes, shape, [_const("scales", [1, 1, 2, 2])]),
                        "variants": {"op library": {"kernels": False}, "generic resize_2d": {GENERIC_RESIZE: True}, "convpass kernel": {}}})
    return out


GENERIC_RESIZE = "generic_resize"  # variant option: Resize runs the generic resize_2d, never the nearest kernel
NORM_PATH = "norm_path"  # variant option: fused normalization units run as "one" launch or "three" kernels, whatever their size


@contextlib.contextmanager
def _generic_resize(on: bool) -> Iterator[None]:
    """Plans compiled inside lower every Resize to the generic kernel (``on``), else as usual."""
    from convpass.kernels import tensor_ops

    saved = tensor_ops.nearest_fits
    if on:
        tensor_ops.nearest_fits = lambda out_shape: False
    try:
        yield
    finally:
        tensor_ops.nearest_fits = saved


@contextlib.contextmanager
def _norm_path(path: str | None) -> Iterator[None]:
    """Plans compiled inside run fused normalization units as one launch (``"one"``) or as three
    kernels (``"three"``) whatever their group size; as the executor picks them for None."""
    from convpass.kernels import group_norm_onepass

    saved = group_norm_onepass.MAX_GROUP_ELEMENTS, group_norm_onepass.MIN_PAIRS
    limits = {"one": (2**62, 0), "three": (0, saved[1]), None: saved}[path]
    group_norm_onepass.MAX_GROUP_ELEMENTS, group_norm_onepass.MIN_PAIRS = limits
    try:
        yield
    finally:
        group_norm_onepass.MAX_GROUP_ELEMENTS, group_norm_onepass.MIN_PAIRS = saved


def _exported_group_norm(shape: tuple[int, ...], groups: int, rng: np.random.Generator, act: str = "silu") -> Any:
    """Reshape(x, [0, G, -1]) -> InstanceNormalization(ones, zeros) -> Reshape(Shape(x)) -> Mul(gamma)
    -> Add(beta) -> Sigmoid, Mul (``act`` "silu") or Relu (``"relu"``): ``nn.GroupNorm`` + ``F.silu``
    / ``F.relu`` as exported at opset 17."""
    c = shape[1]
    tail = [N("Sigmoid", ["a"], ["sig"]), N("Mul", ["a", "sig"], ["y"])] if act == "silu" else [N("Relu", ["a"], ["y"])]
    nodes = [N("Reshape", ["x", "g"], ["r"]), N("InstanceNormalization", ["r", "ones", "zeros"], ["i"], epsilon=1e-6),
             N("Shape", ["x"], ["s"]), N("Reshape", ["i", "s"], ["back"]), N("Mul", ["back", "gamma"], ["m"]), N("Add", ["m", "beta"], ["a"]),
             *tail]
    inits = [_const("g", [0, groups, -1], np.int64), _const("ones", np.ones(groups)), _const("zeros", np.zeros(groups)),
             _const("gamma", (1 + 0.1 * rng.standard_normal(c)).reshape(c, 1, 1)), _const("beta", rng.standard_normal(c).reshape(c, 1, 1))]
    return _model(nodes, shape, inits, 17)


def _cudnn_instance_norm(case: dict[str, Any], x: np.ndarray, reps: int, batches: int) -> tuple[float, np.ndarray]:
    """The library baseline of InstanceNormalization: cuDNN's batch norm over n * c channels."""
    import cupy as cp

    from convpass.native.cudnn import get_handle
    from convpass.native.cudnn.rowwise import instance_norm_rows

    xd = cp.asarray(x)
    y = cp.empty_like(xd)
    n, c = x.shape[:2]
    length = x.size // (n * c)
    init = {t.name: numpy_helper.to_array(t) for t in case["model"].graph.initializer}
    scale = cp.asarray(np.tile(init["s"].astype(np.float32), n))
    bias = cp.asarray(np.tile(init["b"].astype(np.float32), n))
    save = cp.empty(2 * n * c, dtype=cp.float32)

    def once() -> None:
        instance_norm_rows(xd, y, n * c, length, scale, bias, 1e-5, save, get_handle().ptr)

    return _replay_us(once, reps, batches), cp.asnumpy(y)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--only", help="run only the cases whose name contains one of these comma-separated texts")
    args = ap.parse_args(argv)
    from convpass.runtime.cuda import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"op_kernels: needs the cuda backend: {reason}", file=sys.stderr)
        return 2
    rows = []
    t0 = time.perf_counter()
    for case in cases():
        if args.only and not any(t in case["name"] for t in args.only.split(",")):
            continue
        x = np.random.default_rng(1).standard_normal(case["shape"]).astype(np.float32)
        base = None
        results = []
        for variant, options in case["variants"].items():
            try:
                options = dict(options)
                with _generic_resize(options.pop(GENERIC_RESIZE, False)), _norm_path(options.pop(NORM_PATH, None)):
                    us, (y, labels) = _executor_variant(case["model"], x, args.reps, args.batches, case.get("channels_last", False), **options)
            except Exception as e:  # noqa: BLE001  (a variant that cannot run is reported, the others still are)
                results.append({"variant": variant, "error": str(e).splitlines()[0]})
                continue
            base = base if base is not None else (y, us)
            results.append({"variant": variant, "us": us, "labels": labels, "rel_err": _rel(y, base[0])})
        if case.get("cudnn"):
            try:
                us, y = _cudnn_instance_norm(case, x, args.reps, args.batches)
                results.append({"variant": f"cuDNN {case['cudnn']}", "us": us, "labels": [], "rel_err": _rel(y, base[0]) if base else None})
            except Exception as e:  # noqa: BLE001
                results.append({"variant": f"cuDNN {case['cudnn']}", "error": str(e).splitlines()[0]})
        # one read of the input, one write of an output of that size (a reduction's output: n x c)
        nbytes = case.get("nbytes") or int(np.prod(case["shape"])) * 4 + (int(np.prod(case["shape"][:2])) if case.get("reduces") else int(np.prod(case["shape"]))) * 4
        for r in results:
            if "us" in r:
                r["GBps"] = nbytes / (r["us"] * 1e-6) / 1e9
                r["speedup_vs_op_library"] = base[1] / r["us"] if base else None
        rows.append({"case": case["name"], "family": case["family"], "results": results})
        for r in results:
            if "error" in r:
                print(f"{case['name'][:62]:<62} {r['variant']:<18} error: {r['error']}", flush=True)
            else:
                applied = " ".join(label[label.index("["):] for label in r["labels"] if "[" in label)
                print(f"{case['name'][:62]:<62} {r['variant']:<18} {r['us']:9.1f} us {r['GBps']:7.0f} GB/s  "
                      f"x{r['speedup_vs_op_library']:.2f}  err {r['rel_err']:.1e}{'  apply ' + applied if applied else ''}", flush=True)
    import convpass

    print(f"op_kernels: {len(rows)} cases in {time.perf_counter() - t0:.0f} s (convpass from {Path(convpass.__file__).parent})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
