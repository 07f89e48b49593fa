"""The kernel side-car (convpass.core.kernel_file), the seam under CuPy's compiler (prebuilt, with a
stand-in CuPy: no GPU here), and how the executor, ``optimize`` and ``convpass compile`` use them."""

from __future__ import annotations

import hashlib
import sys
import types
import zipfile

import onnx
import pytest
from conftest import conv_model, random_input

import convpass
from convpass.compiler.aot import KernelReport, parse_archs
from convpass.core import kernel_file
from convpass.core.errors import ConvpassError
from convpass.core.kernel_file import KernelEntry, KernelFileError
from convpass.native import prebuilt
from convpass.runtime import Executor

ENTRIES = [KernelEntry("a" * 32, "90", "cupy_copy", b"\x7fELF binary one"), KernelEntry("b" * 32, "80", "norm_block", b"another binary")]


def _write(path, entries=ENTRIES, model_sha256="0" * 64, verified=True, **recorded):
    return kernel_file.write(path, entries, model_sha256=model_sha256, verified=verified, cupy_version="14.2.0", **recorded)


HERE = {"recorded_arch": "90", "model_profiles": True}  # what `optimize` records on the (fake) sm_90 GPU


def test_round_trip(tmp_path):
    out = _write(tmp_path / "m.onnx.kernels")
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx.kernels"]  # no temporary file left
    kf = kernel_file.read(out, model_sha256="0" * 64)
    assert kf.verified and kf.cupy_version == "14.2.0" and kf.archs == ["80", "90"]
    assert kf.entries == {(e.key, e.arch): e for e in ENTRIES}


def test_sidecar_path():
    assert kernel_file.sidecar_path("dir/model.tuned.onnx").as_posix() == "dir/model.tuned.onnx.kernels"


def test_another_models_sidecar_is_refused(tmp_path):
    out = _write(tmp_path / "k", model_sha256="1" * 64)
    with pytest.raises(KernelFileError, match="written for another model"):
        kernel_file.read(out, model_sha256="2" * 64)


@pytest.mark.parametrize("damage", ["truncated", "not a zip", "payload altered", "no manifest", "other format", "member missing"])
def test_damaged_sidecars_are_refused_with_the_reason(tmp_path, damage):
    out = _write(tmp_path / "k")
    data = out.read_bytes()
    if damage == "truncated":
        out.write_bytes(data[: len(data) // 2])
        match = "not a zip|unreadable"
    elif damage == "not a zip":
        out.write_bytes(b"hello")
        match = "not a zip"
    else:
        with zipfile.ZipFile(out) as z:
            members = {n: z.read(n) for n in z.namelist()}
        if damage == "payload altered":
            members[ENTRIES[0].file] = b"tampered"
            match = "does not match its SHA-256"
        elif damage == "no manifest":
            del members["manifest.json"]
            match = "no manifest.json"
        elif damage == "other format":
            members["manifest.json"] = members["manifest.json"].replace(b"convpass.kernels/1", b"convpass.kernels/9")
            match = "format 'convpass.kernels/9'"
        else:
            del members[ENTRIES[1].file]
            match = "is missing"
        with zipfile.ZipFile(out, "w") as z:
            for n, b in members.items():
                z.writestr(n, b)
    with pytest.raises(KernelFileError, match=match):
        kernel_file.read(out)


def test_parse_archs():
    assert parse_archs("80, sm_90,sm100,9.0") == ["80", "90", "100"]
    assert parse_archs("") == []
    with pytest.raises(ConvpassError, match="not a GPU architecture"):
        parse_archs("hopper")


def test_kernel_key_ignores_include_paths_and_nothing_else():
    k = prebuilt.kernel_key("src", ("-I/a/cupy/include", "-std=c++17"), {"extra_source": "hdr"}, "14.2.0")
    assert k == prebuilt.kernel_key("src", ("-I/elsewhere/include", "-std=c++17"), {"extra_source": "hdr"}, "14.2.0")
    for other in (
        prebuilt.kernel_key("src2", ("-std=c++17",), {"extra_source": "hdr"}, "14.2.0"),
        prebuilt.kernel_key("src", ("-std=c++14",), {"extra_source": "hdr"}, "14.2.0"),
        prebuilt.kernel_key("src", ("-std=c++17",), {"extra_source": "hdr2"}, "14.2.0"),
        prebuilt.kernel_key("src", ("-std=c++17",), {"extra_source": "hdr"}, "14.3.0"),
    ):
        assert other != k
    assert prebuilt.kernel_label('extern "C" __global__ void cupy_copy(float* x) {}') == "cupy_copy"


# ------------------------------------------------------------------------------------------------
# the seam, over a stand-in for CuPy's compiler module


class _Module:
    loaded: list[bytes] = []

    def load(self, payload: bytes) -> None:
        if payload.startswith(b"sm80"):
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")  # a binary of another architecture
        _Module.loaded.append(payload)


class _DiskCache:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def load(self, name):
        return self.files.get(name)

    def save(self, name, payload, source=None):
        self.files[name] = payload


@pytest.fixture
def fake_cupy(monkeypatch):
    """A CuPy whose compiler 'compiles' a source to b'sm<arch>:' + source, through its cache backend."""
    compiled: list[str] = []
    compiler = types.ModuleType("cupy.cuda.compiler")
    compiler._kernel_cache_backend = _DiskCache()

    def compile_module(source, options=(), *, arch=None, **kwargs):
        arch = arch or "90"
        name = hashlib.md5(f"{source}{options}{arch}".encode()).hexdigest()
        payload = compiler._kernel_cache_backend.load(name)
        if payload is None:
            compiled.append(source)
            payload = f"sm{arch}:{source}".encode()
            compiler._kernel_cache_backend.save(name, payload, source)
        m = _Module()
        m.load(payload)
        return m

    compiler._compile_module_with_cache = compile_module
    function = types.ModuleType("cupy.cuda.function")
    function.Module = _Module
    device = types.ModuleType("cupy.cuda.device")
    device.Device = lambda: types.SimpleNamespace(compute_capability="90")
    cuda = types.ModuleType("cupy.cuda")
    cuda.compiler, cuda.function, cuda.device = compiler, function, device
    cupy = types.ModuleType("cupy")
    cupy.__version__, cupy.cuda = "14.2.0", cuda
    for name, mod in {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.compiler": compiler, "cupy.cuda.function": function, "cupy.cuda.device": device}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(prebuilt, "_STATE", {"installed": None})
    monkeypatch.setattr(prebuilt, "_LOADED", {})
    monkeypatch.setattr(prebuilt, "COMPILATIONS", [])
    _Module.loaded = []
    assert prebuilt.install() is None
    return types.SimpleNamespace(compiler=compiler, compiled=compiled)


SRC_A = 'extern "C" __global__ void kern_a() {}'
SRC_B = 'extern "C" __global__ void kern_b() {}'


def test_seam_counts_compilations_and_records_binaries_for_other_archs(fake_cupy):
    with prebuilt.recording() as rec:
        fake_cupy.compiler._compile_module_with_cache(SRC_A, ("-I/x",))
        fake_cupy.compiler._compile_module_with_cache(SRC_A, ("-I/x",))  # CuPy's own cache: loaded, not compiled
        failed = prebuilt.compile_for(rec, ["80"])
    assert prebuilt.COMPILATIONS == ["kern_a", "kern_a"]  # every call that did not come from a side-car
    assert fake_cupy.compiled == [SRC_A, SRC_A]  # once for sm_90, once for sm_80
    assert failed == []
    assert sorted(e.arch for e in rec.entries.values()) == ["80", "90"]
    assert {e.payload for e in rec.entries.values()} == {b"sm90:" + SRC_A.encode(), b"sm80:" + SRC_A.encode()}


def test_seam_loads_sidecar_binaries_without_compiling(fake_cupy, tmp_path):
    with prebuilt.recording() as rec:
        fake_cupy.compiler._compile_module_with_cache(SRC_A, ("-I/x",))
    side = _write(tmp_path / "k", rec.entries.values())
    fake_cupy.compiler._kernel_cache_backend = _DiskCache()  # a fresh machine: CuPy's cache is empty
    prebuilt.COMPILATIONS.clear()
    prebuilt.use(kernel_file.read(side))
    fake_cupy.compiler._compile_module_with_cache(SRC_A, ("-I/installed/elsewhere",))
    assert prebuilt.COMPILATIONS == [] and _Module.loaded[-1] == b"sm90:" + SRC_A.encode()
    fake_cupy.compiler._compile_module_with_cache(SRC_B, ())  # not in the side-car: compiled, counted
    assert prebuilt.COMPILATIONS == ["kern_b"]


def test_seam_compiles_when_a_stored_binary_does_not_load(fake_cupy, tmp_path):
    key = prebuilt.kernel_key(SRC_A, (), {}, "14.2.0")
    prebuilt.use(kernel_file.read(_write(tmp_path / "k", [KernelEntry(key, "90", "kern_a", b"sm80:wrong image")])))
    with pytest.warns(UserWarning, match="prebuilt kernel kern_a .* did not load"):
        fake_cupy.compiler._compile_module_with_cache(SRC_A, ())
    assert prebuilt.COMPILATIONS == ["kern_a"]


def test_a_cupy_without_the_private_compiler_api_is_said_plainly(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(__version__="99.0", cuda=types.SimpleNamespace()))
    monkeypatch.setitem(sys.modules, "cupy.cuda", types.ModuleType("cupy.cuda"))
    monkeypatch.setitem(sys.modules, "cupy.cuda.compiler", types.ModuleType("cupy.cuda.compiler"))
    monkeypatch.setitem(sys.modules, "cupy.cuda.function", types.ModuleType("cupy.cuda.function"))
    monkeypatch.setattr(prebuilt, "_STATE", {"installed": None})
    assert "CuPy 99.0 has no _compile_module_with_cache" in prebuilt.install()


# ------------------------------------------------------------------------------------------------
# the executor, optimize and compile around it


def _model_file(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), path)
    return path


def test_executor_checks_the_model_a_verified_sidecar_vouches_for(tmp_path, monkeypatch):
    path = _model_file(tmp_path)
    calls = []
    monkeypatch.setattr(onnx.checker, "check_model", lambda *a, **k: calls.append(a))
    assert not Executor(path).trusted and len(calls) == 1  # no side-car: checked
    _write(kernel_file.sidecar_path(path), model_sha256=kernel_file.file_sha256(path))
    ex = Executor(path)
    assert ex.trusted and ex.kernel_file is not None and len(calls) == 2  # the side-car's word is checked, not taken
    x = random_input((1, 3, 8, 8))
    assert ex.run(None, {"x": x})[0].shape == (1, 4, 6, 6)


def test_executor_refuses_a_sidecar_of_another_model_and_checks_the_model(tmp_path, monkeypatch):
    path = _model_file(tmp_path)
    _write(kernel_file.sidecar_path(path), model_sha256="f" * 64)
    calls = []
    monkeypatch.setattr(onnx.checker, "check_model", lambda *a, **k: calls.append(a))
    ex = Executor(path)
    assert ex.kernel_file is None and not ex.trusted and len(calls) == 1
    unverified = tmp_path / "other.kernels"
    _write(unverified, model_sha256=kernel_file.file_sha256(path), verified=False)
    ex = Executor(path, kernels=unverified)
    assert ex.kernel_file is not None and not ex.trusted and len(calls) == 2


def test_compile_without_a_gpu_says_why(tmp_path, capsys):
    from convpass.cli.main import main

    path = _model_file(tmp_path)
    assert main(["compile", str(path), "--arch", "90"]) == 1
    err = capsys.readouterr().err
    assert "needs a GPU" in err and "convpass compile" in err
    assert not kernel_file.sidecar_path(path).exists()


def test_describe_says_what_the_executor_would_take(tmp_path, capsys):
    from convpass.cli.main import main

    path = _model_file(tmp_path)
    assert "no m.onnx.kernels beside the model" in kernel_file.describe(path)
    _write(kernel_file.sidecar_path(path), model_sha256=kernel_file.file_sha256(path))
    assert kernel_file.describe(path) == ("kernels: m.onnx.kernels, 2 kernel(s) (sm_80: 1, sm_90: 1), verified on the GPU before "
                                          f"writing; convpass {convpass.__version__}, CuPy 14.2.0")
    assert main(["inspect", str(path)]) == 0
    assert "kernels: m.onnx.kernels, 2 kernel(s)" in capsys.readouterr().out
    _write(kernel_file.sidecar_path(path), model_sha256="e" * 64)
    assert kernel_file.describe(path).startswith("kernels: refused, ") and "written for another model" in kernel_file.describe(path)


# ------------------------------------------------------------------------------------------------
# a cached re-run of optimize keeps the side-car it would write again


def _plan_entry(cudnn="91900", frontend="1.32.0"):
    head = {"format": "convpass.engine-plan/1", "cudnn": cudnn, "frontend": frontend, "key": "k", "algo": "engine:eng0"}
    import json

    return KernelEntry("plan-" + "c" * 27, "90", kernel_file.PLAN_PREFIX + "engine:eng0", json.dumps(head).encode() + b"\n" + b"blob")


@pytest.fixture
def graph_api_here(monkeypatch):
    from convpass.native.cudnn import graph_api

    monkeypatch.setattr(graph_api, "unavailable", lambda: None)
    monkeypatch.setattr(graph_api, "versions", lambda: {"cudnn": "91900", "frontend": "1.32.0"})


def test_a_sidecar_is_kept_only_when_compiling_again_would_write_the_same(fake_cupy, graph_api_here, tmp_path):
    from convpass.compiler.aot import current_sidecar

    path = _model_file(tmp_path)
    side = kernel_file.sidecar_path(path)
    assert current_sidecar(path) is None  # none there
    digest = kernel_file.file_sha256(path)
    _write(side, ENTRIES + [_plan_entry()], model_sha256=digest, **HERE)
    assert current_sidecar(path) == f"{side}: kept, written for this exact model by this convpass and CuPy (2 kernel(s) and 1 cuDNN plan(s) for sm_90)"
    refused = {
        "another model": lambda: _write(side, model_sha256="e" * 64, **HERE),
        "not verified": lambda: _write(side, model_sha256=digest, verified=False, **HERE),
        "built on another GPU, cross-compiled for this one": lambda: _write(side, model_sha256=digest, recorded_arch="80", model_profiles=True),
        "no record of the GPU it was built on (an older side-car)": lambda: _write(side, model_sha256=digest, model_profiles=True),
        "built for shapes given to convpass compile": lambda: _write(side, model_sha256=digest, recorded_arch="90"),
        "another CuPy": lambda: kernel_file.write(side, ENTRIES, model_sha256=digest, verified=True, cupy_version="13.6.0", **HERE),
        "another cuDNN's plan": lambda: _write(side, ENTRIES + [_plan_entry(cudnn="91000")], model_sha256=digest, **HERE),
        "another frontend's plan": lambda: _write(side, ENTRIES + [_plan_entry(frontend="1.31.0")], model_sha256=digest, **HERE),
    }
    for why, write in refused.items():
        write()
        assert current_sidecar(path) is None, why
    from convpass.core import version as version_module

    saved = version_module.__version__
    try:
        version_module.__version__ = "0.0.1"
        _write(side, model_sha256=digest, **HERE)
    finally:
        version_module.__version__ = saved
    assert current_sidecar(path) is None, "another convpass"
    side.write_bytes(b"not a zip")
    assert current_sidecar(path) is None, "damaged"


def test_a_sidecar_with_plans_is_not_kept_without_the_graph_api(fake_cupy, tmp_path, monkeypatch):
    from convpass.compiler.aot import current_sidecar
    from convpass.native.cudnn import graph_api

    monkeypatch.setattr(graph_api, "unavailable", lambda: "the nvidia-cudnn-frontend package is not installed")
    path = _model_file(tmp_path)
    _write(kernel_file.sidecar_path(path), ENTRIES + [_plan_entry()], model_sha256=kernel_file.file_sha256(path), **HERE)
    assert current_sidecar(path) is None
    _write(kernel_file.sidecar_path(path), ENTRIES, model_sha256=kernel_file.file_sha256(path), **HERE)
    assert current_sidecar(path) is not None  # no plans: nothing needs the graph API


def test_a_sidecar_that_cannot_be_judged_is_compiled_again(fake_cupy, graph_api_here, tmp_path, monkeypatch):
    from convpass.compiler.aot import current_sidecar

    path = _model_file(tmp_path)
    _write(kernel_file.sidecar_path(path), model_sha256=kernel_file.file_sha256(path), **HERE)
    assert current_sidecar(path) is not None

    def gpu_error():
        raise RuntimeError("cudaErrorInitializationError")

    monkeypatch.setattr(prebuilt, "device_arch", gpu_error)
    assert current_sidecar(path) is None


def test_optimize_keeps_a_current_sidecar_and_rebuilds_a_stale_one(fake_cupy, graph_api_here, tmp_path, monkeypatch):
    from rich.console import Console

    import convpass.compiler.aot
    import convpass.runtime.cuda
    from convpass.compiler.optimize import write_kernels as _write_kernels

    compiled = []

    def compile_kernels(output):
        compiled.append(output)
        _write(kernel_file.sidecar_path(output), model_sha256=kernel_file.file_sha256(output), **HERE)
        return KernelReport(kernel_file.sidecar_path(output), 1, {"90": 1}, ["1x3"], [], 0.1)

    monkeypatch.setattr(convpass.runtime.cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(convpass.compiler.aot, "compile_kernels", compile_kernels)
    path = _model_file(tmp_path)
    console = Console(record=True, width=400)
    _write_kernels(path, True, console)  # none there: compiled
    _write_kernels(path, True, console)  # the same model again: kept
    assert compiled == [path] and "kept, written for this exact model" in console.export_text()
    path.write_bytes(path.read_bytes() + b" ")  # another model at that path: compiled again
    _write_kernels(path, True, console)
    assert compiled == [path, path]
    _write_kernels(path, False, console)  # --no-kernels: no side-car left that could mismatch
    assert not kernel_file.sidecar_path(path).exists()


def test_kernel_key_hashes_cupy_s_header_source_once(monkeypatch):
    import hashlib

    headers = "// CuPy's headers\n" * 20000  # the same string with every kernel
    key = prebuilt.kernel_key("src", (), {"extra_source": headers}, "14.2.0")
    hashed: list[int] = []
    real = hashlib.sha256
    monkeypatch.setattr(prebuilt.hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real(data))
    again = [prebuilt.kernel_key(f"src{i}", (), {"extra_source": headers}, "14.2.0") for i in range(3)]
    assert max(hashed) < len(headers)  # the sources and the key document, never the headers again
    assert prebuilt.kernel_key("src", (), {"extra_source": headers}, "14.2.0") == key and len(set(again)) == 3
    assert key != prebuilt.kernel_key("src", (), {"extra_source": headers + " "}, "14.2.0")


def test_optimize_names_each_conv_that_runs_slower_in_place_than_tuned(tmp_path, monkeypatch, caplog):
    """The side-car's child times every tuned conv inside its plan; what runs over 1.15x its tuned
    time is a warning naming the conv (the counts in one line)."""
    from rich.console import Console

    import convpass.compiler.aot
    import convpass.runtime.cuda
    from convpass.compiler.optimize import write_kernels as _write_kernels

    rows = [{"node": "fast", "profile": 0, "tuned_ms": 0.1, "in_place_ms": 0.105, "algo": "gemm", "memory_format": "NHWC", "ratio": 1.05},
            {"node": "slow", "profile": 0, "tuned_ms": 0.1, "in_place_ms": 0.2, "algo": "gemm", "memory_format": "NCHW", "ratio": 2.0}]
    report = KernelReport(tmp_path / "m.onnx.kernels", 1, {"90": 1}, ["1x3"], [], 0.1, 0,
                          ({"how": "h", "reliable": True, "convs": rows}, {"how": "h", "reliable": False, "convs": rows}))
    monkeypatch.setattr(convpass.runtime.cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(convpass.compiler.aot, "compile_kernels", lambda output: report)
    console = Console(record=True, width=400)
    with caplog.at_level("WARNING", logger="convpass"):
        _write_kernels(_model_file(tmp_path), True, console)
    text = console.export_text()
    assert "in place: 4 tuned conv launch(es) timed inside the plan, 1 more than 15% over their tuned time; 1 profile(s) timed with host gaps" in text
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "conv 'slow' (profile 0) runs 0.2000 ms in place against 0.1000 ms tuned (2.00x" in warned[0]
