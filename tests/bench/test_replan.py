"""benchmarks/replan.py: a committed planner record is planned again by its own command, a
record of JSON lines line by line; a record made by another command is left as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_each_line_is_planned_by_its_own_command_and_others_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.replan import replan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    planned = {"command": "tiledmlp plan --hidden 64 --intermediate 128 --seq-len 512 --json",
               "result": {}}  # fmt: skip
    other = {"command": "tiledmlp bench --json", "result": {"kept": 1}}
    path = tmp_path / "plan-x.jsonl"
    path.write_text(json.dumps(planned) + "\n" + json.dumps(other) + "\n")

    assert replan(path) is False  # one line was not a plan's
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["result"]["seq_len"] == 512 and first["result"]["hidden"] == 64
    assert first["result"]["tiled_mib"] > 0 and first["result"]["regular_mib"] > 0
    assert "planning_s" in first and "git" in first
    assert second == other
