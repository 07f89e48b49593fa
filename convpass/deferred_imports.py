"""SymPy, imported when something uses it rather than when onnx-ir is imported.

onnx-ir (1.0 and 1.1) imports SymPy at its own import, for arithmetic on symbolic dimensions
(``SymbolicDim("N") + 1``), and builds a table of SymPy functions when it imports its
``_symbolic_shapes`` module. convpass never does that arithmetic, yet every ``convpass optimize``,
``inspect`` or ``tune`` paid for the import: 0.5 s on the development machine, 1.9 s on an H200
device machine (2026-11-27: a third of a cached re-run there).

:func:`defer_sympy` puts a stand-in module for each of the two into ``sys.modules`` before
onnx-ir is imported. ``import sympy`` binds the stand-in; the first attribute anyone reads from it
(``sympy.Expr``, ``sympy.Symbol``, a submodule import) imports the real module, puts it back in
``sys.modules`` and answers from it; every read after that is answered from the real module's
contents. So code that uses SymPy, onnx-ir's or a user's, behaves as with a plain import; only
when the import happens moves. Nothing is stood in for when SymPy or onnx-ir is already imported,
when either is not installed, or when onnx-ir has no ``_symbolic_shapes`` module (another layout:
then SymPy loads at onnx-ir's import, as without this module).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any

SYMBOLIC_SHAPES = "onnx_ir._symbolic_shapes"
_lock = threading.RLock()  # reentrant: loading onnx-ir's module reads from SymPy's stand-in


class DeferredModule(types.ModuleType):
    """A module that imports the real one of its name at the first read of a missing attribute."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.load(), name)

    def load(self) -> types.ModuleType:
        """The real module, imported now if it was not yet (and put in ``sys.modules``)."""
        with _lock:
            real = self.__dict__.get("_convpass_real")
            if real is None:
                module_name = self.__dict__["__name__"]
                if sys.modules.get(module_name) is self:
                    del sys.modules[module_name]
                real = importlib.import_module(module_name)
                self.__dict__.update(real.__dict__)
                self.__dict__["_convpass_real"] = real
            return real


def defer_sympy() -> bool:
    """Stand in for SymPy and onnx-ir's ``_symbolic_shapes`` until first used (module docstring).
    True when the stand-ins are in place (now or from an earlier call)."""
    with _lock:
        if isinstance(sys.modules.get("sympy"), DeferredModule):
            return True
        if "sympy" in sys.modules or "onnx_ir" in sys.modules:
            return False
        sympy_spec = importlib.util.find_spec("sympy")
        ir_spec = importlib.util.find_spec("onnx_ir")  # a top-level spec: onnx-ir is not imported
        if sympy_spec is None or ir_spec is None or not ir_spec.submodule_search_locations:
            return False
        if importlib.machinery.PathFinder.find_spec(SYMBOLIC_SHAPES, list(ir_spec.submodule_search_locations)) is None:
            return False
        for name in ("sympy", SYMBOLIC_SHAPES):
            sys.modules[name] = DeferredModule(name)
        return True
