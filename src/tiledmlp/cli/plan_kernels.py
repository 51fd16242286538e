"""`tiledmlp plan --attention-kernel`: the attention kernel the whole step is planned with.

A named kernel ("cudnn", "by_heads", "flash", "efficient", "math") plans every stack with that
kernel's attention buffers (ops/attention/buffers.py; by_heads: the model's own attention by
head groups, each group's call with cuDNN's workspace), refused in one line where the planned
device or dtype cannot run it. "auto" (the default) plans with what a run's "auto" would choose: cuDNN,
SDPA's choice on Hopper and the fastest, unless another kernel lets a stack fit a longer
sequence within --memory-gb. A kernel whose backward buffers at cuDNN's longest sequence are
not smaller than cuDNN's cannot fit a longer one, so only kernels with smaller buffers there are
planned. Longer is what the search itself means by longest (plan/search.py: it fits, one more
granule does not): such a kernel is first estimated one granule past cuDNN's longest, and
only where that fits is the stack planned with it and searched from there; the stacks of one
kernel are planned together (in parallel where CPUs allow, plan/forked.py). Each stack then
carries the kernel auto takes ("attention_kernel"), each kernel's longest sequence where more
than cuDNN's fit ("max_seq_len_by_kernel", cuDNN's first) and the kernels that did not fit one
granule more ("kernels_no_longer").

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
from tiledmlp.ops.attention.buffers import (
    AttentionShape,
    backward_buffer_bytes,
    unusable,
    usable_kernels,
)

__all__ = ["plan_with_kernels"]

_GRANULE = 2 * 2**20  # smaller by less than one large-pool block: no longer sequence fits


def _shape(config: Any, tokens: int, itemsize: int) -> AttentionShape:
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return AttentionShape(1, heads, kv, tokens, head_dim, itemsize)


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
    choice = getattr(args, "attention_kernel", "auto")
    device, dtype = args.device, args.dtype
    if choice != "auto":
        why = unusable(choice, _shape(config, args.seq_len, itemsize), device, dtype)
        if why is not None:
            raise UsageError(f"--attention-kernel {choice}: {why}; use auto or another kernel")
        return plan(config, **_with_kernel(kwargs, choice))
    stacks = plan(config, **_with_kernel(kwargs, "cudnn"))
    if kwargs.get("budget_bytes") is None or device != "cuda":
        return stacks
    p = kwargs["step"].sequence_parallel_size
    wanted: dict[str, list[str]] = {}  # kernel -> the stacks it may lift
    for name, entry in stacks.items():
        longest = entry.get("max_seq_len")
        if not longest:
            continue
        shape = _shape(config, longest, itemsize)  # the whole sequence: buffers scale with T x H
        cudnn = backward_buffer_bytes("cudnn", shape)
        for k in usable_kernels(shape, device, dtype):
            if k != "cudnn" and backward_buffer_bytes(k, shape) < cudnn - _GRANULE * p:
                wanted.setdefault(k, []).append(name)
    others = {
        kernel: plan(config, **{**_with_kernel(kwargs, kernel), "stacks": tuple(names),
                                "search_above": {n: stacks[n]["max_seq_len"] for n in names}})
        for kernel, names in wanted.items()
    }  # fmt: skip
    for name, entry in list(stacks.items()):
        stacks[name] = _best(entry, {k: got[name] for k, got in others.items() if name in got})
    return stacks


def _best(cudnn: dict[str, Any], others: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A stack's entry for the kernel auto takes: cuDNN's `cudnn` unless another kernel's entry
    of `others` (each planned above cuDNN's longest: plan_model's search_above) fits longer;
    the longest wins, of equal ones the first (the faster: usable_kernels' order)."""
    if "max_seq_len" not in cudnn:
        return cudnn
    by_kernel = {"cudnn": cudnn["max_seq_len"]}
    no_longer = [k for k, e in others.items() if e.get("max_seq_len") is None]
    best, best_entry = "cudnn", cudnn
    for kernel, other in others.items():
        if other.get("max_seq_len") is None:
            continue
        by_kernel[kernel] = other["max_seq_len"]
        if by_kernel[kernel] > by_kernel[best]:
            best, best_entry = kernel, other
    out = {**best_entry, "attention_kernel": best}
    if len(by_kernel) > 1:
        out["max_seq_len_by_kernel"] = by_kernel
    if no_longer:
        out["kernels_no_longer"] = no_longer
    return out


def _with_kernel(kwargs: dict[str, Any], kernel: str) -> dict[str, Any]:
    """plan_model's keyword arguments with the step planned for attention `kernel`."""
    return {**kwargs, "step": dataclasses.replace(kwargs["step"], attention_kernel=kernel)}
