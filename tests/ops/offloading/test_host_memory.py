"""Host memory under activation offloading: the bytes a step pins (equal to what the offloader
moves, and to the planner's "host" figure), the check that stops a step that cannot fit with the
figures and the fix, and long runs whose resident memory stays flat (no pool growth, no leak)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_models import BASE
from tiledmlp import patch_model
from tiledmlp.ops.offloading.host_memory import (
    HostMemoryError,
    available_host_bytes,
    check_host_memory,
    offload_bytes,
)
from tiledmlp.patching.features.activation_offloading import offloader_of

GiB = 2**30


def test_offload_bytes_is_what_the_offloader_moves_and_what_the_planner_reports() -> None:
    import transformers as tr

    torch.manual_seed(0)
    config = tr.LlamaConfig(**{**BASE, "num_hidden_layers": 4})
    model = tr.LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patch_model(model, num_tiles=2, tiled_loss=True, activation_offloading=True)
    ids = torch.randint(3, 90, (2, 24))
    model(input_ids=ids, labels=ids).loss.backward()
    offloader = offloader_of(model)
    assert offloader is not None
    want = offload_bytes(4, ids.numel(), BASE["hidden_size"], 4)
    assert offloader.stats.offloaded_bytes == want == 3 * 48 * BASE["hidden_size"] * 4
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.plan.model import plan_model

    step = StepSpec(seq_len=1024, dtype=torch.float32, optimizer="cpu-offload")
    plan = plan_model(config, step, stacks=("tiled_mlp_loss", "tiled_mlp_loss_offload"))
    params = sum(p.numel() for p in model.parameters())
    states = 2 * params * 4
    assert plan["tiled_mlp_loss"]["host_peak_mib"] == round(states / 2**20, 1)
    offloaded = offload_bytes(4, 1024, BASE["hidden_size"], 4)
    assert plan["tiled_mlp_loss_offload"]["host_peak_mib"] == round((offloaded + states) / 2**20, 1)


def test_a_step_that_cannot_fit_stops_with_the_figures_and_the_fix() -> None:
    have = (2 * GiB, "MemAvailable 2.0 GiB")
    check_host_memory(GiB, "a step", processes=1, available=have)  # fits
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(3 * GiB // 2, "a step of 4096 tokens", processes=2, available=have)
    message = str(info.value)
    assert "a step of 4096 tokens needs 1.5 GiB of pinned host memory" in message
    assert "2.0 GiB is available (MemAvailable 2.0 GiB)" in message
    assert "shared by 2 processes on this machine (1.0 GiB each)" in message
    assert "shorten the sequence" in message and "sequence_parallel_size" in message
    check_host_memory(100 * GiB, "a step", available=(None, "not readable"))  # no figures: no stop


def test_available_host_memory_is_read_from_this_machine() -> None:
    have, source = available_host_bytes()
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert have is not None and 0 < have <= total, (have, source)
    assert "MemAvailable" in source


# ---- long runs: resident memory flat after warm-up ----

SOAK = """
import json, sys, torch, transformers as tr
sys.path.insert(0, sys.argv[1])
from hf_models import BASE
from tiledmlp import patch_model
from tiledmlp.process_memory import proc_status_bytes
from tiledmlp.patching.features.activation_offloading import offloader_of
torch.manual_seed(0)
torch.set_num_threads(1)
model = tr.LlamaForCausalLM(tr.LlamaConfig(**{**BASE, "num_hidden_layers": 3})).train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
patch_model(model, num_tiles=2, tiled_loss=True, activation_offloading=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(3, 90, (1, 32))
rss, created = [], []
for step in range(200):
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    rss.append(proc_status_bytes("VmRSS"))
    created.append(offloader_of(model).pool.created)
print("RESULT " + json.dumps({"rss": rss, "created": created}))
"""


def _assert_flat(rss: list[int], created: list[int], what: str) -> None:
    assert len(set(created)) == 1, f"{what}: the host pool grew: {sorted(set(created))}"
    warm = rss[20]
    growth = max(rss[20:]) - warm
    # A leak of one layer input per step (tokens x hidden x 4 bytes = 8 KiB) would add 1.4 MiB
    # over the 180 steps; allocator noise stays well below 4 MiB here.
    assert growth < 4 * 2**20, (
        f"{what}: resident memory grew {growth / 2**20:.1f} MiB after warm-up"
    )


@pytest.mark.slow
def test_200_offloaded_steps_keep_resident_memory_flat() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SOAK, str(Path(__file__).resolve().parents[2])],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    _assert_flat(result["rss"], result["created"], "one process")


def _soak_sequence_parallel(rank: int) -> dict[str, Any]:
    from sequence_parallel.test_sequence_parallel import global_batches, tiny_model
    from tiledmlp.process_memory import proc_status_bytes
    from tiledmlp.sequence_parallel import installed_groups, shard_batch

    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patch_model(model, num_tiles=2, tiled_loss=True, activation_offloading=True,
                sequence_parallel_size=2)  # fmt: skip
    groups = installed_groups(model)
    offloader = offloader_of(model)
    assert groups is not None and offloader is not None
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    shard = shard_batch(global_batches(1, packed=False)[0], groups)
    rss, created = [], []
    for _ in range(200):
        ddp(**shard, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rss.append(proc_status_bytes("VmRSS"))
        created.append(offloader.pool.created)
    return {"rss": rss, "created": created}


@pytest.mark.slow
@pytest.mark.distributed
def test_200_offloaded_sequence_parallel_steps_keep_resident_memory_flat() -> None:
    from distributed.harness import run_distributed

    for rank, result in enumerate(run_distributed(_soak_sequence_parallel, timeout=600)):
        _assert_flat(result["rss"], result["created"], f"rank {rank}")
