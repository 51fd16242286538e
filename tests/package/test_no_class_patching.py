"""Instances, never classes: no source file assigns an attribute of a class at runtime.

Behaviour is swapped on instances (patching/) or through a hook the class reads (a context
variable, as `TilePlan.bounds` reads `walking_tiles`'s); a class attribute assigned at runtime
changes every instance in the process, other threads' included, and is not undone by an error
in between. Read from the source (AST): an assignment, augmented assignment or deletion of
`C.attr`, and `setattr(C, ...)` / `delattr(C, ...)`, where C names a class (a CamelCase name,
`cls`, `type(...)` or `....__class__`); class bodies define their attributes by plain names and
are not matched. Tests may patch classes (monkeypatch restores them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "tiledmlp"

# file -> why its class attribute assignment stays
ALLOWED = {
    # enable() wraps transformers' constructors so that every model built from then on comes
    # back patched (a model the caller never holds cannot be patched as an instance);
    # disable() puts the originals back
    "integrations/hf.py": "tiledmlp.enable() wraps PreTrainedModel's constructors",
}


def _names_a_class(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        name = node.id
        return name == "cls" or (name[:1].isupper() and any(c.islower() for c in name))
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "type" and len(node.args) == 1
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def class_assignments(source: str) -> list[tuple[int, str]]:
    """(line, code) of each assignment of a class attribute in `source` (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _names_a_class(node.args[0])
        ):
            found.append((node.lineno, ast.unparse(node)))
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and _names_a_class(t.value):
                    found.append((node.lineno, ast.unparse(t)))
    return found


def test_no_source_file_assigns_a_class_attribute() -> None:
    found = [
        f"{rel}:{line}: {code}"
        for path in sorted(SRC.rglob("*.py"))
        if (rel := str(path.relative_to(SRC))) not in ALLOWED
        for line, code in class_assignments(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "swap behaviour on instances or through a hook, not on classes:\n" + "\n".join(found)
    )


def test_every_allowed_file_still_assigns_one() -> None:
    stale = [rel for rel in ALLOWED if not class_assignments((SRC / rel).read_text("utf-8"))]
    assert not stale, f"no class attribute is assigned in {stale} any more: drop them from ALLOWED"


@pytest.mark.parametrize(
    "source",
    [
        "TilePlan.bounds = f\n",
        "def f(x):\n    TilePlan.bounds += x\n",
        "def f():\n    setattr(PreTrainedModel, 'from_pretrained', g)\n",
        "def f(x):\n    type(x).forward = g\n",
        "def f(x):\n    x.__class__.forward = g\n",
        "class A:\n    @classmethod\n    def f(cls):\n        cls.n = 1\n",
        "def f():\n    del Module.forward\n",
        "Plan.x, b = 1, 2\n",
    ],
)
def test_the_check_catches_a_class_attribute(source: str) -> None:
    assert class_assignments(source)


@pytest.mark.parametrize(
    "source",
    [
        "class A:\n    x = 1\n",  # a class body
        "def f(self):\n    self.x = 1\n",
        "def f(module):\n    setattr(module, 'x', 1)\n",
        "def f(self):\n    object.__setattr__(self, 'x', 1)\n",
        "MAX_TILES = 4\nconfig.MAX = 1\n",
    ],
)
def test_the_check_passes_instances_and_modules(source: str) -> None:
    assert not class_assignments(source)
