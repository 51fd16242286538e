"""The summary of a `tiledmlp train` run: the keys `--json` prints and OUTPUT_DIR/summary.json
holds (a contract), from the options, the finished Trainer and what the run measured.

Invariant: every key is present in every summary (None where it does not apply).
"""

from __future__ import annotations

import resource
from typing import Any

import torch

from tiledmlp.allocator import allocator_setting
from tiledmlp.patching import tile_counts
from tiledmlp.patching.features.activation_offloading import offloader_of
from tiledmlp.process_memory import proc_status_bytes
from tiledmlp.train.callbacks import StepLosses
from tiledmlp.train.data import plural
from tiledmlp.train.options import TrainOptions

__all__ = ["data_line", "peak_mib", "summary"]

MiB = 2**20


def peak_mib(device: torch.device) -> float:
    """The run's peak memory in MiB: allocated on CUDA, the process's high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MiB
    # This process's high-water mark. VmHWM starts afresh at exec; ru_maxrss does not (a child
    # of a big process reports its parent's peak), so it is only the fallback off Linux.
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm / MiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summary(
    opts: TrainOptions,
    engine: str,
    world: int,
    trainer: Any,
    args: Any,
    losses: StepLosses,
    report: Any,
    model: Any,
    facts: dict[str, Any],
) -> dict[str, Any]:
    """The run's summary (the keys of --json), from the options, the finished Trainer and what
    the run measured (`facts`: resumed_from_step, elapsed, peak_mib, device, interrupted,
    data)."""
    elapsed = facts["elapsed"]
    ran = len(losses.losses)
    tokens = (
        ran
        * opts.per_device_train_batch_size
        * opts.gradient_accumulation_steps
        * world
        * opts.seq_len
    )
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    counts = tile_counts(model)
    norms = {n for n, how in (report.paths.items() if report else ()) if how.endswith(": norm")}
    return {
        "model": opts.model,
        "data": facts["data"],
        "engine": engine,
        "world_size": world,
        "sequence_parallel_size": opts.sequence_parallel_size,
        "seq_len": opts.seq_len,
        "batch_size": opts.per_device_train_batch_size,
        "steps": ran,
        "global_step": trainer.state.global_step,
        "max_steps": opts.max_steps,
        "resumed_from_step": facts["resumed_from_step"],
        "dtype": opts.dtype,
        "learning_rate": args.learning_rate,
        "lr_scheduler_type": opts.lr_scheduler_type,
        "warmup_steps": opts.warmup_steps,
        "gradient_accumulation_steps": opts.gradient_accumulation_steps,
        "max_grad_norm": opts.max_grad_norm,
        **opts.feature_summary(),  # use_tiled_mlp, num_tiles, tiled_loss, ... (the schema's)
        "tiles_per_mlp": {n: c.last for n, c in counts.items() if n not in norms},
        "tiles_per_norm": {n: c.last for n, c in counts.items() if n in norms},
        "gradient_checkpointing": opts.gradient_checkpointing,
        "every_n_layers": opts.every_n_layers,
        "offloaded_mib": _offloaded_mib(model),
        "tiled_modules": report.patched if report else [],
        "losses": losses.losses,
        "first_loss": losses.losses[0] if losses.losses else None,
        "last_loss": losses.losses[-1] if losses.losses else None,
        "eval_loss": evals[-1] if evals else None,
        "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
        "seconds": round(elapsed, 2),
        "peak_mib": facts["peak_mib"],
        "peak_kind": "max_memory_allocated" if facts["device"] == "cuda" else "process max RSS",
        "device": facts["device"],
        "torch": torch.__version__,
        "cuda_alloc_conf": allocator_setting(),
        "interrupted": facts["interrupted"],
        "checkpoint": None,
        "curve": None,  # OUTPUT_DIR/curve.png once drawn (train/curve.py)
        "curve_note": None,  # why no curve was drawn, where one was due
        "output_dir": str(opts.output_dir) if opts.output_dir is not None else None,
    }


def _offloaded_mib(model: Any) -> float | None:
    """MiB of layer inputs moved to the host over the run, or None when offloading is off."""
    offloader = offloader_of(model)
    return None if offloader is None else round(offloader.stats.offloaded_bytes / MiB, 1)


def data_line(data: dict[str, Any], max_steps: int) -> str:
    """What the run read, in one line: "data: notes.jsonl (jsonl, field text): 11 documents of
    40, 4,278 tokens, 2 sequences, repeated 6 times to fill 12 steps"."""
    files = data["files"][0] if len(data["files"]) == 1 else f"{len(data['files'])} files"
    field = f", field {data['field']}" if data["field"] else ""
    read = plural(data["documents"], "document")
    available, cut = data.get("available_documents"), data.get("cut_at_bytes")
    if available is not None and cut is not None:
        read += f" of the first {available:,} (--max-data-bytes {cut:,})"
    elif available is not None:
        read += f" of {available:,}"
    line = (
        f"data: {files} ({data['format']}{field}): {read}, {plural(data['tokens'], 'token')}, "
        f"{plural(data['sequences'], 'sequence')}"
    )
    repeats = data.get("repeats")
    if repeats is not None and repeats > 1:
        times = f"{repeats:.0f}" if repeats == int(repeats) else f"{repeats:.1f}"
        line += f", repeated {times} times to fill {plural(max_steps, 'step')}"
    return line
