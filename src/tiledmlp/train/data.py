"""Training text: what `--data` reads, and packing it into fixed-length sequences.

Default corpus: the Python standard library's own source files (always present, nothing
downloaded). `--data` reads, by its suffix: plain text (.txt, .text, .md: the whole file is one
document), JSON Lines (.jsonl, .ndjson), a JSON array of records (.json), CSV (.csv), Parquet
(.parquet), Arrow (.arrow), or a folder written by `datasets.Dataset.save_to_disk` (a
DatasetDict's "train" split). Records give their text by one field (`--data-field`, default
"text"); a "messages" field of chat turns ({"role", "content"}) is rendered through the
tokenizer's chat template. Plain text and JSON Lines are read here; the other formats through the
Hugging Face `datasets` library (the `data` extra), and without it they are refused in one line
naming the install. Anything else is refused in one line naming the formats.

Invariant: packing is deterministic for a given corpus, tokenizer and sequence length; every
sequence has exactly seq_len tokens (the remainder is dropped); `Corpus` counts exactly the
documents and tokens that packing consumed.
"""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiledmlp.extras import install_command

__all__ = [
    "FORMATS",
    "encoder",
    "Corpus",
    "PackedDataset",
    "check_data",
    "data_format",
    "default_corpus",
    "open_corpus",
    "pack",
    "plural",
]

# suffix -> format name
FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
SAVED = "save_to_disk"  # the format name of a folder written by datasets' save_to_disk
_NEEDS_DATASETS = {"json", "csv", "parquet", "arrow", SAVED}
_KINDS = (
    ".txt/.md (plain text), .jsonl, .json (an array of records), .csv, .parquet, .arrow, or a "
    "folder written by datasets' save_to_disk"
)
CHAT_FIELD = "messages"

Document = str | list[dict[str, Any]]  # a text, or chat turns for the chat template


@dataclass
class Corpus:
    """What a run trained on: the `data` key of the summary."""

    files: list[str]
    format: str
    field: str | None
    documents: int = 0
    tokens: int = 0
    sequences: int = 0
    # the documents there are to read (within --max-data-bytes; None: not counted, a record past
    # those read could not be read) and whether --max-data-bytes stopped the reading before the end
    available: int | None = None
    cut_at_bytes: int | None = None
    # how many times the run reads each training sequence to fill its steps (1.0: once or less)
    repeats: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "format": self.format,
            "field": self.field,
            "documents": self.documents,
            "available_documents": self.available,
            "cut_at_bytes": self.cut_at_bytes,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "repeats": self.repeats,
        }


def data_format(path: Path) -> str:
    """The format of `path` (a FORMATS value or "save_to_disk").

    Raises:
        ValueError: missing path, an unknown suffix, or a folder that save_to_disk did not write.
    """
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return SAVED
        raise ValueError(
            f"--data: {path} is a folder but not one written by datasets' save_to_disk (no "
            f"state.json or dataset_dict.json); expected {_KINDS}"
        )
    if not path.is_file():
        raise ValueError(f"--data: {path} is not a file; expected {_KINDS}")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"--data: {path}: unknown format {path.suffix or '(no suffix)'!r}; expected {_KINDS}"
        )
    return fmt


def check_data(path: Path) -> str:
    """The format of `path`, checked before any work: known, and readable with what is
    installed (see data_format for the errors; also ValueError when `datasets` is needed and
    missing)."""
    fmt = data_format(path)
    if fmt in _NEEDS_DATASETS and importlib.util.find_spec("datasets") is None:
        what = "a save_to_disk folder" if fmt == SAVED else f"{fmt} files"
        raise ValueError(
            f"--data {path}: reading {what} needs the datasets library: {install_command('data')} (the data extra: datasets); plain text "
            "and .jsonl need nothing more"
        )
    return fmt


def default_corpus(max_bytes: int) -> tuple[Corpus, Iterator[Document]]:
    """Source files of the standard library, in a fixed order, up to about max_bytes."""
    corpus = Corpus(files=[], format="text", field=None)

    def texts() -> Iterator[Document]:
        root = Path(sysconfig.get_paths()["stdlib"])
        total = 0
        for path in sorted(root.glob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            corpus.files.append(str(path))
            yield text
            total += len(text)
            if total >= max_bytes:
                corpus.cut_at_bytes = max_bytes
                return

    return corpus, texts()


def open_corpus(
    path: Path, field_name: str | None, max_bytes: int
) -> tuple[Corpus, Iterator[Document]]:
    """The documents of `path` (see the module docstring), up to about max_bytes of text.

    Args:
        field_name: the records' text field; None: "text", else "messages" (chat turns).

    Raises:
        ValueError: one line naming the file (and the line or record): unknown format, not
            UTF-8, not valid JSON, no such field, a field that is not text or chat turns.
    """
    fmt = check_data(path)
    corpus = Corpus(files=[str(path)], format=fmt, field=None if fmt == "text" else field_name)
    if fmt == "text":
        return corpus, _limited(_plain_text(path, max_bytes), max_bytes, corpus)
    records = _jsonl(path) if fmt == "jsonl" else _with_datasets(path, fmt)
    return corpus, _limited(_documents(path, records, field_name, corpus), max_bytes, corpus)


def _limited(docs: Iterator[Document], max_bytes: int, corpus: Corpus) -> Iterator[Document]:
    total = 0
    for doc in docs:
        yield doc
        total += len(doc) if isinstance(doc, str) else sum(len(str(t)) for t in doc)
        if total >= max_bytes:
            corpus.cut_at_bytes = max_bytes
            return


def _plain_text(path: Path, max_bytes: int) -> Iterator[Document]:
    try:
        with path.open(encoding="utf-8") as f:
            text = f.read(max_bytes)
            if text.strip():  # an empty file is no document (not one of zero tokens)
                yield text
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--data: {path} is not UTF-8 text (byte {e.start}: {e.reason}); expected {_KINDS}"
        ) from None


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for each non-blank line."""
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    what = e.msg.removesuffix(" at")  # "Invalid control character at"
                    raise ValueError(
                        f"--data: {path}:{n} is not valid JSON ({what} at column {e.colno}); "
                        "each line must be one JSON object"
                    ) from None
                yield f"{path}:{n}", record
    except UnicodeDecodeError as e:
        raise ValueError(f"--data: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def _with_datasets(path: Path, fmt: str) -> Iterator[tuple[str, Any]]:
    """(where, record) read by the `datasets` library, streamed (nothing cached)."""
    import datasets

    try:
        if fmt == SAVED:
            loaded: Any = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ValueError(
                        f"--data: {path} holds the splits {', '.join(loaded)}, no 'train'; save "
                        "the split to train on with save_to_disk"
                    )
                loaded = loaded["train"]
        else:
            loaded = datasets.load_dataset(fmt, data_files=str(path), split="train", streaming=True)
        for n, record in enumerate(loaded):
            yield f"{path} record {n}", record
    except ValueError as e:
        if str(e).startswith("--data"):
            raise
        raise ValueError(f"--data: {path} could not be read as {fmt} ({_first_line(e)})") from None
    except Exception as e:  # pyarrow and datasets errors: malformed files
        raise ValueError(f"--data: {path} could not be read as {fmt} ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _documents(
    path: Path, records: Iterable[tuple[str, Any]], field_name: str | None, corpus: Corpus
) -> Iterator[Document]:
    """Each record's text (or chat turns), by `field_name` (None: "text", else "messages")."""
    for where, record in records:
        if not isinstance(record, dict):
            raise ValueError(
                f"--data: {where} holds {type(record).__name__}, not a record (an object with a "
                '"text" or "messages" field)'
            )
        name = field_name
        if name is None:
            name = "text" if "text" in record else CHAT_FIELD if CHAT_FIELD in record else "text"
        if name not in record:
            fields = ", ".join(map(str, record)) or "none"
            raise ValueError(
                f'--data: {where} has no field "{name}" (fields: {fields}); choose one with '
                "--data-field"
            )
        if corpus.field is None:
            corpus.field = name
        elif corpus.field != name:
            raise ValueError(
                f'--data: {where} has no "{corpus.field}" field like the records before it; '
                "give every record the same field"
            )
        value = record[name]
        if isinstance(value, str):
            yield value
        elif _is_chat(value):
            yield list(value)
        else:
            raise ValueError(
                f'--data: {where}: field "{name}" holds {type(value).__name__}; expected text '
                'or chat turns (a list of {"role": ..., "content": ...})'
            )


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, dict) and "role" in t and "content" in t for t in value)
    )


def encoder(tokenizer: Any, model: str) -> Callable[[Document], list[int]]:
    """Token ids of a document: a text as the tokenizer encodes it, chat turns through its chat
    template (which places the special tokens itself)."""

    def encode(doc: Document) -> list[int]:
        if isinstance(doc, str):
            return list(tokenizer(doc)["input_ids"])
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f'--data: chat records ("{CHAT_FIELD}") go through the tokenizer\'s chat '
                f"template, and the tokenizer of --model {model} has none; use a model whose "
                "tokenizer has one, or a text field (--data-field)"
            )
        text = tokenizer.apply_chat_template(doc, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode


def pack(
    docs: Iterator[Document],
    encode: Callable[[Document], list[int]],
    seq_len: int,
    max_sequences: int,
    corpus: Corpus | None = None,
) -> torch.Tensor:
    """Concatenates the token ids of `docs` and cuts them into sequences of seq_len tokens,
    counting into `corpus` the documents and tokens read and the sequences made.

    Returns:
        (sequences, seq_len) int64; raises ValueError when not even one sequence fits.
    """
    buf: list[int] = []
    need = seq_len * max_sequences
    documents = 0
    for doc in docs:
        buf.extend(encode(doc))
        documents += 1
        if len(buf) >= need:
            break
    count = min(len(buf) // seq_len, max_sequences)
    if corpus is not None:
        corpus.documents, corpus.tokens, corpus.sequences = documents, len(buf), count
        corpus.available = _count_rest(docs, documents)
    if documents == 0:
        where = f"--data {corpus.files[0]}" if corpus and len(corpus.files) == 1 else "the corpus"
        raise ValueError(f"{where} holds no text (0 documents); give a file with text in it")
    if count == 0:
        raise ValueError(
            f"the corpus has {len(buf):,} tokens ({plural(documents, 'document')}), fewer than "
            f"one sequence of --seq-len {seq_len}; use a larger corpus or a shorter --seq-len"
        )
    return torch.tensor(buf[: count * seq_len], dtype=torch.int64).view(count, seq_len)


def _count_rest(docs: Iterator[Document], read: int) -> int | None:
    """`read` plus the documents left in `docs` (read, not encoded), or None when one of them
    cannot be read (the run trains on those before it; the total is left unsaid)."""
    try:
        return read + sum(1 for _ in docs)
    except ValueError:
        return None


def plural(n: int, noun: str) -> str:
    """'1 document', '2 documents', '4,278 tokens'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


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
