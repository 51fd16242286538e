"""`tiledmlp plan --attention-kernel`: the attention kernel the whole step is planned with.

A named kernel ("cudnn", "by_heads", "flash", "efficient", "math") plans every stack with that
kernel's attention buffers (ops/attention/buffers.py; by_heads: the model's own attention by
head groups, each group's call with cuDNN's workspace), refused in one line where the planned
device or dtype cannot run it. "auto" (the default) plans with what a run's "auto" would choose:
cuDNN, SDPA's choice on Hopper and the fastest, unless another kernel lets a stack fit a longer
sequence within --memory-gb (plan/kernel_choice.py: each stack's other kernels are planned in its
own job, right after its cuDNN plan). Each stack then carries the kernel auto takes
("attention_kernel"), each kernel's longest sequence where more than cuDNN's fit
("max_seq_len_by_kernel", cuDNN's first) and the kernels that did not fit one granule more
("kernels_no_longer").

Invariant: without --memory-gb, or where no kernel has smaller buffers than cuDNN's, "auto"
plans exactly what planning with cuDNN plans; a kernel other than cuDNN is taken only with a
verified longer sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from tiledmlp.cli.common import UsageError
from tiledmlp.ops.attention.buffers import KernelChoice, unusable
from tiledmlp.plan.kernel_choice import attention_shape

__all__ = ["plan_with_kernels"]


def plan_with_kernels(
    plan: Callable[..., dict[str, Any]],
    config: Any,
    args: argparse.Namespace,
    itemsize: int,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """plan_model's answer (`plan(config, **kwargs)`) under --attention-kernel (module
    docstring).

    Raises:
        UsageError: a named kernel the planned device or dtype cannot run.
    """
    choice = getattr(args, "attention_kernel", KernelChoice()).name
    device, dtype = args.device, args.dtype
    if choice != "auto":
        why = unusable(choice, attention_shape(config, args.seq_len, itemsize), device, dtype)
        if why is not None:
            raise UsageError(f"--attention-kernel {choice}: {why}; use auto or another kernel")
        return plan(config, **_with_kernel(kwargs, choice))
    if kwargs.get("budget_bytes") is None or device != "cuda":
        return plan(config, **_with_kernel(kwargs, "cudnn"))
    return plan(config, **_with_kernel(kwargs, "cudnn"), auto_kernel=True)


def _with_kernel(kwargs: dict[str, Any], kernel: str) -> dict[str, Any]:
    """plan_model's keyword arguments with the step planned for attention `kernel`."""
    step = dataclasses.replace(kwargs["step"], attention_kernel=KernelChoice(kernel))
    return {**kwargs, "step": step}
