"""`tiledmlp check`'s run: a training run's options (the same as `tiledmlp train`'s), its model
loaded as train loads it, one step of random token ids through tiledmlp.check under the run's
engine (one process, DDP or FSDP2 under torchrun).

The batch is token ids drawn at random from the model's vocabulary (seeded, different on each
rank): the check compares two computations of the same step, so no data or tokenizer is needed
(a model folder without tokenizer files is checked too). Its length is CHECK_SEQ_LEN unless
--seq-len says otherwise: the tiles' logic, not the length, is what is checked.

Invariant: every option is checked (TrainOptions, check_launch) before the model is loaded;
what the check cannot run (DeepSpeed, sequence parallelism, an FSDP config file) is refused in
one line rather than run another way.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tiledmlp.patching.check import CHECK_SEQ_LEN, LocalEngine, StepEngine, check
from tiledmlp.patching.check_result import CheckResult
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.train.launch import Launch, check_launch, shard_fsdp2
from tiledmlp.train.model_source import load_model
from tiledmlp.train.options import TrainOptions

__all__ = ["CHECK_MICRO_BATCHES", "CHECK_SEQ_LEN", "refusal", "run_check"]

#: the check's default micro-batches per step (at least 2: gradient accumulation is checked)
CHECK_MICRO_BATCHES = 2


def refusal(opts: TrainOptions) -> str | None:
    """What the check cannot run with these options (one line), or None."""
    if opts.deepspeed is not None or opts.engine == "deepspeed":
        return (
            "tiledmlp check runs one process, DDP or FSDP2 (--fsdp full_shard); it does not run "
            "DeepSpeed yet: drop --deepspeed to check the tiling under DDP"
        )
    if opts.sequence_parallel_size > 1:
        return (
            "tiledmlp check does not run sequence parallelism yet: drop --sequence-parallel-size "
            "(the tiles' logic on each rank is the same)"
        )
    if opts.fsdp_config is not None:
        return "tiledmlp check shards FSDP2 itself (one unit per decoder layer); drop --fsdp-config"
    if opts.patch is None:
        return "nothing to check: every feature is off (e.g. --use-tiled-mlp false alone)"
    if opts.gradient_accumulation_steps < 2:
        return (
            f"--gradient-accumulation-steps must be at least 2 for the check (a gradient counted "
            f"once per micro-batch shows only then), got {opts.gradient_accumulation_steps}"
        )
    return None


class _DDP:
    """DDP as the Trainer runs it: gradients all-reduced on the last micro-batch only."""

    name = "ddp"

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.world_size = launch.world

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.launch.device] if self.launch.cuda else None
        return DistributedDataParallel(model, device_ids=ids)

    def accumulating(
        self, wrapped: nn.Module, last: bool
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last else wrapped.no_sync()  # type: ignore[operator]

    def whole(self, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _FSDP2:
    """FSDP2 as `tiledmlp train` shards it on CPU (one unit per decoder layer, then the root);
    gradients reduced on the last micro-batch only; each gradient gathered whole."""

    name = "fsdp2"

    def __init__(self, opts: TrainOptions, launch: Launch) -> None:
        self.opts = opts
        self.launch = launch
        self.world_size = launch.world

    def wrap(self, model: nn.Module) -> nn.Module:
        shard_fsdp2(model, self.opts, self.launch)
        return model

    def accumulating(
        self, wrapped: nn.Module, last: bool
    ) -> contextlib.AbstractContextManager[Any]:
        wrapped.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    def whole(self, grad: torch.Tensor) -> torch.Tensor:
        full = getattr(grad, "full_tensor", None)
        return full() if full is not None else grad


def run_check(opts: TrainOptions, *, seq_len_given: bool) -> CheckResult:
    """Checks one step of `opts`' model, patched as `opts` asks, against the unpatched step.

    Args:
        opts: the run's options (seq_len and gradient_accumulation_steps are the check's).
        seq_len_given: whether the length was chosen (else the verdict says it is the default).

    Raises:
        ValueError: an option the check cannot run (refusal), a model that cannot load.
    """
    why = refusal(opts)
    if why is not None:
        raise ValueError(why)
    launch = check_launch(opts)  # the model was checked with the options
    build_on = launch.device if launch.cuda else None
    model, _ = load_model(
        opts.model, opts.dtype, opts.seq_len, opts.seed, build_on, tokenizer_needed=False
    )
    model = model.to(launch.device)
    if opts.gradient_checkpointing:
        enable_checkpointing(model, every_n_layers=opts.every_n_layers)
    engine: StepEngine = LocalEngine()
    if launch.engine in ("ddp", "fsdp2"):
        if not dist.is_initialized():
            backend = "nccl" if launch.cuda else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=opts.ddp_timeout))
        engine = _DDP(launch) if launch.engine == "ddp" else _FSDP2(opts, launch)
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(opts.seed * 1000 + rank)
    vocab = int(model.config.vocab_size)
    micro = []
    for _ in range(opts.gradient_accumulation_steps):
        ids = torch.randint(0, vocab, (opts.per_device_train_batch_size, opts.seq_len),
                            generator=generator)  # fmt: skip
        micro.append({"input_ids": ids, "labels": ids})
    length = (
        f"length: {opts.seq_len} tokens per sequence"
        if seq_len_given
        else f"length: {opts.seq_len} tokens per sequence, the check's short default (the "
        "tiles' logic, not the length, is what it checks; --seq-len picks another)"
    )
    notes = [f"model: {opts.model}; batch: random token ids, seed {opts.seed}", length]
    try:
        return check(
            model,
            micro,
            opts.patch,
            autocast=torch.float16 if opts.dtype == "float16" else None,
            engine=engine,
            seed=opts.seed,
            notes=notes,
        )
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()  # gloo's threads otherwise abort the exit
