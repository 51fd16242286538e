"""The integration examples run as they are and say what they claim (CPU, tiny models)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a fresh interpreter per example: imports dominate (~15 s each)


def _run(script: str, *args: str) -> str:
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("when", ["before", "after"])
def test_trl_example_never_calls_trls_head(when: str) -> None:
    pytest.importorskip("trl")
    out = _run("trl_sft.py", "--when", when, "--steps", "2")
    assert "loss: tiled" in out
    assert len(re.findall(r"step \d+: loss [0-9.]+", out)) == 2
    assert "TRL chunked-head calls: 0" in out


@pytest.mark.parametrize("way", ["enable", "callback"])
def test_enable_example_trains_and_evaluates(way: str) -> None:
    out = _run("enable_any_stack.py", "--way", way, "--steps", "2")
    assert len(re.findall(r"step \d+: loss [0-9.]+", out)) == 2
    assert re.search(r"eval loss [0-9.]+ accuracy [0-9.]+", out)
    if way == "enable":
        assert "loss: tiled" in out  # patched at load, reported before the Trainer exists
