"""Checkpoints of `tiledmlp train` that survive a kill, and the choice of one to resume from.

A checkpoint is written by every rank into OUTPUT_DIR/.incomplete/checkpoint-N and, once all of
them are done, renamed to OUTPUT_DIR/checkpoint-N by the main process (a rename within one
directory tree is atomic): a run killed while saving leaves the previous checkpoints whole and
the unfinished one under .incomplete/, which no resume picks. `--resume-from-checkpoint latest`
takes the newest complete checkpoint-N (one whose trainer_state.json, written last, exists),
with a one-line note for each one it skips; a checkpoint whose files are damaged (truncated,
not what their name says) is an error naming the file, before training starts.

Invariant: OUTPUT_DIR/checkpoint-N exists only once every file of it is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "STAGING",
    "check_checkpoint",
    "damage",
    "incomplete_reason",
    "newest_checkpoint",
    "publish",
    "resolve_resume",
]

STAGING = ".incomplete"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_STATE = "trainer_state.json"  # the Trainer writes it after everything else


def _checkpoints(folder: Path) -> list[Path]:
    """checkpoint-N directories in `folder`, newest (highest N) first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found, reverse=True) if p.is_dir()]


def newest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint-N in `folder`, or None."""
    for path in _checkpoints(folder):
        if incomplete_reason(path) is None:
            return path
    return None


def incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None when it is."""
    if not (path / _STATE).is_file():
        return f"no {_STATE} (its save did not finish)"
    return None


def damage(path: Path) -> str | None:
    """Why this file cannot be what its name says, or None. Cheap checks (headers and
    directories, not every byte): safetensors' header against the file size, a torch.save zip
    archive's central directory, JSON parsing."""
    name = path.name
    try:
        if name.endswith(".safetensors"):
            size = path.stat().st_size
            with path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    return f"{size} bytes, shorter than a safetensors header"
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    return f"its header claims {n} bytes, the file has {size}"
                header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                      default=0)  # fmt: skip
            if 8 + n + end != size:
                return f"truncated: {size} bytes, its header describes {8 + n + end}"
        elif name.endswith((".pt", ".pth", ".bin")) and zipfile.is_zipfile(path) is False:
            return "not a complete torch.save archive (no zip directory at its end: truncated?)"
        elif name.endswith(".pt") or name.endswith(".pth") or name.endswith(".bin"):
            with zipfile.ZipFile(path) as z:
                z.infolist()
        elif name.endswith(".json"):
            json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, IndexError, zipfile.BadZipFile) as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_checkpoint(path: Path) -> None:
    """Raises ValueError naming the first damaged file of checkpoint `path`."""
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        why = damage(file)
        if why is not None:
            raise ValueError(
                f"--resume-from-checkpoint: {file} is damaged ({why}); resume from an earlier "
                f"checkpoint or remove {path}"
            )


def resolve_resume(spec: str, output_dir: Path, note: Callable[[str], None]) -> Path | None:
    """The checkpoint to resume from for --resume-from-checkpoint `spec` (a directory or
    "latest"; None when "latest" finds none), calling `note` once per checkpoint skipped.
    Raises ValueError for an explicit directory that is incomplete, and for damaged files."""
    if spec != "latest":
        path = Path(spec)
        why = incomplete_reason(path)
        if why is not None:
            raise ValueError(
                f"--resume-from-checkpoint {path}: not a complete checkpoint ({why}); use "
                "'latest' to take the newest complete one"
            )
        check_checkpoint(path)
        return path
    for unfinished in _checkpoints(output_dir / STAGING):
        note(f"skipping {unfinished}: its save did not finish")
    for path in _checkpoints(output_dir):
        why = incomplete_reason(path)
        if why is None:
            check_checkpoint(path)
            return path
        note(f"skipping {path}: {why}")
    return None


def publish(staged: Path, final: Path) -> None:
    """Moves a completely written checkpoint into place (replacing one of the same name, which
    stays whole until the new one is there)."""
    old = final.with_name(f"{STAGING}-replaced-{final.name}")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    with contextlib.suppress(OSError):  # the staging directory, once nothing else is in it
        staged.parent.rmdir()


def _fsync_dir(folder: Path) -> None:
    """Makes a rename in `folder` durable (where the platform allows opening directories)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
