"""The layout map of docs/contributing.md, rendered from the source: one line per module of
src/tiledmlp with the first sentence of its docstring (a package by its __init__.py), cut to
SUMMARY characters.

    python -m benchmarks.layout_map           # exit 1 when the page's map differs from the source
    python -m benchmarks.layout_map --write   # rewrite the page's map

Invariant: the text between the page's `<!-- layout-map -->` and `<!-- /layout-map -->` marks is
render() of the source (tests/package/test_layout_map.py).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import ROOT

__all__ = ["PAGE", "render", "update_page"]

PACKAGE = ROOT / "src" / "tiledmlp"
PAGE = ROOT / "docs" / "contributing.md"
OPEN, CLOSE = "<!-- layout-map -->", "<!-- /layout-map -->"
WIDTH = 34  # the column where the docstrings start
SUMMARY = 90  # the longest summary shown, in characters


def _first_line(path: Path) -> str:
    """The docstring's first sentence (its first paragraph up to ". "), cut at a word."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        return "(no docstring)"
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = paragraph.split(". ")[0].rstrip(".")
    if len(sentence) <= SUMMARY:
        return sentence
    return sentence[:SUMMARY].rsplit(" ", 1)[0] + " ..."


def _row(depth: int, name: str, text: str) -> str:
    head = "  " * depth + name
    return f"{head:<{WIDTH}}{text}" if len(head) < WIDTH else f"{head}  {text}"


def _rows(folder: Path, depth: int) -> list[str]:
    rows = []
    for path in sorted(folder.iterdir(), key=lambda p: (p.is_dir(), p.name)):
        if path.is_dir() and (path / "__init__.py").is_file():
            rows.append(_row(depth, path.name + "/", _first_line(path / "__init__.py")))
            rows += _rows(path, depth + 1)
        elif path.suffix == ".py" and path.name != "__init__.py":
            rows.append(_row(depth, path.name, _first_line(path)))
    return rows


def render(package: Path = PACKAGE) -> str:
    """The map as a fenced text block: the package, then each module and sub-package."""
    top = _row(0, "src/tiledmlp/", _first_line(package / "__init__.py"))
    return "\n".join(["```text", top, *_rows(package, 1), "```"])


def update_page(text: str, package: Path = PACKAGE) -> str:
    """The page with its map replaced by render()."""
    start, end = text.index(OPEN) + len(OPEN), text.index(CLOSE)
    return text[:start] + "\n" + render(package) + "\n" + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the page's map")
    args = parser.parse_args(argv)
    text = PAGE.read_text(encoding="utf-8")
    new = update_page(text)
    if args.write:
        PAGE.write_text(new, encoding="utf-8")
        return 0
    if new != text:
        print(f"{PAGE.relative_to(ROOT)}: the layout map differs from the source; run "
              "`python -m benchmarks.layout_map --write`", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
