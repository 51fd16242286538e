"""tests/ mirrors src/tiledmlp/: every test folder is the folder of a package of the source
(tests/ops/loss/ for src/tiledmlp/ops/loss/), but the folders of tests that belong to no one
package (EXCEPTIONS); and a test whose docstring opens on a module of a sub-package
("plan/sim/deeper.py: ...") sits in that sub-package's folder, not in a folder above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SRC = ROOT / "src" / "tiledmlp"
# test folders that mirror no package of the source
EXCEPTIONS = {
    "package": "the whole package: docs, import layers, the layout map",
    "distributed": "the multi-process tests of every package, on one harness",
}


def _folders(tests: Path) -> list[Path]:
    return sorted(
        p.relative_to(tests)
        for p in tests.rglob("*")
        if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")
    )


def _unmirrored(tests: Path, src: Path) -> list[str]:
    """The test folders that are no package of the source (a folder of modules: plan/ is a
    namespace package) and no exception."""
    return [
        f"tests/{rel}: no package src/tiledmlp/{rel}; move its tests to the folder of the "
        "package they test, or name the folder in EXCEPTIONS"
        for rel in _folders(tests)
        if rel.parts[0] not in EXCEPTIONS and not any((src / rel).glob("*.py"))
    ]


def _above_their_subject(tests: Path, src: Path) -> list[str]:
    """The tests whose docstring's first line names a module of a sub-package below their own
    folder (in the same package)."""
    wrong = []
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests)
        if not folder.parts or folder.parts[0] in EXCEPTIONS:
            continue
        first = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        for cited in re.findall(r"[\w/]+\.py", first.split("\n")[0]):
            home = Path(cited).parent
            if (src / cited).is_file() and home.parts[: len(folder.parts)] == folder.parts:
                if home != folder:
                    wrong.append(
                        f"tests/{folder}/{path.name} tests {cited}: move it to tests/{home}/"
                    )
                break
    return wrong


def test_every_test_folder_mirrors_a_package_of_the_source() -> None:
    wrong = _unmirrored(TESTS, SRC)
    assert not wrong, "\n".join(wrong)


def test_a_test_of_a_sub_package_sits_in_its_folder() -> None:
    wrong = _above_their_subject(TESTS, SRC)
    assert not wrong, "\n".join(wrong)


def test_the_mirror_catches_what_it_forbids(tmp_path: Path) -> None:
    src, tests = tmp_path / "src", tmp_path / "tests"
    for package in ("plan", "plan/sim"):
        (src / package).mkdir(parents=True, exist_ok=True)
        (src / package / "__init__.py").touch()
    (src / "plan/sim/deeper.py").touch()
    (tests / "plan/simulator").mkdir(parents=True)
    (tests / "plan/test_deeper.py").write_text('"""plan/sim/deeper.py: one layer more."""\n')
    assert _unmirrored(tests, src) == [
        "tests/plan/simulator: no package src/tiledmlp/plan/simulator; move its tests to the "
        "folder of the package they test, or name the folder in EXCEPTIONS"
    ]
    assert _above_their_subject(tests, src) == [
        "tests/plan/test_deeper.py tests plan/sim/deeper.py: move it to tests/plan/sim/"
    ]
