"""The README's two set-up commands are the ones that work, and CI runs the README's test command."""

from __future__ import annotations

from conftest import REPO


def _commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Set-up: the two commands", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_readme_has_the_two_setup_commands():
    install_run, test = _commands()
    assert "convpass optimize models/" in install_run
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    _, test = _commands()
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci.splitlines()


def test_readme_sample_model_exists():
    install_run, _ = _commands()
    model = install_run.split("convpass optimize ", 1)[1].split()[0]
    assert (REPO / model).is_file()


def test_every_package_of_the_tree_is_installed():
    """A non-editable install carries only the packages pyproject.toml lists: each folder with an
    ``__init__.py`` must be one (a missing ``convpass.runtime.cuda`` left installed copies without
    the CUDA executor)."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = {v: k for k, v in config.get("package-dir", {}).items()}
    found = set()
    for init in [*REPO.glob("convpass/**/__init__.py"), *REPO.glob("passes/**/__init__.py")]:
        folder = init.parent.relative_to(REPO).as_posix()
        top = next((d for d in dirs if folder == d or folder.startswith(d + "/")), None)
        name = dirs[top] + folder[len(top):].replace("/", ".") if top else folder.replace("/", ".")
        found.add(name)
    assert found == listed, f"missing from pyproject.toml: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
