"""`tiledmlp plan`: fake-tensor estimates equal the tensor-level measurement on real tensors and
the untiled one is within 10% of a process-level measurement; budget recommendations fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiledmlp import tiled_mlp
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.models.mlps import GatedMLP
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan.mlp import plan_mlp

MiB = 2**20


@pytest.mark.parametrize("tiles", [4, "auto"])
def test_fake_estimate_equals_real_tensor_level_peak(tiles: int | str) -> None:
    h, m, n = 256, 768, 2048
    est = plan_mlp(
        hidden=h,
        intermediate=m,
        seq_len=n,
        dtype=torch.float32,
        tiles=TilePolicy.of(tiles),
        device_type="cpu",
    )
    torch.manual_seed(0)
    mlp = GatedMLP(h, m)
    x = torch.randn(1, n, h, requires_grad=True)
    dy = torch.randn(1, n, h)
    alive = tensor_bytes(*mlp.parameters(), x, dy)
    tiled_mlp(mlp, x[:, :8], num_tiles=2)  # one-time structure probe outside the measurement

    def measure(fn) -> float:
        peak = peak_bytes(lambda: fn().backward(dy), alive, torch.device("cpu"))
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        return peak / MiB

    assert est["regular_mib"] == pytest.approx(measure(lambda: mlp(x)), abs=0.1)
    assert est["tiled_mib"] == pytest.approx(
        measure(lambda: tiled_mlp(mlp, x, num_tiles=tiles)), abs=0.1
    )


@pytest.mark.slow
def test_untiled_estimate_within_10_percent_of_process_peak() -> None:
    h, m, n = 512, 2048, 8192
    est = plan_mlp(hidden=h, intermediate=m, seq_len=n, dtype=torch.float32)
    script = Path(__file__).resolve().parents[1] / "process_peak.py"
    res = subprocess.run(
        [sys.executable, str(script), str(h), str(m), str(n)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    measured = json.loads(res.stdout)["peak_mib"]
    assert abs(est["regular_mib"] - measured) <= 0.10 * measured, (est["regular_mib"], measured)


def test_budget_recommendation_fits() -> None:
    h, m, n = 512, 1536, 8192
    base = plan_mlp(hidden=h, intermediate=m, seq_len=n, dtype=torch.bfloat16, device_type="cpu")
    budget = int((base["tiled_mib"] + base["regular_mib"]) / 2 * MiB)
    rec = plan_mlp(hidden=h, intermediate=m, seq_len=n, dtype=torch.bfloat16, budget_bytes=budget)
    assert rec["recommended_num_tiles"] >= 1 and rec["recommended_mib"] * MiB <= budget
    roomy = plan_mlp(hidden=h, intermediate=m, seq_len=n, dtype=torch.bfloat16, budget_bytes=2**40)
    assert roomy["recommended_num_tiles"] == 0
    tight = plan_mlp(hidden=h, intermediate=m, seq_len=n, dtype=torch.bfloat16, budget_bytes=MiB)
    assert tight["recommended_num_tiles"] is None


@pytest.mark.slow  # the CLI in fresh processes
def test_cli_json_and_errors() -> None:
    cmd = [sys.executable, "-m", "tiledmlp", "plan", "--hidden", "64", "--intermediate", "128",
           "--seq-len", "512", "--dtype", "float32", "--num-tiles", "4", "--json"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["tiles"] == 4 and out["tiled_mib"] < out["regular_mib"]
    bad = subprocess.run(
        [*cmd[:-1], "--budget-gb", "-1"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--budget-gb" in bad.stderr
    help_ = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--help"], capture_output=True, text=True
    )
    for flag in (
        "--hidden",
        "--intermediate",
        "--seq-len",
        "--dtype",
        "--num-tiles",
        "--json",
        "--budget-gb",
    ):
        assert flag in help_.stdout
