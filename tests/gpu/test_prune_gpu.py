"""--prune learned on a real GPU: with a history that says fft never wins for a class, a problem
of that class is tuned without timing fft (a skipped row says why) and still decided; a run with
--prune off afterwards times it."""

from __future__ import annotations

import prune_rows
import pytest
from rich.console import Console

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from convpass.core.options import TuneOptions  # noqa: E402
from convpass.core.problem import ConvProblem  # noqa: E402
from convpass.native import device  # noqa: E402
from convpass.tuning.cache import TuningCache  # noqa: E402
from convpass.tuning.prune import PRUNED  # noqa: E402
from convpass.tuning.tuner import CudnnTuner  # noqa: E402


def test_a_family_the_history_never_saw_win_is_skipped_and_off_times_it(tmp_path):
    local = device.detect()
    history = [m for m in prune_rows.models(count=1, per_model=12) if m.key.shape.n == 1]  # 12 problems of one class
    problem = ConvProblem((prune_rows.shape(1, 30),))
    options = TuneOptions(prune="learned", engines="legacy", layout="nchw", tf32="on")
    with TuningCache(tmp_path / "c.db") as cache:
        cache.put(local, history)
        tuner = CudnnTuner(cache, local, console=Console(quiet=True))
        assert tuner.decide([problem], options)[problem] is not None
        rows = {m.algo: m for m in cache.get(local, problem.primary) if m.method == "measure"}
        assert rows["fft"].status == "skipped" and rows["fft"].note.startswith(PRUNED)
        assert rows["implicit_precomp_gemm"].status == "ok"
        CudnnTuner(cache, local, console=Console(quiet=True)).decide([problem], TuneOptions(engines="legacy", layout="nchw", tf32="on"))
        rows = {m.algo: m for m in cache.get(local, problem.primary) if m.method == "measure"}
        assert rows["fft"].status != "skipped"
