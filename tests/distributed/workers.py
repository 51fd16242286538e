"""Worker functions for the 2-process tests (importable by spawned processes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model

STEPS = 3
LR = 0.05


def global_batches(seq: int = 23, per_rank: int = 2, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (per_rank * 2, seq), generator=g) for _ in range(STEPS)]


def freeze(model: torch.nn.Module, how: str | None) -> torch.nn.Module:
    """None: all trainable; "embeddings": frozen embeddings; "all_but_mlp": only the MLPs train,
    so the first layer's MLP input does not require grad."""
    if how == "embeddings":
        model.get_input_embeddings().weight.requires_grad_(False)
    elif how == "all_but_mlp":
        for name, p in model.named_parameters():
            p.requires_grad_(".mlp." in name)
    return model


def reference(family: str, seq: int = 23, frozen: str | None = None) -> dict[str, Any]:
    """Single process, untiled, on the global batch: params and grads after STEPS SGD steps."""
    model = freeze(tiny_causal_lm(family), frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for ids in global_batches(seq):
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        last = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads": last}


def ddp_worker(rank: int, family: str, frozen: str | None) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = freeze(tiny_causal_lm(family), frozen)
    patch_model(model, num_tiles=3)
    ddp = DDP(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for ids in global_batches():
        local = ids.chunk(2)[rank]
        opt.zero_grad(set_to_none=True)
        ddp(input_ids=local, labels=local).loss.backward()
        last = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads": last}


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fsdp2_worker(rank: int, family: str, frozen: str | None, shard_mlp: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = freeze(tiny_causal_lm(family), frozen)
    patch_model(model, num_tiles=3)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        if shard_mlp:
            fully_shard(layer.mlp, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for ids in global_batches():
        local = ids.chunk(2)[rank]
        opt.zero_grad(set_to_none=True)
        model(input_ids=local, labels=local).loss.backward()
        last = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return {
        "params": {n: _full(p.detach()).clone() for n, p in model.named_parameters()},
        "grads": last,
    }


def fsdp2_inner_worker(rank: int) -> str:
    """The MLP's inner Linear layers sharded on their own: must be refused clearly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_causal_lm("llama")
    patch_model(model, num_tiles=3)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            fully_shard(proj, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = global_batches()[0].chunk(2)[rank]
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


def deepspeed_worker(rank: int, family: str, stage: int, frozen: str | None) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    # Built normally (same seed on both ranks); for stage 3 deepspeed.initialize partitions it.
    model = freeze(tiny_causal_lm(family), frozen)
    patch_model(model, num_tiles=3, hidden_size=32)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(params, lr=LR), config=_ds_config(stage)
    )
    for ids in global_batches():
        local = ids.chunk(2)[rank]
        loss = engine(input_ids=local, labels=local).loss
        engine.backward(loss)
        last = {}
        for n, p in model.named_parameters():
            g = safe_get_full_grad(p)
            if g is not None:
                last[n] = g.detach().clone()
        engine.step()
    final = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters()}
    return {"params": final, "grads": last}
