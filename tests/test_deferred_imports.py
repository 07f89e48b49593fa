"""SymPy is imported when used, not when onnx-ir is (convpass.deferred_imports).

Each check runs in a Python process of its own: which modules are imported is process state.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_whole_optimize_never_imports_sympy(tmp_path):
    """A cached optimize, as a deployment pipeline re-runs it (recorded H200 rows, --device-name)."""
    import recorded

    from convpass.cache import TuningCache

    with TuningCache(tmp_path / "tune.db") as cache:
        cache.put(recorded.H200, [m for rows in recorded.recorded_rows("oracle").values() for m in rows])
    model = recorded.save(recorded.resnet_block(), tmp_path, "resnet_block")
    out = _run(f"""
import sys
from convpass.cli import main
code = main(["optimize", {str(model)!r}, "--shape", "input=1x64x56x56", "--shape", "input=32x64x56x56", "--device-name", "H200",
             "--cache", {str(tmp_path / 'tune.db')!r}, "-o", {str(tmp_path / 'tuned.onnx')!r}, "--no-kernels"])
assert not code, code
import onnx_ir
print("sympy.core" in sys.modules, type(sys.modules["sympy"]).__name__)
""")
    assert out.splitlines()[-1] == "False DeferredModule"
    assert (tmp_path / "tuned.onnx").exists()


def test_symbolic_dimension_arithmetic_imports_it_then(tmp_path):
    out = _run("""
import sys
import convpass.pipeline
import onnx_ir as ir
before = "sympy.core" in sys.modules
print(before, ir.SymbolicDim("N") * 2 + 1, type(sys.modules["sympy"]).__name__)
""")
    assert out == "False 2*N + 1 module"


def test_user_code_that_imports_sympy_after_convpass_gets_all_of_it():
    out = _run("""
import sys
import convpass.model_io
import sympy
from sympy import Max, Symbol
import sympy.core.numbers
x = Symbol("x", positive=True)
print(Max(x, 2).subs(x, 3), isinstance(x, sympy.Expr), sympy.__version__ == sys.modules["sympy"].__version__)
print(type(sys.modules["sympy"]).__name__)
""")
    assert out.splitlines() == ["3 True True", "module"]  # the real module is back in sys.modules


@pytest.mark.parametrize("first", ["sympy", "onnx_ir"])
def test_nothing_is_stood_in_for_when_it_was_imported_before(first):
    out = _run(f"""
import sys
import {first}
import convpass.pipeline
from convpass.deferred_imports import DeferredModule, defer_sympy
print(defer_sympy(), any(isinstance(m, DeferredModule) for m in list(sys.modules.values())))
""")
    assert out == "False False"
