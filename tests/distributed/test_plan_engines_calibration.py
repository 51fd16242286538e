"""The planner's ZeRO-3 model (plan/engines.py) against what a real DeepSpeed ZeRO-3 engine holds
on each of 2 ranks (gloo on CPU, a tiny Llama in bfloat16): the parameters' partitions, the
gradients' partitions, the reduce bucket and the optimizer's master weights and states, byte for
byte, with the optimizer on the device and offloaded to the host (with the parameters)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed.harness import run_distributed

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")

BUCKET = 4096  # reduce_bucket_size, elements: small, so that the test stays small


def _config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def held_worker(rank: int) -> dict[bool, dict[str, int]]:
    """What this rank's engine holds after one step, optimizer on the device and offloaded."""
    import torch.distributed as dist

    out = {offload: _held(rank, offload) for offload in (False, True)}
    dist.barrier()
    return out


def _held(rank: int, offload: bool) -> dict[str, int]:
    """One ZeRO-3 training step of the tiny model; what this rank's engine then holds."""
    import deepspeed
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16)
    zero: dict[str, Any] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": BUCKET,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1_000_000,
    }
    params = list(model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(params, lr=1e-3), config=config
    )
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    opt = engine.optimizer
    partitions = [p.ds_tensor for p in model.parameters()]
    # float32 master partitions: none of their own when they are the partitions themselves
    master = [m for m in opt.fp32_partitioned_groups_flat if m.dtype == torch.float32]
    states = [t for s in opt.optimizer.state.values() for t in s.values() if t.dim() > 0]
    buckets = [b.buffer for b in opt.ipg_buckets.values() if b.buffer is not None]
    return {
        "weights": _bytes(partitions),
        "grads": _bytes([opt.grad_partitions_flat_buffer]),
        "optimizer": _bytes(master) + _bytes(states),
        "reduce_scatter": _bytes(buckets),
    }


@pytest.fixture(scope="module")
def held() -> list[dict[bool, dict[str, int]]]:
    return run_distributed(held_worker, timeout=180)


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "offloaded"])
def test_zero3_holds_what_the_planner_says(held: list, offload: bool) -> None:
    from tiledmlp.plan import engines
    from tiledmlp.plan.model import param_counts

    counts = param_counts(_config())
    plan = engines.engine_memory(
        "zero3",
        counts,
        world=2,
        elem=2,
        optimizer="cpu-offload" if offload else "adamw",
        offload_params=offload,
        reduce_bucket=BUCKET,
    )
    # The sub-group's float32 gradient the host optimizer steps on is a transient of the step,
    # not a buffer the engine keeps between steps: compare the rest.
    sub_group = 4 * min(engines.ZERO3_SUB_GROUP, counts.shard(2)) if offload else 0
    planned = {
        "weights": plan.device["weights"] + plan.host["params"],
        "grads": plan.device["grads"] + plan.host["grads"],
        "optimizer": plan.device["optimizer"] + plan.host["optimizer"] - sub_group,
        "reduce_scatter": plan.device["reduce_scatter"],
    }
    assert counts.total == sum(p.numel() for p in _model_params())
    assert min(planned.values()) > 0
    for rank, both in enumerate(held):
        got = both[offload]
        assert got == planned, f"rank {rank}: DeepSpeed holds {got}, the planner says {planned}"


def _model_params() -> list[torch.nn.Parameter]:
    import transformers

    return list(transformers.LlamaForCausalLM(_config()).parameters())
