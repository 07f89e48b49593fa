"""The package's layers import only leftward, and no module imports itself back through others.

    core -> native -> ops -> kernels -> runtime | tuning -> compiler -> fleet | bench -> cli

A module may import its own layer and every layer to its left; ``runtime`` and ``tuning`` never
import each other, nor do ``fleet`` and ``bench``; nothing imports ``cli``. Imports inside
functions count as much as those at the top of a module. The package's ``__init__`` (the public
API, resolved lazily) is the one module above ``cli`` that may reach into ``compiler`` and
``runtime``. docs/architecture.md draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1] / "convpass"

RANK = {"core": 0, "native": 1, "ops": 2, "kernels": 3, "runtime": 4, "tuning": 4, "compiler": 5, "fleet": 6, "bench": 6, "cli": 7}
API = 8  # convpass/__init__.py


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for target in _imports(path, mods):
            parent_package = target != "convpass" and name.startswith(target + ".")
            if target != name and not parent_package:
                g.add_edge(name, target)
    return g


def test_every_module_sits_in_a_layer(graph):
    unplaced = [m for m in graph if m != "convpass" and _layer(m) not in RANK]
    assert not unplaced, f"modules outside the layers {sorted(RANK)}: {unplaced}"


def test_imports_run_only_leftward(graph):
    bad = []
    for src, dst in graph.edges:
        a = API if src == "convpass" else RANK[_layer(src)]
        b = API if dst == "convpass" else RANK[_layer(dst)]
        same_rank_sibling = a == b and _layer(src) != _layer(dst) and src != "convpass"
        if b > a or same_rank_sibling:
            bad.append(f"{src} -> {dst}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(sorted(bad))


def test_nothing_imports_the_cli(graph):
    importers = sorted(src for src, dst in graph.edges if _layer(dst) == "cli" and _layer(src) != "cli")
    assert not importers, importers


def test_no_import_circles(graph):
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_a_violation(tmp_path):
    fake = {"convpass.core.a": tmp_path / "a.py", "convpass.cli.b": tmp_path / "b.py"}
    fake["convpass.core.a"].write_text("def f():\n    from convpass.cli.b import g\n")
    fake["convpass.cli.b"].write_text("")
    assert _imports(fake["convpass.core.a"], fake) == {"convpass.cli.b"}
