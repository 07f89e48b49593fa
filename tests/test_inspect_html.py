"""``convpass inspect --html``: a self-contained, well-formed page with one section per conv and
profile, the candidates the tuning cache timed as a chart, the margins, and every string from the
model escaped; rendered by a real browser engine where one is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import onnx
import pytest
from conftest import conv_model
from test_decide import H200, ROWS

from convpass.cli.main import main
from convpass.tuning.cache import TuningCache

VOID = {"meta", "input", "br", "img", "link", "hr", "rect"}  # rect: SVG, written self-closed
HOSTILE = "</script><script>alert(1)</script> <b>&amp; [bold]x"


class Page(HTMLParser):
    """Checks that every element is closed in order and collects the sections, the data block and
    anything that would fetch from elsewhere."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.sections: list[dict[str, str]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.fetches: list[str] = []
        self._script: dict[str, str | None] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for name in ("src", "href"):
            if a.get(name):
                self.fetches.append(f"{tag} {name}={a[name]}")
        if tag == "section":
            self.sections.append({k: v or "" for k, v in a.items()})
        if tag == "script":
            self._script, self._text = a, []
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass  # <rect .../>: opened and closed

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag == "script" and self._script is not None:
            self.scripts.append((self._script, "".join(self._text)))
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            self._text.append(data)


def _parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    assert not page.errors and page.stack == [], (page.errors, page.stack)
    assert not page.fetches and "url(" not in text and "@import" not in text
    return page


def _data(page: Page) -> dict:
    [block] = [body for attrs, body in page.scripts if attrs.get("type") == "application/json"]
    return json.loads(block)


@pytest.fixture
def tuned(tmp_path) -> tuple[Path, Path]:
    """A two-conv model tuned from a cache that timed 8 candidates of its conv geometry."""
    model = conv_model("Conv", ("n", 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    model.graph.node[0].name = HOSTILE
    with TuningCache(tmp_path / "c.db") as cache:
        cache.put(H200, ROWS)
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["-q", "optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"), "--shape", "x=1x3x8x8",
                 "--shape", "x=2x3x8x8", "--device-name", "H200", "--cache", str(tmp_path / "c.db"), "--no-kernels"]) == 0
    return tmp_path / "t.onnx", tmp_path / "c.db"


def test_one_section_per_conv_and_profile_with_candidates_and_margins(tuned, tmp_path, capsys):
    model, cache = tuned
    assert main(["inspect", str(model), "--html", str(tmp_path / "r.html"), "--cache", str(cache), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["records"]
    text = (tmp_path / "r.html").read_text()
    page = _parse(text)
    data = _data(page)
    assert data["schema"] == "convpass.inspect-html/1" and len(data["sections"]) == len(records) == len(page.sections) == 2
    first = data["sections"][0]
    assert first["node"] == HOSTILE and first["profile"] == "x=1x3x8x8"
    # the profile at batch 1 is the cache's geometry: 8 candidates timed, one that failed its check
    assert len(first["candidates"]) == 8 and first["not_run"] == {"wrong_result": 1}
    chosen = [c for c in first["candidates"] if c["chosen"]]
    assert [(c["algo"], c["layout"], c["math"], c["time_ms"]) for c in chosen] == [("implicit_gemm", "nhwc", "fma", 0.011)]
    assert first["runner_up"]["algo"] == "fft" and first["runner_up_margin"] == pytest.approx(0.012 / 0.011 - 1)
    assert first["heuristic_algo"] == "implicit_precomp_gemm" and first["heuristic_margin"] == pytest.approx(0.016 / 0.011 - 1)
    section = text[text.index('id="conv-0"'):text.index('id="conv-1"')]
    assert "9.1% slower than the choice" in section and "45.5% slower than the choice" in section
    assert section.count("<rect") == 8 and 'class="bar chosen"' in section and 'class="bar heuristic"' in section
    assert "TF32 off (FMA)" in section and "NHWC" in section
    # batch 2: no rows in the cache, so no decision either: the section says why
    assert "Candidates are not available" in text[text.index('id="conv-1"'):]


def test_strings_from_the_model_are_escaped(tuned, tmp_path):
    model, cache = tuned
    assert main(["inspect", str(model), "--html", str(tmp_path / "r.html"), "--cache", str(cache)]) == 0
    text = (tmp_path / "r.html").read_text()
    assert "<script>alert(1)" not in text and "<b>" not in text
    assert text.count("<script") == 2  # the data block and the page's own script
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt; &lt;b&gt;&amp;amp; [bold]x" in text
    assert _data(_parse(text))["sections"][0]["node"] == HOSTILE


def test_without_a_cache_the_page_says_candidates_are_not_available(tuned, tmp_path, capsys):
    model, _ = tuned
    assert main(["inspect", str(model), "--html", str(tmp_path / "r.html")]) == 0  # the default cache: none here
    text = (tmp_path / "r.html").read_text()
    page = _parse(text)
    assert len(page.sections) == 2 and text.count("Candidates are not available: no tuning cache at") == 2
    assert "implicit_gemm" in text  # what the model records is still shown
    assert main(["inspect", str(model), "--html", str(tmp_path / "s.html"), "--cache", str(tmp_path / "typo.db")]) == 1
    assert "--cache" in capsys.readouterr().err and not (tmp_path / "s.html").exists() and not (tmp_path / "typo.db").exists()


def test_the_sample_model_s_page(tmp_path):
    from conftest import REPO

    assert main(["-q", "optimize", str(REPO / "models" / "residual_cnn.onnx"), "-o", str(tmp_path / "t.onnx")]) == 0
    assert main(["-q", "inspect", str(tmp_path / "t.onnx"), "--html", str(tmp_path / "r.html")]) == 0
    page = _parse((tmp_path / "r.html").read_text())
    assert len(page.sections) == len(_data(page)["sections"]) == 6
    assert [s["data-node"] for s in page.sections][:2] == ["stem/conv", "block1/conv1"]


CHROMIUM = Path("/usr/bin/chromium")


def _render(page: Path, tmp_path: Path) -> str:
    """The DOM of ``page`` after a headless Chromium ran its script; fails on a script error."""
    done = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Uncaught" not in done.stderr, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install -y chromium)")
def test_a_headless_browser_renders_the_page_without_a_script_error(tuned, tmp_path):
    model, cache = tuned
    page = tmp_path / "r.html"
    assert main(["-q", "inspect", str(model), "--html", str(page), "--cache", str(cache)]) == 0
    dom = _render(page, tmp_path)
    assert re.search(r'<p id="convpass-rendered"[^>]*>report rendered: 2 sections</p>', dom)
    assert dom.count('<section class="conv"') == 2


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install -y chromium)")
def test_a_headless_browser_renders_the_sample_model_s_page(tmp_path):
    from conftest import REPO

    assert main(["-q", "optimize", str(REPO / "models" / "residual_cnn.onnx"), "-o", str(tmp_path / "t.onnx")]) == 0
    assert main(["-q", "inspect", str(tmp_path / "t.onnx"), "--html", str(tmp_path / "r.html")]) == 0
    assert re.search(r'<p id="convpass-rendered"[^>]*>report rendered: 6 sections</p>', _render(tmp_path / "r.html", tmp_path))
