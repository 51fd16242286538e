"""Training text, tokenizers and packing into fixed-length sequences.

Default corpus: the Python standard library's own source files (always present, nothing
downloaded). Local corpora: a .txt file (its text) or a .jsonl file (the "text" field of each
line). Presets use a byte-level tokenizer (256 byte values + BOS/EOS); a local model directory
brings its own tokenizer.

Invariant: packing is deterministic for a given corpus, tokenizer and sequence length; every
sequence has exactly seq_len tokens (the remainder is dropped).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["ByteTokenizer", "default_corpus", "pack", "read_corpus"]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, BOS 256, EOS 257 (vocabulary 258)."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8"), self.eos_token_id]


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
    """Texts of a local .txt or .jsonl file (the "text" field of each JSON line)."""
    if not path.is_file():
        raise ValueError(f"--data: {path} is not a file; expected a .txt or .jsonl file")
    total = 0
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record: Any = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--data: {path}:{n} is not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'--data: {path}:{n} has no string field "text"')
                yield record["text"]
                total += len(record["text"])
                if total >= max_bytes:
                    return
        return
    text = path.read_text(encoding="utf-8")
    yield text[:max_bytes]


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
