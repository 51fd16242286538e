"""The distributed examples run as they are (torchrun, 2 processes, gloo on CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def _run(engine: str, *extra: str) -> list[float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
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


def test_long_context_recipe_runs_cpu_sized() -> None:
    # examples/long_context_one_gpu.sh as it is, CPU-sized with its own switch: the tiny
    # preset, fp32, and the shipped CPU config, which is the recipe's DeepSpeed config without
    # bf16 and without pinned memory.
    pytest.importorskip("deepspeed")
    config = json.loads((ROOT / "examples" / "ds_zero3_offload.json").read_text())
    config.pop("bf16")
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    cpu_config = ROOT / "examples" / "ds_zero3_offload_cpu.json"
    assert json.loads(cpu_config.read_text()) == config
    env = {**os.environ, "PYTHON": sys.executable, "CPU_SIZED": "1", "STEPS": "2"}
    res = subprocess.run(
        ["bash", str(ROOT / "examples" / "long_context_one_gpu.sh"), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["engine"] == "deepspeed" and summary["activation_offloading"]
    assert summary["tiled_loss"] and summary["tiled_norms"] and summary["offloaded_mib"] > 0
    # The same run without offloading gives bit-identical losses.
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
         "tiledmlp", "train", "--model", "tiny", "--seq-len", "512", "--dtype", "float32",
         "--steps", "2", "--lr", "1e-3", "--gradient-checkpointing", "--tiled-norms",
         "--engine", "deepspeed",
         "--deepspeed-config", str(cpu_config), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert json.loads(plain.stdout.strip().splitlines()[-1])["losses"] == summary["losses"]


def test_sequence_parallel_examples_match_one_process() -> None:
    # The library example: each sequence split over 2 ranks (packed documents) = one process.
    script = str(ROOT / "examples" / "train_sequence_parallel.py")

    def losses(*cmd: str) -> list[float]:
        res = subprocess.run(
            [*cmd, script, "--seq-len", "128"], cwd=ROOT, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", res.stdout)]

    split = losses(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"
    )
    one = losses(sys.executable)
    assert len(split) == 3 and split == pytest.approx(one, rel=1e-5)
    # The CLI example: tiledmlp train --sequence-parallel-size 2 under torchrun.
    env = {**os.environ, "PYTHON": sys.executable, "SEQ_LEN": "128"}
    res = subprocess.run(
        ["bash", str(ROOT / "examples" / "train_sequence_parallel.sh"), "--max-steps", "2",
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["sequence_parallel_size"] == 2 and len(summary["losses"]) == 2


def test_million_token_recipes_run_cpu_sized_and_agree() -> None:
    # examples/long_context_1m_one_gpu.sh and long_context_5m_eight_gpus.sh as they are,
    # CPU-sized with their own switch: the tiny preset, 512 tokens, fp32, gloo, and the shipped
    # CPU config (the recipes' DeepSpeed config, parameters and optimizer on the host, without
    # bf16 and pinned memory). The sequence split over 2 ranks trains as one process does.
    pytest.importorskip("deepspeed")
    config = json.loads((ROOT / "examples" / "ds_zero3_offload_params.json").read_text())
    config.pop("bf16")
    for part in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][part]["pin_memory"] = False
    cpu_config = ROOT / "examples" / "ds_zero3_offload_params_cpu.json"
    assert json.loads(cpu_config.read_text()) == config
    env = {**os.environ, "PYTHON": sys.executable, "CPU_SIZED": "1", "STEPS": "2"}
    summaries = []
    for recipe in ("long_context_1m_one_gpu.sh", "long_context_5m_eight_gpus.sh"):
        res = subprocess.run(
            ["bash", str(ROOT / "examples" / recipe), "--json"],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert res.returncode == 0, recipe + res.stdout[-3000:] + res.stderr[-3000:]
        summary = json.loads(res.stdout.strip().splitlines()[-1])
        assert summary["engine"] == "deepspeed" and summary["activation_offloading"]
        assert summary["tiled_loss"] and summary["tiled_norms"] and summary["tiled_layers"]
        assert summary["offloaded_mib"] > 0  # the layer inputs went to the host
        summaries.append(summary)
    one, split = summaries
    assert (one["sequence_parallel_size"], split["sequence_parallel_size"]) == (1, 2)
    assert len(one["losses"]) == 2 and split["losses"] == pytest.approx(one["losses"], rel=1e-5)
