"""One tile-policy type inside the library: a spelling (an int, "auto", "arctic",
"target:<GB>") becomes a TilePolicy at an edge, and everything below takes the TilePolicy.

Held from the source (ast): outside EDGE_SIGNATURES no parameter or dataclass field in src/ is
annotated with a union of TilePolicy and int or str, and `TilePolicy.of` (the parser of the
Python spellings) is named only in EDGE_MODULES: the public ops that cannot import config
(tiled_mlp and the tiled losses) and config/values.py, the parser of everything above ops.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tiledmlp"

# module (relative to src/tiledmlp) -> the public functions there that take the spellings
EDGE_SIGNATURES = {
    "ops/tiling/policy.py": {"TilePolicy.of"},
    "ops/mlp/functional.py": {"tiled_mlp"},
    "ops/loss/cross_entropy.py": {
        "tiled_cross_entropy",
        "tiled_token_logprobs",
        "tiled_token_stats",
    },
}
# the modules that may call TilePolicy.of
EDGE_MODULES = {"ops/mlp/functional.py", "ops/loss/cross_entropy.py", "config/values.py"}

_SPELLINGS = {"int", "str"}


@functools.cache
def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _members(node: ast.expr | None) -> set[str]:
    """The names of a union annotation's members (`a | b`, Union[a, b], Optional[a], "a | b")."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _members(ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _members(node.left) | _members(node.right)
    if isinstance(node, ast.Subscript) and _name(node.value) in ("Union", "Optional"):
        inner = node.slice
        parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        return set().union(*(_members(p) for p in parts))
    name = _name(node)
    return {name} if name else set()


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _spelled(annotation: ast.expr | None) -> bool:
    members = _members(annotation)
    return "TilePolicy" in members and bool(members & _SPELLINGS)


def _annotated(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(qualified name of the function or class, line, parameter or field) of every
    parameter and class-level field whose annotation is a union of TilePolicy and a
    spelling."""
    found: list[tuple[str, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qual = prefix + child.name
                for item in child.body:
                    if isinstance(item, ast.AnnAssign) and _spelled(item.annotation):
                        target = item.target
                        field = target.id if isinstance(target, ast.Name) else "?"
                        found.append((qual, item.lineno, field))
                walk(child, qual + ".")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qual = prefix + child.name
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                params += [p for p in (a.vararg, a.kwarg) if p is not None]
                found.extend((qual, p.lineno, p.arg) for p in params if _spelled(p.annotation))
                walk(child, qual + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def _parser_uses(tree: ast.Module) -> list[int]:
    """The lines that name TilePolicy.of."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "of"
        and isinstance(node.value, ast.Name)
        and node.value.id == "TilePolicy"
    ]


def test_only_the_edges_take_a_spelled_tile_policy() -> None:
    bad = [
        f"src/tiledmlp/{rel}:{line}: {qual}({param}: ... TilePolicy | int/str ...)"
        for rel, tree in _modules()
        for qual, line, param in _annotated(tree)
        if qual not in EDGE_SIGNATURES.get(rel, set())
    ]
    assert not bad, (
        "below the edges a tile policy is a TilePolicy; these take a spelling too (parse it "
        "where the value enters: config/values.py, or a public op listed in EDGE_SIGNATURES, "
        "and annotate the parameter `TilePolicy`):\n" + "\n".join(bad)
    )


def test_the_spellings_are_parsed_only_at_the_edges() -> None:
    bad = [
        f"src/tiledmlp/{rel}:{line}"
        for rel, tree in _modules()
        if rel not in EDGE_MODULES
        for line in _parser_uses(tree)
    ]
    assert not bad, (
        "TilePolicy.of parses the Python spellings and is called only in "
        f"{sorted(EDGE_MODULES)}; these call it elsewhere (take a TilePolicy, or build one "
        "with TilePolicy(rule, amount) / config.values.parse_tile_policy):\n" + "\n".join(bad)
    )


def test_the_checks_see_what_they_look_for() -> None:
    """The detectors find each form of union and each way of naming the parser."""
    source = (
        "from typing import Optional, Union\n"
        "def a(x: int | str | TilePolicy): ...\n"
        "def b(x: 'Union[TilePolicy, int]'): ...\n"
        "def c(x: Optional[Union[str, tiling.TilePolicy]] = None): ...\n"
        "def d(x: TilePolicy | None, y: dict[str, TilePolicy]): ...\n"
        "class E:\n"
        "    x: TilePolicy | int = 1\n"
        "    def f(self, *, y: TilePolicy | str): return TilePolicy.of(y)\n"
    )
    tree = ast.parse(source)
    assert [(q, p) for q, _, p in _annotated(tree)] == [
        ("a", "x"),
        ("b", "x"),
        ("c", "x"),
        ("E", "x"),
        ("E.f", "y"),
    ]
    assert _parser_uses(tree) == [8]
