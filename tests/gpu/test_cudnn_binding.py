"""GPU tests of the cuDNN binding (convpass.native.cudnn) against a float64 NumPy reference.

Run on the device machine: ``python3 -m pytest -m gpu tests/gpu/test_cudnn_binding.py -q``.
Set ``CONVPASS_GPU_REPORT=/path/report.json`` to get, per problem / direction / algorithm, the
workspace size or the status cuDNN refused it with, and the error against the reference.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'convpass[gpu]')")

from convpass.core import cudnn_enums as enums  # noqa: E402
from convpass.core.cudnn_enums import CudnnError, CudnnNotFound  # noqa: E402
from convpass.core.problem import ConvShape, ProblemKey  # noqa: E402
from convpass.native.cudnn import api, arrays, descriptors, library

try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device", allow_module_level=True)
except Exception as e:  # noqa: BLE001
    pytest.skip(f"no usable CUDA device: {e}", allow_module_level=True)
try:
    CUDNN_VERSION = library.version()
except (CudnnNotFound, OSError) as e:
    pytest.skip(f"cuDNN is not loadable: {e}", allow_module_level=True)

REPORT: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    path = os.environ.get("CONVPASS_GPU_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "cudnn_version": CUDNN_VERSION,
                    "cudnn_path": library.path(),
                    "cudnn_source": library.source(),
                    "load_notes": library.diagnostics(),
                    "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                    "rows": REPORT,
                },
                f,
                indent=1,
            )


# -------------------------------------------------------------------------------------------------
# float64 NumPy reference
# -------------------------------------------------------------------------------------------------

_SP = "hwd"


def _slices(s: ConvShape, kr):
    out = s.output_spatial
    return tuple(
        slice(kr[i] * s.dilations[i], kr[i] * s.dilations[i] + (out[i] - 1) * s.strides[i] + 1, s.strides[i])
        for i in range(s.rank)
    )


def _padded(s: ConvShape):
    return tuple(n + 2 * p for n, p in zip(s.spatial, s.pads))


def ref_fwd(x, w, s: ConvShape):
    g, n, out, sp = s.groups, s.n, s.output_spatial, _SP[: s.rank]
    cg, kg = s.c // g, s.k // g
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in s.pads])
    y = np.zeros((n, g, kg, *out))
    for kr in itertools.product(*(range(k) for k in s.kernel)):
        xs = xp[(slice(None), slice(None)) + _slices(s, kr)].reshape(n, g, cg, *out)
        wk = w[(slice(None), slice(None)) + kr].reshape(g, kg, cg)
        y += np.einsum(f"ngc{sp},gkc->ngk{sp}", xs, wk)
    return y.reshape(n, s.k, *out)


def ref_dgrad(dy, w, s: ConvShape):
    g, n, out, sp = s.groups, s.n, s.output_spatial, _SP[: s.rank]
    cg, kg = s.c // g, s.k // g
    dxp = np.zeros((n, g, cg, *_padded(s)))
    dyg = dy.reshape(n, g, kg, *out)
    for kr in itertools.product(*(range(k) for k in s.kernel)):
        wk = w[(slice(None), slice(None)) + kr].reshape(g, kg, cg)
        dxp[(slice(None),) * 3 + _slices(s, kr)] += np.einsum(f"ngk{sp},gkc->ngc{sp}", dyg, wk)
    dxp = dxp.reshape(n, s.c, *_padded(s))
    return dxp[(slice(None), slice(None)) + tuple(slice(p, p + m) for p, m in zip(s.pads, s.spatial))]


def ref_wgrad(x, dy, s: ConvShape):
    g, n, out, sp = s.groups, s.n, s.output_spatial, _SP[: s.rank]
    cg, kg = s.c // g, s.k // g
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in s.pads])
    dyg = dy.reshape(n, g, kg, *out)
    dw = np.zeros((g, kg, cg, *s.kernel))
    for kr in itertools.product(*(range(k) for k in s.kernel)):
        xs = xp[(slice(None), slice(None)) + _slices(s, kr)].reshape(n, g, cg, *out)
        dw[(slice(None),) * 3 + kr] = np.einsum(f"ngc{sp},ngk{sp}->gkc", xs, dyg)
    return dw.reshape(s.k, cg, *s.kernel)


def test_reference_self_consistency():
    """<conv(x, w), dy> == <x, dgrad(dy, w)> == <w, wgrad(x, dy)> (adjointness), on CPU float64."""
    rng = np.random.default_rng(0)
    s = ConvShape("fwd", 2, 6, 4, (7, 6), (3, 2), (1, 1), (2, 1), (1, 2), groups=2)
    x, w, dy = rng.standard_normal(s.x_shape), rng.standard_normal(s.w_shape), rng.standard_normal(s.y_shape)
    a = np.vdot(ref_fwd(x, w, s), dy)
    assert np.isclose(a, np.vdot(x, ref_dgrad(dy, w, s)))
    assert np.isclose(a, np.vdot(w, ref_wgrad(x, dy, s)))


# -------------------------------------------------------------------------------------------------
# data in every dtype / layout
# -------------------------------------------------------------------------------------------------


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    b = a.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16_bits(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def make(shape, dtype: str, layout: str, rng):
    """Random device tensor (never zeros) and its exact float64 value."""
    a = rng.standard_normal(shape).astype(np.float32)
    if dtype == "float32":
        store = a
    elif dtype == "float16":
        store = a.astype(np.float16)
    else:
        store = _to_bf16_bits(a)
    exact = _from_bf16_bits(store) if dtype == "bfloat16" else store
    d = arrays.empty_like_layout(shape, dtype, layout)
    d[...] = cupy.asarray(store)
    return d, exact.astype(np.float64)


def poison(d, dtype: str):
    d.fill(0x7FC0 if dtype == "bfloat16" else np.nan)


def fetch(d, dtype: str) -> np.ndarray:
    h = cupy.asnumpy(d)
    return (_from_bf16_bits(h) if dtype == "bfloat16" else h).astype(np.float64)


def tolerance(key: ProblemKey, algo: str = "") -> float:
    """Normwise relative tolerance by data type and math mode.

    One measured exception: Winograd with kernels larger than 3 (cuDNN 9.19 ``winograd_nonfused``
    on 5x5, fp32, FMA math) is ~5e-4 off in all three directions -- the transform's own error, not
    TF32 -- so it gets 1e-3 instead of 1e-4.
    """
    if key.shape.dtype == "float16":
        return 1e-2
    if key.shape.dtype == "bfloat16":
        return 3e-2
    if key.math != "fma":
        return 3e-3  # TF32 allowed
    if algo.startswith("winograd") and max(key.shape.kernel) > 3:
        return 1e-3
    return 1e-4


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _shape(direction="fwd", **kw) -> ConvShape:
    base = dict(n=2, c=8, k=16, spatial=(12, 10), kernel=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1))
    base.update(kw)
    return ConvShape(direction=direction, **base)


S3 = dict(n=1, c=4, k=8, spatial=(6, 5, 7), kernel=(3, 3, 3), pads=(1, 1, 1), strides=(1, 1, 1), dilations=(1, 1, 1))
PROBLEMS = {
    "plain3x3_fma": (_shape(), "nchw", "fma"),
    "plain3x3_tf32": (_shape(), "nchw", "default"),
    "stride2": (_shape(k=8, spatial=(13, 11), strides=(2, 2)), "nchw", "fma"),
    "dilation2": (_shape(k=8, pads=(2, 2), dilations=(2, 2)), "nchw", "fma"),
    "groups2": (_shape(k=12, groups=2), "nchw", "fma"),
    "depthwise": (_shape(k=8, groups=8), "nchw", "fma"),
    "1x1": (_shape(c=16, k=8, spatial=(9, 7), kernel=(1, 1), pads=(0, 0)), "nchw", "default"),
    "1d_as_2d": (_shape(k=8, spatial=(1, 20), kernel=(1, 5), pads=(0, 2)), "nchw", "fma"),
    "5x5": (_shape(k=8, kernel=(5, 5), pads=(2, 2)), "nchw", "fma"),
    "3d": (ConvShape("fwd", **S3), "nchw", "fma"),
    # wide enough for tensor-core kernels: TF32 shows (~1e-4..1e-3) with default math and must
    # not with fma math (proves the math type reaches cuDNN)
    "tf32_c64": (_shape(c=64, k=64, spatial=(14, 14)), "nchw", "default"),
    "fma_c64": (_shape(c=64, k=64, spatial=(14, 14)), "nchw", "fma"),
    "nhwc_tf32_c64": (_shape(c=64, k=64, spatial=(14, 14)), "nhwc", "default"),
    "nhwc_fma_c64": (_shape(c=64, k=64, spatial=(14, 14)), "nhwc", "fma"),
    "fp16": (_shape(dtype="float16"), "nchw", "default"),
    "bf16": (_shape(dtype="bfloat16"), "nchw", "default"),
    "nhwc_fp32": (_shape(), "nhwc", "fma"),
    "nhwc_tf32_stride2": (_shape(k=8, spatial=(13, 11), strides=(2, 2)), "nhwc", "default"),
    "nhwc_fp16": (_shape(dtype="float16"), "nhwc", "default"),
    "nhwc_bf16": (_shape(dtype="bfloat16"), "nhwc", "default"),
    "nhwc_depthwise": (_shape(k=8, groups=8), "nhwc", "fma"),
    "3d_nhwc_fp16": (ConvShape("fwd", **S3, dtype="float16"), "nhwc", "default"),
}


def key_of(name: str, direction: str = "fwd") -> ProblemKey:
    shape, layout, math = PROBLEMS[name]
    return ProblemKey(shape.with_direction(direction), layout, math)


class Problem:
    """Descriptors plus random device tensors and their exact values for one problem key."""

    def __init__(self, key: ProblemKey, seed: int = 0) -> None:
        self.key = key
        self.s = key.shape
        self.dtype = key.shape.dtype
        self.descs = descriptors.ConvDescriptors(key)
        rng = np.random.default_rng(seed)
        self.x, self.x64 = make(self.s.x_shape, self.dtype, key.layout, rng)
        self.w, self.w64 = make(self.s.w_shape, self.dtype, key.layout, rng)
        self.y, self.y64 = make(self.s.y_shape, self.dtype, key.layout, rng)

    def reference(self, direction: str) -> np.ndarray:
        if direction == "fwd":
            return ref_fwd(self.x64, self.w64, self.s)
        if direction == "dgrad":
            return ref_dgrad(self.y64, self.w64, self.s)
        return ref_wgrad(self.x64, self.y64, self.s)

    def output(self, direction: str):
        return {"fwd": self.y, "dgrad": self.x, "wgrad": self.w}[direction]

    def run(self, direction: str, algo: str, **kw) -> np.ndarray:
        out = self.output(direction)
        poison(out, self.dtype)
        api.run(self.descs, direction, algo, self.x, self.w, self.y, **kw)
        cupy.cuda.get_current_stream().synchronize()
        return fetch(out, self.dtype)


# -------------------------------------------------------------------------------------------------
# the library
# -------------------------------------------------------------------------------------------------


def test_library_loaded():
    assert CUDNN_VERSION >= 90000
    assert os.path.exists(library.path())
    assert library.load() is library.load()


# -------------------------------------------------------------------------------------------------
# every algorithm of every direction against the reference
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", enums.DIRECTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_every_algorithm_matches_reference(name, direction):
    key = key_of(name, direction)
    p = Problem(key, seed=zlib.crc32(f"{name}/{direction}".encode()))
    ref = p.reference(direction)
    ran, failures = [], []
    for algo in enums.algo_names(direction):
        tol = tolerance(key, algo)
        row = {"problem": name, "key": str(key), "direction": direction, "algo": algo}
        REPORT.append(row)
        try:
            ws = api.workspace_size(p.descs, direction, algo)
        except CudnnError as e:
            row["workspace"] = e.status_name
            continue
        row["workspace"] = ws
        try:
            out = p.run(direction, algo, workspace=ws)
        except CudnnError as e:
            row["run"] = e.status_name
            if not e.not_supported:
                failures.append(f"{algo}: {e}")
            continue
        err = rel_err(out, ref)
        row["rel_err"] = err
        ran.append(algo)
        if not err <= tol:
            failures.append(f"{algo}: normwise relative error {err:.3g} > {tol:g}")
    assert ran, f"no {direction} algorithm ran {key}"
    assert not failures, f"{key}:\n" + "\n".join(failures)


# -------------------------------------------------------------------------------------------------
# heuristics and search
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", enums.DIRECTIONS)
@pytest.mark.parametrize("name", ["plain3x3_tf32", "nhwc_fp16"])
def test_heuristic_and_find_are_ranked(name, direction):
    key = key_of(name, direction)
    p = Problem(key)
    h = api.heuristic(p.descs, direction)
    assert h and h[0].ok, h
    assert all(e.algo in enums.algo_names(direction) for e in h)
    REPORT.append({"problem": name, "direction": direction, "heuristic": [dataclasses.asdict(e) for e in h]})

    found = api.find(p.descs, direction, p.x, p.w, p.y, workspace=64 << 20)
    ok = [e for e in found if e.ok]
    assert ok, found
    assert found[: len(ok)] == ok  # successful entries first
    times = [e.time_ms for e in ok]
    assert times == sorted(times) and times[0] >= 0
    REPORT.append({"problem": name, "direction": direction, "find": [dataclasses.asdict(e) for e in found]})

    best = ok[0]
    out = p.run(direction, best.algo, workspace=max(best.workspace_bytes, api.workspace_size(p.descs, direction, best.algo)))
    assert rel_err(out, p.reference(direction)) <= tolerance(key, best.algo)


def test_heuristic_direction_defaults_to_the_key():
    p = Problem(key_of("plain3x3_fma", "wgrad"))
    assert [e.algo for e in api.heuristic(p.descs)] == [e.algo for e in api.heuristic(p.descs, "wgrad")]


# -------------------------------------------------------------------------------------------------
# unsupported algorithms
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,direction,algo",
    [
        ("stride2", "fwd", "fft"),  # FFT needs unit stride
        ("5x5", "fwd", "winograd"),  # fused Winograd is 3x3 only
        ("plain3x3_fma", "wgrad", "winograd"),  # declared, never implemented
    ],
)
def test_unsupported_algorithm_raises_not_supported(name, direction, algo):
    p = Problem(key_of(name, direction))
    with pytest.raises(CudnnError) as ei:
        ws = api.workspace_size(p.descs, direction, algo)
        p.run(direction, algo, workspace=ws)  # only reached when the size query accepted it
    REPORT.append({"problem": name, "direction": direction, "algo": algo, "unsupported": str(ei.value)})
    assert ei.value.not_supported, str(ei.value)
    assert ei.value.call.startswith("cudnn")


# -------------------------------------------------------------------------------------------------
# alpha / beta, layouts, arrays
# -------------------------------------------------------------------------------------------------


def test_alpha_beta_accumulate():
    p = Problem(key_of("plain3x3_fma"))
    y0 = fetch(p.y, p.dtype)
    api.run(p.descs, "fwd", "implicit_gemm", p.x, p.w, p.y, alpha=2.0, beta=1.0)
    cupy.cuda.get_current_stream().synchronize()
    assert rel_err(fetch(p.y, p.dtype), 2 * ref_fwd(p.x64, p.w64, p.s) + y0) <= 1e-4


def test_layout_helpers_and_checks():
    a = arrays.empty_like_layout((2, 3, 4, 5), "float32", "nhwc")
    assert a.shape == (2, 3, 4, 5) and arrays.layout_of(a) == "nhwc"
    assert tuple(s // 4 for s in a.strides) == descriptors.strides_for((2, 3, 4, 5), "nhwc")
    b = arrays.as_layout(a, "nchw")
    assert arrays.layout_of(b) == "nchw" and arrays.as_layout(b, "nchw") is b
    assert arrays.empty_like_layout((1, 2, 3), "bfloat16", "nchw").dtype == np.uint16

    p = Problem(key_of("nhwc_fp32"))
    wrong = cupy.ascontiguousarray(p.x)  # NCHW memory for an NHWC problem
    with pytest.raises(ValueError, match="strides"):
        api.run(p.descs, "fwd", "implicit_gemm", wrong, p.w, p.y)
    with pytest.raises(ValueError, match="dtype"):
        api.run(p.descs, "fwd", "implicit_gemm", p.x.astype(cupy.float16), p.w, p.y)
    with pytest.raises(ValueError, match="shape"):
        api.run(p.descs, "fwd", "implicit_gemm", p.y, p.w, p.y)
    with pytest.raises(ValueError, match="valid names"):
        api.run(p.descs, "fwd", "algo_0", p.x, p.w, p.y)


def test_descriptors_close_and_context_manager():
    with descriptors.ConvDescriptors(key_of("3d")) as d:
        assert d.conv and d.x and d.w and d.y and d.bias and d.activation("relu")
    assert d.closed
    d.close()  # idempotent


# -------------------------------------------------------------------------------------------------
# fused conv + bias + activation
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain3x3_fma", "nhwc_fp16"])
def test_conv_bias_relu_equals_conv_then_bias_then_relu(name):
    key = key_of(name)
    p = Problem(key)
    rng = np.random.default_rng(7)
    bias, bias64 = make((1, p.s.k, 1, 1), p.dtype, "nchw", rng)
    bias = bias.reshape(p.s.k)  # a (k,) vector is accepted too
    z, z64 = make(p.s.y_shape, p.dtype, key.layout, rng)
    conv = ref_fwd(p.x64, p.w64, p.s)
    tol = tolerance(key)

    # unfused through cuDNN, then bias + relu in float64
    unfused = np.maximum(p.run("fwd", "implicit_precomp_gemm") + bias64, 0)
    assert rel_err(unfused, np.maximum(conv + bias64, 0)) <= tol

    results = {}
    for algo in enums.algo_names("fwd"):
        poison(p.y, p.dtype)
        try:
            api.conv_bias_activation_forward(p.descs, algo, p.x, p.w, p.y, bias, activation="relu")
            cupy.cuda.get_current_stream().synchronize()
        except CudnnError as e:
            results[algo] = e.status_name
            continue
        fused = fetch(p.y, p.dtype)
        results[algo] = rel_err(fused, unfused)
        assert results[algo] <= tol, (algo, results[algo])
    REPORT.append({"problem": name, "fused_relu": results})
    assert isinstance(results["implicit_precomp_gemm"], float), results

    # residual: relu(conv + z + bias)
    poison(p.y, p.dtype)
    api.conv_bias_activation_forward(p.descs, "implicit_precomp_gemm", p.x, p.w, p.y, bias, z=z)
    cupy.cuda.get_current_stream().synchronize()
    assert rel_err(fetch(p.y, p.dtype), np.maximum(conv + z64 + bias64, 0)) <= tol

    # identity: only with implicit_precomp_gemm
    poison(p.y, p.dtype)
    api.conv_bias_activation_forward(p.descs, "implicit_precomp_gemm", p.x, p.w, p.y, bias, activation="identity")
    cupy.cuda.get_current_stream().synchronize()
    assert rel_err(fetch(p.y, p.dtype), conv + bias64) <= tol
    with pytest.raises(ValueError, match="implicit_precomp_gemm"):
        api.conv_bias_activation_forward(p.descs, "gemm", p.x, p.w, p.y, bias, activation="identity")


# -------------------------------------------------------------------------------------------------
# inputs read from a channel slice of a larger buffer (a Concat's)
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tf32_c64", "fma_c64", "nhwc_tf32_c64", "nhwc_fma_c64", "nhwc_fp16", "fp16"])
@pytest.mark.parametrize("first", [0, 32], ids=["leading", "offset32"])
def test_every_algorithm_reads_a_channel_slice_through_its_strides_or_refuses(name, first):
    """``x`` a channel slice (channels ``first:first + c``) of a buffer of ``c + 32`` channels in
    the key's memory format, given with ``x_strides``: every forward algorithm, the plain call and
    cuDNN's fused bias + ReLU call, either refuses (a CudnnError, as the executor expects) or
    matches the float64 reference. Prints what this cuDNN takes; the report says it per algorithm."""
    key = key_of(name)
    p = Problem(key)
    s, total = p.s, p.s.c + 32
    rng = np.random.default_rng(9)
    big, big64 = make((s.n, total, *s.spatial), p.dtype, key.layout, rng)
    x, x64 = big[:, first:first + s.c], big64[:, first:first + s.c]
    assert arrays.channel_slice(x, key.layout) and arrays.layout_of(x) is None
    strides = tuple(v // x.itemsize for v in x.strides)
    bias, bias64 = make((1, s.k, 1, 1), p.dtype, "nchw", rng)
    bias = bias.reshape(s.k)
    conv = ref_fwd(x64, p.w64, s)
    taken: dict[str, object] = {}
    for algo in enums.algo_names("fwd"):
        for fused in (False, True):
            label = algo + ("+bias+relu" if fused else "")
            try:
                packed_ws = api.workspace_size(p.descs, "fwd", algo)
                ws = api.workspace_size(p.descs, "fwd", algo, x_strides=strides)
            except CudnnError as e:
                taken[label] = e.status_name
                continue
            poison(p.y, p.dtype)
            try:
                if fused:
                    api.conv_bias_activation_forward(p.descs, algo, x, p.w, p.y, bias, workspace=ws, x_strides=strides)
                else:
                    api.run(p.descs, "fwd", algo, x, p.w, p.y, workspace=ws, x_strides=strides)
                cupy.cuda.get_current_stream().synchronize()
            except CudnnError as e:
                taken[label] = e.status_name
                continue
            want = np.maximum(conv + bias64, 0) if fused else conv
            err = rel_err(fetch(p.y, p.dtype), want)
            taken[label] = f"ok err {err:.2g}" + (f", workspace {ws} B (packed {packed_ws} B)" if ws != packed_ws else "")
            assert err <= tolerance(key, algo), (label, err)
    REPORT.append({"problem": name, "x_slice_first_channel": first, "x_strides": strides, "slice_reads": taken})
    print(f"{name} slice at channel {first} of {total} (strides {strides}):")
    for label, what in taken.items():
        print(f"  {label}: {what}")


# -------------------------------------------------------------------------------------------------
# call listeners
# -------------------------------------------------------------------------------------------------


def test_call_listener_sees_every_execution():
    p = Problem(key_of("plain3x3_fma"))
    seen = []
    api.add_call_listener(seen.append)
    try:
        api.run(p.descs, "fwd", "implicit_gemm", p.x, p.w, p.y)
        api.run(p.descs, "wgrad", "algo_1", p.x, p.w, p.y)
        bias = cupy.ones(p.s.k, dtype=cupy.float32)
        api.conv_bias_activation_forward(p.descs, "implicit_precomp_gemm", p.x, p.w, p.y, bias)
        api.heuristic(p.descs, "fwd")  # queries are not executions
        api.workspace_size(p.descs, "dgrad", "algo_1")
    finally:
        api.remove_call_listener(seen.append)
    assert [(c.call, c.direction, c.algo) for c in seen] == [
        ("cudnnConvolutionForward", "fwd", "implicit_gemm"),
        ("cudnnConvolutionBackwardFilter", "wgrad", "algo_1"),
        ("cudnnConvolutionBiasActivationForward", "fwd", "implicit_precomp_gemm"),
    ]
    assert all(c.key == p.descs.key for c in seen)
    assert seen[0].stream == cupy.cuda.get_current_stream().ptr

    api.run(p.descs, "fwd", "gemm", p.x, p.w, p.y)  # removed: nothing more recorded
    assert len(seen) == 3
    with api.record_calls() as calls:
        with pytest.raises(CudnnError):  # a failed execution is not reported
            sp = Problem(key_of("stride2"))
            api.run(sp.descs, "fwd", "fft", sp.x, sp.w, sp.y, workspace=0)
        api.run(p.descs, "dgrad", "algo_1", p.x, p.w, p.y)
    cupy.cuda.get_current_stream().synchronize()
    assert [(c.call, c.algo) for c in calls] == [("cudnnConvolutionBackwardData", "algo_1")]


# -------------------------------------------------------------------------------------------------
# handles and threads
# -------------------------------------------------------------------------------------------------


def test_handles_per_thread_and_stream():
    h1 = api.get_handle()
    assert api.get_handle() is h1
    s = cupy.cuda.Stream(non_blocking=True)
    assert api.get_handle(s) is h1 and h1.stream == s.ptr
    api.get_handle()  # back to the current stream
    assert h1.stream == cupy.cuda.get_current_stream().ptr

    key = key_of("plain3x3_tf32")
    ref = None
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            p = Problem(key, seed=1)
            cupy.cuda.Device().synchronize()  # uploads ran on the legacy stream
            with cupy.cuda.Stream(non_blocking=True) as stream:
                h = api.get_handle()
                assert h.stream == stream.ptr
                outs = []
                for _ in range(20):
                    poison(p.y, p.dtype)
                    api.run(p.descs, "fwd", "implicit_precomp_gemm", p.x, p.w, p.y)
                    stream.synchronize()
                    outs.append(fetch(p.y, p.dtype))
                results[i] = (h.ptr, threading.get_ident(), outs, p.reference("fwd"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ptrs = {r[0] for r in results.values()}
    assert len(ptrs) == 2 and h1.ptr not in ptrs
    for _, _, outs, ref in results.values():
        for out in outs:
            assert rel_err(out, ref) <= tolerance(key)


def test_a_handle_made_ahead_by_another_thread_is_taken_over_by_its_thread():
    key = key_of("plain3x3_tf32")
    errors: list[BaseException] = []

    def work():
        me = threading.get_ident()
        helper = threading.Thread(target=api.make_handle_for, args=(threading.current_thread(), 0))
        helper.start()
        helper.join()
        try:
            made = api._made_ahead[(me, 0)]
            with cupy.cuda.Device(0):
                h = api.get_handle()
            assert h is made and h.thread == me and (me, 0) not in api._made_ahead
            api.make_handle_for(threading.current_thread(), 0)  # it has one now: nothing is made
            assert (me, 0) not in api._made_ahead
            p = Problem(key, seed=1)
            cupy.cuda.Device().synchronize()
            api.run(p.descs, "fwd", "implicit_precomp_gemm", p.x, p.w, p.y)
            cupy.cuda.Device().synchronize()
            assert rel_err(fetch(p.y, p.dtype), p.reference("fwd")) <= tolerance(key)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=work)  # a fresh thread: it has no handle of its own yet
    t.start()
    t.join()
    assert not errors, errors
