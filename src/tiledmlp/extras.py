"""The install command of an optional extra, in the form that works where the user is.

tiledmlp installs from a checkout. Run from a checkout (an editable install): the editable
install with the checkout's constraints, in relative paths when the working folder is the
checkout and absolute ones elsewhere. Installed from a local folder that is still there (pip's
direct_url.json): that folder with the extra. Otherwise: the extra's own packages, as the
installed package's metadata lists them.

Invariant: the command names only paths that exist and packages the extra lists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["checkout_root", "install_command"]

_DIST = "tiledmlp"


def checkout_root() -> Path | None:
    """The checkout this package runs from (the folder of tiledmlp's pyproject.toml above
    src/tiledmlp), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if f'name = "{_DIST}"' in text else None


def install_command(*extras: str) -> str:
    """`pip install ...` that adds `extras` (e.g. install_command("bench")), as it works from
    the current folder."""
    names = ",".join(extras)
    root = checkout_root()
    if root is not None:
        here = Path.cwd().resolve() == root
        constraints = root / "constraints.txt"
        pin = ""
        if constraints.is_file():
            pin = "-c constraints.txt " if here else f"-c {constraints} "
        return f"pip install {pin}-e '{'.' if here else root}[{names}]'"
    source = _installed_from()
    if source is not None:
        return f"pip install '{source}[{names}]'"
    packages = _packages_of(extras)
    if packages:
        return "pip install " + " ".join(f"'{p}'" if re.search(r"[<>=!~; ]", p) else p
                                         for p in packages)  # fmt: skip
    return f"pip install the {names} extra of tiledmlp"


def _installed_from() -> Path | None:
    """The local folder pip installed this package from (direct_url.json), if it still holds
    tiledmlp's pyproject.toml."""
    import importlib.metadata as md

    try:
        text = md.distribution(_DIST).read_text("direct_url.json")
    except md.PackageNotFoundError:
        return None
    if not text:
        return None
    url = urlparse(str(json.loads(text).get("url", "")))
    if url.scheme != "file":
        return None
    folder = Path(unquote(url.path))
    return folder if (folder / "pyproject.toml").is_file() else None


def _packages_of(extras: tuple[str, ...]) -> list[str]:
    """The requirements the installed package's metadata lists for `extras`."""
    import importlib.metadata as md

    try:
        requires = md.requires(_DIST) or []
    except md.PackageNotFoundError:
        return []
    out = []
    for line in requires:
        requirement, _, marker = line.partition(";")
        for extra in extras:
            if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", marker):
                out.append(requirement.strip())
    return out
