"""Every runnable Python block of the README and docs/ stands alone: each name it uses is
imported or defined in the block itself (or is a builtin), so a reader can copy one block and
run it without the blocks before it. Checked statically (the blocks themselves run in
test_docs.py)."""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

import pytest

from test_docs import PAGES, ROOT, code_blocks


def _free_names(code: str) -> set[str]:
    """Global names a block reads but never binds (imports, assignments, defs, loop targets)."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    bound |= {t.get_name() for t in top.get_children()}  # functions and classes defined
    free: set[str] = set()

    def walk(table: symtable.SymbolTable, top_level: bool) -> None:
        for sym in table.get_symbols():
            if not sym.is_referenced():
                continue
            unbound_here = top_level and not (sym.is_assigned() or sym.is_imported())
            if unbound_here or (not top_level and sym.is_global()):
                free.add(sym.get_name())
        for child in table.get_children():
            walk(child, top_level=False)

    walk(top, top_level=True)
    return {n for n in free if n not in bound and not hasattr(builtins, n)}


_BLOCKS = [
    (page, line, code)
    for page in PAGES
    for line, code, skip in code_blocks(page, "python")
    if skip is None
]


@pytest.mark.parametrize(
    ("page", "line", "code"),
    _BLOCKS,
    ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in _BLOCKS],
)
def test_each_python_block_stands_alone(page: Path, line: int, code: str) -> None:
    free = _free_names(code)
    assert not free, (
        f"{page.relative_to(ROOT)}:{line} uses {sorted(free)} without importing or defining "
        "them: a block must run on its own"
    )
