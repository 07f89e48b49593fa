"""The scripts beside the package (``benchmarks/``, ``models/``, ``scripts/``) and the GPU tests
(``tests/gpu/``, which the CPU suite never runs) against the package
they use: every ``convpass`` module or name they import exists, and every attribute they read off
an imported convpass module (``cont.warm_gpu``, ``convpass.bench.measure.cupy``) is there.

These scripts mostly run on a GPU machine only, so a module split that moves a function would
otherwise show only there. The scripts are parsed (``ast``), never imported or run: only the
convpass modules they name are imported, and those import on the CPU (torch, CuPy and the like
are imported inside the functions that use them). An attribute written (``module.x = ...``) is
not checked; names are resolved per file, not per scope.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

SCRIPTS = sorted(p for folder in ("benchmarks", "models", "scripts", "tests/gpu") for p in (REPO / folder).glob("*.py"))
_MISSING = object()


def _is_convpass(name: str) -> bool:
    return name == "convpass" or name.startswith("convpass.")


def _import(name: str) -> ModuleType | str:
    """The convpass module ``name``, or why it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        return f"cannot import {name} ({e})"


def _attribute(module: ModuleType, name: str) -> object:
    """``module.name``, importing the submodule of that name if it is one; :data:`_MISSING` if neither."""
    if hasattr(module, name):
        return getattr(module, name)
    sub = f"{module.__name__}.{name}"
    if hasattr(module, "__path__") and importlib.util.find_spec(sub) is not None:
        return importlib.import_module(sub)
    return _MISSING


def _imported_modules(tree: ast.AST, where: str) -> tuple[dict[str, ModuleType], list[str]]:
    """The names a script binds to convpass modules by its imports, and its imports that fail."""
    names: dict[str, ModuleType] = {}
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_convpass(node.module):
            module = _import(node.module)
            if isinstance(module, str):
                problems.append(f"{where}:{node.lineno}: {module}")
                continue
            for alias in node.names:
                value = _MISSING if alias.name == "*" else _attribute(module, alias.name)
                if alias.name != "*" and value is _MISSING:
                    problems.append(f"{where}:{node.lineno}: {node.module} has no {alias.name!r}")
                elif isinstance(value, ModuleType):
                    names[alias.asname or alias.name] = value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_convpass(alias.name):
                    continue
                module = _import(alias.name)
                if isinstance(module, str):
                    problems.append(f"{where}:{node.lineno}: {module}")
                elif alias.asname:  # ``import convpass.a.b as m`` binds ``m`` to convpass.a.b
                    names[alias.asname] = module
                else:  # ``import convpass.a.b`` binds ``convpass``
                    names["convpass"] = importlib.import_module("convpass")
    return names, problems


def _module_of(node: ast.expr, names: dict[str, ModuleType]) -> ModuleType | None:
    """The convpass module an expression names (``cont``, ``convpass.bench.measure``), or None."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _module_of(node.value, names)
        value = _attribute(parent, node.attr) if parent is not None else None
        return value if isinstance(value, ModuleType) else None
    return None


def missing_attributes(path: Path, source: str | None = None) -> list[str]:
    """``file:line: ...`` for every convpass import of the script at ``path`` (or of ``source``,
    as if it were there) that fails and every attribute it reads off a convpass module that the
    module does not have, in line order."""
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, filename=str(path))
    names, problems = _imported_modules(tree, str(where))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            module = _module_of(node.value, names)
            if module is not None and _attribute(module, node.attr) is _MISSING:
                problems.append(f"{where}:{node.lineno}: {ast.unparse(node)}: {module.__name__} has no {node.attr!r}")
    return sorted(problems, key=lambda p: int(p[len(str(where)) + 1:].split(":", 1)[0]))  # in line order


def test_there_are_scripts_to_check():
    folders = {p.parent.name for p in SCRIPTS}
    assert folders == {"benchmarks", "models", "scripts", "gpu"} and REPO / "benchmarks" / "precision_panel.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_script_uses_only_what_the_package_has(path):
    problems = missing_attributes(path)
    assert not problems, "\n".join(problems)


def test_what_a_module_split_leaves_behind_is_named_by_file_and_line(tmp_path):
    # precision_panel.py once read these off contenders after they had moved to measure / environment
    script = tmp_path / "rotten.py"
    script.write_text(
        "import convpass\n"
        "import convpass.bench.measure as m\n"
        "from convpass.bench import contenders as cont\n"
        "from convpass.bench import measure, no_such_module\n"
        "from convpass.bench.records import find, no_such_name\n"
        "from convpass.bench.gone import anything\n"
        "\n"
        "def main():\n"
        "    cont.warm_gpu()\n"
        "    cp = cont._cupy()\n"
        "    env = cont.environment.environment()\n"
        "    measure.warm_gpu(); m.cupy(); cont.reference_outputs\n"  # these exist
        "    convpass.bench.measure.no_clock()\n"
        "    convpass.optimize; convpass.no_such_api\n"
        "    cont.later = 1\n"  # written, not read: not checked
    )
    problems = missing_attributes(script)
    assert problems == [
        f"{script}:4: convpass.bench has no 'no_such_module'",
        f"{script}:5: convpass.bench.records has no 'no_such_name'",
        f"{script}:6: cannot import convpass.bench.gone (No module named 'convpass.bench.gone')",
        f"{script}:9: cont.warm_gpu: convpass.bench.contenders has no 'warm_gpu'",
        f"{script}:10: cont._cupy: convpass.bench.contenders has no '_cupy'",
        f"{script}:11: cont.environment: convpass.bench.contenders has no 'environment'",
        f"{script}:13: convpass.bench.measure.no_clock: convpass.bench.measure has no 'no_clock'",
        f"{script}:14: convpass.no_such_api: convpass has no 'no_such_api'",
    ], problems


def test_the_precision_panel_before_it_followed_the_split_fails():
    """The version of benchmarks/precision_panel.py that failed only on the GPU machine (where the
    repository's history is at hand)."""
    import subprocess

    old = subprocess.run(["git", "show", "178e723:benchmarks/precision_panel.py"], cwd=REPO, capture_output=True, text=True)
    if old.returncode != 0:
        pytest.skip(f"the repository's history is not here ({old.stderr.strip()})")
    problems = missing_attributes(REPO / "benchmarks" / "precision_panel.py", old.stdout)
    assert "benchmarks/precision_panel.py:83: cont.warm_gpu: convpass.bench.contenders has no 'warm_gpu'" in problems
    assert "benchmarks/precision_panel.py:109: cont._cupy: convpass.bench.contenders has no '_cupy'" in problems
    assert "benchmarks/precision_panel.py:288: cont.environment: convpass.bench.contenders has no 'environment'" in problems
