"""The Hugging Face Trainer as `tiledmlp train` runs it: checkpoints published whole (and
carrying the run's settings, train/resume.py), each micro-batch loss recorded, a self-sharded
FSDP2 model saved with its full state dict, and sequence parallelism's per-replica batches and
exact loss. Everything else (optimizer, schedule, accumulation, clipping, evaluation, logging,
checkpoints, resume, DDP and DeepSpeed) is done the Trainer's way.

Invariant: a checkpoint-N appears in OUTPUT_DIR only once every rank has written all of it,
the run's settings file included; the Trainer gets all it holds of the run at construction
(RunState), nothing is set on it afterwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiledmlp.sequence_parallel.collectives import guarded
from tiledmlp.train.callbacks import StepLosses
from tiledmlp.train.checkpoints import STAGING, publish
from tiledmlp.train.options import TrainOptions
from tiledmlp.train.resume import RUN_SETTINGS

__all__ = ["RunState", "make_trainer"]


@dataclass(frozen=True)
class RunState:
    """What the run hands its Trainer at construction.

    Attributes:
        step_losses: records each micro-batch loss.
        own_fsdp: the model is sharded with FSDP2 by the run itself (saved with a gathered full
            state dict).
        run_settings: the run's options, written into each checkpoint (train/resume.py).
        sequence_parallel: the model runs sequence parallelism (its groups are installed).
    """

    step_losses: StepLosses
    own_fsdp: bool = False
    run_settings: dict[str, Any] | None = None
    sequence_parallel: bool = False


def _trainer_class() -> Any:
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class TiledTrainer(Trainer):  # type: ignore[misc]
        """The Trainer, recording each micro-batch loss, saving a self-sharded FSDP2 model with
        a gathered full state dict, and with sequence parallelism: batches drawn per
        data-parallel replica (the SP ranks of a replica get the same batch), each rank's shard
        of the sequences, and the exact token-weighted loss over the whole sequences; our
        progress bar (a callback) instead of transformers' own."""

        def __init__(self, *, run: RunState, **kwargs: Any) -> None:
            self.step_losses = run.step_losses
            self.own_fsdp = run.own_fsdp
            self.run_settings = run.run_settings
            self.sp_groups = _sp_groups(kwargs["model"]) if run.sequence_parallel else None
            self._staging = False
            super().__init__(**kwargs)
            self.remove_callback(PrinterCallback)
            self.remove_callback(ProgressCallback)
            if self.sp_groups is not None:
                # a mean per micro-batch: the Trainer divides by the accumulation steps (both
                # names, for transformers versions with and without loss_is_scaled_for_ga)
                self.loss_is_scaled_for_ga = False
                self.model_accepts_loss_kwargs = False

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
            if self.run_settings is not None and self.args.should_save:
                staged = run_dir / STAGING / name
                (staged / RUN_SETTINGS).write_text(json.dumps(self.run_settings, indent=2) + "\n")
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


def _sp_groups(model: Any) -> Any:
    """The sequence-parallel groups installed on `model`."""
    from tiledmlp.sequence_parallel import installed_groups

    return installed_groups(model)


def make_trainer(
    opts: TrainOptions,
    model: Any,
    args: Any,
    datasets: tuple[Any, Any],
    tokenizer: Any,
    callbacks: list[Any],
    run: RunState,
) -> Any:
    """The Trainer of the run, holding `run`; --report-to naming a tracker that is not
    installed is one line naming it."""
    from transformers.utils import logging as hf_logging

    # One progress bar (ours, on stderr); transformers' own bars (e.g. "Writing model shards"
    # when saving) would interleave with it and leave cursor-movement codes in logs.
    hf_logging.disable_progress_bar()
    train_set, eval_set = datasets
    try:
        trainer = _trainer_class()(
            model=model,
            args=args,
            train_dataset=train_set,
            eval_dataset=eval_set,
            processing_class=tokenizer,
            callbacks=callbacks,
            run=run,
        )
    except RuntimeError as e:
        if opts.report_to != "none" and "requires" in str(e):
            # e.g. "TensorBoardCallback requires tensorboard to be installed"
            raise ValueError(f"--report-to {opts.report_to}: {e}") from None
        raise
    return trainer
