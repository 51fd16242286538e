"""What `tiledmlp train --data` reads: every format, a chosen field, chat records; refused in one
line when unknown or when the `datasets` library it needs is missing; reported in the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiledmlp.train.data import check_data, open_corpus

SRC = str(Path(__file__).resolve().parents[2] / "src")
TEXTS = ["first document", "second one", "third"]
CHAT = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]


def _write_all(tmp: Path) -> dict[str, Path]:
    """The same three records in every format (field "body" too, for --data-field)."""
    datasets = pytest.importorskip("datasets")
    rows = [{"text": t, "body": t.upper()} for t in TEXTS]
    ds = datasets.Dataset.from_list(rows)
    paths = {
        "jsonl": tmp / "d.jsonl",
        "json": tmp / "d.json",
        "csv": tmp / "d.csv",
        "parquet": tmp / "d.parquet",
        "save_to_disk": tmp / "saved",
        "dict": tmp / "saved-dict",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["save_to_disk"]))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(paths["dict"]))
    paths["arrow"] = next(paths["save_to_disk"].glob("*.arrow"))
    return paths


@pytest.mark.parametrize(
    "fmt", ["jsonl", "json", "csv", "parquet", "arrow", "save_to_disk", "dict"]
)
def test_every_format_gives_the_records_by_field(fmt: str, tmp_path: Path) -> None:
    path = _write_all(tmp_path)[fmt]
    corpus, docs = open_corpus(path, None, 10**6)
    assert list(docs) == TEXTS
    assert corpus.field == "text" and corpus.files == [str(path)]
    assert corpus.format == {"dict": "save_to_disk"}.get(fmt, fmt)
    _, docs = open_corpus(path, "body", 10**6)
    assert list(docs) == [t.upper() for t in TEXTS]
    with pytest.raises(ValueError, match=r'has no field "title" \(fields: text, body\); choose'):
        list(open_corpus(path, "title", 10**6)[1])


def test_a_json_array_is_records_not_text(tmp_path: Path) -> None:
    # a .json array of {"text": ...} used to be trained on as raw JSON text
    path = tmp_path / "big.json"
    path.write_text(json.dumps([{"text": t} for t in TEXTS]))
    pytest.importorskip("datasets")
    corpus, docs = open_corpus(path, None, 10**6)
    assert list(docs) == TEXTS and corpus.format == "json"


def test_chat_records_go_through_the_chat_template(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tiledmlp.train.data import encoder
    from tiledmlp.train.tokenizer import BOS_ID, EOS_ID, byte_tokenizer

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT[0]}) + "\n")
    corpus, docs = open_corpus(path, None, 10**6)
    (doc,) = list(docs)
    assert corpus.field == "messages"
    ids = encoder(byte_tokenizer(), "tiny")(doc)
    assert ids == [BOS_ID, *b"user: hi\nassistant: hello\n", EOS_ID]
    no_template = byte_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template, and the tokenizer of --model m has none"):
        encoder(no_template, "m")(doc)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("notes.xml", "<a/>", "unknown format '.xml'; expected .txt/.md (plain text), .jsonl"),
        ("noext", "text", "unknown format '(no suffix)'"),
        ("bad.json", "[1, 2]", 'record 0: field "text" holds int; expected text or chat'),
        ("bad.jsonl", "[1, 2]\n", "bad.jsonl:1 holds list, not a record"),
        ("bad.parquet", "not parquet", "could not be read as parquet"),
    ],
)
def test_bad_data_is_one_line(name: str, content: str, message: str, tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=None) as info:
        list(open_corpus(path, None, 10**6)[1])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_folder_not_saved_by_datasets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a folder but not one written by datasets' save_to"):
        check_data(tmp_path)


def _without_datasets(tmp: Path) -> dict[str, str]:
    hide = tmp / "hide"
    hide.mkdir()
    (hide / "datasets.py").write_text("raise ImportError('No module named datasets')\n")
    # find_spec sees the stub; make it look absent the way an uninstalled package is
    (hide / "sitecustomize.py").write_text(
        "import importlib.util, sys\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'datasets' else _find(n, *a)\n"
    )
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hide), SRC]),
        "HF_HUB_OFFLINE": "1",
    }


@pytest.mark.slow
def test_trains_on_parquet_chat_records_and_reports_the_data(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list([{"messages": CHAT[0]}] * 40).to_parquet(str(path))
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "train", "--data", str(path), "--seq-len", "32",
         "--max-steps", "2", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)["data"]
    per_doc = len(b"user: hi\nassistant: hello\n") + 2
    assert data["files"] == [str(path)] and data["format"] == "parquet"
    assert data["field"] == "messages" and data["sequences"] == 2
    assert data["tokens"] == data["documents"] * per_doc >= 2 * 32


@pytest.mark.slow
def test_without_datasets_the_formats_that_need_it_are_refused_and_jsonl_works(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": "some text " * 20}) + "\n" for _ in range(20)))
    env = _without_datasets(tmp_path)
    base = [sys.executable, "-m", "tiledmlp", "train", "--seq-len", "32", "--max-steps", "1"]
    refused = subprocess.run(
        [*base, "--data", str(tmp_path / "d.parquet")], capture_output=True, text=True,
        timeout=600, env=env,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert (
        "reading parquet files needs the datasets library: pip install -c constraints.txt "
        "-e '.[data]'" in last
    )
    works = subprocess.run(
        [*base, "--data", str(jsonl), "--json"], capture_output=True, text=True, timeout=600,
        env=env,
    )  # fmt: skip
    assert works.returncode == 0, works.stderr[-3000:]
    assert json.loads(works.stdout)["data"]["format"] == "jsonl"
