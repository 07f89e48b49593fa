"""Fleet tuning on real GPUs: the worker's measurer against the in-process tuner, one worker per
visible GPU with its own CUDA_VISIBLE_DEVICES, a whole run and its cached re-run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import pytest
from rich.console import Console

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS, conv_model  # noqa: E402

from convpass.compiler.pipeline import OptimizeReport, prepare_model  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.algo import Algo  # noqa: E402
from convpass.core.fusion import FUSED_CALL_CANDIDATES  # noqa: E402
from convpass.core.model_io import load_model  # noqa: E402
from convpass.core.options import TuneOptions  # noqa: E402
from convpass.fleet import driver  # noqa: E402
from convpass.fleet.local import LocalExecutor, visible_gpus  # noqa: E402
from convpass.fleet.measurers import CudnnMeasurer  # noqa: E402
from convpass.fleet.model_procs import ModelSpec  # noqa: E402
from convpass.native import device  # noqa: E402
from convpass.tuning.cache import TuningCache  # noqa: E402
from convpass.tuning.tuner import CudnnTuner, was_measured  # noqa: E402

OPTIONS = TuneOptions(layout="per-conv")



def _problems(model, shapes=()):
    return list(prepare_model(load_model(model), OPTIONS, shapes, OptimizeReport()))


def test_the_worker_measures_what_the_tuner_measures(tmp_path):
    problem = _problems(conv_model("Conv", (2, 8, 16, 16), (16, 8, 3, 3), pads=[1, 1, 1, 1]))[0]
    measurer = CudnnMeasurer()
    assert measurer.start() == device.detect()
    rows = measurer.measure([problem], OPTIONS)
    assert measurer.complete(device.detect(), rows, problem, OPTIONS)
    with TuningCache(tmp_path / "c.db") as cache:
        CudnnTuner(cache, device.detect(), console=Console(quiet=True)).decide([problem], OPTIONS)
        stored = [m for s in problem.candidates for m in cache.get(device.detect(), s)]
    # Which fused calls are timed follows from the bare timings (each key's FUSED_CALL_CANDIDATES
    # fastest measured, none where every bare one was stopped early), which differ by noise between
    # two measurements: on H100 and H200 the two took fused calls of different algorithms and keys;
    # and the head-to-head of close candidates may reorder the bare times after that choice. So
    # each run's legacy fused calls are held to being of its own measured bare algorithms, at most
    # FUSED_CALL_CANDIDATES per key (checked against an H200 panel run's 799 fused calls);
    # everything else is compared row by row.
    def rows_of(ms):
        return {(m.key, m.algo, m.method, m.status) for m in ms if not (m.method == "measure" and Algo.parse(m.algo).fusion)}

    # Fused graph-API engine graphs are configurations cuDNN lists for the fused operation graph,
    # not fused calls of a measured bare configuration; which of them are timed to the end follows
    # from noisy early stops, so the two runs are held to timing them for the same keys and fusions.
    def engine_graphs(ms):
        return {(m.key, Algo.parse(m.algo).fusion) for m in ms
                if m.method == "measure" and Algo.parse(m.algo).fusion and Algo.parse(m.algo).family == "engine"}

    assert rows_of(rows) == rows_of(stored)
    assert engine_graphs(rows) and engine_graphs(rows) == engine_graphs(stored)
    for ms in (rows, stored):
        calls = [m for m in ms if m.method == "measure" and Algo.parse(m.algo).fusion and Algo.parse(m.algo).family == "legacy"]
        measured = {(m.key, m.algo) for m in ms if m.method == "measure" and was_measured(m) and not Algo.parse(m.algo).fusion}
        assert calls and all((m.key, str(Algo.parse(m.algo).bare)) in measured for m in calls)
        assert max(Counter(m.key for m in calls).values()) <= FUSED_CALL_CANDIDATES


def test_a_fleet_run_uses_every_gpu_and_a_rerun_measures_nothing(tmp_path):
    path = MODELS / "mobile_block.onnx"
    specs = [ModelSpec(path, ("input=1x3x32x32", "input=8x3x32x32"))]
    out = tmp_path / "out"
    out.mkdir()
    report = driver.tune(specs, out, OPTIONS, cluster=LocalExecutor(), cache=tmp_path / "c.db", console=Console(quiet=True))
    doc = report.to_json()
    gpus = visible_gpus()
    assert [s["id"] for s in doc["slots"]] == [f"gpu{g}" for g in gpus]
    assert {s["device"] for s in doc["slots"]} == {str(device.detect())}
    assert doc["failed"] == [] and doc["missing"] == [] and doc["problems_measured"] == doc["problems"]
    assert doc["cache_writes"]["max_per_task"] == 1
    if len(gpus) > 1:
        assert len(doc["measured_by_slot"]) > 1  # the problems were shared out
    tuned = onnx.load(report.written[0])
    onnx.checker.check_model(tuned, full_check=True)
    info, nodes = annotation.read_annotations(tuned, device=device.detect())
    assert info.devices == (str(device.detect()),)
    assert all(d.source == "measure" and d.algo != "auto" for n in nodes for d in n.decisions)
    written = Path(report.written[0]).read_bytes()
    again = driver.tune(specs, out, OPTIONS, cluster=LocalExecutor(), cache=tmp_path / "c.db", console=Console(quiet=True)).to_json()
    assert again["measured"] == 0 and again["cached"] == doc["tasks"]
    rewritten = Path(report.written[0]).read_bytes()
    if rewritten != written:  # name what differs: the metadata entries and annotated attributes
        a, b = onnx.load_from_string(written), onnx.load_from_string(rewritten)
        meta = [(p.key, p.value, q.value) for p, q in zip(a.metadata_props, b.metadata_props) if p.value != q.value]
        attrs = [(n.name, x.name, str(x)[:300], str(y)[:300]) for n, m in zip(a.graph.node, b.graph.node)
                 for x, y in zip(n.attribute, m.attribute) if x != y]
        raise AssertionError(f"the cached re-run wrote another model: metadata {meta}; attributes {attrs[:5]}")
