"""Causal self-attention a few heads at a time, through PyTorch's fused attention kernels.

Invariant: the output and the gradients of q, k and v equal those of
scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True) up to the
summation order of the kernels; the op refuses (returns a reason from `unsupported`) anything
else: masks, dropout, unequal query and key lengths, devices without a fused kernel.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#ops-attention-heads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from tiledmlp.ops.attention.kernels import (
    FusedKernel,
    KernelState,
    default_kernel,
)
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = [
    "BUFFER_FLOOR",
    "DEFAULT_MULTIPROCESSORS",
    "MIN_WAVES",
    "attention_buffer_bytes",
    "causal_attention_by_heads",
    "head_groups",
    "multiprocessors",
    "unsupported",
]

# Note [Head groups]
# ~~~~~~~~~~~~~~~~~~
# Fewer heads per call means smaller kernel buffers but more calls, and every call costs time
# beyond its share of the FLOPs: its launch, its last wave, the copy of its output and gradients
# into the whole buffers and, for calls inside one key/value head, the float32 sum of that
# head's dk and dv. Two bounds decide:
# - launch: a fused forward runs one thread block (CTA) per block of `rows_per_block` query rows
#   per head and sequence, and a launch with few CTAs leaves streaming multiprocessors idle in
#   its last wave. Causal row blocks do unequal work (block i reads i + 1 key blocks), so the
#   kernels start the long ones first and the last wave holds the shortest; with at least
#   MIN_WAVES full waves (MIN_WAVES x the device's multiprocessor count CTAs) per call the idle
#   share of the last wave is at most 1 / MIN_WAVES of a call, and in practice much less. So no
#   more groups than keep every call at MIN_WAVES x multiprocessors CTAs: a short sequence runs
#   as one call. The backward parallelises over key blocks of the same size, so the same count
#   holds for it. Taken alone this bound gives the smallest buffers the launches allow;
# - memory: what one grouping holds beyond the op's tensors is one call's float32 dq
#   accumulator and row sums, which every fused backward allocates for the heads of the call
#   (tokens x heads/groups x (head_dim + 1) x 4 bytes; cuDNN's workspace holds one more
#   float32 value per query element, attention_buffer_bytes, but the rule weighs every
#   grouping by the flash kernel's buffers, the measure its timed groupings were chosen by),
#   the call's results in flight before they are copied (its dq, dk and dv), and, for calls
#   inside one key/value head, that head's dk and dv summed in float32. head_groups takes the
#   FEWEST groups that hold at most what the launch bound's grouping holds, or BUFFER_FLOOR
#   bytes where that is more: below it a split saves too little memory for what its calls
#   cost. With 32 query and 8 key/value heads of 128 in bf16: one call up to 8K tokens, 2
#   groups at 16K, 4 at 32K, a key/value head per call (8 groups) at 64K, and from 128K, where
#   every fewer grouping passes the floor and holds more than one query head per call, the
#   launch bound's 32.
# The multiprocessor count is the device's (CUDA); elsewhere (the CPU, fake tensors in the
# planner) DEFAULT_MULTIPROCESSORS stands for the accelerator planned for (an H100's 132).

MIN_WAVES = 4
CUDNN_WORKSPACE_EXTRA = 256  # bytes beyond the float32 buffers in every cuDNN backward workspace
DEFAULT_MULTIPROCESSORS = 132
BUFFER_FLOOR = 256 * 2**20


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessor count (CUDA), else DEFAULT_MULTIPROCESSORS."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_MULTIPROCESSORS


def _allowed(heads: int, kv_heads: int, shares_kv: bool = True) -> list[int]:
    """Group counts that split the heads evenly: groups of whole key/value heads (a divisor of
    kv_heads), or groups inside one key/value head (a multiple of kv_heads dividing heads). A
    kernel that cannot share a key/value head among more query heads in one call (shares_kv
    False) takes only calls with one key/value head, or as many as query heads."""
    fits = [
        g
        for g in range(1, heads + 1)
        if heads % g == 0 and (kv_heads % g == 0 or g % kv_heads == 0)
    ]
    if shares_kv:
        return fits
    return [g for g in fits if g >= kv_heads or heads == kv_heads]


def head_groups(
    batch: int,
    heads: int,
    kv_heads: int,
    tokens: int,
    *,
    sms: int | None = None,
    rows_per_block: int = 128,
    shares_kv: bool = True,
    head_dim: int = 128,
    itemsize: int = 2,
    buffer_floor: int | None = None,
) -> int:
    """How many groups of query heads (with their key/value heads) the attention runs in: the
    fewest that hold (one call's kernel buffers and results, a split key/value head's float32
    sums) at most what the most groups that keep every call at MIN_WAVES x `sms` CTAs of
    `rows_per_block` query rows hold, or `buffer_floor` bytes (See Note [Head groups]).

    Args:
        batch: sequences per call.
        heads: query heads.
        kv_heads: key/value heads (a divisor of `heads`).
        tokens: query (= key) tokens per sequence.
        sms: the device's multiprocessor count; None: DEFAULT_MULTIPROCESSORS.
        rows_per_block: query rows per CTA of the kernel (FusedKernel.rows_per_block).
        shares_kv: whether the kernel takes several query heads per key/value head in a call.
        head_dim: per-head size.
        itemsize: bytes per element of q, k and v.
        buffer_floor: bytes of per-call buffers too small to split for; None: BUFFER_FLOOR;
            0: the launch bound alone.

    Returns:
        1 (one call, as unchunked) up to `heads` (one query head per call).
    """
    minimum = MIN_WAVES * (DEFAULT_MULTIPROCESSORS if sms is None else sms)
    blocks_per_head = batch * math.ceil(tokens / rows_per_block)
    allowed = _allowed(heads, kv_heads, shares_kv)
    launch = max((g for g in allowed if blocks_per_head * (heads // g) >= minimum), default=1)
    floor = BUFFER_FLOOR if buffer_floor is None else buffer_floor
    if floor <= 0 or launch not in allowed:
        return launch
    rows = batch * tokens

    def held(g: int) -> int:  # See Note [Head groups]: memory
        h, h_kv = heads // g, max(1, kv_heads // g)
        results = (h + 2 * h_kv) * head_dim * itemsize
        split = 8 * head_dim if g > kv_heads else 0
        return rows * (4 * h * (head_dim + 1) + results + split)

    budget = max(held(launch), floor)
    return min(g for g in allowed if g <= launch and held(g) <= budget)


def attention_buffer_bytes(
    batch: int,
    heads: int,
    kv_heads: int,
    tokens: int,
    head_dim: int,
    itemsize: int,
    groups: int,
    kernel: str = "flash",
) -> int:
    """Bytes a fused attention backward allocates inside one call (invisible to a tensor trace)
    when the attention runs in `groups` groups: for the call's heads h = heads / groups and
    key/value heads h_kv (kv_heads / groups, or 1 inside one key/value head), the flash and
    memory-efficient kernels a float32 dq accumulator (tokens x h x head_dim, head_dim rounded
    up to 8) and float32 row sums (h x tokens), and where h != h_kv dk and dv per query head
    (the flash kernel's expanded ones, the efficient kernel's per-head gradients of its
    stride-0 key/value view). cuDNN ("cudnn") takes grouped-query attention natively (no
    per-query-head dk and dv) and its workspace holds two float32 values per query element and
    one per row: tokens x h x (2 x head_dim + 1) x 4 bytes and 256 more, one allocation per call
    (the H100 allocator traces of benchmarks/results/gpu/2026-11-26T0933-h100/trace/: 1,077,936,384
    bytes per call at 32K tokens and 4,311,744,768 at 128K for 32 query heads of 128, torch 2.11).
    """
    h, h_kv = heads // groups, max(1, kv_heads // groups)
    if kernel == "cudnn":
        return batch * tokens * h * (2 * head_dim + 1) * 4 + CUDNN_WORKSPACE_EXTRA
    rounded = -(-head_dim // 8) * 8
    size = batch * tokens * h * (rounded + 1) * 4
    if h != h_kv:
        size += 2 * batch * tokens * h * rounded * itemsize
    return size


def unsupported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: FusedKernel | None = None
) -> str | None:
    """Why the op cannot take these (batch, heads, tokens, head_dim) tensors, or None; with a
    kernel, also what that kernel cannot take (None: the device's flash kernel)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return "q, k and v must be (batch, heads, tokens, head_dim), k and v alike"
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        return "query and key lengths (or batch, head size) differ"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
    if not (q.device == k.device == v.device) or not (q.dtype == k.dtype == v.dtype):
        return "q, k and v differ in device or dtype"
    if q.device.type not in ("cpu", "cuda"):
        return f"no fused attention kernel is called directly on {q.device.type}"
    return (kernel or default_kernel(q.device)).unsupported(q)


def _slices(heads: int, kv_heads: int, groups: int) -> list[tuple[slice, slice]]:
    """(query heads, key/value heads) of each group, in order: groups inside one key/value
    head follow each other."""
    h = heads // groups
    if groups <= kv_heads:
        h_kv = kv_heads // groups
        return [(slice(i * h, (i + 1) * h), slice(i * h_kv, (i + 1) * h_kv)) for i in range(groups)]
    per_kv = heads // kv_heads
    return [
        (slice(i * h, (i + 1) * h), slice(i * h // per_kv, i * h // per_kv + 1))
        for i in range(groups)
    ]


class CausalAttentionByHeads(torch.autograd.Function):
    """Inputs q (batch, heads, tokens, head_dim), k and v (batch, kv_heads, tokens, head_dim),
    the scale, the number of groups and the kernel; output (batch, tokens, heads, head_dim),
    contiguous. Where several groups share a key/value head, their dk and dv are summed in
    float32 (one key/value head's worth) and rounded once, as the kernels sum per-query-head
    gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        groups: int,
        kernel: FusedKernel,
    ) -> torch.Tensor:
        batch, heads, tokens, head_dim = q.shape
        out = q.new_empty(batch, tokens, heads, head_dim)
        states: list[KernelState] = []
        for hq, hkv in _slices(heads, k.shape[1], groups):
            part, state = kernel.forward(q[:, hq], k[:, hkv], v[:, hkv], scale)
            out[:, :, hq].copy_(part.transpose(1, 2))
            del part
            states.append(state)
        # Each group's tensors (its log-sum-exp, and RNG state where the kernel keeps it as
        # tensors) are saved through autograd, which frees them after the backward.
        counts = [len(s.tensors) for s in states]
        ctx.save_for_backward(q, k, v, out, *(t for s in states for t in s.tensors))
        ctx.counts, ctx.rest = counts, [s.rest for s in states]
        ctx.scale, ctx.groups, ctx.kernel = scale, groups, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        q, k, v, out, *flat = ctx.saved_tensors
        kernel: FusedKernel = ctx.kernel
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        units = _units(q.shape[1], k.shape[1], ctx.groups)
        wide = k.dtype in (torch.float32, torch.float64)
        at = [0]  # each group's first saved state tensor
        for count in ctx.counts:
            at.append(at[-1] + count)
        for start, _ in _unit_tiles(units):
            unit = units[start]
            acc: list[torch.Tensor] = []  # dk, dv of the unit's key/value head, summed
            for j, (hq, hkv) in enumerate(unit):
                i = start * len(unit) + j
                state = KernelState(tuple(flat[at[i] : at[i + 1]]), ctx.rest[i])
                gq, gk, gv = kernel.backward(
                    dout[:, :, hq].transpose(1, 2), q[:, hq], k[:, hkv], v[:, hkv],
                    out[:, :, hq].transpose(1, 2), state, ctx.scale,
                )  # fmt: skip
                del state
                dq[:, hq].copy_(gq)
                del gq
                if len(unit) == 1:  # the group has its key/value heads to itself
                    dk[:, hkv].copy_(gk)
                    dv[:, hkv].copy_(gv)
                elif j == 0:
                    acc = (
                        [gk, gv] if wide or gk.dtype == torch.float32 else [gk.float(), gv.float()]
                    )
                else:
                    acc[0].add_(gk)
                    acc[1].add_(gv)
                    if j == len(unit) - 1:
                        dk[:, hkv].copy_(acc[0])
                        dv[:, hkv].copy_(acc[1])
                        acc = []
                del gk, gv
        return dq, dk, dv, None, None, None


def _units(heads: int, kv_heads: int, groups: int) -> list[list[tuple[slice, slice]]]:
    """The groups (_slices) by unit, all units alike: the groups inside one key/value head
    together (more groups than key/value heads), else each group alone."""
    slices = _slices(heads, kv_heads, groups)
    per = max(1, groups // kv_heads)
    return [slices[i : i + per] for i in range(0, groups, per)]


def _unit_tiles(units: list[list[tuple[slice, slice]]]) -> Iterator[tuple[int, int]]:
    """The units walked as a tile loop (one unit a tile: TilePlan.bounds), the way every tiled
    op walks its tiles: the planner's fake tensors run repeated units once
    (plan/sim/periodic_tiles.py)."""
    return TilePlan((1,) * len(units)).bounds()


def causal_attention_by_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    groups: int,
    kernel: FusedKernel,
) -> torch.Tensor:
    """Causal attention in `groups` groups of heads through one fused kernel (module docstring).

    Args:
        q: (batch, heads, tokens, head_dim).
        k, v: (batch, kv_heads, tokens, head_dim); kv_heads divides heads.
        scale: the softmax scale (usually head_dim ** -0.5).
        groups: a divisor of kv_heads (whole key/value heads per call) or a multiple of it
            dividing heads (calls inside one key/value head); head_groups picks one.
        kernel: the fused kernel (ops/attention/kernels.py). Take the one
            scaled_dot_product_attention would select that passed its self-check
            (ops/attention/select.py: choose_kernel, or by_heads_plan with the groups), e.g.
            cuDNN on Hopper: another kernel runs, but slower than SDPA.

    Returns:
        (batch, tokens, heads, head_dim), contiguous.

    Raises:
        ValueError: what `unsupported` names, or groups the kernel cannot split the heads in.
    """
    why = unsupported(q, k, v, kernel)
    if why is not None:
        raise ValueError(f"causal_attention_by_heads: {why}")
    if groups not in _allowed(q.shape[1], k.shape[1], kernel.shares_kv):
        raise ValueError(
            f"causal_attention_by_heads: groups must divide the {k.shape[1]} key/value heads or "
            f"be a multiple of them dividing the {q.shape[1]} query heads (the {kernel.name} "
            f"kernel: {_allowed(q.shape[1], k.shape[1], kernel.shares_kv)}), got {groups}"
        )
    return CausalAttentionByHeads.apply(q, k, v, float(scale), groups, kernel)  # type: ignore[no-any-return]
