"""The step a training run is planned as: one typed request (the model's configuration, the
stack of features, a StepSpec) built from a run's TrainOptions and where it executes
(`Placement`). `tiledmlp train`'s pre-flight, `tiledmlp plan` (whose flags are train's that
matter to memory, plus planning-only ones) and Python code build it with `step_request`.

A preset is planned as `tiledmlp train` builds it (its byte tokenizer's vocabulary, positions
for the sequence: models/presets.py, trained_fields); a config.json as written.

Invariant: the same options and placement give the same request, whoever asks; a run the
planner cannot describe exactly raises Unplanned, saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a request is built: plan's cache key reads no torch
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.train.options import TrainOptions

__all__ = ["ModelRequest", "Placement", "StepRequest", "Unplanned", "placement_of", "step_request"]


class Unplanned(ValueError):
    """A run the planner cannot describe exactly (the message says why)."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a step runs and where its engine keeps the weights and the optimizer states; the
    defaults are `tiledmlp train`'s (one process, AdamW stepping on the device).

    Attributes:
        device_type: "cuda" or "cpu".
        engine: "ddp" (whole on every GPU), "zero3" (DeepSpeed ZeRO-3) or "fsdp2".
        optimizer: "adamw" (states on the device), "cpu-offload" (states and update on the
            host) or "none" (a forward and backward only: no optimizer state).
        offload_params: the engine keeps its parameter and gradient shards on the host.
        expandable_segments: the CUDA caching allocator's setting.
    """

    device_type: str = "cuda"
    engine: str = "ddp"
    optimizer: str = "adamw"
    offload_params: bool = False
    expandable_segments: bool = True


@dataclass(frozen=True)
class ModelRequest:
    """The model a run trains, as the planner reads it.

    Attributes:
        name: --model as given.
        fields: what identifies its configuration (the plan cache's key).
        preset: a preset's LlamaConfig fields as train builds it, or None.
        file: the config.json of a model folder, file or cached Hub id, or None.
    """

    name: str
    fields: dict[str, Any]
    preset: dict[str, Any] | None = None
    file: Path | None = None


@dataclass(frozen=True)
class StepRequest:
    """What the planner is asked about one run: its model, its stack and its step."""

    model: ModelRequest
    stack: str
    step: StepSpec


def model_request(name: str, seq_len: int) -> ModelRequest | None:
    """The model `--model NAME` trains at `seq_len` tokens, or None where its configuration
    cannot be read without loading it (a Hub id not in the local cache)."""
    from tiledmlp.models.presets import PRESETS, trained_fields

    if name in PRESETS:
        values = trained_fields(name, seq_len)
        return ModelRequest(name, {"train_preset": values}, preset=values)
    path = Path(name)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():  # a Hub id: its cached config.json, if any
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(name, "config.json")
        except Exception:  # not a Hub id either (a missing path): nothing to read
            return None
        if not isinstance(found, str):
            return None
        file = Path(found)
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(values, dict):
        return None
    return ModelRequest(name, {"config": values}, file=file)


def placement_of(opts: TrainOptions, *, cuda: bool, engine: str, world: int) -> Placement:
    """Where the run of `opts` keeps what: its engine ("single", "ddp", "fsdp2" or
    "deepspeed", as launched over `world` processes) and its DeepSpeed config's offloading.

    Raises:
        Unplanned: DeepSpeed below ZeRO-3, an unreadable DeepSpeed config, or sharding over
            more GPUs than the sequence is split over.
    """
    from tiledmlp.allocator import allocator_setting

    expandable = "expandable_segments:True" in allocator_setting()["value"].replace(" ", "")
    planned, optimizer, offload = "ddp", "adamw", False
    if engine == "fsdp2":
        planned = "fsdp2"
    elif engine == "deepspeed":
        planned, optimizer, offload = _deepspeed(opts)
    p = opts.sequence_parallel_size
    if planned != "ddp" and world != p:
        raise Unplanned(
            f"the planner shards over the {p} GPU(s) the sequence is split over; this run "
            f"shards over {world}"
        )
    return Placement(
        device_type="cuda" if cuda else "cpu",
        engine=planned,
        optimizer=optimizer,
        offload_params=offload,
        expandable_segments=expandable,
    )


def _deepspeed(opts: TrainOptions) -> tuple[str, str, bool]:
    """(engine, optimizer, offload_params) of the run's DeepSpeed config: ZeRO-3 only."""
    try:
        zero = json.loads(Path(str(opts.deepspeed)).read_text()).get("zero_optimization", {})
    except (OSError, ValueError, AttributeError):
        raise Unplanned(f"--deepspeed {opts.deepspeed} could not be read as JSON") from None
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        raise Unplanned("the planner plans DeepSpeed's ZeRO-3 only")

    def on_cpu(key: str) -> bool:
        part = zero.get(key)
        return isinstance(part, dict) and part.get("device") in ("cpu", "nvme")

    optimizer = "cpu-offload" if on_cpu("offload_optimizer") else "adamw"
    return "zero3", optimizer, on_cpu("offload_param")


def step_request(opts: TrainOptions, where: Placement | None = None) -> StepRequest:
    """The request of the run `opts` placed `where` (default: train's, on a GPU).

    Raises:
        Unplanned: fp16 mixed precision, batches above one sequence, features that are no
            stack the planner knows, or a model whose configuration cannot be read.
    """
    import torch

    from tiledmlp.config.patch import FEATURES
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.config.stacks import STACKS, stack_of
    from tiledmlp.ops.attention.buffers import KernelChoice
    from tiledmlp.ops.tiling.policy import TilePolicy

    where = Placement() if where is None else where
    if opts.dtype == "float16":
        raise Unplanned(
            "fp16 mixed precision (float32 weights, float16 activations) is not planned"
        )
    if opts.per_device_train_batch_size != 1:
        raise Unplanned("the planner plans batches of one sequence")
    stack = stack_of(opts.patch)
    if stack is None:
        on = {f for f in FEATURES if opts.patch is not None and getattr(opts.patch, f)}
        raise Unplanned(
            f"the planner knows the stacks {', '.join(STACKS)}; this run's features "
            f"({', '.join(sorted(on))}) are not one of them"
        )
    model = model_request(opts.model, opts.seq_len)
    if model is None:
        raise Unplanned(f"no configuration of --model {opts.model} to plan from")
    kernel = "auto" if opts.patch is None else opts.patch.attention_kernel.name
    step = StepSpec(
        seq_len=opts.seq_len,
        dtype=getattr(torch, opts.dtype),
        checkpointing=opts.gradient_checkpointing,
        optimizer=where.optimizer,
        tiles=opts.patch.tiles if opts.patch is not None else TilePolicy(),
        device_type=where.device_type,
        sequence_parallel_size=opts.sequence_parallel_size,
        engine=where.engine,
        offload_params=where.offload_params,
        expandable_segments=where.expandable_segments,
        attention_kernel=KernelChoice("cudnn" if kernel == "auto" else kernel),
        every_n_layers=opts.every_n_layers,
    )
    return StepRequest(model, stack, step)
