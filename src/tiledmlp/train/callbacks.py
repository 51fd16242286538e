"""Trainer callbacks of `tiledmlp train`: per-step losses, a JSON-lines metrics file, a progress
bar on stderr, and a clean stop on Ctrl-C.

Invariant: every rank takes the same decisions at the same step (the stop request and the
per-step loss are all-reduced), so no rank waits in a collective that another rank skipped.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from tiledmlp.sequence_parallel.collectives import guarded

__all__ = ["InterruptToSave", "MetricsFile", "Progress", "StepLosses"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepLosses(TrainerCallback):
    """The mean training loss of every optimizer step (over micro-batches and ranks).

    The Trainer's subclass in train/trainer.py hands it each micro-batch loss as returned by
    `training_step` (already divided for gradient accumulation), so a step's sum is its loss.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self._sum: torch.Tensor | None = None

    def add(self, loss: torch.Tensor) -> None:
        value = loss.detach().float().reshape(())
        self._sum = value if self._sum is None else self._sum + value

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        total = self._sum if self._sum is not None else torch.zeros(())
        self._sum = None
        if _distributed():
            backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            total = total.to(backend_device)
            with guarded("the per-step loss all-reduce"):
                dist.all_reduce(total)
            total = total / dist.get_world_size()
        self.losses.append(float(total))


class MetricsFile(TrainerCallback):
    """Appends each of the Trainer's log records, with its step, to a JSON-lines file (the main
    process only)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


class Progress(TrainerCallback):
    """A tqdm bar on stderr (main process), created when training begins, so it shows before
    the first step ends; the latest loss and learning rate as its postfix."""

    def __init__(self, total: int | None = None) -> None:
        self.bar: Any = None
        self.total = total  # default: the Trainer's max_steps

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=self.total or state.max_steps,
                initial=state.global_step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.bar is not None and logs:
            shown = {k: logs[k] for k in ("loss", "eval_loss", "learning_rate") if k in logs}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StopAtStep(TrainerCallback):
    """Ends training after optimizer step `step`: a resumed run that stops before the end the
    checkpoint's run was planned for (its schedule and data order stay the planned run's)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


class InterruptToSave(TrainerCallback):
    """Ctrl-C (SIGINT) during training: finish the current step, save a checkpoint (when there
    is an output directory), stop. A second Ctrl-C interrupts at once."""

    def __init__(self, can_save: bool) -> None:
        self.can_save = can_save
        self.requested = False
        self.stopped_at: int | None = None
        self._previous: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._previous = signal.signal(signal.SIGINT, self._handler)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        flag = torch.tensor(1.0 if self.requested else 0.0)
        if _distributed():
            flag = flag.to("cuda" if dist.get_backend() == "nccl" else "cpu")
            with guarded("the per-step stop-request all-reduce"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag) > 0:
            self.stopped_at = state.global_step
            control.should_training_stop = True
            control.should_save = self.can_save

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
