"""Where and how a `tiledmlp train` run executes: the launcher's world, the engine, the device,
the process group, self-sharded FSDP2 on CPU-only machines, and the TrainingArguments.

Engines: one process; DDP under torchrun (the Trainer's own); DeepSpeed with --deepspeed CONFIG
(the Trainer's own, on the CPU too); FSDP2 with --fsdp: the Trainer's own on GPUs. The Trainer
(accelerate) does not run FSDP on CPU-only machines ("Using fsdp only works in distributed
training": its CPU process groups are MULTI_CPU, which it wraps in DDP), so there we shard each
decoder layer and the root with `fully_shard` ourselves and hand the Trainer a model it must not
wrap (the state it keeps for models sharded at load time); its checkpoints then hold the model
only (the Trainer cannot save their optimizer state), so resuming is refused on that path.

Invariant: every check of the launch (engine against launcher, dtype against device) runs
before any model is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiledmlp.launcher import launched
from tiledmlp.models.presets import default_learning_rate
from tiledmlp.sequence_parallel.sizes import check_world_divisible
from tiledmlp.train.options import TrainOptions

__all__ = ["Launch", "check_launch", "shard_fsdp2", "start_sequence_parallel", "training_arguments"]


@dataclass(frozen=True)
class Launch:
    """How this process runs: world size, engine, CUDA or not, and whether tiledmlp shards
    FSDP2 itself (CPU-only machines)."""

    world: int
    engine: str
    cuda: bool
    own_fsdp: bool

    @property
    def device(self) -> torch.device:
        """This rank's device: its CUDA device, or the CPU."""
        if self.cuda:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")


def check_launch(opts: TrainOptions) -> Launch:
    """The launch, checked against the launcher and the device before any work; on CUDA, this
    rank's device is selected and its peak memory statistics reset."""
    under_launcher = launched()
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher else 1
    engine = opts.resolved_engine(world)
    if engine != "single" and not under_launcher:
        raise ValueError(
            f"--engine {engine} needs a launcher: torchrun --nproc_per_node N -m tiledmlp train ..."
        )
    if engine == "single" and world > 1:
        raise ValueError(f"--engine single runs one process, but WORLD_SIZE is {world}")
    cuda = torch.cuda.is_available()
    if opts.dtype == "float16" and not cuda:
        raise ValueError(
            "--dtype float16 trains with loss scaling on a CUDA GPU; on the CPU use --dtype bf16 "
            "or fp32"
        )
    _check_attention_kernel(opts, cuda)
    own_fsdp = engine == "fsdp2" and not cuda
    if own_fsdp and opts.fsdp_config is not None:
        raise ValueError(
            "--fsdp-config on a CPU-only machine: the Trainer cannot run FSDP there, so tiledmlp "
            "shards the model itself (one unit per decoder layer, then the root) and reads no "
            "FSDP config; drop --fsdp-config or run on GPUs"
        )
    if own_fsdp and opts.resume_from_checkpoint is not None:
        raise ValueError(
            "--resume-from-checkpoint with FSDP2 on a CPU-only machine: the Trainer cannot run "
            "FSDP there, so tiledmlp shards the model itself and its checkpoints hold the model "
            "only (no optimizer state); resume on GPUs or with DDP/DeepSpeed"
        )
    launch = Launch(world=world, engine=engine, cuda=cuda, own_fsdp=own_fsdp)
    if cuda:
        torch.cuda.set_device(launch.device)
        torch.cuda.reset_peak_memory_stats(launch.device)
    return launch


def _check_attention_kernel(opts: TrainOptions, cuda: bool) -> None:
    """A named attention kernel this machine or dtype cannot run, refused before any work (the
    head size is checked at the first call: ops/attention/buffers.py, unusable)."""
    name = opts.patch.attention_kernel.name if opts.patch is not None else "auto"
    if name in ("auto", "math") or (name == "by_heads" and not cuda):
        return  # by_heads on the CPU: the CPU's flash kernel by head groups
    if not cuda:
        raise ValueError(
            f"--attention-kernel {name}: the {name} attention kernel runs on CUDA GPUs, and this "
            "machine has none; use auto or math"
        )
    if name != "efficient" and opts.dtype == "float32":
        raise ValueError(
            f"--attention-kernel {name}: the {name} attention kernel takes bfloat16 or float16, "
            "not float32; add --dtype bf16, or use auto, efficient or math"
        )


def start_sequence_parallel(opts: TrainOptions, launch: Launch) -> int:
    """P, checked against the world; the process group started for it (sequence parallelism
    builds its groups before the Trainer starts, which reuses them)."""
    sp = opts.sequence_parallel_size
    check_world_divisible(launch.world, sp, size_name="--sequence-parallel-size")
    if sp > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if launch.cuda else "gloo", timeout=timedelta(seconds=opts.ddp_timeout)
        )
    return sp


def shard_fsdp2(model: Any, opts: TrainOptions, launch: Launch) -> None:
    """FSDP2 the way the Trainer cannot on CPU: one unit per decoder layer (MLP inside), then the
    root; marked as sharded at load so the Trainer neither wraps nor re-shards it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=opts.ddp_timeout))
    mesh = init_device_mesh(launch.device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model._is_distributed_loading_by_transformers = True


def _json_object(path: Path, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {path} is not valid JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: {path} must hold a JSON object, got {type(value).__name__}")
    return value


def _deepspeed_config(opts: TrainOptions) -> dict[str, Any]:
    """The user's DeepSpeed JSON with the Trainer's "auto" placeholders where it is silent."""
    assert opts.deepspeed is not None
    config = _json_object(Path(opts.deepspeed), "--deepspeed")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config.setdefault(key, "auto")
    config.setdefault("gradient_clipping", "auto")
    config.setdefault("zero_allow_untested_optimizer", True)
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        # full weights in OUTPUT_DIR, so that it works as --model again
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    return config


def training_arguments(opts: TrainOptions, launch: Launch, output_dir: Path, model: Any) -> Any:
    """The Trainer's arguments for this run (learning rate: --learning-rate or the model's
    documented default)."""
    from transformers import TrainingArguments

    lr = opts.learning_rate or default_learning_rate(opts.model, model.config.hidden_size)
    engine = launch.engine
    kwargs: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": opts.max_steps,
        "per_device_train_batch_size": opts.per_device_train_batch_size,
        "per_device_eval_batch_size": opts.per_device_train_batch_size,
        "gradient_accumulation_steps": opts.gradient_accumulation_steps,
        "learning_rate": lr,
        "lr_scheduler_type": opts.lr_scheduler_type,
        "warmup_steps": opts.warmup_steps,
        "weight_decay": opts.weight_decay,
        "max_grad_norm": opts.max_grad_norm,
        "logging_strategy": "steps",
        "logging_steps": opts.logging_steps,
        "report_to": [] if opts.report_to == "none" else opts.report_to.split(","),
        "eval_strategy": "steps" if opts.eval_steps is not None else "no",
        "eval_steps": opts.eval_steps,
        "save_strategy": "steps" if opts.save_steps is not None else "no",
        "save_steps": opts.save_steps if opts.save_steps is not None else 500,
        "save_total_limit": opts.save_total_limit,
        "save_only_model": launch.own_fsdp,
        "seed": opts.seed,
        "data_seed": opts.seed,
        "use_cpu": not launch.cuda,
        "fp16": opts.dtype == "float16",
        "bf16": engine == "deepspeed" and opts.dtype == "bfloat16",
        "disable_tqdm": True,  # our Progress callback draws the bar (on stderr)
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "ddp_find_unused_parameters": False,
        "ddp_timeout": opts.ddp_timeout,
        "torch_compile": opts.torch_compile,
    }
    if engine == "deepspeed":
        kwargs["deepspeed"] = _deepspeed_config(opts)
    if engine == "fsdp2" and not launch.own_fsdp:
        kwargs["fsdp"] = opts.fsdp or "full_shard"
        fsdp_config: dict[str, Any] = {
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": [type(model.model.layers[0]).__name__],
        }
        if opts.fsdp_config is not None:
            fsdp_config.update(_json_object(Path(opts.fsdp_config), "--fsdp-config"))
        kwargs["fsdp_config"] = fsdp_config
    return TrainingArguments(**kwargs)
