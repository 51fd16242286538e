"""The plan cache (plan/cache.py, plan/cached.py): a repeated question is read back exactly,
without planning; a changed option or configuration is planned; a damaged file is ignored."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tiledmlp.config.plan import StepSpec
from tiledmlp.plan import cache
from tiledmlp.plan.cached import plan_stacks

FIELDS = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
}  # fmt: skip
OPTIONS: dict[str, Any] = {"step": StepSpec(seq_len=256, dtype=torch.float32, device_type="cpu")}
STACKS = ("tiled_mlp_loss",)


class Builds:
    """The config's builder, counting how often the planner needed it (a miss)."""

    def __init__(self, **fields: Any) -> None:
        self.fields = {**FIELDS, **fields}
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        return transformers.LlamaConfig(**self.fields)


@pytest.fixture
def cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "tiledmlp" / "plan"


def test_a_repeated_question_is_read_back_identical_without_planning(cached: Path) -> None:
    first = Builds()
    planned = plan_stacks(first, {"config": first.fields}, stacks=STACKS, **OPTIONS)
    assert first.calls == 1 and len(list(cached.glob("*.json"))) == 1
    again = Builds()
    read = plan_stacks(again, {"config": again.fields}, stacks=STACKS, **OPTIONS)
    assert again.calls == 0  # not planned: read back
    assert read == planned
    assert read["tiled_mlp_loss"]["per_gpu_mib"] > 0


def test_a_changed_option_or_configuration_is_planned(cached: Path) -> None:
    base = Builds()
    planned = plan_stacks(base, {"config": base.fields}, stacks=STACKS, **OPTIONS)
    longer = Builds()
    other = plan_stacks(
        longer,
        {"config": longer.fields},
        stacks=STACKS,
        **{**OPTIONS, "step": dataclasses.replace(OPTIONS["step"], seq_len=512)},
    )
    assert longer.calls == 1
    assert other["tiled_mlp_loss"]["peak_mib"] > planned["tiled_mlp_loss"]["peak_mib"]
    wider = Builds(intermediate_size=256)
    plan_stacks(wider, {"config": wider.fields}, stacks=STACKS, **OPTIONS)
    assert wider.calls == 1
    assert len(list(cached.glob("*.json"))) == 3


@pytest.mark.parametrize("damage", ["{not json", '{"key": "another", "answer": {}}', ""])
def test_a_damaged_cache_file_is_ignored_and_replanned(cached: Path, damage: str) -> None:
    first = Builds()
    planned = plan_stacks(first, {"config": first.fields}, stacks=STACKS, **OPTIONS)
    (file,) = cached.glob("*.json")
    file.write_text(damage)
    again = Builds()
    assert plan_stacks(again, {"config": again.fields}, stacks=STACKS, **OPTIONS) == planned
    assert again.calls == 1
    assert json.loads(file.read_text())["answer"] == planned["tiled_mlp_loss"]  # written again


def test_the_key_follows_the_options_the_configuration_and_the_planner() -> None:
    key = cache.cache_key("stack", {"config": FIELDS}, {"seq_len": 256})
    assert key == cache.cache_key("stack", {"config": dict(FIELDS)}, {"seq_len": 256})
    assert key != cache.cache_key("stack", {"config": FIELDS}, {"seq_len": 257})
    assert key != cache.cache_key(
        "stack", {"config": {**FIELDS, "vocab_size": 301}}, {"seq_len": 256}
    )
    assert key != cache.cache_key("plan", {"config": FIELDS}, {"seq_len": 256})
    assert len(cache.planner_version()) == 64


def test_an_unwritable_cache_folder_loses_only_the_saving(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: no folder can be made there
    first = Builds()
    planned = plan_stacks(first, {"config": first.fields}, stacks=STACKS, **OPTIONS)
    assert planned["tiled_mlp_loss"]["peak_mib"] > 0 and first.calls == 1


def _imported(package: str, importtime: str) -> bool:
    """Whether `python -X importtime` shows `package` imported, at any depth."""
    return re.search(rf"^import time:.*\|\s+{package}$", importtime, re.MULTILINE) is not None


@pytest.mark.slow  # two fresh processes, the first plans
def test_the_cli_answers_a_repeated_plan_from_the_cache(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path)}
    plan = [
        "plan",
        "--model",
        "tiny",
        "--seq-len",
        "1024",
        "--stacks",
        "tiled_mlp_loss",
        "--gpu",
        "h100-80gb",
    ]  # fmt: skip  (a named card: the bottom line is the machine's)
    args = [sys.executable, "-X", "importtime", "-m", "tiledmlp", *plan]
    first = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    again = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0 and again.returncode == 0, (
        first.stderr[-2000:] + again.stderr[-2000:]
    )
    assert _imported("torch", first.stderr)  # planned: the simulation imported torch
    assert _imported("transformers", first.stderr)  # and the model's classes
    assert "one step at" in first.stderr and "one step at" not in again.stderr  # planned once
    assert again.stdout == first.stdout and "bottom line" in first.stdout
    as_json = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=600,
                             env=env)  # fmt: skip
    assert "one step at" not in as_json.stderr, as_json.stderr[-2000:]  # the cached answer
    result = json.loads(as_json.stdout)
    assert result["bottom_line"]["fastest"] == "tiled_mlp_loss"
