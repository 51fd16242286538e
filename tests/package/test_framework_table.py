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
