"""The compatibility table of docs/guides/integrations.md is the one scripts/frameworks/table.py
renders from the committed record of scripts/frameworks/run.py's last run, and that record
covers ms-swift, axolotl and TRL at batch sizes 1 and 2, each with its version."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _table() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "framework_table", ROOT / "scripts/frameworks/table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_records() -> None:
    table = _table()
    record = json.loads(table.RECORD.read_text())
    assert table.in_docs(table.DOC.read_text()) == table.render(record), (
        "docs/guides/integrations.md's compatibility table differs from the record: run "
        "python scripts/frameworks/table.py"
    )


def test_the_record_covers_each_framework_and_batch_size() -> None:
    record = json.loads(_table().RECORD.read_text())
    assert set(record["frameworks"]) == {"swift", "axolotl", "trl"}
    for name, entry in record["frameworks"].items():
        assert entry["version"] and entry["versions"]["torch"], name
        assert set(entry["batches"]) == {"1", "2"}, name
        assert entry["result"] == "pass", (name, entry["problems"])
        assert entry["pins_moved"] == {} and entry["trl_extra_moves"] == {}, name
        for batch, run in entry["batches"].items():
            assert len(run["losses_plain"]) == record["steps"], (name, batch)
            assert run["tiled_loss_calls"] > 0 and run["logits_formed_tiled"] == 0, (name, batch)


def test_one_source_for_the_install_lines() -> None:
    # the docs' install table, the compatibility table and the record all show EXTRAS's line
    table = _table()
    record = json.loads(table.RECORD.read_text())
    text = table.DOC.read_text()
    assert table.in_docs(text, table.INSTALL_BEGIN, table.INSTALL_END) == table.render_install()
    for name, entry in record["frameworks"].items():
        assert entry["install"] == table.install_line(name, constraints=True), name
    run = (ROOT / "scripts/frameworks/run.py").read_text()
    assert "EXTRAS[name]" in run and '".[hf]"' not in run and '".[trl]"' not in run


def test_the_native_pieces_rows_name_their_version_and_command() -> None:
    table = _table()
    record = json.loads(table.RECORD.read_text())
    pieces = {entry["piece"].split(" ")[0] for entry in record["native"]}
    assert {"transformers", "TRL", "Liger-Kernel"} <= pieces
    for entry in record["native"]:
        assert entry["version"] and entry["result"] == "pass", entry
        path = entry["command"].split("pytest")[1].split()[4]  # the first test file named
        assert (ROOT / path).is_file(), entry["command"]
    text = table.DOC.read_text()
    assert table.in_docs(text, table.NATIVE_BEGIN, table.NATIVE_END) == table.render_native(record)
