"""A cache of the planner's answers on disk, so that a question asked before is answered without
building a model or importing transformers.

An answer is stored under the hash of what decides it: the model's configuration (its fields
as written, a preset's or a config.json's), the options asked, and the planner's version (the
hash of tiledmlp's own source files and the versions of torch and transformers). A change to
any of them is a different key, so a stale answer is never read. Files live under the user's
cache folder ($XDG_CACHE_HOME/tiledmlp/plan, else ~/.cache/tiledmlp/plan), one JSON file per
key, written whole and renamed into place.

Invariant: a read returns exactly what was stored for the same key, or None (missing,
unreadable, damaged or another key's file); a failed write loses only the saving, never the
answer. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["cache_dir", "cache_key", "config_fields", "load", "planner_version", "store"]

_FORMAT = 1  # the layout of a cache file; a new layout is a new key
_PACKAGE = Path(__file__).resolve().parents[1]  # src/tiledmlp
_VERSION: list[str] = []  # the planner's version, computed once per process


def cache_dir() -> Path:
    """The folder the answers are kept in: $XDG_CACHE_HOME/tiledmlp/plan, else
    ~/.cache/tiledmlp/plan (the XDG base directory convention)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tiledmlp" / "plan"


def planner_version() -> str:
    """A hash of everything that can change an estimate: the source of every tiledmlp module
    (the planner runs the features' own code on fake tensors) and the installed torch and
    transformers (the models' code)."""
    if not _VERSION:
        digest = hashlib.sha256(f"format {_FORMAT}".encode())
        for path in sorted(_PACKAGE.rglob("*.py")):
            digest.update(str(path.relative_to(_PACKAGE)).encode())
            digest.update(path.read_bytes())
        for package in ("torch", "transformers"):
            try:
                digest.update(f"{package} {metadata.version(package)}".encode())
            except metadata.PackageNotFoundError:
                digest.update(f"{package} none".encode())
        _VERSION.append(digest.hexdigest())
    return _VERSION[0]


def config_fields(name_or_path: str, presets: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """What identifies a model's configuration without building it: a preset's fields (with
    the preset's name), or a config.json's contents (the file, or the one in a folder); None
    when `name_or_path` is neither (the caller reports that, not the cache)."""
    if name_or_path in presets:
        return {"preset": name_or_path, "fields": presets[name_or_path]}
    path = Path(name_or_path)
    file = path / "config.json" if path.is_dir() else path
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return {"config": values} if isinstance(values, dict) else None


def cache_key(kind: str, config: dict[str, Any], options: dict[str, Any]) -> str:
    """The key of a question: `kind` (what is asked), the configuration's fields, the options
    (JSON-able values; others by their repr) and the planner's version."""
    text = json.dumps(
        {"kind": kind, "config": config, "options": options, "planner": planner_version()},
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str) -> Any | None:
    """The answer stored under `key`, or None (module docstring: a damaged file is a miss)."""
    file = cache_dir() / f"{key}.json"
    try:
        stored = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or "answer" not in stored:
        logger.debug("plan cache: %s holds no answer for its key; ignored", file)
        return None
    return stored["answer"]


def store(key: str, answer: Any) -> None:
    """Keeps `answer` (JSON-able) under `key`; a folder that cannot be written is skipped."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    except OSError as e:
        logger.debug("plan cache: could not write to %s (%s)", folder, e)
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "answer": answer}, f)
        os.replace(tmp, folder / f"{key}.json")  # readers see the whole file or none
    except OSError as e:
        logger.debug("plan cache: could not write to %s (%s)", folder, e)
        Path(tmp).unlink(missing_ok=True)
