"""scripts/ab-trees.sh: the same command run in the trees of two commits imports each tree's own package."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ab-trees.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None, reason="needs git and bash")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_each_tree_runs_its_own_code_also_under_python_m(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for folder in ("benchmarks", "models", "tests"):
        (repo / folder).mkdir()
        (repo / folder / "keep.txt").write_text("")
    shutil.copy(SCRIPT, repo / "scripts" / "ab-trees.sh")
    (repo / "pyproject.toml").write_text("")
    pkg = repo / "convpass"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (repo / "benchmarks" / "which.py").write_text("import convpass.which\n")
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    shas = []
    for version in ("old", "new"):
        (pkg / "which.py").write_text(f"print({version!r})\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", version)
        shas.append(_git(repo, "rev-parse", "--short", "HEAD"))
    # the checkout holds "new" and is importable (PYTHONPATH stands in for its editable install):
    # a PYTHONPATH-only A/B from the root, or a run inside the tree that leaves PYTHONPATH as it is,
    # would print "new" for both commits in one of the two forms
    subprocess.run(["bash", "scripts/ab-trees.sh", "prepare", shas[0], shas[1]], cwd=repo, check=True, capture_output=True)
    path = "/usr/bin:/bin:" + str(Path(shutil.which("python3")).parent)
    for form in (["python3", "-m", "convpass.which"], ["python3", "benchmarks/which.py"]):
        out = tmp_path / ("out" + str(len(form)))
        subprocess.run(["bash", "scripts/ab-trees.sh", "run", *form], cwd=repo, check=True, capture_output=True,
                       env={"OUT": str(out), "PATH": path, "PYTHONPATH": str(repo)})
        for sha, version in zip(shas, ("old", "new")):
            assert (out / f"ab-{sha}.txt").read_text().splitlines()[1] == version, form


def test_run_without_prepared_trees_says_what_to_do(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "ab-trees.sh")
    r = subprocess.run(["bash", "scripts/ab-trees.sh", "run", "true"], cwd=repo, capture_output=True, text=True,
                       env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "prepare" in r.stderr
