"""docs/contributing.md's layout map is the source's: one line per module with its docstring's
first sentence (benchmarks/layout_map.py renders it; `python -m benchmarks.layout_map --write`
regenerates it)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import layout_map


def test_the_contributing_page_maps_every_module_as_the_source_describes_it() -> None:
    text = layout_map.PAGE.read_text(encoding="utf-8")
    assert layout_map.update_page(text) == text, (
        "docs/contributing.md's layout map differs from src/tiledmlp: run "
        "`python -m benchmarks.layout_map --write`"
    )


def test_a_new_module_changes_the_map(tmp_path: Path) -> None:
    package = tmp_path / "tiledmlp"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "ops" / "__init__.py").write_text('"""The ops.\n\nMore."""\n')
    page = "# Layout\n\n<!-- layout-map -->\n<!-- /layout-map -->\n"
    before = layout_map.update_page(page, package)
    assert "  ops/" in before and "The ops" in before and "More" not in before
    (package / "ops" / "new.py").write_text('"""A new module. Its second sentence."""\n')
    after = layout_map.update_page(page, package)
    assert after != before
    assert "    new.py" in after and "A new module" in after and "second" not in after
    assert layout_map.update_page(after, package) == after
