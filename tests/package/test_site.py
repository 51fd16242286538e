"""The built site reads at 1280 px: scripts/check_site.py builds it, serves it on localhost,
opens the home, getting-started, benchmarks and long-context pages in headless Chromium and
measures, in the page,
every element whose content is wider than its box (clipped or behind a scroll bar). Skipped, with
the reason, where Chromium is not installed (Debian: apt-get install chromium)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _check_site() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_site", ROOT / "scripts" / "check_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_site"] = module
    spec.loader.exec_module(module)
    return module


check_site = _check_site()
needs_chromium = pytest.mark.skipif(
    check_site.chromium() is None,
    reason="no Chromium: the site's rendering is measured in headless Chromium "
    "(apt-get install chromium)",
)


@needs_chromium
def test_the_measurement_finds_a_cut_code_line_and_a_scrolled_table(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    wide = "x ──► " + "gate, up, act ─► down " * 12
    cells = "".join(f"<td>column {i} of a wide table</td>" for i in range(14))
    (site / "index.html").write_text(
        "<html><body><div class='md-content' style='width:600px'>"
        f"<pre><code style='display:block;overflow:auto'>{wide}</code></pre>"
        "<p>a paragraph that fits</p>"
        f"<div class='md-typeset__scrollwrap' style='overflow:auto'><table><tr>{cells}</tr>"
        "</table></div></div></body></html>"
    )
    lines = check_site.check(site, tmp_path / "shots", ("",))
    assert any(line.startswith("/: code ") and "gate, up, act" in line for line in lines), lines
    assert any(line.startswith("/: div ") and "column 0" in line for line in lines), lines
    assert not any("a paragraph that fits" in line for line in lines), lines
    assert (tmp_path / "shots" / "home.png").read_bytes().startswith(b"\x89PNG")


@needs_chromium
def test_the_sites_css_wraps_a_long_command_and_leaves_a_diagram_alone(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "extra.css").write_text((ROOT / "docs" / "stylesheets" / "extra.css").read_text())
    command = " && ".join(["pip install -c constraints.txt -e '.[hf]'"] * 6)
    diagram = "x ──► " + "gate, up, act ─► down " * 12

    def block(language: str, text: str) -> str:  # as pymdownx.highlight writes a code block
        return (
            f"<div class='language-{language} highlight'><pre><span></span>"
            f"<code style='display:block;overflow:auto'>{text}</code></pre></div>"
        )

    (site / "index.html").write_text(
        "<html><head><link rel='stylesheet' href='extra.css'></head><body>"
        "<div class='md-content' style='width:600px'><article class='md-typeset'>"
        f"{block('bash', command)}{block('text', diagram)}</article></div></body></html>"
    )
    lines = check_site.check(site, tmp_path / "shots", ("",))
    # the command wraps inside the column; the diagram keeps its lines (and is reported: on a
    # docs page it would have to be made narrower)
    assert not any("pip install" in line for line in lines), lines
    assert any(line.startswith("/: code ") and "gate, up, act" in line for line in lines), lines


@needs_chromium
@pytest.mark.slow  # builds the whole site (mkdocs, the API reference included)
def test_nothing_is_cut_on_the_home_getting_started_benchmarks_and_long_context_pages(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    check_site.build(site)
    lines = check_site.check(site, tmp_path / "shots")
    assert lines == [], "cut at 1280 px:\n" + "\n".join(lines)
    for name in ("home", "getting-started", "benchmarks", "guides-long-context"):
        assert (tmp_path / "shots" / f"{name}.png").stat().st_size > 10_000
