"""The layering contract, read from the source: every import in src/ goes down the layer map,
siblings never import each other, and no import circle exists (imports inside functions
count too).

The map (lowest first; see the README's layout section):

    ops, registrations                 torch only (and optional kernels); the declared table of
                                       the engines' checks and SP's attention backend (stdlib)
    sequence_parallel                  torch only
    config, models, process_memory     typed configuration; built-in models; process memory;
    allocator                          the CUDA allocator setting of the entry points
    extras                             the install command of an optional extra
    launcher                           whether a distributed launcher started the process
    module, patching                   TiledMLP; finding and patching MLPs of a model
    integrations                       engines and frameworks
    plan | bench | train               siblings: they share what lies below, never each other,
                                       nor the integrations (what a run needs of an engine is
                                       handed in from the cli: SIDEWAYS)
    the package facade (__init__)      re-exports the public API
    cli, __main__                      on top; nothing imports them

An import by name (importlib.import_module) counts as an import of every module a string of its
file names ("tiledmlp.x.y" or "tiledmlp.x.y:attribute"), and only the files in BY_NAME may import
by a computed name: the facades, from their own tables (downward), and the one late import that
goes up, LATE: tiledmlp/registrations.py imports the providers its table declares (in the
integrations and the patching layer) on first use, for the layers below them.

The project's tooling (benchmarks/: the GPU suite, the docs' figures and tables) stands outside
the installed package, above all of it: it may import any part of tiledmlp, and nothing in
src/ imports it (TOOLING).

Inside ops, the same rule one level down (OPS_LAYERS): tiling (tile plans and policies, the
shared gradient, state and probe pieces) is the floor; the ops (mlp, loss, attention,
offloading) stand on it as siblings, importing each other only where OPS_SIBLINGS declares it;
the ops facade (ops/__init__.py) and the list of custom operators (ops/library.py) sit on top.

Inside plan, the simulator (plan/sim: fake tensors tracked, records extended, the allocator
replayed) is a floor below the planner: it imports nothing of plan/ outside plan/sim.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "tiledmlp"

# top-level part of tiledmlp -> layer; a part may import only parts of a lower layer
LAYERS = {
    "ops": 0,
    "registrations": 0,
    "sequence_parallel": 1,
    "config": 2,
    "models": 2,
    "process_memory": 2,
    "allocator": 2,
    "extras": 2,
    "launcher": 2,
    "module": 3,
    "patching": 3,
    "integrations": 4,
    "plan": 5,
    "bench": 5,
    "train": 5,
    "": 6,  # the package facade, tiledmlp/__init__.py
    "cli": 7,
    "__main__": 8,
}
# sub-package of tiledmlp.ops -> layer ("" is the facade, ops/__init__.py)
OPS_LAYERS = {
    "tiling": 0,
    "mlp": 1,
    "loss": 1,
    "attention": 1,
    "offloading": 1,
    "library": 2,
    "": 2,
}
# (importer, imported) pairs of sibling ops allowed to meet; none today
OPS_SIBLINGS: set[tuple[str, str]] = set()
# (importer, imported) parts that may not meet although the map allows it: the siblings above
# the integrations leave engine internals to the cli, which hands in what a run needs
SIDEWAYS = {("plan", "integrations"), ("bench", "integrations"), ("train", "integrations")}
# the one import from a lower layer into a higher one: the declared registrations, imported by
# name on first use (its targets are checked by tests/package/test_registrations.py)
LATE = "tiledmlp.registrations"
# the modules that may call importlib.import_module with a computed name
BY_NAME = {LATE, "tiledmlp", "tiledmlp.ops", "tiledmlp.cli"}
# the bottom layers import no third-party package but these (each lazily where optional)
BOTTOM = {"ops", "registrations", "sequence_parallel"}
BOTTOM_THIRD_PARTY = {"torch", "triton", "numpy"}
# the checkout's tooling folder (not installed): src/ never imports it
TOOLING = "benchmarks"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


_IMPORTERS = {"import_module", "__import__"}


def _by_name(tree: ast.AST, modules: dict[str, Path]) -> tuple[list[tuple[str, int]], int | None]:
    """(module a string names, line) for a file that imports by name, and the line of its first
    import by a computed name (None if none)."""
    calls = [
        n for n in ast.walk(tree)
        if isinstance(n, ast.Call) and (getattr(n.func, "attr", None) in _IMPORTERS
                                        or getattr(n.func, "id", None) in _IMPORTERS)
    ]  # fmt: skip
    if not calls:
        return [], None
    computed = [c.lineno for c in calls if not (c.args and isinstance(c.args[0], ast.Constant))]
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            target = node.value.partition(":")[0]
            if target in modules:
                named.append((target, node.lineno))
    return named, (computed[0] if computed else None)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported name, line) of every import in the file; a `from package import submodule`
    names the submodule, not the package; a file that imports by name imports every module its
    strings name (module docstring)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, _ = _by_name(tree, modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found += [(s, node.lineno) for s in subs]
            if len(subs) < len(node.names):
                found.append((target, node.lineno))
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """The import graph between tiledmlp's modules, and the violations of the layer map."""
    modules = _modules(root)
    graph: dict[str, set[str]] = defaultdict(set)
    errors = []
    for name, path in modules.items():
        src = _part(name)
        _, computed = _by_name(ast.parse(path.read_text(encoding="utf-8")), modules)
        if computed is not None and name not in BY_NAME:
            errors.append(
                f"{path.relative_to(root)}:{computed}: {name} imports a module by a computed "
                f"name: only {sorted(BY_NAME)} may; import it by its literal name, or declare "
                "it in tiledmlp/registrations.py"
            )
        for target, line in _imports(name, path, modules):
            where = f"{path.relative_to(root)}:{line}"
            top = target.split(".")[0]
            if top == TOOLING:
                errors.append(
                    f"{where}: {name} imports {target}: the installed package never imports "
                    f"the checkout's tooling ({TOOLING}/); move the piece it needs into src/"
                )
                continue
            if top != PACKAGE:
                if src in BOTTOM and top not in BOTTOM_THIRD_PARTY and top not in _STDLIB:
                    errors.append(f"{where}: {name} ({src}) imports {target}: torch only here")
                continue
            if target not in modules or target == name or name == LATE:
                continue
            graph[name].add(target)
            dst = _part(target)
            if (src, dst) in SIDEWAYS:
                errors.append(
                    f"{where}: {name} ({src}) imports {target} ({dst}): {src} leaves engine "
                    "internals to the cli, which hands in what it needs (SIDEWAYS)"
                )
            elif src != dst and LAYERS[dst] >= LAYERS[src]:
                errors.append(
                    f"{where}: {name} (layer {src or 'facade'}) imports {target} (layer "
                    f"{dst or 'facade'}): only lower layers may be imported"
                )
    return graph, errors


_STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {_part(m) for m in _modules(SRC)}
    assert parts <= LAYERS.keys(), f"add {sorted(parts - LAYERS.keys())} to LAYERS"


def test_imports_go_down_the_layer_map() -> None:
    _, errors = _graph(SRC)
    assert not errors, "\n".join(errors)


def test_no_import_circle() -> None:
    graph, _ = _graph(SRC)
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"ops/a.py": "from tiledmlp.patching import b\n", "patching/b.py": ""}, "layer ops"),
        ({"plan/a.py": "from tiledmlp.bench.b import x\n", "bench/b.py": ""}, "layer plan"),
        ({"ops/a.py": "def f():\n    import transformers\n"}, "torch only here"),
        ({"cli/a.py": "def f():\n    from benchmarks import suite\n"}, "never imports"),
        ({"ops/a.py": "from tiledmlp.ops import b\n", "ops/b.py": "from . import a\n"}, "circle"),
        (
            {"train/a.py": "from tiledmlp.integrations import b\n", "integrations/b.py": ""},
            "SIDEWAYS",
        ),
        (
            {
                "ops/a.py": "import importlib\nimportlib.import_module('tiledmlp.patching.b')\n",
                "patching/b.py": "",
            },
            "layer ops",
        ),
        (
            {
                "ops/a.py": "import importlib\nT = {'x': 'tiledmlp.patching.b:f'}\n"
                "def f(k):\n    return importlib.import_module(T[k])\n",
                "patching/b.py": "",
            },
            "computed name",
        ),
        (
            {
                "sequence_parallel/a.py": "def f():\n    return __import__('tiledmlp.patching.b')\n",
                "patching/b.py": "",
            },
            "layer sequence_parallel",
        ),
    ],
)
def test_the_contract_catches_what_it_forbids(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    for rel, text in {"__init__.py": "", **files}.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    graph, errors = _graph(tmp_path)
    found = errors + [f"circle {c}" for c in _cycles(graph)]
    assert any(expected in e for e in found), found


def _ops_part(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def _ops_errors(root: Path) -> list[str]:
    """The imports inside tiledmlp.ops that break OPS_LAYERS (module docstring)."""
    modules = _modules(root)
    errors = []
    for name, path in modules.items():
        if _part(name) != "ops":
            continue
        src = _ops_part(name)
        for target, line in _imports(name, path, modules):
            if target not in modules or _part(target) != "ops":
                continue
            dst = _ops_part(target)
            if src == dst or (src, dst) in OPS_SIBLINGS:
                continue
            if OPS_LAYERS.get(dst, 99) >= OPS_LAYERS.get(src, -1):
                errors.append(
                    f"{path.relative_to(root)}:{line}: {name} (ops.{src or 'facade'}) imports "
                    f"{target} (ops.{dst or 'facade'}): inside ops only lower layers may be "
                    "imported (tiling, then the ops as siblings, then the facade)"
                )
    return errors


def test_every_sub_package_of_ops_has_a_layer() -> None:
    parts = {_ops_part(m) for m in _modules(SRC) if _part(m) == "ops"}
    assert parts <= OPS_LAYERS.keys(), f"add {sorted(parts - OPS_LAYERS.keys())} to OPS_LAYERS"


def test_ops_import_down_their_layer_map() -> None:
    errors = _ops_errors(SRC)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"ops/tiling/a.py": "from tiledmlp.ops.mlp import b\n", "ops/mlp/b.py": ""}, "ops.tiling"),
        ({"ops/loss/a.py": "from tiledmlp.ops.mlp.b import x\n", "ops/mlp/b.py": ""}, "ops.loss"),
        ({"ops/mlp/a.py": "def f():\n    from tiledmlp.ops import b\n", "ops/b.py": ""}, "ops.mlp"),
    ],
)
def test_the_ops_contract_catches_what_it_forbids(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    for rel, text in {"__init__.py": "", **files}.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in (path.parent, *path.parent.parents):
            if folder == tmp_path:
                break
            (folder / "__init__.py").touch()
        path.write_text(text)
    errors = _ops_errors(tmp_path)
    assert any(f"({expected})" in e for e in errors), errors


def _sim_errors(root: Path) -> list[str]:
    """The imports from plan/sim into plan/ proper (module docstring)."""
    modules = _modules(root)
    sim = f"{PACKAGE}.plan.sim"
    errors = []
    for name, path in modules.items():
        if name != sim and not name.startswith(f"{sim}."):
            continue
        for target, line in _imports(name, path, modules):
            if _part(target) == "plan" and target != sim and not target.startswith(f"{sim}."):
                errors.append(
                    f"{path.relative_to(root)}:{line}: {name} imports {target}: the simulator "
                    "(plan/sim) is a floor below the planner; move the piece down into "
                    "plan/sim or pass it in"
                )
    return errors


def test_the_simulator_imports_nothing_of_the_planner() -> None:
    errors = _sim_errors(SRC)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    "text",
    [
        "from tiledmlp.plan.forked import beside\n",
        "def f():\n    from tiledmlp.plan import apply_stack\n",
        "import tiledmlp.plan.estimate\n",
        "from .. import forked\n",
    ],
)
def test_the_simulator_contract_catches_what_it_forbids(tmp_path: Path, text: str) -> None:
    files = {"plan/sim/a.py": text, "plan/forked.py": "", "plan/apply_stack.py": "",
             "plan/estimate.py": "", "plan/sim/b.py": ""}  # fmt: skip
    for rel, body in {"__init__.py": "", **files}.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in (path.parent, *path.parent.parents):
            if folder == tmp_path:
                break
            (folder / "__init__.py").touch()
        path.write_text(body)
    assert _sim_errors(tmp_path), text
    (tmp_path / PACKAGE / "plan/sim/a.py").write_text("from tiledmlp.plan.sim import b\n")
    assert not _sim_errors(tmp_path)


def test_the_tooling_stays_out_of_the_installed_package() -> None:
    """The wheel carries src/ only (pyproject: packages found under src): the checkout's tooling
    is a folder beside it, not a part of tiledmlp, and imports tiledmlp like any user does."""
    root = SRC.parent
    tooling = root / TOOLING
    assert (tooling / "__init__.py").is_file()
    assert not (SRC / PACKAGE / TOOLING).exists()
    pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    assert 'where = ["src"]' in pyproject, "the wheel must be built from src/ only"
