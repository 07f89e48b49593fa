"""onnx-ir imported without importing SymPy: SymPy loads when onnx-ir first uses it.

onnx-ir (1.0 and 1.1) imports SymPy at its own import, for arithmetic on symbolic dimensions
(``SymbolicDim("N") + 1``), and builds a table of SymPy functions when it imports its
``_symbolic_shapes`` module. convpass never does that arithmetic, yet every ``convpass optimize``,
``inspect`` or ``tune`` paid for the import, up to a third of a cached re-run
(docs/measurements/2026-11-27-tuning-time-third-pass.md).

:func:`defer_sympy` puts a one-shot finder first on ``sys.meta_path``. It is called where convpass
is about to import onnx-ir for its own work: the CLI's entry (:func:`convpass.cli.main.main`), the
first use of a name of the Python API (``convpass.optimize``, ``convpass.inspect``,
``convpass.Executor``) and a model process of ``convpass tune`` (:mod:`convpass.fleet.preload`).
``import convpass`` alone calls it not: importing a package changes nothing in the interpreter. When something imports onnx-ir, the finder lets the
import system load it as usual, with :class:`DeferredModule` stand-ins for ``sympy`` and
``onnx_ir._symbolic_shapes`` in ``sys.modules`` while onnx-ir's own code runs, and takes them
out again right after. So the stand-ins live only in onnx-ir's module globals: the first attribute
onnx-ir reads from one imports the real module, and every read is answered by it. Anyone else who
imports SymPy, before or after, gets the real module from the import system, untouched.

Nothing is stood in for when SymPy is imported already, when onnx-ir was imported before convpass,
when SymPy is not installed, or when onnx-ir has no ``_symbolic_shapes`` module (another layout):
onnx-ir then imports SymPy as it always did.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types
from typing import Any

SYMPY = "sympy"
SYMBOLIC_SHAPES = "onnx_ir._symbolic_shapes"
_lock = threading.Lock()


class DeferredModule(types.ModuleType):
    """Stands in for the module of its name: every read of an attribute it lacks is answered by the
    real module, imported at the first such read."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.load(), name)

    def load(self) -> types.ModuleType:
        """The real module (imported by the import system, which serializes concurrent imports)."""
        real = self.__dict__.get("_convpass_real")
        if real is None:
            module_name = self.__dict__["__name__"]
            with _lock:  # only while onnx-ir itself is being imported is a stand-in in sys.modules
                if sys.modules.get(module_name) is self:
                    del sys.modules[module_name]
            real = importlib.import_module(module_name)
            self.__dict__["_convpass_real"] = real
        return real


# The finder and loader are plain classes (the import system asks for their methods only):
# importlib.abc imports importlib.resources, 10 ms of every `import convpass`.
class _OnnxIrLoader:
    """onnx-ir's own loader, run with the stand-ins in ``sys.modules`` (module docstring)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # the package's loader is its own from here on (resources, reloads)
        module.__loader__ = self.real
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        with _lock:
            stand_ins = {name: DeferredModule(name) for name in (SYMPY, SYMBOLIC_SHAPES) if name not in sys.modules}
            sys.modules.update(stand_ins)
        try:
            self.real.exec_module(module)
        finally:
            with _lock:
                for name, stand_in in stand_ins.items():
                    if sys.modules.get(name) is stand_in:
                        del sys.modules[name]


class _OnnxIrFinder:
    """Finds onnx-ir once, through the other finders, and hands it :class:`_OnnxIrLoader`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "onnx_ir":
            return None
        import importlib.util

        with _lock:
            if self not in sys.meta_path:
                return None
            sys.meta_path.remove(self)  # one shot: onnx-ir is imported once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or SYMPY in sys.modules or importlib.util.find_spec(SYMPY) is None:
            return spec
        locations = list(spec.submodule_search_locations or ())
        if not locations or importlib.machinery.PathFinder.find_spec(SYMBOLIC_SHAPES, locations) is None:
            return spec
        spec.loader = _OnnxIrLoader(spec.loader)  # type: ignore[assignment]
        return spec


def defer_sympy() -> bool:
    """Have onnx-ir's coming import leave SymPy out (module docstring). True when it will: neither
    onnx-ir nor SymPy is imported yet."""
    with _lock:
        if any(isinstance(f, _OnnxIrFinder) for f in sys.meta_path):
            return True
        if "onnx_ir" in sys.modules or SYMPY in sys.modules:
            return False
        sys.meta_path.insert(0, _OnnxIrFinder())
        return True
