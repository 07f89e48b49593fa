"""The product speaks of the product: no issue numbers, machine names or dated measurements in the
package's text or in what its command line prints.

What is refused, on any line of ``convpass/**/*.py`` (code, comments, docstrings and strings
alike) and of the CLI's output for the sample model (``convpass optimize`` and ``convpass
inspect`` of ``models/residual_cnn.onnx``):

* issue numbers: ``issue 42``, ``Issue #42``;
* ISO dates (``2026-11-27``), except as part of a ``docs/measurements/`` path: the dated studies
  are where measurements live, and a comment may point to one for its figures;
* the words of a working log: ``device machine``, ``this session``;
* GPU names (:data:`GPU_NAMES`: H100, H200, A100, L4), unless the same line says ``e.g.`` or
  ``fingerprint``. That is the one allow-rule: a GPU name may stand only as an example of what a
  user types (``--device-name`` help, ``(e.g. H200, or a full fingerprint)``, a docstring showing
  how a fingerprint is matched), and such an example says so on its line. A figure measured on
  some GPU belongs in docs/measurements/, with the comment keeping the design reason and pointing
  there.

Every ``docs/measurements/`` study the package points to must exist.

The CLI is run with no GPU detected (``detect`` patched to None), so its output is the same on
every machine: on a GPU, ``optimize`` rightly names the user's own device.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "convpass"
SAMPLE = REPO / "models" / "residual_cnn.onnx"
GPU_NAMES = ("H100", "H200", "A100", "L4")

EXEMPT: tuple[str, ...] = ()  # every file of the package is scanned

_ISSUE = re.compile(r"\b[Ii]ssues?\s*#?\d")
_DATE = re.compile(r"(?<!docs/measurements/)\b20\d\d-[01]\d-[0-3]\d\b")
_LOG_WORDS = re.compile(r"device machine|this session", re.IGNORECASE)
_GPU = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(GPU_NAMES) + r")s?(?![A-Za-z0-9])")
_EXAMPLE = re.compile(r"e\.g\.|fingerprint", re.IGNORECASE)


def refused(line: str) -> str | None:
    """What ``line`` says that the product must not (the first such word), else None."""
    for pattern, what in ((_ISSUE, "an issue number"), (_DATE, "a date"), (_LOG_WORDS, "a working-log word")):
        m = pattern.search(line)
        if m:
            return f"{what} ({m.group(0)!r})"
    m = _GPU.search(line)
    if m and not _EXAMPLE.search(line):
        return f"a GPU name ({m.group(0)!r}) outside an example (say 'e.g.' on the line)"
    return None


def findings(text: str, where: str) -> list[str]:
    return [f"{where}:{n}: {why}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if (why := refused(line))]


def package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if not EXEMPT or not p.relative_to(REPO).as_posix().startswith(EXEMPT))


@pytest.mark.parametrize("line", [
    "# on an H200 (cuDNN 9.19) the same algorithm ran 1.5-5x slower",
    "two runs on H200s", "in two 2-H200 fleet checks", "an A100 at batch 32", "the L4 ran it",
    "see issue 42", "Issue #9 targets", "(2026-11-27: a third of a cached re-run)",
    "measured on the device machine", "as this session found",
])
def test_each_refused_word_is_caught(line):
    assert refused(line) is not None


@pytest.mark.parametrize("line", [
    'help="part of the GPU name, e.g. H200, or a full fingerprint"',
    '"""Whether a user\'s ``--device-name`` (e.g. ``H200`` or ``NVIDIA H100 80GB HBM3``) names it."""',
    "(docs/measurements/2026-11-23-conv-epilogues.md)",
    "sess = ort.InferenceSession(path)", "L40S", "kernel_L4x", "issue a warning", "H1000",
])
def test_examples_measurement_links_and_ordinary_words_pass(line):
    assert refused(line) is None


def test_the_package_speaks_of_the_product():
    files = package_files()
    assert len(files) > 100  # the scan reaches the package
    found = [f for p in files for f in findings(p.read_text(encoding="utf-8"), p.relative_to(REPO).as_posix())]
    assert not found, "\n".join(found)


def test_every_study_the_package_points_to_exists():
    linked = {m for p in PACKAGE.rglob("*.py") for m in re.findall(r"docs/measurements/[\w.-]+\.md", p.read_text(encoding="utf-8"))}
    assert linked  # the package points to its studies
    assert [m for m in sorted(linked) if not (REPO / m).is_file()] == []


def test_the_cli_output_speaks_of_the_product(tmp_path, capsys, monkeypatch):
    import convpass.native.device
    from convpass.cli.main import main

    monkeypatch.setattr(convpass.native.device, "detect", lambda: None)
    monkeypatch.setenv("CONVPASS_CACHE", str(tmp_path / "cache.db"))
    tuned = tmp_path / "tuned.onnx"
    assert main(["optimize", str(SAMPLE), "-o", str(tuned)]) == 0
    optimized = capsys.readouterr()
    assert main(["inspect", str(tuned)]) == 0
    inspected = capsys.readouterr()
    assert "6 convolutions" in optimized.err and "fwd|" in inspected.out  # the output was read
    found = (findings(optimized.out, "optimize stdout") + findings(optimized.err, "optimize stderr")
             + findings(inspected.out, "inspect stdout") + findings(inspected.err, "inspect stderr"))
    assert not found, "\n".join(found)
