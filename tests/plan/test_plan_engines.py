"""The whole-model planner under a sharding engine (plan/engines.py, plan/model.py): shards scale
with the world, the default (DDP) is what it was, offloading moves the engine's memory to the
host, and combinations the model cannot describe are refused in one line."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from test_plan_model import SMALL
from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import stack_patch
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan import engines
from tiledmlp.plan.model import CATEGORIES, estimate_step, param_counts, plan_model

pytest.importorskip("transformers")

MiB = 2**20
STACK = ("tiled_mlp_loss_offload_norms",)


def _config() -> Any:
    import transformers as tr

    return tr.LlamaConfig(**SMALL)


def test_param_counts_by_where_they_sit() -> None:
    import transformers as tr

    config = _config()
    model = tr.LlamaForCausalLM(config)
    counts = param_counts(config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.layer == sum(p.numel() for p in model.model.layers[0].parameters())
    assert counts.embed == counts.head == 512 * 128
    assert counts.shard(1) == counts.total
    tied = param_counts(tr.LlamaConfig(**{**SMALL, "tie_word_embeddings": True}))
    assert tied.head == 0 and tied.total == counts.total - 512 * 128


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_shards_scale_with_the_world_and_what_is_in_flight_does_not(engine: str) -> None:
    counts = param_counts(_config())
    n = len(counts.numels)
    by_world = {
        w: engines.engine_memory(engine, counts, world=w, elem=2, optimizer="adamw").device
        for w in (1, 2, 4, 8)
    }
    for w, held in by_world.items():
        shard = counts.shard(w)
        assert counts.total / w <= shard <= counts.total / w + n
        assert held["weights"] == held["grads"] == 2 * shard
        # ZeRO-3: float32 master partitions and two float32 states; FSDP2: two states in the
        # parameters' dtype
        assert held["optimizer"] == (12 * shard if engine == "zero3" else 4 * shard)
        assert held["gathered"] == by_world[1]["gathered"] > 0
    if engine == "zero3":
        assert {h["reduce_scatter"] for h in by_world.values()} == {2 * 500_000_000}
    else:
        layer = counts.layer
        assert by_world[8]["reduce_scatter"] == 2 * (layer + -(-layer // 8))


def test_float32_zero3_updates_its_partitions_in_place() -> None:
    counts = param_counts(_config())
    held = engines.engine_memory("zero3", counts, world=2, elem=4, optimizer="adamw").device
    assert held["optimizer"] == 8 * counts.shard(2)  # no master copy: the partitions are float32


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_step_is_the_same_simulation_plus_the_engine(engine: str) -> None:
    config = _config()
    patch = stack_patch(STACK[0], TilePolicy.of(4))
    one, four = (
        estimate_step(
            config, StepSpec(seq_len=1024, optimizer="adamw", engine=engine, world=w), patch
        )
        for w in (1, 4)
    )
    held = {
        w: engines.engine_memory(engine, param_counts(config), world=w, elem=2, optimizer="adamw")
        for w in (1, 4)
    }
    assert one.peak - four.peak == sum(held[1].device.values()) - sum(held[4].device.values())
    assert four.breakdown["gathered"] == held[4].device["gathered"]
    assert four.breakdown["weights"] < one.breakdown["weights"] / 3
    ddp = estimate_step(config, StepSpec(seq_len=1024, optimizer="adamw"), patch)
    # DeepSpeed's default reduce bucket (5e8 elements) outweighs this small model whole
    assert four.peak - four.breakdown["reduce_scatter"] < ddp.peak


def test_ddp_is_the_default_and_keeps_its_figures() -> None:
    import transformers as tr

    config = _config()
    step = StepSpec(seq_len=1024, optimizer="adamw", tiles=TilePolicy.of(4))
    default = plan_model(config, step, stacks=STACK)
    ddp = plan_model(config, StepSpec(seq_len=1024, optimizer="adamw", tiles=TilePolicy.of(4), engine="ddp"),
                     stacks=STACK)  # fmt: skip
    assert default == ddp
    entry = default[STACK[0]]
    # no engine terms: the tensor categories, then the allocator's own parts of the peak on a GPU
    assert tuple(entry["breakdown_mib"]) == (*CATEGORIES, "attention_backward", "cublas_workspace")
    model = tr.LlamaForCausalLM(config).to(torch.bfloat16)
    whole = sum(p.numel() * 2 for p in model.parameters())
    # AdamW's two states, whole; the peak lies in its foreach step: one update temporary more
    assert entry["breakdown_mib"]["optimizer"] == round(3 * whole / MiB, 1)
    total = entry["peak_mib"] + entry["device_overhead_mib"]
    assert entry["per_gpu_mib"] == pytest.approx(total, abs=0.11)
    assert entry["host_per_gpu_mib"] == entry["host_peak_mib"]


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_offloaded_params_leave_only_what_is_in_flight_on_the_device(engine: str) -> None:
    config = _config()
    step = StepSpec(
        seq_len=2048,
        tiles=TilePolicy.of(4),
        optimizer="cpu-offload",
        engine=engine,
        offload_params=True,
        sequence_parallel_size=2,
    )
    got = plan_model(config, step, stacks=STACK)[STACK[0]]
    device, host = got["breakdown_mib"], got["host_breakdown_mib"]
    assert device["weights"] == device["optimizer"] == 0
    assert device["gathered"] > 0 and device["reduce_scatter"] > 0
    counts = param_counts(config)
    assert host["params"] == round(2 * counts.shard(2) / MiB, 1)
    assert host["grads"] > 0 and host["optimizer"] > 0 and host["checkpoints"] > 0
    assert got["host_per_gpu_mib"] == pytest.approx(sum(host.values()), abs=0.2)
    assert got["host_per_node_mib"] == pytest.approx(2 * got["host_per_gpu_mib"], abs=0.1)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--offload-params"], "--offload-params needs a sharding engine"),
        (["--engine", "zero3", "--offload-params", "--optimizer", "adamw"], "not adamw"),
        (["--engine", "fsdp2", "--optimizer", "cpu-offload"], "add --offload-params"),
        (["--engine", "zero3", "--model", ""], None),
    ],
)
def test_cli_refuses_what_the_engines_cannot_combine_in_one_line(
    flags: list[str], says: str | None
) -> None:
    if says is None:  # an engine without a model
        flags, says = ["--engine", "zero3"], "add --model"
    else:
        flags = ["--model", "tiny", *flags]
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", *flags], capture_output=True, text=True
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in res.stderr, res.stderr


@pytest.mark.slow
def test_cli_json_says_the_engine_per_gpu_and_per_host(tmp_path) -> None:
    import json

    cfg = tmp_path / "config.json"
    import transformers as tr

    tr.LlamaConfig(**SMALL).to_json_file(str(cfg))
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--model", str(cfg), "--seq-len", "2048",
         "--engine", "zero3", "--offload-params", "--optimizer", "cpu-offload",
         "--sequence-parallel-size", "2", "--num-tiles", "4", "--json",
         "--stacks", "tiled_mlp_loss,tiled_mlp_loss_offload_norms"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["engine"], out["offload_params"], out["gpus_per_node"]) == ("zero3", True, 2)
    assert list(out["model"]) == ["tiled_mlp_loss", "tiled_mlp_loss_offload_norms"]
    for entry in out["model"].values():
        assert {
            "per_gpu_mib",
            "host_per_gpu_mib",
            "host_per_node_mib",
            "host_breakdown_mib",
        } <= set(entry)
        assert entry["breakdown_mib"]["weights"] == 0
