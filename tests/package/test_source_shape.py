"""The source's shape: one concept per file, one home per option.

A file past 500 lines usually holds two concepts (split it along its seam); an option is
written in its schema (config/), its stack table and its feature (patching/features/), and
everything else derives from the schema.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tiledmlp"
MAX_LINES = 500


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_source_file_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _sources()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"split these along their seams (at most {MAX_LINES} lines): {long}"


MAX_DOCSTRING_LINES = 25


def test_every_module_docstring_is_at_most_25_lines() -> None:
    """A module's docstring says what it is and its invariant; how it works, measured figures
    and long reasons live in docs/how-it-works/ (module-notes.md), which a Note points to."""
    import ast

    long = {}
    for path in _sources():
        name = str(path.relative_to(PACKAGE))
        body = ast.parse(path.read_text(encoding="utf-8")).body
        assert body and isinstance(body[0], ast.Expr), f"{name} opens without a docstring"
        doc = body[0]
        lines = (doc.end_lineno or doc.lineno) - doc.lineno + 1
        if lines > MAX_DOCSTRING_LINES:
            long[name] = lines
    assert not long, (
        f"shorten these module docstrings to at most {MAX_DOCSTRING_LINES} lines (what the "
        f"module is and its invariant; the rest to docs/how-it-works/module-notes.md): {long}"
    )


def test_the_norms_switch_is_written_in_at_most_four_files() -> None:
    word = re.compile(r"\btiled_norms\b")
    files = [str(p.relative_to(PACKAGE)) for p in _sources() if word.search(p.read_text("utf-8"))]
    assert len(files) <= 4, f"tiled_norms is named in {len(files)} files: {files}"


# the planner's functions that are still longer: their closures share one search's state
LONG_PLANNER_FUNCTIONS: set[str] = set()
MAX_FUNCTION_LINES = 80


def test_no_planner_function_is_over_80_lines() -> None:
    """plan/ reads as named steps: a function past 80 lines (docstring included) is split into
    helpers with names and notes."""
    import ast

    long = {}
    for path in sorted((PACKAGE / "plan").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{path.relative_to(PACKAGE)}:{node.name}"
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and name not in LONG_PLANNER_FUNCTIONS:
                    long[name] = lines
    assert not long, f"split these into named helpers (at most {MAX_FUNCTION_LINES} lines): {long}"


MAX_PLANNER_DOCSTRING_LINES = 25


def test_planner_module_docstrings_are_at_most_25_lines() -> None:
    """A planner module's docstring states its purpose and invariant; measured figures and long
    explanations live in docs/how-it-works/planner.md, which it points to."""
    import ast

    long = {}
    for path in sorted((PACKAGE / "plan").rglob("*.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            lines = (first.end_lineno or first.lineno) - first.lineno + 1
            if lines > MAX_PLANNER_DOCSTRING_LINES:
                long[str(path.relative_to(PACKAGE))] = lines
    assert not long, (
        f"shorten these module docstrings to {MAX_PLANNER_DOCSTRING_LINES} lines (the long "
        f"explanation goes to docs/how-it-works/planner.md): {long}"
    )


def test_the_planner_s_pointers_into_its_docs_page_name_its_sections() -> None:
    """Every `docs/how-it-works/planner.md, "<section>"` a source file points to is a heading
    of that page."""
    page = (PACKAGE.parents[1] / "docs" / "how-it-works" / "planner.md").read_text("utf-8")
    headings = {line.lstrip("#").strip() for line in page.splitlines() if line.startswith("#")}
    pointer = re.compile(r'docs/how-it-works/planner\.md,\s+"([^"]+)"')
    missing = {
        f"{p.relative_to(PACKAGE)}: {m}"
        for p in _sources()
        for m in pointer.findall(p.read_text("utf-8"))
        if m not in headings
    }
    assert not missing, f"no such section in docs/how-it-works/planner.md: {sorted(missing)}"
