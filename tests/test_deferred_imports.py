"""onnx-ir is imported without SymPy; SymPy loads when onnx-ir first uses it (convpass.core.deferred_imports).

Each check runs in a Python process of its own: which modules are imported is process state.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_whole_optimize_never_imports_sympy(tmp_path):
    """A cached optimize, as a deployment pipeline re-runs it (recorded H200 rows, --device-name)."""
    import recorded

    from convpass.tuning.cache import TuningCache

    with TuningCache(tmp_path / "tune.db") as cache:
        cache.put(recorded.H200, [m for rows in recorded.recorded_rows("oracle").values() for m in rows])
    model = recorded.save(recorded.resnet_block(), tmp_path, "resnet_block")
    out = _run(f"""
import sys
from convpass.cli.main import main
code = main(["optimize", {str(model)!r}, "--shape", "input=1x64x56x56", "--shape", "input=32x64x56x56", "--device-name", "H200",
             "--cache", {str(tmp_path / 'tune.db')!r}, "-o", {str(tmp_path / 'tuned.onnx')!r}, "--no-kernels"])
assert not code, code
import onnx_ir._core as core
print(sorted(m for m in sys.modules if m.split(".")[0] == "sympy"), type(core.sympy).__name__, type(core._symbolic_shapes).__name__)
""")
    assert out.splitlines()[-1] == "[] DeferredModule DeferredModule"
    assert (tmp_path / "tuned.onnx").exists()


def test_symbolic_dimension_arithmetic_imports_it_then():
    out = _run("""
import sys
from convpass.core.deferred_imports import defer_sympy
defer_sympy()
import convpass.compiler.pipeline
import onnx_ir as ir
before = "sympy" in sys.modules
print(before, ir.SymbolicDim("N") * 2 + 1, type(sys.modules["sympy"]).__name__, type(sys.modules["onnx_ir._symbolic_shapes"]).__name__)
""")
    assert out == "False 2*N + 1 module module"


def test_others_who_import_sympy_get_the_real_module_from_the_import_system():
    """After onnx-ir's import nothing of the stand-ins is in sys.modules: a submodule imported
    first, availability checks, and onnx-ir's own later use all meet one real SymPy."""
    out = _run("""
import importlib.util, sys
import convpass
convpass.inspect  # the API's first use prepares the import of onnx-ir
import onnx_ir
import onnx_ir._core as core
print(importlib.util.find_spec("sympy") is not None, "sympy" in sys.modules)
import sympy.core.numbers
import sympy
print(type(sys.modules["sympy"]).__name__, sympy.core is sys.modules["sympy.core"], core.sympy.Expr is sympy.Expr)
from sympy import Max, Symbol
x = Symbol("x", positive=True)
print(Max(x, 2).subs(x, 3), isinstance(x, core.sympy.Expr), onnx_ir.__loader__ is onnx_ir.__spec__.loader, type(onnx_ir.__loader__).__name__)
""")
    assert out.splitlines() == ["True False", "module True True", "3 True True SourceFileLoader"]


def test_nothing_is_stood_in_for_when_sympy_was_imported_before():
    out = _run("""
import sympy
import convpass.compiler.pipeline
import onnx_ir._core as core
from convpass.core.deferred_imports import defer_sympy
print(defer_sympy(), core.sympy is sympy)
""")
    assert out == "False True"


def test_nothing_is_stood_in_for_when_onnx_ir_was_imported_before_convpass():
    out = _run("""
import sys
import onnx_ir
import convpass.compiler.pipeline
from convpass.core.deferred_imports import _OnnxIrFinder, defer_sympy
print(defer_sympy(), any(isinstance(f, _OnnxIrFinder) for f in sys.meta_path), type(sys.modules["sympy"]).__name__)
""")
    assert out == "False False module"


def test_importing_convpass_alone_imports_neither():
    out = _run("""
import sys
import convpass, convpass.runtime
print("onnx_ir" in sys.modules, "sympy" in sys.modules)
""")
    assert out == "False False"


def test_importing_convpass_changes_nothing_in_the_interpreter():
    """No import hook, no logging set-up, no warning filter: ``import convpass`` has no side effects."""
    out = _run("""
import logging, sys, warnings
before = (list(sys.meta_path), list(sys.path_hooks), len(logging.getLogger().handlers), list(warnings.filters))
import convpass
after = (list(sys.meta_path), list(sys.path_hooks), len(logging.getLogger().handlers), list(warnings.filters))
print(before == after, sorted(m for m in sys.modules if m.startswith("convpass")))
""")
    assert out == "True ['convpass', 'convpass.core', 'convpass.core.errors', 'convpass.core.version']"


def test_the_cli_and_the_api_prepare_the_import_of_onnx_ir():
    out = _run("""
import sys
import convpass
from convpass.core.deferred_imports import _OnnxIrFinder
print(any(isinstance(f, _OnnxIrFinder) for f in sys.meta_path))
convpass.optimize
import onnx_ir._core as core
print(type(core.sympy).__name__, "sympy" in sys.modules)
""")
    assert out.splitlines() == ["False", "DeferredModule False"]
