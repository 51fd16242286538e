"""StepSpec: the training step the planner estimates, as one frozen, checked object.

What the planner is asked about a step beside the model's config and the features applied (a
PatchConfig, or None for the untiled model): the sequence, the dtype, checkpointing, the
optimizer, the tile policy of the named stacks, the device, the sharding engine, sequence
parallelism and the allocator's setting. The planner's entry points (plan/estimate.py's
estimate_step, plan/model.py's plan_model, plan/fake_step.py's simulate) take it whole.

Invariant: a StepSpec that constructs has a known optimizer and positive counts; what the
engine can combine is checked by the planner (plan/engines.py), which knows the engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiledmlp.ops.attention.buffers import KernelChoice
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.values import check_int

__all__ = ["OPTIMIZERS", "StepSpec"]

OPTIMIZERS = ("none", "adamw", "cpu-offload")


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """One training step to plan, on one GPU.

    Attributes:
        seq_len: tokens of the step's one sequence on this GPU (plan_model: the whole
            sequence, split over `sequence_parallel_size` GPUs).
        dtype: the weights' and activations' dtype.
        checkpointing: the model's own non-reentrant gradient checkpointing (activation
            offloading turns it on by itself).
        optimizer: "none", "adamw" (torch.optim.AdamW, states on the device) or "cpu-offload"
            (states and update on the host).
        tiles: the tile policy the named stacks get (config/stacks.py: stack_patch) and one
            layer's plan uses, a TilePolicy (the edges parse `--num-tiles` and the like into
            one: config/values.py).
        device_type: the device whose tile rules and overheads are planned ("cuda", "cpu").
        engine: "ddp" (parameters, gradients and optimizer states whole on every GPU), "zero3"
            or "fsdp2" (sharded over `world` GPUs; plan/engines.py).
        world: the GPUs a sharding engine shards over.
        offload_params: the engine keeps its parameter and gradient shards on the host.
        sequence_parallel_size: P > 1: Ulysses sequence parallelism over P GPUs.
        expandable_segments: the CUDA caching allocator's setting the step runs with.
        attention_kernel: the kernel whose backward buffers a GPU's attention calls get, a
            KernelChoice of one kernel (a name is taken too; "cudnn", SDPA's choice on Hopper;
            ops/attention/buffers.py).
        every_n_layers: N > 1: where the step checkpoints, only every N-th decoder layer is
            checkpointed (layers 0, N, 2N, ...: transformers'
            activation_checkpointing_enable(every_n_layers=N)); the others keep their
            activations.
        transformers_offload: the checkpointed layers' inputs held in host memory by
            transformers' activation_checkpointing_enable(offload=True) (checkpointing on);
            where the stack offloads with tiledmlp's offloader, that one owns the job instead
            (patching/features/activation_offloading.py, Note [One offloader]).
    """

    seq_len: int
    dtype: torch.dtype = torch.bfloat16
    checkpointing: bool = False
    optimizer: str = "none"
    tiles: TilePolicy = TilePolicy()  # noqa: RUF009 (frozen: shared safely)
    device_type: str = "cuda"
    engine: str = "ddp"
    world: int = 1
    offload_params: bool = False
    sequence_parallel_size: int = 1
    expandable_segments: bool = True
    attention_kernel: KernelChoice = KernelChoice("cudnn")  # noqa: RUF009 (frozen: shared safely)
    every_n_layers: int = 1
    transformers_offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tiles, TilePolicy):
            raise TypeError(
                f"StepSpec: tiles must be a TilePolicy (e.g. TilePolicy.of(4), TilePolicy.of("
                f"'arctic')), got {self.tiles!r}"
            )
        kernel = self.attention_kernel
        if not isinstance(kernel, KernelChoice):  # a kernel's name, typed once here
            object.__setattr__(self, "attention_kernel", KernelChoice(str(kernel)))
        if self.attention_kernel.name == "auto":
            raise ValueError(
                "a step is planned with one attention kernel: cudnn, by_heads, flash, efficient "
                "or math, not auto (plan's auto plans each and keeps the longest: "
                "cli/plan_kernels.py)"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        check_int("world", self.world)
        check_int("sequence_parallel_size", self.sequence_parallel_size)
        check_int("every_n_layers", self.every_n_layers)

    @property
    def sharded(self) -> bool:
        """Whether an engine shards the parameters, gradients and optimizer states."""
        return self.engine != "ddp"
