"""Training text, tokenizers and packing into fixed-length sequences.

Default corpus: the Python standard library's own source files (always present, nothing
downloaded). Local corpora: a .txt file (its text), a .jsonl file (the "text" field of each
line) or a .csv file (its "text" column). Presets use the byte-level tokenizer (train/tokenizer.py);
a local model directory brings its own tokenizer.

Invariant: packing is deterministic for a given corpus, tokenizer and sequence length; every
sequence has exactly seq_len tokens (the remainder is dropped).
"""

from __future__ import annotations

import csv
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["PackedDataset", "default_corpus", "pack", "read_corpus"]


def default_corpus(max_bytes: int) -> Iterator[str]:
    """Source files of the standard library, in a fixed order, up to about max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def read_corpus(path: Path, max_bytes: int) -> Iterator[str]:
    """Texts of a local .txt, .jsonl ("text" field of each line) or .csv ("text" column) file.

    Raises:
        ValueError: the file is missing, is not UTF-8 text, or lacks the "text" field/column;
            the message names the file (and the line).
    """
    if not path.is_file():
        raise ValueError(f"--data: {path} is not a file; expected a .txt, .jsonl or .csv file")
    try:
        yield from _read(path, max_bytes)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--data: {path} is not UTF-8 text (byte {e.start}: {e.reason}); expected a .txt, "
            ".jsonl or .csv file"
        ) from None


def _read(path: Path, max_bytes: int) -> Iterator[str]:
    total = 0
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record: Any = json.loads(line)
                except json.JSONDecodeError as e:
                    what = e.msg.removesuffix(" at")  # "Invalid control character at"
                    raise ValueError(
                        f"--data: {path}:{n} is not valid JSON ({what} at column {e.colno}); "
                        'each line must be one JSON object with a "text" field'
                    ) from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'--data: {path}:{n} has no string field "text"')
                yield record["text"]
                total += len(record["text"])
                if total >= max_bytes:
                    return
        return
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or "text" not in reader.fieldnames:
                raise ValueError(
                    f'--data: {path} has no "text" column (columns: {reader.fieldnames}); '
                    'expected a header row naming a "text" column'
                )
            for row in reader:
                text = row["text"] or ""
                yield text
                total += len(text)
                if total >= max_bytes:
                    return
        return
    with path.open(encoding="utf-8") as f:
        yield f.read(max_bytes)


def pack(texts: Iterator[str], encode: Any, seq_len: int, max_sequences: int) -> torch.Tensor:
    """Concatenates the token ids of `texts` and cuts them into sequences of seq_len tokens.

    Returns:
        (sequences, seq_len) int64; raises ValueError when not even one sequence fits.
    """
    buf: list[int] = []
    need = seq_len * max_sequences
    for text in texts:
        buf.extend(encode(text))
        if len(buf) >= need:
            break
    count = min(len(buf) // seq_len, max_sequences)
    if count == 0:
        raise ValueError(
            f"the corpus has {len(buf)} tokens, fewer than one sequence of --seq-len {seq_len}; "
            "use a larger corpus or a shorter --seq-len"
        )
    return torch.tensor(buf[: count * seq_len], dtype=torch.int64).view(count, seq_len)


class PackedDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Packed sequences as causal-LM examples: input_ids and labels (the same ids; the model
    shifts them)."""

    def __init__(self, sequences: torch.Tensor) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return int(self.sequences.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.sequences[index]
        return {"input_ids": ids, "labels": ids}
