"""CPU tests of the cuDNN binding's pure-Python parts: enums, errors, descriptor derivation, discovery.

Nothing here needs CuPy, a GPU or cuDNN.
"""

from __future__ import annotations

import pickle
import sys

import pytest

from convpass.core import cudnn_enums as enums
from convpass.core.cudnn_enums import CudnnError, CudnnNotFound
from convpass.core.problem import ConvShape, ProblemKey
from convpass.native.cudnn import library
from convpass.native.cudnn.descriptors import descriptor_params, strides_for


def test_import_does_not_need_cupy_or_cudnn():
    import subprocess

    code = (
        "import sys, convpass.native.cudnn as c; from convpass.native.cudnn import library; "
        "assert 'cupy' not in sys.modules, 'cupy imported'; assert library._state is None, 'cuDNN loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- algorithms ----------------------------------------------------------------------------------


def test_forward_algorithm_table_matches_cudnn_headers():
    assert {n: enums.algo_id("fwd", n) for n in enums.algo_names("fwd")} == {
        "implicit_gemm": 0,
        "implicit_precomp_gemm": 1,
        "gemm": 2,
        "direct": 3,
        "fft": 4,
        "fft_tiling": 5,
        "winograd": 6,
        "winograd_nonfused": 7,
    }


def test_backward_data_algorithm_table_matches_cudnn_headers():
    assert {n: enums.algo_id("dgrad", n) for n in enums.algo_names("dgrad")} == {
        "algo_0": 0,
        "algo_1": 1,
        "fft": 2,
        "fft_tiling": 3,
        "winograd": 4,
        "winograd_nonfused": 5,
    }


def test_backward_filter_algorithm_table_matches_cudnn_headers():
    assert {n: enums.algo_id("wgrad", n) for n in enums.algo_names("wgrad")} == {
        "algo_0": 0,
        "algo_1": 1,
        "fft": 2,
        "algo_3": 3,
        "winograd": 4,
        "winograd_nonfused": 5,
        "fft_tiling": 6,
    }
    assert not enums.is_implemented("wgrad", "winograd")
    assert "winograd" not in enums.algo_names("wgrad", implemented_only=True)
    assert len(enums.algo_names("wgrad", implemented_only=True)) == 6


def test_cudnn_enumerator_names():
    assert enums.algo_info("fwd", "implicit_precomp_gemm").cudnn_name == "CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM"
    assert enums.algo_info("dgrad", "algo_1").cudnn_name == "CUDNN_CONVOLUTION_BWD_DATA_ALGO_1"
    assert enums.algo_info("wgrad", "fft_tiling").cudnn_name == "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING"
    # the C name and odd casing resolve to the canonical name
    assert enums.algo_id("fwd", "CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED") == 7
    assert enums.algo_id("fwd", " Winograd ") == 6


@pytest.mark.parametrize("direction", enums.DIRECTIONS)
def test_name_id_round_trip(direction):
    names = enums.algo_names(direction)
    for i, name in enumerate(names):
        assert enums.algo_id(direction, name) == i
        assert enums.algo_name(direction, i) == name
    with pytest.raises(ValueError):
        enums.algo_name(direction, len(names))
    with pytest.raises(ValueError):
        enums.algo_name(direction, -1)


def test_determinism():
    assert all(enums.is_deterministic("fwd", n) for n in enums.algo_names("fwd"))
    nondet = {(d, n) for d in enums.DIRECTIONS for n in enums.algo_names(d) if not enums.is_deterministic(d, n)}
    assert nondet == {("dgrad", "algo_0"), ("wgrad", "algo_0"), ("wgrad", "algo_3")}


def test_unknown_algorithm_lists_valid_names():
    with pytest.raises(ValueError) as ei:
        enums.algo_id("dgrad", "implicit_gemm")
    msg = str(ei.value)
    assert "implicit_gemm" in msg and "dgrad" in msg
    for name in enums.algo_names("dgrad"):
        assert name in msg


def test_unknown_direction():
    with pytest.raises(ValueError, match="fwd"):
        enums.algo_names("backward")


# -- math, data types, formats --------------------------------------------------------------------


def test_math_types():
    assert enums.MATH_TYPES == {"default": 0, "tensor_op": 1, "tensor_op_allow_conversion": 2, "fma": 3}
    from convpass.core.problem import MATH_MODES

    for m in MATH_MODES:  # every convpass math mode maps to a cuDNN math type
        assert enums.math_name(enums.math_type(m)) == m
    with pytest.raises(ValueError):
        enums.math_type("tf32")


def test_data_types_and_formats():
    assert enums.data_type("float32") == 0  # CUDNN_DATA_FLOAT
    assert enums.data_type("float16") == 2  # CUDNN_DATA_HALF
    assert enums.data_type("bfloat16") == 9  # CUDNN_DATA_BFLOAT16
    assert enums.COMPUTE_TYPE == 0  # float accumulation for all
    assert enums.tensor_format("nchw") == 0 and enums.tensor_format("nhwc") == 1
    assert enums.CUDNN_CROSS_CORRELATION == 1
    assert enums.ACTIVATION_MODES["relu"] == 1 and enums.ACTIVATION_MODES["identity"] == 5
    with pytest.raises(ValueError):
        enums.data_type("float64")


# -- status codes and the exception --------------------------------------------------------------


def test_status_table():
    s = enums.STATUS
    assert s["CUDNN_STATUS_SUCCESS"] == 0
    assert s["CUDNN_STATUS_NOT_INITIALIZED"] == 1001
    assert s["CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED"] == 1008
    assert s["CUDNN_STATUS_BAD_PARAM"] == 2000
    assert s["CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE"] == 2012
    assert s["CUDNN_STATUS_NOT_SUPPORTED"] == 3000
    assert s["CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API"] == 3013
    assert s["CUDNN_STATUS_INTERNAL_ERROR"] == 4000
    assert s["CUDNN_STATUS_EXECUTION_FAILED_CURAND"] == 5004
    assert len(set(s.values())) == len(s)  # no duplicate codes
    assert enums.status_name(3002) == "CUDNN_STATUS_NOT_SUPPORTED_SHAPE"
    assert enums.status_name(4242) == "CUDNN_STATUS_UNKNOWN"


def test_cudnn_error_message_and_fields():
    e = CudnnError(3000, "cudnnConvolutionForward")
    assert str(e) == "cudnnConvolutionForward failed: CUDNN_STATUS_NOT_SUPPORTED (3000)"
    assert e.status == 3000 and e.status_name == "CUDNN_STATUS_NOT_SUPPORTED" and e.call == "cudnnConvolutionForward"
    assert e.not_supported and e.category == 3000
    e2 = CudnnError(3002, "cudnnGetConvolutionForwardWorkspaceSize", detail="winograd needs 3x3")
    assert e2.not_supported
    assert str(e2).splitlines()[0] == (
        "cudnnGetConvolutionForwardWorkspaceSize failed: CUDNN_STATUS_NOT_SUPPORTED_SHAPE (3002)"
    )
    assert "winograd needs 3x3" in str(e2)
    e3 = CudnnError(2000, "cudnnSetTensorNdDescriptor")
    assert not e3.not_supported and e3.status_name == "CUDNN_STATUS_BAD_PARAM"
    back = pickle.loads(pickle.dumps(e2))
    assert (back.status, back.call, back.detail) == (3002, e2.call, e2.detail)


# -- descriptor parameters ------------------------------------------------------------------------


def _key(layout="nchw", math="default", **kw) -> ProblemKey:
    base = dict(
        direction="fwd", n=2, c=8, k=16, spatial=(10, 12), kernel=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1)
    )
    base.update(kw)
    return ProblemKey(ConvShape(**base), layout, math)


def test_strides_for():
    assert strides_for((2, 3, 4, 5), "nchw") == (60, 20, 5, 1)
    assert strides_for((2, 3, 4, 5), "nhwc") == (60, 1, 15, 3)
    assert strides_for((2, 3, 4, 5, 6), "nhwc") == (360, 1, 90, 18, 3)
    assert strides_for((2, 3, 4, 5, 6), "nchw") == (360, 120, 30, 6, 1)
    with pytest.raises(ValueError):
        strides_for((2, 3, 4, 5), "chwn")


def test_params_plain_nchw():
    p = descriptor_params(_key())
    assert p.nb_dims == 4
    assert p.x.dims == (2, 8, 10, 12) and p.x.strides == (960, 120, 12, 1)
    assert p.w.dims == (16, 8, 3, 3) and p.w.strides == (72, 9, 3, 1)
    assert p.y.dims == (2, 16, 10, 12) and p.y.strides == (1920, 120, 12, 1)
    assert p.bias.dims == (1, 16, 1, 1)
    assert p.tensor_format == enums.CUDNN_TENSOR_NCHW
    assert (p.pads, p.strides, p.dilations, p.groups) == ((1, 1), (1, 1), (1, 1), 1)
    assert p.mode == enums.CUDNN_CROSS_CORRELATION
    assert p.data_type == enums.CUDNN_DATA_FLOAT and p.compute_type == enums.CUDNN_DATA_FLOAT
    assert p.math_type == 0


def test_params_nhwc_strides_and_filter_format():
    p = descriptor_params(_key(layout="nhwc", math="fma"))
    assert p.x.dims == (2, 8, 10, 12)  # dims stay logical NCHW
    assert p.x.strides == (960, 1, 96, 8)
    assert p.y.strides == (1920, 1, 192, 16)
    assert p.w.strides == (72, 1, 24, 8)  # filter stored k, r, s, c
    assert p.tensor_format == enums.CUDNN_TENSOR_NHWC
    assert p.bias.strides == (16, 1, 16, 16)
    assert p.math_type == enums.MATH_TYPES["fma"]


def test_params_3d():
    k = _key(spatial=(6, 7, 8), kernel=(3, 3, 3), pads=(1, 1, 1), strides=(2, 1, 1), dilations=(1, 1, 1))
    p = descriptor_params(k)
    assert p.nb_dims == 5
    assert p.x.dims == (2, 8, 6, 7, 8)
    assert p.y.dims == (2, 16, 3, 7, 8)
    assert p.w.dims == (16, 8, 3, 3, 3)
    assert p.bias.dims == (1, 16, 1, 1, 1)
    assert p.strides == (2, 1, 1)
    pn = descriptor_params(dataclasses_replace(k, layout="nhwc"))
    assert pn.x.strides == (6 * 7 * 8 * 8, 1, 7 * 8 * 8, 8 * 8, 8)


def dataclasses_replace(key, **kw):
    import dataclasses

    return dataclasses.replace(key, **kw)


def test_params_groups_and_depthwise_filter_dims():
    p = descriptor_params(_key(c=8, k=12, groups=2))
    assert p.w.dims == (12, 4, 3, 3) and p.groups == 2
    dw = descriptor_params(_key(c=8, k=8, groups=8))
    assert dw.w.dims == (8, 1, 3, 3) and dw.groups == 8
    assert dw.key.shape.is_depthwise


def test_params_dilation_and_stride():
    p = descriptor_params(_key(spatial=(13, 13), pads=(2, 2), dilations=(2, 2), strides=(2, 2)))
    assert p.dilations == (2, 2) and p.strides == (2, 2) and p.pads == (2, 2)
    # (13 + 4 - 2*2 - 1) // 2 + 1 = 7
    assert p.y.dims == (2, 16, 7, 7)


def test_params_1d_mapped_to_2d():
    p = descriptor_params(_key(spatial=(1, 20), kernel=(1, 5), pads=(0, 2)))
    assert p.x.dims == (2, 8, 1, 20) and p.w.dims == (16, 8, 1, 5) and p.y.dims == (2, 16, 1, 20)


@pytest.mark.parametrize("dtype,code", [("float16", 2), ("bfloat16", 9), ("float32", 0)])
def test_params_half_types_compute_in_float(dtype, code):
    p = descriptor_params(_key(dtype=dtype))
    assert p.data_type == code
    assert p.compute_type == enums.CUDNN_DATA_FLOAT


def test_params_direction_does_not_change_descriptors():
    a = descriptor_params(_key(direction="fwd"))
    b = descriptor_params(_key(direction="wgrad"))
    assert (a.x, a.w, a.y, a.pads) == (b.x, b.w, b.y, b.pads)


def test_params_rejects_non_keys():
    with pytest.raises(TypeError):
        descriptor_params("fwd|n=1")


# -- library discovery ----------------------------------------------------------------------------


@pytest.fixture
def no_cudnn_anywhere(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "libcudnn.so.9"
    monkeypatch.setenv(library.ENV_VAR, str(missing))
    monkeypatch.setattr(library, "_wheel_dirs", lambda: [])
    monkeypatch.setattr(library, "_find_system_library", lambda: None)

    def refuse(path, mode):
        raise OSError(f"{path}: cannot open shared object file")

    monkeypatch.setattr(library, "_dlopen", refuse)
    monkeypatch.setattr(library, "_state", None)
    return missing


def test_not_found_message_lists_every_place_and_the_fix(no_cudnn_anywhere):
    with pytest.raises(CudnnNotFound) as ei:
        library.load()
    msg = str(ei.value)
    assert library.ENV_VAR in msg and str(no_cudnn_anywhere) in msg and "file does not exist" in msg
    assert "nvidia-cudnn-cu13" in msg
    assert "find_library" in msg
    assert "libcudnn.so.9" in msg and "cannot open shared object file" in msg
    assert "pip install 'convpass[gpu]'" in msg
    assert msg.index(library.ENV_VAR) < msg.index("wheel") < msg.index("find_library")  # search order
    with pytest.raises(CudnnNotFound):
        library.version()


def test_discovery_order(monkeypatch, tmp_path):
    env_lib = tmp_path / "env" / "libcudnn.so.9"
    wheel_dir = tmp_path / "site" / "nvidia" / "cudnn" / "lib"
    monkeypatch.setenv(library.ENV_VAR, str(env_lib))
    monkeypatch.setattr(library, "_wheel_dirs", lambda: [wheel_dir])
    monkeypatch.setattr(library, "_find_system_library", lambda: "libcudnn.so.9")
    c = library.candidates()
    assert [src for src, _, _ in c][0] == f"${library.ENV_VAR}"
    assert c[0][1] == str(env_lib) and c[0][2]
    assert c[1][1] == str(wheel_dir / "libcudnn.so.9") and "wheel" in c[1][0]
    assert c[2][1] == "libcudnn.so.9" and not c[2][2]
    assert c[-1][1] == "libcudnn.so.9"


def test_env_var_may_name_a_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(library.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(library, "_wheel_dirs", lambda: [])
    assert library.candidates()[0][1] == str(tmp_path / "libcudnn.so.9")


def test_preload_order_and_first_loadable_wins(monkeypatch, tmp_path):
    """A file candidate preloads its folder's sub-libraries (graph first) before the shim."""
    folder = tmp_path / "nvidia" / "cudnn" / "lib"
    folder.mkdir(parents=True)
    for name in (*library.SUBLIBRARIES, library.SONAME):
        (folder / name).write_bytes(b"")
    opened: list[str] = []

    class FakeFn:
        restype = argtypes = None

        def __call__(self):
            return 91900

    class FakeCDLL:
        cudnnGetVersion = FakeFn()

    def fake_dlopen(path, mode):
        opened.append(path.rsplit("/", 1)[-1])
        return FakeCDLL()

    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.setattr(library, "_wheel_dirs", lambda: [folder])
    monkeypatch.setattr(library, "_dlopen", fake_dlopen)
    monkeypatch.setattr(library, "_state", None)
    library.load()
    assert opened[0] == "libcudnn_graph.so.9"
    assert opened[-1] == library.SONAME
    assert opened.index("libcudnn_ops.so.9") < opened.index("libcudnn_cnn.so.9")
    assert library.path() == str(folder / library.SONAME)
    assert library.version() == 91900
    assert any("preload libcudnn_cnn.so.9: ok" in n for n in library.diagnostics())


def test_old_cudnn_is_skipped(monkeypatch):
    class FakeFn:
        restype = argtypes = None

        def __call__(self):
            return 8902

    class FakeCDLL:
        cudnnGetVersion = FakeFn()

    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.setattr(library, "_wheel_dirs", lambda: [])
    monkeypatch.setattr(library, "_find_system_library", lambda: "libcudnn.so.8")
    monkeypatch.setattr(library, "_dlopen", lambda path, mode: FakeCDLL())
    monkeypatch.setattr(library, "_state", None)
    with pytest.raises(CudnnNotFound, match="needs cuDNN 9"):
        library.load()
