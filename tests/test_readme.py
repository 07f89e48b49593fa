"""The documentation: the README's set-up commands are the ones CI runs, the README stays short,
every relative link in README.md and docs/ resolves, the CPU commands the README shows run, and
the user documentation speaks of no issue numbers (dated studies in docs/measurements/ may)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import MODELS, REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
MEASUREMENTS = DOCS / "measurements"

# Run by CI (.ci/run) and by people: they must stay exactly these.
INSTALL_AND_RUN = (
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/convpass optimize models/residual_cnn.onnx "
    "-o residual_cnn.tuned.onnx && .venv/bin/convpass inspect residual_cnn.tuned.onnx"
)
INSTALL_AND_TEST = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/python -m pytest -q"
MAX_README_LINES = 200
MAX_README_WORDS = 1400  # about five minutes at a reading pace of 280 words a minute
# A README code block right after this comment holds `convpass ...` commands that need no GPU.
CPU_MARK = "<!-- cpu-command -->"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# --------------------------------------------------------------------------------------------
# (a) the set-up commands


def test_readme_has_the_two_setup_commands():
    lines = {line.strip() for line in _text(README).splitlines()}
    for command in (INSTALL_AND_RUN, INSTALL_AND_TEST):
        assert command in lines, f"README.md lacks the set-up command, verbatim on a line of its own: {command}"


def test_ci_runs_the_readme_test_command():
    pytest_call = INSTALL_AND_TEST[INSTALL_AND_TEST.index("python -m pytest"):]
    assert pytest_call == "python -m pytest -q"
    ci = _text(REPO / ".ci" / "run")
    assert pytest_call in ci, f".ci/run does not run the README's {pytest_call!r}"


def test_readme_sample_model_exists():
    model = INSTALL_AND_RUN.split("convpass optimize ", 1)[1].split()[0]
    assert (REPO / model).is_file()


# --------------------------------------------------------------------------------------------
# (b) a README a newcomer reads in five minutes


def test_readme_is_short():
    text = _text(README)
    n, words = len(text.splitlines()), len(text.split())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move the long parts to docs/"
    assert words <= MAX_README_WORDS, f"README.md has {words} words (at most {MAX_README_WORDS}): move the long parts to docs/"


# --------------------------------------------------------------------------------------------
# (c) relative links

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _links(text: str) -> list[str]:
    prose = _prose(text)
    return _LINK.findall(prose) + _REFERENCE.findall(prose)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings (lower case, punctuation dropped,
    spaces as hyphens; a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", _text(path))):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_point_to_files_that_exist():
    broken = []
    checked = 0
    for md in _markdown_files():
        for target in _links(_text(md)):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            if path_part:
                path = unquote(path_part)
                resolved = (REPO / path.lstrip("/")) if path.startswith("/") else (md.parent / path)
            else:
                resolved = md
            where = f"{md.relative_to(REPO)}: {target}"
            checked += 1
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment.lower() not in _anchors(resolved):
                broken.append(f"{where} (no heading #{fragment} there)")
    assert checked, "no relative link found: the link pattern is broken"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_what_a_reader_sees():
    text = "[a](x.md) and ![b](img/y.png \"title\") `[c](not-a-link.md)`\n```\n[d](nor-this.md)\n```\n[e]: ref.md\n"
    assert sorted(_links(text)) == ["img/y.png", "ref.md", "x.md"]


# --------------------------------------------------------------------------------------------
# (d) the README's CPU commands run


def _cpu_blocks(text: str) -> list[list[str]]:
    """The code blocks marked with CPU_MARK: each as its lines."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != CPU_MARK:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        assert j < len(lines), f"README.md line {i + 1}: {CPU_MARK} is not followed by a code block"
        block = []
        if lines[j].lstrip().startswith(("```", "~~~")):
            fence = lines[j].lstrip()[:3]
            j += 1
            while j < len(lines) and not lines[j].lstrip().startswith(fence):
                block.append(lines[j])
                j += 1
            assert j < len(lines), f"README.md line {i + 1}: the code block after {CPU_MARK} is not closed"
        elif lines[j].startswith("    "):
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                block.append(lines[j][4:])
                j += 1
        else:
            raise AssertionError(f"README.md line {i + 1}: {CPU_MARK} is not followed by a code block")
        blocks.append(block)
    return blocks


def _commands(block: list[str]) -> list[list[str]]:
    """Each command of a block as its argv (a trailing backslash continues a line; # starts a comment)."""
    joined, pending = [], ""
    for line in block:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    if pending:
        joined.append(pending)
    return [argv for argv in (shlex.split(line, comments=True) for line in joined) if argv]


def _convpass_argv() -> list[str]:
    """How to start the ``convpass`` console script of pyproject.toml with this interpreter:
    ``python -m MODULE`` where the module runs its entry point as a script, else ``python -c``."""
    text = _text(REPO / "pyproject.toml")
    try:
        import tomllib
    except ImportError:  # Python 3.10
        entry = re.search(r'^\[project\.scripts\][^\[]*?^convpass\s*=\s*"([^"]+)"', text, re.M | re.S).group(1)
    else:
        entry = tomllib.loads(text)["project"]["scripts"]["convpass"]
    module, _, func = entry.partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"the convpass entry point's module {module} is not importable"
    source = Path(spec.origin).read_text(encoding="utf-8")
    if func == "main" and re.search(r"^if __name__ == ['\"]__main__['\"]:\s*\n\s+sys\.exit\(main\(\)\)", source, re.M):
        return [sys.executable, "-m", module]
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}(sys.argv[1:]))"]


def test_readme_marks_cpu_commands():
    blocks = _cpu_blocks(_text(README))
    assert blocks, f"README.md marks no code block with {CPU_MARK}: the doc test would check nothing"
    commands = [argv for block in blocks for argv in _commands(block)]
    assert commands, f"the code blocks after {CPU_MARK} hold no command"
    for argv in commands:
        assert argv[0] == "convpass", f"a {CPU_MARK} block holds {shlex.join(argv)!r}: only convpass commands run there"


def test_readme_cpu_commands_run(tmp_path: Path):
    """Each marked command, in order, in one temporary folder that sees the repository's models/,
    with no GPU visible and a tuning cache of its own: each must exit 0."""
    commands = [argv for block in _cpu_blocks(_text(README)) for argv in _commands(block)]
    assert commands, f"README.md marks no command with {CPU_MARK}"
    (tmp_path / "models").symlink_to(MODELS, target_is_directory=True)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # commands that need no GPU: run them as a machine without one does
        "CONVPASS_CACHE": str(tmp_path / "tuning.db"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg-cache"),
        "COLUMNS": "200",
    }
    convpass = _convpass_argv()
    for argv in commands:
        proc = subprocess.run([*convpass, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (
            f"README command {shlex.join(argv)!r} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )


def test_the_cpu_block_parser():
    text = f"x\n{CPU_MARK}\n\n```sh\nconvpass a b  # note\nconvpass c \\\n  --d e\n```\n\n{CPU_MARK}\n    convpass f\n\ny\n"
    blocks = _cpu_blocks(text)
    assert [_commands(b) for b in blocks] == [[["convpass", "a", "b"], ["convpass", "c", "--d", "e"]], [["convpass", "f"]]]
    with pytest.raises(AssertionError):
        _cpu_blocks(f"{CPU_MARK}\nplain text\n")


# --------------------------------------------------------------------------------------------
# (e) user documentation without issue numbers or talk of the machines it was written on

_ISSUE = re.compile(r"\bissues?\s*#?\s*\d+|(?<![\w/&#])#\d+\b", re.I)
_WORDS = re.compile(r"\b(?:this|last|previous|earlier|one|a|each) sessions?\b|\bdevice machines?\b|\bwaves?\b", re.I)  # a work session; ONNX Runtime's InferenceSession is fine


def _user_docs() -> list[Path]:
    return [p for p in _markdown_files() if MEASUREMENTS not in p.parents]


@pytest.mark.parametrize("pattern", [_ISSUE, _WORDS], ids=["issue numbers", "session words"])
def test_user_docs_speak_of_no_issues_or_sessions(pattern: re.Pattern):
    found = []
    for md in _user_docs():
        for n, line in enumerate(_text(md).splitlines(), 1):
            for m in pattern.finditer(line):
                found.append(f"{md.relative_to(REPO)}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not found, "\n".join(found)


def test_the_issue_pattern():
    for bad in ("issue 9 targets", "Issue 10's", "#11", "(#12)", "issues 9 and 10", "issue #4"):
        assert _ISSUE.search(bad), bad
    for good in ("&#123;", "a/b#3", "H200", "sm_90", "## Heading", "tissue 9"):
        assert not _ISSUE.search(good), good


# --------------------------------------------------------------------------------------------
# the package layout


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
