"""Worker functions for the 2-process tests (importable by spawned processes)."""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model
from tiledmlp.patching.features.activation_offloading import enable_checkpointing

from generic_modules import with_mlp_lora

STEPS = 3
LR = 0.05
PER_RANK = 2


def build(family: str) -> torch.nn.Module:
    """A tiny causal LM; "<family>+lora": with PEFT LoRA adapters (seeded) on the MLPs'
    projections and only the adapters trainable."""
    base, _, extra = family.partition("+")
    model = tiny_causal_lm(base)
    if extra == "lora":
        torch.manual_seed(5)
        model = with_mlp_lora(model)
    elif extra:
        raise ValueError(family)
    return model


def freeze(model: torch.nn.Module, how: str | None) -> torch.nn.Module:
    """None: all trainable; "embeddings": frozen embeddings; "all_but_mlp": only the MLPs train,
    so the first layer's MLP input does not require grad."""
    if how == "embeddings":
        model.get_input_embeddings().weight.requires_grad_(False)
    elif how == "all_but_mlp":
        for name, p in model.named_parameters():
            p.requires_grad_(".mlp." in name)
    return model


def rank_batches(seqs: tuple[int, int], seed: int = 1) -> list[list[torch.Tensor]]:
    """Per step, the two ranks' batches (PER_RANK sequences of seqs[rank] tokens each)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(3, VOCAB, (PER_RANK, s), generator=g) for s in seqs] for _ in range(STEPS)
    ]


def reference(
    family: str = "llama", frozen: str | None = None, seqs: tuple[int, int] = (23, 23)
) -> dict[str, Any]:
    """Single process, untiled: each step's loss is the mean of the two ranks' losses (what
    data-parallel gradient averaging computes); params and grads after STEPS SGD steps."""
    model = freeze(build(family), frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for batches in rank_batches(seqs):
        opt.zero_grad(set_to_none=True)
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in batches) / len(batches)
        loss.backward()
        last = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads": last}


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_accumulation_steps": 1,
        # persistence 0: every ZeRO-3 parameter is partitioned, however small (the default keeps
        # those under 1e5 elements whole, i.e. all of the test models' MLP weights)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # DeepSpeed clips at 1.0 unless told otherwise; the references do not clip
        "gradient_clipping": 0.0,
    }


def engine_worker(
    rank: int,
    engine: str,
    family: str = "llama",
    frozen: str | None = None,
    seqs: tuple[int, int] = (23, 23),
    tile_tokens: int | None = None,
    shard_mlp: bool = False,
    tiled: bool = True,
    dtype: torch.dtype = torch.float32,
    copy_mode: str | None = None,
    offload: bool = False,
    compiled: bool = False,
) -> dict[str, Any]:
    """Trains a patched (or, with tiled=False, untouched) model for STEPS steps under `engine`
    ("ddp", "fsdp2", "fsdp1" (flat parameters), "fsdp1_orig", "zero1".."zero3"); returns full params and last grads, and the token count
    the ranks agreed on. copy_mode "deepcopy" or "pickle": train a copy of the patched model
    (made by copy.deepcopy or a pickle round trip) while the original stays alive.
    offload: the model's own non-reentrant checkpointing, the tiled loss, tiled norms, tiled
    decoder layers and activation offloading on top of the tiling (the result's "offloaded"
    counts the inputs moved). compiled: the wrapped model under torch.compile (aot_eager)."""
    model = freeze(build(family).to(dtype), frozen)
    if offload:
        enable_checkpointing(model)
        patch_model(
            model,
            num_tiles=3,
            tiled_loss=True,
            activation_offloading=True,
            tiled_norms=True,
            tiled_layers=True,
        )
    elif not tiled:
        pass
    elif tile_tokens is None:
        patch_model(model, num_tiles=3)
    else:
        patch_model(model, tile_tokens=tile_tokens)
    original = model
    if copy_mode == "deepcopy":
        model = copy.deepcopy(original)
    elif copy_mode == "pickle":
        model = pickle.loads(pickle.dumps(original))
    elif copy_mode is not None:
        raise ValueError(copy_mode)
    params = [p for p in model.parameters() if p.requires_grad]
    ds_engine = None
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner: Any = DDP(model)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            if shard_mlp:
                fully_shard(layer.mlp, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runner = model
    elif engine.startswith("fsdp1"):
        runner = _fsdp1(model, shard_mlp, use_orig_params=engine == "fsdp1_orig")
    elif engine.startswith("zero"):
        import deepspeed

        ds_engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.SGD(params, lr=LR),
            config=_ds_config(int(engine[-1])),
        )
        runner = ds_engine
    else:
        raise ValueError(engine)
    # After wrapping: fully_shard replaces the parameters with sharded ones, FSDP1 with flat ones.
    trainable = [p for p in runner.parameters() if p.requires_grad]
    if compiled:
        runner = torch.compile(runner, backend="aot_eager")
    opt = None if ds_engine is not None else torch.optim.SGD(trainable, lr=LR)
    agreed = []
    for batches in rank_batches(seqs):
        local = batches[rank]
        loss = runner(input_ids=local, labels=local).loss
        agreement = model.__dict__.get("_tiledmlp_agreement")
        agreed.append(None if agreement is None else agreement[0].value)
        if engine.startswith("fsdp1"):
            assert opt is not None
            loss.backward()
            last = _fsdp1_grads(runner)
            opt.step()
            opt.zero_grad(set_to_none=True)
        elif ds_engine is not None:
            ds_engine.backward(loss)
            last = _ds_grads(model)
            ds_engine.step()
        else:
            assert opt is not None
            loss.backward()
            last = {
                n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None
            }
            opt.step()
            opt.zero_grad(set_to_none=True)
    if engine.startswith("fsdp1"):
        final = _fsdp1_params(runner)
    elif ds_engine is not None:
        final = {n: _ds_param(p) for n, p in model.named_parameters()}
    else:
        final = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    del original
    from tiledmlp.patching.features.activation_offloading import offloader_of

    offloader = offloader_of(model)
    offloaded = None if offloader is None else offloader.stats.offloaded
    return {"params": final, "grads": last, "agreed": agreed, "offloaded": offloaded}


def _fsdp1(model: torch.nn.Module, shard_mlp: bool, use_orig_params: bool) -> Any:
    """FullyShardedDataParallel per decoder layer (and per MLP with shard_mlp) on CPU."""

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layer_cls = type(model.model.layers[0])
    classes = {layer_cls, type(model.model.layers[0].mlp)} if shard_mlp else {layer_cls}
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(classes),
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
    )


def _fsdp1_params(fsdp: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    with FSDP.summon_full_params(fsdp):
        return {clean_tensor_name(n): p.detach().clone() for n, p in fsdp.named_parameters()}


def _fsdp1_grads(fsdp: Any) -> dict[str, torch.Tensor]:
    """Full gradients by original parameter name: each flat parameter's gradient shard is
    all-gathered and split into the original parameters (FSDP1 keeps their names, numels and
    shapes on the flat parameter)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    names = {m: n for n, m in fsdp.named_modules()}
    out = {}
    for unit in FSDP.fsdp_modules(fsdp):
        if (
            unit._handle is None or unit._handle.flat_param.grad is None
        ):  # frozen: same on all ranks
            continue
        flat = unit._handle.flat_param
        shard = flat.grad
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard.detach().contiguous())
        full = torch.cat(parts)
        pieces = [
            piece
            for piece, pad in zip(
                full[: sum(flat._numels_with_padding)].split(flat._numels_with_padding),
                flat._is_padding_mask,
            )
            if not pad
        ]
        prefix = names[unit] + "." if names[unit] else ""
        for fqn, piece, shape in zip(flat._fqns, pieces, flat._shapes):
            out[clean_tensor_name(prefix + fqn)] = piece.view(shape).clone()
    return out


def fsdp1_inner_worker(rank: int, use_orig_params: bool) -> str:
    """FSDP1 with the MLP's inner Linear layers wrapped on their own: must be refused clearly."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = tiny_causal_lm("llama")
    patch_model(model, num_tiles=3)
    policy = ModuleWrapPolicy({type(model.model.layers[0]), torch.nn.Linear})
    fsdp = FSDP(
        model,
        auto_wrap_policy=policy,
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
    )
    ids = rank_batches((23, 23))[0][rank]
    try:
        fsdp(input_ids=ids, labels=ids).loss.backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _ds_param(p: torch.nn.Parameter) -> torch.Tensor:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(p)  # None for frozen parameters (not in the optimizer)
    if full is not None:
        return full.detach().clone()
    with deepspeed.zero.GatheredParameters([p] if hasattr(p, "ds_id") else []):
        return p.detach().clone()


def _ds_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for n, p in model.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            out[n] = g.detach().clone()
    return out


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
    ids = rank_batches((23, 23))[0][rank]
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
