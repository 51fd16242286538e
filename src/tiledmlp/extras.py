"""The install command of an optional extra, in the form that works where the user is: from a
checkout of tiledmlp that this package runs from, the editable install with the checkout's
constraints (relative paths when the working folder is the checkout, absolute ones elsewhere);
otherwise the published package's extra (`pip install 'tiledmlp[bench]'`).

Invariant: the command names only paths that exist (a constraints file is named only when it is
there).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["checkout_root", "install_command"]


def checkout_root() -> Path | None:
    """The checkout this package runs from (the folder of tiledmlp's pyproject.toml above
    src/tiledmlp), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    project = root / "pyproject.toml"
    try:
        text = project.read_text(encoding="utf-8")
    except OSError:
        return None
    return root if 'name = "tiledmlp"' in text else None


def install_command(*extras: str) -> str:
    """`pip install ...` that adds `extras` (e.g. install_command("bench")), as it works from
    the current folder."""
    names = ",".join(extras)
    root = checkout_root()
    if root is None:
        return f"pip install 'tiledmlp[{names}]'"
    here = Path.cwd().resolve() == root
    constraints = root / "constraints.txt"
    pin = ""
    if constraints.is_file():
        pin = "-c constraints.txt " if here else f"-c {constraints} "
    target = "." if here else str(root)
    return f"pip install {pin}-e '{target}[{names}]'"
