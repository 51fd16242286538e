"""The attention kernel "auto" plans a stack with: cuDNN's, unless another fits a longer sequence.

A stack is first planned with cuDNN's attention buffers (SDPA's choice on Hopper, and the
fastest). A kernel whose backward buffers at cuDNN's longest sequence are not smaller than
cuDNN's cannot fit a longer one, so only kernels with smaller buffers there are tried
(`kernels_to_try`), and not by_heads for a stack of tiled decoder layers, whose attention
already runs by head groups (the same estimates as cuDNN's). Longer is what the search itself
means by longest (plan/search.py: it fits, one more granule does not): such a kernel is first
estimated one granule past cuDNN's longest, and only where that fits is the stack planned with
it and searched from there (plan_model's `search_above`). `best_entry` keeps the longest; of
equal ones the first tried (the faster: usable_kernels' order).

plan_model (plan/model.py) does this inside each stack's job, right after the stack's cuDNN
plan, so a stack's other kernels are planned while the other stacks' searches still run.

Invariant: where no kernel has smaller buffers than cuDNN's, the entry is cuDNN's plan with
"attention_kernel": "cudnn"; a kernel other than cuDNN is taken only with a verified longer
sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiledmlp.ops.attention.buffers import (
    AttentionShape,
    backward_buffer_bytes,
    config_heads,
    usable_kernels,
)

if TYPE_CHECKING:  # no torch for a plan answered from the cache (cli/plan_kernels.py)
    from tiledmlp.config.patch import PatchConfig
    from tiledmlp.config.plan import StepSpec

__all__ = ["attention_shape", "best_entry", "kernels_to_try"]

_GRANULE = 2 * 2**20  # smaller by less than one large-pool block: no longer sequence fits


def attention_shape(config: Any, tokens: int, itemsize: int) -> AttentionShape:
    """The shape of one attention call of `config`'s model on `tokens` tokens (batch 1)."""
    heads, kv, head_dim = config_heads(config)
    return AttentionShape(1, heads, kv, tokens, head_dim, itemsize)


def kernels_to_try(
    config: Any, longest: int | None, step: StepSpec, patch: PatchConfig | None = None
) -> tuple[str, ...]:
    """The kernels other than cuDNN whose backward buffers at cuDNN's longest sequence
    `longest` (whole-sequence tokens; None or 0: none fits, nothing to try) are smaller than
    cuDNN's by more than one large-pool block, fastest first, among those `step`'s device and
    dtype can run; without by_heads where `patch` tiles the decoder layers (Note [By heads
    already])."""
    if not longest:
        return ()
    itemsize = step.dtype.itemsize
    shape = attention_shape(config, longest, itemsize)  # the whole sequence: buffers ~ T x H
    cudnn = backward_buffer_bytes("cudnn", shape)
    dtype = str(step.dtype).removeprefix("torch.")
    margin = _GRANULE * step.sequence_parallel_size
    already = patch is not None and patch.tiled_layers
    return tuple(
        k
        for k in usable_kernels(shape, step.device_type, dtype)
        if k != "cudnn"
        and not (k == "by_heads" and already)
        and backward_buffer_bytes(k, shape) < cudnn - margin
    )


# Note [By heads already]: a tiled decoder layer runs its SDPA attention by head groups
# whatever the kernel option (patching/features/tiled_layers/blocks.py: layer_math calls the
# attention inside by_heads()), and a layer it cannot tile is refused, or is a linear-attention
# layer with no SDPA call (recognise.py: own_mixer). The by_heads option adds the same context
# around the same calls (its routing of the configs that name sdpa resolves to the same
# attention by head groups inside it), and the planner gives a by-heads call cuDNN's workspace
# of its own heads as it gives a cuDNN call (device_overhead.py: AttentionBuffers): every
# estimate of such a stack with by_heads is its estimate with cuDNN
# (tests/plan/test_attention_kernel_plan.py), so a search with it cannot fit one granule more.


def best_entry(cudnn: dict[str, Any], others: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A stack's entry for the kernel auto takes: cuDNN's `cudnn` unless another kernel's entry
    of `others` (each planned above cuDNN's longest: plan_model's search_above) fits longer;
    the longest wins, of equal ones the first (the faster: usable_kernels' order). Carries
    "attention_kernel", "max_seq_len_by_kernel" (cuDNN's first) where another kernel fits longer
    and "kernels_no_longer" (those that did not fit one granule more)."""
    if "max_seq_len" not in cudnn:
        return cudnn
    by_kernel = {"cudnn": cudnn["max_seq_len"]}
    no_longer = [k for k, e in others.items() if e.get("max_seq_len") is None]
    best, best_entry_ = "cudnn", cudnn
    for kernel, other in others.items():
        if other.get("max_seq_len") is None:
            continue
        by_kernel[kernel] = other["max_seq_len"]
        if by_kernel[kernel] > by_kernel[best]:
            best, best_entry_ = kernel, other
    out = {**best_entry_, "attention_kernel": best}
    if len(by_kernel) > 1:
        out["max_seq_len_by_kernel"] = by_kernel
    if no_longer:
        out["kernels_no_longer"] = no_longer
    return out
