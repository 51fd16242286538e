"""The distributed examples run as they are (torchrun, 2 processes, gloo on CPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def _run(engine: str, *extra: str) -> list[float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_distributed.py"), "--engine", engine,
        "--seq-len", "128", "--steps", "2", *extra,
    ]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "loss: tiled" in res.stdout
    return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", res.stdout)]


def test_examples_run_and_agree_across_engines() -> None:
    ddp = _run("ddp")
    fsdp2 = _run("fsdp2", "--fsdp-config", str(ROOT / "examples" / "fsdp2.json"))
    assert len(ddp) == 2 and fsdp2 == pytest.approx(ddp, rel=1e-4)
    pytest.importorskip("deepspeed")
    zero3 = _run("deepspeed", "--deepspeed-config", str(ROOT / "examples" / "ds_zero3.json"))
    assert zero3 == pytest.approx(ddp, rel=1e-4)
