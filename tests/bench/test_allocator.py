"""The CUDA allocator setting (tiledmlp.allocator): expandable segments unless the user chose,
named by `tiledmlp env` and the train summary, run as a user runs them (fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiledmlp.allocator import (
    ALLOC_CONF_ENV,
    EXPANDABLE,
    allocator_setting,
    describe,
    prefer_expandable_segments,
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ALLOC_CONF_ENV and "ALLOC_CONF" not in k}
    return {**env, **extra}


def test_the_default_is_set_only_where_the_user_set_nothing() -> None:
    env: dict[str, str] = {}
    assert prefer_expandable_segments(env) == {"value": EXPANDABLE, "set_by": "tiledmlp"}
    assert env[ALLOC_CONF_ENV] == EXPANDABLE
    mine = {ALLOC_CONF_ENV: "expandable_segments:False"}
    assert prefer_expandable_segments(mine) == {
        "value": "expandable_segments:False",
        "set_by": "user",
    }
    assert mine[ALLOC_CONF_ENV] == "expandable_segments:False"
    assert allocator_setting({}) == {"value": "", "set_by": "nobody"}
    assert "PyTorch's default" in describe(allocator_setting({}))


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, f"{ALLOC_CONF_ENV}={EXPANDABLE} (tiledmlp's default)"),
        (
            "expandable_segments:False",
            f"{ALLOC_CONF_ENV}=expandable_segments:False (set by the user)",
        ),
    ],
)
def test_tiledmlp_env_names_the_allocator_setting(given: str | None, expected: str) -> None:
    env = _env() if given is None else _env(**{ALLOC_CONF_ENV: given})
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "env"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    line = next(line for line in res.stdout.splitlines() if line.startswith("cuda allocator"))
    assert line == f"cuda allocator {expected}"


@pytest.mark.slow
def test_the_train_summary_names_the_allocator_setting() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiledmlp",
            "train",
            "--max-steps",
            "1",
            "--seq-len",
            "64",
            "--max-data-bytes",
            "20000",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["cuda_alloc_conf"] == {"value": EXPANDABLE, "set_by": "tiledmlp"}
