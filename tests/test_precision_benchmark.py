"""benchmarks/precision_panel.py on the CPU: its verdicts from case figures, a case built as on the
GPU machine (CuPy, the clocks, the executor's device, ONNX Runtime's CUDA EP and the tuner's GPU
stood in for) written as JSON, and its ``--out`` file written after every case."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import MODELS, benchmark_script
from precision_fakes import RATES, synthetic_cache

import convpass

precision_panel = benchmark_script("precision_panel")

MODEL = MODELS / "residual_cnn.onnx"
SLOW = {k: v / 1000 for k, v in RATES.items()}  # made-up rates slow enough for float16 to pay for its casts


def _case(model, batch, tf32, auto2, auto3, fp32, err2=1e-3, err3=1e-4, peer=None):
    c = {"model": model, "batch": batch, "fp32": {"ms": fp32, "error": 1e-7}, "tf32": {"ms": tf32, "error": 3e-3},
         "auto-1e-2": {"ms": auto2, "error": err2, "convs": {"fp16": 3}}, "auto-1e-3": {"ms": auto3, "error": err3, "convs": {"tf32": 3}}}
    if peer is not None:
        c["ort_fp16"] = {"ms": peer, "error": 2e-3}
        c["torch_compile_fp16"] = {"skipped": "torch is not installed"}
    return c


def test_the_summary_judges_every_target():
    cases = [_case("a", 16, 2.0, 1.0, 1.5, 3.0, peer=1.2), _case("b", 16, 3.0, 2.0, 3.5, 3.0, err3=2e-3, peer=1.0),
             {"model": "c", "batch": 16, "error": "out of memory"}]
    lines = precision_panel.summarize(cases)
    text = "\n".join(lines)
    assert "batch 16, 2 models:" in text
    assert "geomean 1.73x" in text and "target 1.5x at batch 16/32: met" in text  # sqrt(2 * 1.5)
    assert "auto 1e-2: worst 1.00e-03 (a): met" in text
    assert "auto 1e-3: worst 2.00e-03 (b): not met" in text
    assert "worst 1.17 of FP32's time (b): not met" in text
    assert "2 models: geomean 1.29 of the peer's time: not met" in text  # sqrt(1/1.2 * 2/1)
    assert "failed: c b16: out of memory" in text
    assert "1.50x tf32" in precision_panel._row(cases[1])


# ---------------------------------------------------------------------------------------------
# a case built as on the GPU machine, its GPU parts stood in for, and the JSON it is written as


class _FakeCupy:
    """``measure.cupy()`` on the CPU: device arrays are host arrays, a pointer indexes them."""

    def __init__(self):
        self.arrays = []
        self.cuda = SimpleNamespace(Device=lambda: SimpleNamespace(id=0))

    def asarray(self, a):
        self.arrays.append(np.asarray(a))
        return SimpleNamespace(data=SimpleNamespace(ptr=len(self.arrays) - 1))


class _OrtWithFakeCuda(types.ModuleType):
    """onnxruntime whose CUDA EP is stood in for (:attr:`Session`); the rest is the real module."""

    def __getattr__(self, name):
        return getattr(ort, name)


def _fake_ort(cupy: _FakeCupy, refuse: str) -> types.ModuleType:
    """onnxruntime whose CUDA EP is ONNX Runtime's CPU EP (IOBinding on ``cupy``'s arrays), and
    which refuses the configuration ``refuse`` (``SEARCH-layout``)."""
    real = ort

    class Session:
        def __init__(self, path, so, providers):
            (_, options), = providers
            if f"{options['cudnn_conv_algo_search']}-{'nhwc' if options['prefer_nhwc'] == '1' else 'nchw'}" == refuse:
                raise RuntimeError("CUDNN failure 9: CUDNN_STATUS_NOT_SUPPORTED\nmore detail")
            self.cpu = real.InferenceSession(path, providers=["CPUExecutionProvider"])
            self.feeds, self.outs = {}, []

        def io_binding(self):
            session = self

            class Binding:
                def bind_input(self, name, device, device_id, dtype, shape, ptr):
                    session.feeds[name] = cupy.arrays[ptr].reshape(shape)

                def bind_output(self, name, device, device_id):
                    pass

                def get_outputs(self):
                    return [SimpleNamespace(numpy=lambda o=o: o) for o in session.outs]

            return Binding()

        def get_outputs(self):
            return self.cpu.get_outputs()

        def run_with_iobinding(self, binding):
            self.outs = self.cpu.run(None, self.feeds)

    fake = _OrtWithFakeCuda("onnxruntime")
    fake.InferenceSession = lambda path, so=None, providers=(), **kw: (  # the reference's own session is the real one
        real.InferenceSession(path, so, providers=providers, **kw) if providers == ["CPUExecutionProvider"] else Session(path, so, providers))
    return fake


def _cpu_stand_ins(monkeypatch, tmp_path):
    """The GPU parts of ``bench_case`` stood in for on the CPU: CuPy and the clocks, the convpass
    executor (its CPU device), ONNX Runtime's CUDA EP (its CPU EP), and the tuner (a synthetic
    tuning cache of a made-up GPU, so that ``--precision auto`` decides)."""
    from convpass.runtime.executor import Executor

    cupy = _FakeCupy()
    cache = tmp_path / "tuning.db"
    synthetic_cache(cache, onnx.load(MODEL), rates=SLOW)
    real_optimize = convpass.optimize

    def optimize(*args, **kw):
        return real_optimize(*args, **{**kw, "device_name": "Synthetic", "kernels": False})

    def time_convpass(path, x_dev, runs, warmup):
        ex = Executor(str(path), device="cpu")
        return 1.0 + len(str(path)) % 7 / 10, ex.run(None, {k: cupy.arrays[v.data.ptr] for k, v in x_dev.items()})

    measure = precision_panel.measure
    for name, value in {"cupy": lambda: cupy, "warm_gpu": lambda: None, "free_gpu_memory": lambda: None,
                        "device_sync": lambda: None}.items():
        monkeypatch.setattr(measure, name, value)
    monkeypatch.setattr(precision_panel, "convpass", SimpleNamespace(optimize=optimize))
    monkeypatch.setattr(precision_panel, "_time_convpass", time_convpass)
    monkeypatch.setattr(precision_panel.ort_contender, "ort_unavailable_reason", lambda: None)
    monkeypatch.setitem(sys.modules, "onnxruntime", _fake_ort(cupy, refuse="HEURISTIC-nhwc"))
    return str(cache)


def test_a_case_built_as_on_the_gpu_is_written_as_json(monkeypatch, tmp_path):
    cache = _cpu_stand_ins(monkeypatch, tmp_path)
    case = precision_panel.bench_case(MODEL, 1, cache, tmp_path, 2, 1, True, None)
    again = json.loads(json.dumps(case))  # no record holds itself, none is shared
    assert again == case
    assert set(precision_panel.CONFIGS) <= set(case) and all(case[k]["ms"] > 0 for k in precision_panel.CONFIGS)
    assert case["fp32"]["error"] < 1e-5 and case["auto-1e-2"]["within_budget"] is True
    peer = case["ort_fp16"]
    assert [t["config"] for t in peer["tried"]] == [f"{s}-{'nhwc' if n else 'nchw'}" for s, n in precision_panel.ORT_SEARCH]
    assert peer["tried"][3] == {"config": "HEURISTIC-nhwc", "failed": "RuntimeError: CUDNN failure 9: CUDNN_STATUS_NOT_SUPPORTED"}
    timed = [t for t in peer["tried"] if "ms" in t]
    assert len(timed) == 3 and peer["ms"] == min(t["ms"] for t in timed) and peer["config"] in {t["config"] for t in timed}
    assert all("tried" not in t for t in peer["tried"])
    assert peer["error"] < 1e-2 and peer["conversion"].startswith("convpass --precision fp16 graph")
    assert set(case["torch_compile_fp16"]) == {"skipped"}  # no torch with CUDA here
    row = precision_panel._row(case)
    assert row.startswith("residual_cnn") and f"ort fp16 {peer['ms']:.3f} ms" in row
    predicted, rounds = case["auto-1e-2"]["predicted_ms"], case["auto-1e-2"]["rounds"]  # why the plan is what it is
    assert set(predicted) == {"plan", "float16", "wide"} and isinstance(rounds, int)
    assert f"predicted: plan {predicted['plan']:.3f} ms, fp16 region {predicted['float16']:.3f}, none {predicted['wide']:.3f}; {rounds} rounds" in row


def test_the_out_file_is_written_after_every_case_and_keeps_them_when_the_run_is_cut_off(monkeypatch, tmp_path):
    out = tmp_path / "prec.json"
    finished = _case("residual_cnn", 1, 2.0, 1.0, 1.5, 3.0)

    def bench_case(path, batch, *rest):
        if batch == 1:
            return finished
        if batch == 2:
            return {}  # one case failing (a KeyError in its row) is reported and the panel goes on
        assert json.loads(out.read_text())["cases"][0] == finished  # on disk before the next case ran
        raise KeyboardInterrupt  # the time limit

    monkeypatch.setattr(precision_panel, "bench_case", bench_case)
    monkeypatch.setattr(precision_panel.environment, "environment", lambda: {"device": "made up"})
    with pytest.raises(KeyboardInterrupt):
        precision_panel.main(["--model", str(MODEL), "--batches", "1,2,16", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["environment"] == {"device": "made up"}
    assert doc["cases"] == [finished, {"model": "residual_cnn", "batch": 2, "error": "KeyError: 'tf32'"}]
    assert "failed: residual_cnn b2: KeyError: 'tf32'" in doc["summary"] and "batch 1, 1 models:" in doc["summary"]
    assert [p.name for p in tmp_path.iterdir()] == ["prec.json"]  # no temporary file left beside it
    monkeypatch.setattr(precision_panel, "bench_case", lambda path, batch, *rest: finished)
    assert precision_panel.main(["--model", str(MODEL), "--batches", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["cases"] == [finished]


def test_the_cost_table_shows_what_the_plan_weighs_from_a_cache(tmp_path, capsys):
    costs = benchmark_script("precision_costs")
    cache = tmp_path / "c.db"
    # float16 made slower than TF32 on every conv: the table says so per conv, and the first plan keeps float32
    synthetic_cache(cache, onnx.load(MODEL), rates={**SLOW, ("float16", "default"): SLOW[("float32", "default")] / 2})
    assert costs.main(["--model", str(MODEL), "--cache", str(cache), "--device-name", "Synthetic"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[1:] if "implicit_gemm" in line]
    assert len(rows) == 6 and all(float(r[3]) > 1.0 for r in rows)  # fp16/tf32 per conv
    assert out[-1].startswith("first plan of the loop: 0 fp16 conv(s), 0 cast(s)")


def test_precision_costs_refuses_a_missing_or_odd_cache_and_says_when_nothing_is_timed(tmp_path, capsys):
    costs = benchmark_script("precision_costs")
    missing = tmp_path / "missing.db"
    with pytest.raises(SystemExit) as e:
        costs.main(["--model", str(MODEL), "--cache", str(missing), "--device-name", "Synthetic"])
    assert e.value.code == 2 and not missing.exists()  # no empty cache made where the one asked for is missing
    with pytest.raises(SystemExit):
        costs.main(["--model", str(MODEL), "--cache", str(tmp_path), "--device-name", "Synthetic"])  # a folder
    assert "not a regular file" in capsys.readouterr().err
    cache = tmp_path / "c.db"
    synthetic_cache(cache, onnx.load(MODEL), rates=SLOW)
    assert costs.main(["--model", str(MODEL), "--cache", str(cache), "--device-name", "nothing-like-it"]) == 2
    assert "no device matching" in capsys.readouterr().err
