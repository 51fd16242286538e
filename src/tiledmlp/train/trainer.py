"""`tiledmlp train` on the Hugging Face Trainer: our patching applied before the Trainer wraps
the model, everything else (optimizer, schedule, accumulation, clipping, evaluation, logging,
checkpoints, resume, DDP and DeepSpeed) done the Trainer's way.

Engines: one process; DDP under torchrun (the Trainer's own); DeepSpeed with --deepspeed CONFIG
(the Trainer's own, on the CPU too); FSDP2 with --fsdp: the Trainer's own on GPUs. The Trainer
(accelerate) does not run FSDP on CPU-only machines ("Using fsdp only works in distributed
training": its CPU process groups are MULTI_CPU, which it wraps in DDP), so there we shard each
decoder layer and the root with `fully_shard` ourselves and hand the Trainer a model it must not
wrap (the state it keeps for models sharded at load time); its checkpoints then hold the model
only (the Trainer cannot save their optimizer state), so resuming is refused on that path.

Invariant: with the same options and seed, a run sees the same batches in the same order; a run
resumed from checkpoint-N produces the same losses after step N as the uninterrupted run (the
Trainer restores weights, optimizer, schedule, RNG states and the data position), and in fp32
tiling changes memory, not losses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiledmlp.models.presets import PRESETS, build_preset, default_learning_rate
from tiledmlp.patching import patch_model, tile_counts
from tiledmlp.patching.offloading import enable_checkpointing, offloader_of
from tiledmlp.process_memory import proc_status_bytes
from tiledmlp.sequence_parallel.collectives import guarded
from tiledmlp.sequence_parallel.sizes import check_world_divisible
from tiledmlp.train.callbacks import InterruptToSave, MetricsFile, Progress, StepLosses, StopAtStep
from tiledmlp.train.checkpoints import STAGING, publish, resolve_resume
from tiledmlp.train.data import PackedDataset, default_corpus, pack, read_corpus
from tiledmlp.train.options import TrainOptions
from tiledmlp.train.tokenizer import VOCAB_SIZE, byte_tokenizer

__all__ = ["METRICS_FILE", "run"]

logger = logging.getLogger(__name__)
MiB = 2**20
METRICS_FILE = "metrics.jsonl"


def _say(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"tiledmlp train: {text}", file=sys.stderr, flush=True)


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MiB
    # This process's high-water mark. VmHWM starts afresh at exec; ru_maxrss does not (a child
    # of a big process reports its parent's peak), so it is only the fallback off Linux.
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm / MiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _checkpoint_to_resume(opts: TrainOptions) -> Path | None:
    """The checkpoint directory --resume-from-checkpoint names ('latest': the newest complete
    OUTPUT_DIR/checkpoint-N, with a note for each one skipped), or None when not resuming;
    incomplete or damaged checkpoints are refused here, before any work (train/checkpoints.py)."""
    if opts.resume_from_checkpoint is None:
        return None
    out = Path(opts.output_dir) if opts.output_dir is not None else Path(".")
    found = resolve_resume(opts.resume_from_checkpoint, out, _say)
    if found is None:
        raise ValueError(f"--resume-from-checkpoint latest: no complete checkpoint-N in {out}")
    return found


def _planned_steps(opts: TrainOptions, checkpoint: Path | None) -> int | None:
    """The --max-steps of the run a resumed checkpoint belongs to (None when not resuming);
    refuses, before any work, a resume that asks for more steps than that run was planned for.

    A resumed run continues the checkpoint's run exactly: its learning-rate schedule (built for
    the original --max-steps: a decaying schedule reaches its end there) and its data order
    (the packed data set and its shuffle depend on the number of steps). So it is built for the
    planned length and may stop earlier (a smaller --max-steps: the same losses as the planned
    run up to that step), but cannot go beyond it: that is refused with the ways that work.
    """
    state_file = None if checkpoint is None else checkpoint / "trainer_state.json"
    if state_file is None or not state_file.is_file():
        return None
    planned = json.loads(state_file.read_text()).get("max_steps")
    if not planned:
        return None
    if opts.max_steps > planned:
        raise ValueError(
            f"--resume-from-checkpoint {checkpoint}: that run was planned for --max-steps "
            f"{planned}, this one asks for {opts.max_steps}; a resumed run continues the same "
            f"learning-rate schedule and data order, which end at step {planned}. Resume with "
            f"--max-steps {planned} (or fewer), or train the saved model further with a new "
            f"schedule: --model {checkpoint} --max-steps N (the optimizer state starts afresh)"
        )
    return int(planned)


def _load(opts: TrainOptions) -> tuple[Any, Any]:
    """(model, tokenizer): a preset (random init, byte tokenizer) or a model directory."""
    if opts.model in PRESETS:
        tokenizer = byte_tokenizer()
        model = build_preset(opts.model, VOCAB_SIZE, opts.seq_len, opts.seed)
    else:
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model)
        except Exception as e:  # missing files, missing optional packages: one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"--model {opts.model}: its tokenizer could not be loaded ({first}); a model "
                "directory needs tokenizer files next to config.json (tiledmlp train's "
                "--output-dir has them)"
            ) from None
        model = transformers.AutoModelForCausalLM.from_pretrained(opts.model)
    model.config.use_cache = False
    if opts.dtype == "bfloat16":
        model = model.to(torch.bfloat16)  # pure bf16 weights, as today; fp16 runs AMP instead
    return model.train(), tokenizer


def _sequences(opts: TrainOptions, tokenizer: Any, world: int) -> tuple[Any, Any]:
    """(train dataset, eval dataset or None) of packed sequences."""
    texts = (
        read_corpus(opts.data, opts.max_data_bytes)
        if opts.data
        else default_corpus(opts.max_data_bytes)
    )
    needed = (
        opts.max_steps * opts.per_device_train_batch_size * opts.gradient_accumulation_steps * world
    )
    held_out = opts.eval_sequences if opts.eval_steps is not None else 0

    def encode(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    seqs = pack(texts, encode, opts.seq_len, needed + held_out)
    if held_out and len(seqs) <= held_out:
        raise ValueError(
            f"the corpus gives {len(seqs)} sequences of {opts.seq_len} tokens, not enough for "
            f"{held_out} evaluation sequences and training; lower --eval-sequences or --seq-len"
        )
    train = seqs[: len(seqs) - held_out]
    evals = seqs[len(seqs) - held_out :] if held_out else None
    return PackedDataset(train), (PackedDataset(evals) if evals is not None else None)


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


def _decoder_layer_class(model: Any) -> str:
    layers = model.model.layers
    return type(layers[0]).__name__


def _shard_fsdp2(model: Any, device: torch.device) -> None:
    """FSDP2 the way the Trainer cannot on CPU: one unit per decoder layer (MLP inside), then the
    root; marked as sharded at load so the Trainer neither wraps nor re-shards it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model._is_distributed_loading_by_transformers = True


def _training_arguments(
    opts: TrainOptions, engine: str, output_dir: Path, own_fsdp: bool, model: Any, cuda: bool
) -> Any:
    from transformers import TrainingArguments

    lr = opts.learning_rate or default_learning_rate(opts.model, model.config.hidden_size)
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
        "save_only_model": own_fsdp,
        "seed": opts.seed,
        "data_seed": opts.seed,
        "use_cpu": not cuda,
        "fp16": opts.dtype == "float16",
        "bf16": engine == "deepspeed" and opts.dtype == "bfloat16",
        "disable_tqdm": True,  # our Progress callback draws the bar (on stderr)
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "ddp_find_unused_parameters": False,
        "ddp_timeout": opts.ddp_timeout,
    }
    if engine == "deepspeed":
        kwargs["deepspeed"] = _deepspeed_config(opts)
    if engine == "fsdp2" and not own_fsdp:
        kwargs["fsdp"] = opts.fsdp or "full_shard"
        fsdp_config: dict[str, Any] = {
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": [_decoder_layer_class(model)],
        }
        if opts.fsdp_config is not None:
            fsdp_config.update(_json_object(Path(opts.fsdp_config), "--fsdp-config"))
        kwargs["fsdp_config"] = fsdp_config
    return TrainingArguments(**kwargs)


def _trainer_class() -> Any:
    from transformers import Trainer

    class TiledTrainer(Trainer):  # type: ignore[misc]
        """The Trainer, recording each micro-batch loss, saving a self-sharded FSDP2 model with
        a gathered full state dict, and with sequence parallelism: batches drawn per
        data-parallel replica (the SP ranks of a replica get the same batch), each rank's shard
        of the sequences, and the exact token-weighted loss over the whole sequences."""

        step_losses: StepLosses
        own_fsdp: bool = False
        sp_groups: Any = None
        _staging: bool = False

        def _get_output_dir(self, trial: Any) -> Any:
            out = super()._get_output_dir(trial)
            return os.path.join(out, STAGING) if self._staging else out

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            # Every rank writes into OUTPUT_DIR/.incomplete/checkpoint-N; once all are done the
            # main process renames it into place (train/checkpoints.py): a kill mid-save never
            # leaves a checkpoint-N that a resume would take.
            run_dir = Path(super()._get_output_dir(trial))
            name = f"checkpoint-{self.state.global_step}"
            self._staging = True
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging = False
            _publish_checkpoint(self, run_dir, name)

        def get_train_dataloader(self) -> Any:
            if self.sp_groups is None:
                return super().get_train_dataloader()
            return _sp_loader(self, self.train_dataset, shuffle=True)

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            if self.sp_groups is None:
                return super().get_eval_dataloader(eval_dataset)
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
            return _sp_loader(self, dataset, shuffle=False)

        def compute_loss(
            self,
            model: Any,
            inputs: Any,
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            if self.sp_groups is None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return _sp_loss(self, model, inputs, return_outputs)

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.step_losses.add(loss)
            return loss

        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            if not self.own_fsdp:
                super()._save(output_dir, state_dict)
                return
            _save_gathered(self, output_dir)

    return TiledTrainer


def _publish_checkpoint(trainer: Any, run_dir: Path, name: str) -> None:
    """Moves the staged checkpoint `name` into `run_dir` once every rank has saved it, then
    applies --save-total-limit; every rank waits until it is published."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        with guarded("the barrier after saving a checkpoint"):
            dist.barrier()
    if trainer.args.should_save:
        publish(run_dir / STAGING / name, run_dir / name)
        _rotate(trainer, run_dir)
    if distributed:
        with guarded("the barrier after publishing a checkpoint"):
            dist.barrier()


def _rotate(trainer: Any, run_dir: Path) -> None:
    """--save-total-limit over the published checkpoints (the Trainer's own rotation ran in the
    staging directory)."""
    if not trainer.args.save_total_limit:
        return
    own = getattr(trainer, "_rotate_checkpoints", None)
    if callable(own):  # transformers 4.x
        own(use_mtime=True, output_dir=str(run_dir))
        return
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(
        output_dir=str(run_dir),
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _sp_loader(trainer: Any, dataset: Any, shuffle: bool) -> Any:
    """Batches drawn per data-parallel replica: the SP ranks of a replica get the same batch."""
    from torch.utils.data import DataLoader, DistributedSampler

    g = trainer.sp_groups
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, g.dp_size, g.dp_rank, shuffle=shuffle, seed=trainer.args.seed
    )
    return DataLoader(
        dataset,
        batch_size=trainer.args.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=trainer.data_collator,
        drop_last=shuffle,
    )


def _sp_loss(trainer: Any, model: Any, inputs: Any, return_outputs: bool) -> Any:
    """The loss of this rank's shard of the batch's sequences: the model's own, exact over the
    whole sequences (sequence_parallel/model_loss.py)."""
    from tiledmlp.sequence_parallel import shard_batch

    batch = dict(inputs)
    mask = batch.pop("attention_mask", None)  # the collator's; packed rows are all ones
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "sequence parallelism needs packed sequences without padding, but a batch "
            "has a padding attention_mask"
        )
    shard = shard_batch(batch, trainer.sp_groups)
    outputs = model(**shard, use_cache=False)
    loss = outputs.loss
    return (loss, outputs) if return_outputs else loss


def _save_gathered(trainer: Any, output_dir: str | None) -> None:
    """Saves a self-sharded FSDP2 model with its full state dict, gathered on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if trainer.args.should_save:
        out = str(output_dir or trainer.args.output_dir)
        os.makedirs(out, exist_ok=True)
        trainer.model.save_pretrained(out, state_dict=full)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(out)
        torch.save(trainer.args, os.path.join(out, "training_args.bin"))


def run(opts: TrainOptions) -> dict[str, Any]:
    """Trains and returns the summary (also written to OUTPUT_DIR/summary.json)."""
    world, engine, cuda, own_fsdp = _launch(opts)
    device = _device(cuda)
    sp = _start_sequence_parallel(opts, world, cuda)
    checkpoint = _checkpoint_to_resume(opts)
    planned = _planned_steps(opts, checkpoint)
    stop_early = planned is not None and planned > opts.max_steps
    build = dataclasses.replace(opts, max_steps=planned) if stop_early and planned else opts
    _say(f"loading {opts.model} and packing {opts.seq_len}-token sequences ...")
    model, tokenizer = _load(opts)
    train_set, eval_set = _sequences(build, tokenizer, world // sp)
    if opts.gradient_checkpointing:
        enable_checkpointing(model)
    config = opts.patch_config()
    report = patch_model(model, config) if config is not None else None

    scratch = None
    if opts.output_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="tiledmlp-train-")
    output_dir = Path(opts.output_dir) if opts.output_dir is not None else Path(scratch.name)  # type: ignore[union-attr]
    args = _training_arguments(build, engine, output_dir, own_fsdp, model, cuda)
    if own_fsdp:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=opts.ddp_timeout))
        _shard_fsdp2(model, device)
    elif not cuda and engine != "deepspeed":
        model = model.to(device)
    losses = StepLosses()
    interrupt = InterruptToSave(can_save=opts.output_dir is not None)
    callbacks: list[Any] = [losses, Progress(opts.max_steps), interrupt]
    if stop_early:
        callbacks.append(StopAtStep(opts.max_steps))
    if opts.output_dir is not None:
        callbacks.append(MetricsFile(Path(opts.output_dir) / METRICS_FILE))
    trainer = _trainer(opts, model, args, (train_set, eval_set), tokenizer, callbacks)
    trainer.step_losses = losses
    trainer.own_fsdp = own_fsdp
    if sp > 1:
        _sequence_parallel_trainer(trainer, model)
    resume = None if checkpoint is None else str(checkpoint)
    rank = args.process_index
    if rank == 0 and opts.output_dir is not None:
        shutil.rmtree(output_dir / STAGING, ignore_errors=True)  # saves a kill interrupted
    start = time.perf_counter()
    try:
        # a rank that dies or hangs: every survivor stops naming it (not a transport error)
        with guarded("a collective of the training step"):
            trainer.train(resume_from_checkpoint=resume)
    except ValueError as e:
        if "No valid checkpoint" in str(e):
            raise ValueError(
                f"--resume-from-checkpoint latest: no checkpoint-N in {output_dir}"
            ) from None
        raise
    elapsed = time.perf_counter() - start
    facts = {
        "resumed_from_step": trainer.state.global_step - len(losses.losses) if resume else None,
        "elapsed": elapsed,
        "peak_mib": round(_peak_mib(device), 1),
        "device": device.type,
        "interrupted": interrupt.stopped_at is not None,
    }
    summary = _summary(opts, engine, world, trainer, args, losses, report, model, facts)
    if interrupt.stopped_at is not None and opts.output_dir is not None:
        summary["checkpoint"] = str(Path(opts.output_dir) / f"checkpoint-{interrupt.stopped_at}")
    elif opts.output_dir is not None:
        trainer.save_model(str(opts.output_dir))
    if opts.output_dir is not None and rank == 0:
        Path(opts.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(opts.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
        # Without this, gloo's threads are torn down at interpreter exit and the process aborts.
        dist.destroy_process_group()
    if scratch is not None:
        scratch.cleanup()
    return summary


def _launch(opts: TrainOptions) -> tuple[int, str, bool, bool]:
    """(world size, engine, CUDA available, tiledmlp shards FSDP2 itself), checked against the
    launcher and the device before any work."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched else 1
    engine = opts.resolved_engine(world)
    if engine != "single" and not launched:
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
    return world, engine, cuda, own_fsdp


def _device(cuda: bool) -> torch.device:
    """This rank's device (its CUDA device, peak memory statistics reset), or the CPU."""
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    return device


def _start_sequence_parallel(opts: TrainOptions, world: int, cuda: bool) -> int:
    """P, checked against the world; the process group started for it (sequence parallelism
    builds its groups before the Trainer starts, which reuses them)."""
    sp = opts.sequence_parallel_size
    check_world_divisible(world, sp, size_name="--sequence-parallel-size")
    if sp > 1 and not dist.is_initialized():
        # sequence parallelism builds its groups before the Trainer starts (it reuses them)
        dist.init_process_group(
            "nccl" if cuda else "gloo", timeout=timedelta(seconds=opts.ddp_timeout)
        )
    return sp


def _trainer(
    opts: TrainOptions,
    model: Any,
    args: Any,
    datasets: tuple[Any, Any],
    tokenizer: Any,
    callbacks: list[Any],
) -> Any:
    """The Trainer, with our progress bar instead of transformers' own."""
    train_set, eval_set = datasets
    try:
        trainer = _trainer_class()(
            model=model,
            args=args,
            train_dataset=train_set,
            eval_dataset=eval_set,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    except RuntimeError as e:
        if opts.report_to != "none" and "requires" in str(e):
            # e.g. "TensorBoardCallback requires tensorboard to be installed"
            raise ValueError(f"--report-to {opts.report_to}: {e}") from None
        raise
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging

    # One progress bar (ours, on stderr); transformers' own bars (e.g. "Writing model shards"
    # when saving) would interleave with it and leave cursor-movement codes in logs.
    hf_logging.disable_progress_bar()

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def _sequence_parallel_trainer(trainer: Any, model: Any) -> None:
    """The Trainer settings sequence parallelism needs (its groups; a mean per micro-batch)."""
    from tiledmlp.sequence_parallel import installed_groups

    trainer.sp_groups = installed_groups(model)
    # a mean per micro-batch: the Trainer divides by the accumulation steps (both names, for
    # transformers versions with and without loss_is_scaled_for_ga)
    trainer.loss_is_scaled_for_ga = False
    trainer.model_accepts_loss_kwargs = False


def _summary(
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
    the run measured (`facts`: resumed_from_step, elapsed, peak_mib, device, interrupted)."""
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
    summary: dict[str, Any] = {
        "model": opts.model,
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
        "use_tiled_mlp": opts.use_tiled_mlp,
        "tiled_loss": opts.use_tiled_mlp and opts.tiled_loss,
        "num_tiles": opts.num_tiles if opts.use_tiled_mlp else None,
        "tiles_per_mlp": {n: c.last for n, c in counts.items() if n not in norms},
        "tiles_per_norm": {n: c.last for n, c in counts.items() if n in norms},
        "gradient_checkpointing": opts.gradient_checkpointing,
        "activation_offloading": opts.activation_offloading,
        "tiled_norms": opts.tiled_norms,
        "tiled_layers": opts.tiled_layers,
        "kernels": opts.kernels,
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
        "interrupted": facts["interrupted"],
        "checkpoint": None,
        "output_dir": str(opts.output_dir) if opts.output_dir is not None else None,
    }
    return summary


def _offloaded_mib(model: Any) -> float | None:
    """MiB of layer inputs moved to the host over the run, or None when offloading is off."""
    offloader = offloader_of(model)
    return None if offloader is None else round(offloader.stats.offloaded_bytes / MiB, 1)
