"""`tiledmlp train`'s run: checks every input before the expensive work, then loads the model,
packs the data, applies the patching and trains on the Hugging Face Trainer (train/trainer.py),
and returns the summary (train/summary.py).

Invariant: with the same options and seed, a run sees the same batches in the same order; a run
resumed from checkpoint-N produces the same losses after step N as the uninterrupted run (the
Trainer restores weights, optimizer, schedule, RNG states and the data position; train/resume.py
restores the run's settings), and in fp32 tiling changes memory, not losses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tiledmlp.patching import patch_model
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.sequence_parallel.collectives import guarded
from tiledmlp.train.callbacks import InterruptToSave, MetricsFile, Progress, StepLosses, StopAtStep
from tiledmlp.train.checkpoints import STAGING
from tiledmlp.train.curve import draw_curve
from tiledmlp.train.data import (
    Corpus,
    PackedDataset,
    default_corpus,
    encoder,
    open_corpus,
    pack,
)
from tiledmlp.train.launch import (
    Launch,
    check_launch,
    shard_fsdp2,
    start_sequence_parallel,
    training_arguments,
)
from tiledmlp.train.model_source import load_model, seq_len_note
from tiledmlp.train.options import TrainOptions
from tiledmlp.train.resume import given_of, resume, settings_record
from tiledmlp.train.summary import peak_mib, summary
from tiledmlp.train.trainer import RunState, make_trainer

__all__ = ["METRICS_FILE", "run"]

METRICS_FILE = "metrics.jsonl"


def _say(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"tiledmlp train: {text}", file=sys.stderr, flush=True)


def check_output_dir(opts: TrainOptions) -> None:
    """Refuses an --output-dir that cannot be made: one under a file."""
    if opts.output_dir is None:
        return
    out = Path(opts.output_dir)
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            raise ValueError(
                f"--output-dir {out}: {folder} is a file, so no folder can be made there; "
                "choose a folder path"
            )


def _sequences(
    opts: TrainOptions, tokenizer: Any, world: int
) -> tuple[PackedDataset, PackedDataset | None, Corpus]:
    """(train dataset, eval dataset or None, what was read) of packed sequences."""
    if opts.data is not None:
        corpus, docs = open_corpus(Path(opts.data), opts.data_field, opts.max_data_bytes)
    else:
        corpus, docs = default_corpus(opts.max_data_bytes)
    needed = (
        opts.max_steps * opts.per_device_train_batch_size * opts.gradient_accumulation_steps * world
    )
    held_out = opts.eval_sequences if opts.eval_steps is not None else 0
    seqs = pack(docs, encoder(tokenizer, opts.model), opts.seq_len, needed + held_out, corpus)
    if held_out and len(seqs) <= held_out:
        raise ValueError(
            f"the corpus gives {len(seqs)} sequences of {opts.seq_len} tokens, not enough for "
            f"{held_out} evaluation sequences and training; lower --eval-sequences or --seq-len"
        )
    train = seqs[: len(seqs) - held_out]
    corpus.repeats = max(1.0, needed / len(train))
    evals = seqs[len(seqs) - held_out :] if held_out else None
    return PackedDataset(train), (PackedDataset(evals) if evals is not None else None), corpus


def _curve_title(s: Mapping[str, Any]) -> str:
    return (
        f"{s['model']}, {s['seq_len']:,} tokens x {s['batch_size']}, {s['dtype']}, "
        f"{s['lr_scheduler_type']} schedule, step {s['global_step']} of {s['max_steps']}"
    )


def run(
    opts: TrainOptions,
    given: Mapping[str, Any] | None = None,
    before_load: Callable[[TrainOptions, Launch], None] | None = None,
) -> dict[str, Any]:
    """Trains and returns the summary (also written to OUTPUT_DIR/summary.json).

    Args:
        opts: the run's options.
        given: the options the user gave (key -> value as given), recorded in each checkpoint
            and compared with a resumed checkpoint's; None: those of `opts` that differ from
            the defaults.
        before_load: called with the run's options (a resumed run's own) and its launch once
            every input is checked, before the model or the data is loaded (the command's
            memory pre-flight, and its logging for the launch's engine); it refuses the run by
            raising ValueError.
    """
    check_launch(opts)  # this command's engine and device, before a checkpoint is read
    plan, _ = resume(opts, given_of(opts) if given is None else given, _say)
    build = plan.build  # the run as planned (a resume stopping early: its planned length)
    opts = build if plan.stop_at is None else dataclasses.replace(build, max_steps=plan.stop_at)
    launch = check_launch(opts)  # again with the checkpoint's settings (e.g. its dtype)
    sp = start_sequence_parallel(opts, launch)
    check_output_dir(opts)  # the model and the data were checked with the options
    if before_load is not None:
        before_load(opts, launch)

    note = seq_len_note(opts.model, opts.seq_len)
    if note is not None:
        _say(note)
    _say(f"loading {opts.model} and packing {opts.seq_len}-token sequences ...")
    # a preset or a config.json is built where the Trainer runs it (DeepSpeed and FSDP place it themselves)
    build_on = launch.device if launch.cuda and launch.engine in ("single", "ddp") else None
    model, tokenizer = load_model(opts.model, opts.dtype, opts.seq_len, opts.seed, build_on)
    train_set, eval_set, corpus = _sequences(build, tokenizer, launch.world // sp)
    if opts.gradient_checkpointing:
        enable_checkpointing(model, every_n_layers=opts.every_n_layers)
    config = opts.patch_config()
    report = patch_model(model, config) if config is not None else None

    scratch = None
    if opts.output_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="tiledmlp-train-")
    output_dir = Path(opts.output_dir) if opts.output_dir is not None else Path(scratch.name)  # type: ignore[union-attr]
    args = training_arguments(build, launch, output_dir, model)
    if launch.own_fsdp:
        shard_fsdp2(model, opts, launch)
    elif not launch.cuda and launch.engine != "deepspeed":
        model = model.to(launch.device)
    losses = StepLosses()
    interrupt = InterruptToSave(can_save=opts.output_dir is not None)
    callbacks: list[Any] = [losses, Progress(opts.max_steps), interrupt]
    if plan.stop_at is not None:
        callbacks.append(StopAtStep(plan.stop_at))
    if opts.output_dir is not None:
        callbacks.append(MetricsFile(Path(opts.output_dir) / METRICS_FILE))
    state = RunState(
        step_losses=losses,
        own_fsdp=launch.own_fsdp,
        run_settings=settings_record(build, build.max_steps),  # the run's own options
        sequence_parallel=sp > 1,
    )
    trainer = make_trainer(opts, model, args, (train_set, eval_set), tokenizer, callbacks, state)
    checkpoint = None if plan.checkpoint is None else str(plan.checkpoint)
    rank = args.process_index
    if rank == 0 and opts.output_dir is not None:
        shutil.rmtree(output_dir / STAGING, ignore_errors=True)  # saves a kill interrupted
    start = time.perf_counter()
    try:
        # a rank that dies or hangs: every survivor stops naming it (not a transport error)
        with guarded("a collective of the training step"):
            trainer.train(resume_from_checkpoint=checkpoint)
    except ValueError as e:
        if "No valid checkpoint" in str(e):
            raise ValueError(
                f"--resume-from-checkpoint latest: no checkpoint-N in {output_dir}"
            ) from None
        raise
    elapsed = time.perf_counter() - start
    facts = {
        "resumed_from_step": trainer.state.global_step - len(losses.losses) if checkpoint else None,
        "elapsed": elapsed,
        "peak_mib": round(peak_mib(launch.device), 1),
        "device": launch.device.type,
        "interrupted": interrupt.stopped_at is not None,
        "data": corpus.as_dict(),
    }
    result = summary(opts, launch.engine, launch.world, trainer, args, losses, report, model, facts)
    if interrupt.stopped_at is not None and opts.output_dir is not None:
        result["checkpoint"] = str(Path(opts.output_dir) / f"checkpoint-{interrupt.stopped_at}")
    elif opts.output_dir is not None:
        trainer.save_model(str(opts.output_dir))
    if opts.output_dir is not None and rank == 0:
        Path(opts.output_dir).mkdir(parents=True, exist_ok=True)
        curve, note = draw_curve(Path(opts.output_dir) / METRICS_FILE, _curve_title(result))
        result["curve"] = None if curve is None else str(curve)
        result["curve_note"] = note
        (Path(opts.output_dir) / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
        # Without this, gloo's threads are torn down at interpreter exit and the process aborts.
        dist.destroy_process_group()
    if scratch is not None:
        scratch.cleanup()
    return result
