"""Causal self-attention a few heads at a time, through PyTorch's flash kernels.

A flash-attention backward allocates, inside the kernel call and for every head it is given, a
float32 accumulator for dq (tokens x heads x head_dim x 4 bytes) and, for grouped-query
attention, dk and dv expanded to the query heads (2 x tokens x heads x head_dim x 2 bytes in
bf16): 32 GiB for one layer of an 8B Llama at 1M tokens, beside a 16 GiB q/dq pair. Attention
never mixes heads, so running the kernel on groups of heads gives the same output and
gradients with those buffers sized for one group.

`causal_attention_by_heads` is that op: the forward calls the flash kernel per group (whole
key/value heads with their query heads, or a few query heads of one key/value head) and writes
each group's output into one (batch, tokens, heads, head_dim) buffer; the backward calls the
flash backward per group with the saved output and log-sum-exp and writes dq, dk and dv into
whole buffers, summing in float32 the dk and dv of groups that share a key/value head (as the
kernel sums its expanded ones). FLOPs are those of one unchunked call (nothing is recomputed);
memory beyond q, k, v, the output and their gradients is one group's kernel buffers, its output
and its three gradients in flight, and, for groups inside a key/value head, that head's dk and
dv in float32. `head_groups` picks the number of groups: as many as keep every call at least
`MIN_ROW_BLOCKS` blocks of 128 query rows (a launch that fills an H100's 132 SMs several times
over), so short sequences run as one call. `agrees` runs the op against
`scaled_dot_product_attention` on a small problem once per device, dtype and head size; callers
use the op only where it agreed.

Invariant: the output and the gradients of q, k and v equal those of
scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True) up to the
summation order of the kernels; the op refuses (returns a reason from `unsupported`) anything
else: masks, dropout, unequal query and key lengths, devices other than the CPU and CUDA.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

__all__ = [
    "MIN_ROW_BLOCKS",
    "agrees",
    "attention_buffer_bytes",
    "causal_attention_by_heads",
    "head_groups",
    "unsupported",
]

logger = logging.getLogger(__name__)

MIN_ROW_BLOCKS = 1024
_ROWS = 128  # query rows per flash-attention block


def _allowed(heads: int, kv_heads: int) -> list[int]:
    """Group counts that split the heads evenly: groups of whole key/value heads (a divisor of
    kv_heads), or groups inside one key/value head (a multiple of kv_heads dividing heads)."""
    return [
        g
        for g in range(1, heads + 1)
        if heads % g == 0 and (kv_heads % g == 0 or g % kv_heads == 0)
    ]


def head_groups(batch: int, heads: int, kv_heads: int, tokens: int) -> int:
    """How many groups of query heads (with their key/value heads) the attention runs in: the
    most that keep every call at `MIN_ROW_BLOCKS` blocks of 128 query rows or more, among
    groups of whole key/value heads and groups inside one key/value head.

    Args:
        batch: sequences per call.
        heads: query heads.
        kv_heads: key/value heads (a divisor of `heads`).
        tokens: query (= key) tokens per sequence.

    Returns:
        1 (one call, as unchunked) up to `heads` (one query head per call).
    """
    blocks_per_head = batch * math.ceil(tokens / _ROWS)
    fit = [g for g in _allowed(heads, kv_heads) if blocks_per_head * (heads // g) >= MIN_ROW_BLOCKS]
    return max(fit, default=1)


def attention_buffer_bytes(
    batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int, itemsize: int, groups: int
) -> int:
    """Bytes a flash-attention backward allocates inside one call (invisible to a tensor trace)
    when the attention runs in `groups` groups: for the call's heads h = heads / groups and
    key/value heads h_kv (kv_heads / groups, or 1 inside one key/value head), a float32 dq
    accumulator (tokens x h x head_dim, head_dim rounded up to 8), float32 row sums
    (h x tokens), and, when h != h_kv, dk and dv expanded to h heads.
    """
    h, h_kv = heads // groups, max(1, kv_heads // groups)
    rounded = -(-head_dim // 8) * 8
    size = batch * tokens * h * (rounded + 1) * 4
    if h != h_kv:
        size += 2 * batch * tokens * h * rounded * itemsize
    return size


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the op cannot take these (batch, heads, tokens, head_dim) tensors, or None."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return "q, k and v must be (batch, heads, tokens, head_dim), k and v alike"
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        return "query and key lengths (or batch, head size) differ"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
    if not (q.device == k.device == v.device) or not (q.dtype == k.dtype == v.dtype):
        return "q, k and v differ in device or dtype"
    if q.device.type == "cuda":
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"the CUDA flash kernel takes float16 or bfloat16, not {q.dtype}"
        if q.shape[3] % 8 or q.shape[3] > 256:
            return f"the CUDA flash kernel takes head sizes of multiples of 8 up to 256, not {q.shape[3]}"
    elif q.device.type != "cpu":
        return f"no flash kernel is called directly on {q.device.type}"
    elif not q.dtype.is_floating_point:
        return f"attention needs floating-point tensors, not {q.dtype}"
    return None


def _kernel_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """One group through the flash forward: (output (batch, h, tokens, head_dim), the state its
    backward takes)."""
    if q.device.type == "cuda":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale
            )
        )
        return out, (lse, cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, True, scale=scale
    )
    return out, (lse,)


def _kernel_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    state: tuple[Any, ...],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group through the flash backward: (dq, dk, dv)."""
    if q.device.type == "cuda":
        lse, cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(  # type: ignore[no-any-return]
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
            scale=scale,
        )  # fmt: skip
    (lse,) = state
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(  # type: ignore[no-any-return]
        dout, q, k, v, out, lse, 0.0, True, scale=scale
    )


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
    the scale and the number of groups; output (batch, tokens, heads, head_dim), contiguous.
    Where several groups share a key/value head, their dk and dv are summed in float32 (one
    key/value head's worth) and rounded once, as flash attention sums its expanded dk and dv."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int
    ) -> torch.Tensor:
        batch, heads, tokens, head_dim = q.shape
        out = q.new_empty(batch, tokens, heads, head_dim)
        states = []
        for hq, hkv in _slices(heads, k.shape[1], groups):
            part, state = _kernel_forward(q[:, hq], k[:, hkv], v[:, hkv], scale)
            out[:, :, hq].copy_(part.transpose(1, 2))
            del part
            states.append(state)
        # Each group's log-sum-exp is saved (autograd frees it after the backward); the CUDA
        # kernel's other state is sizes and seeds.
        ctx.save_for_backward(q, k, v, out, *(s[0] for s in states))
        ctx.rest = [s[1:] for s in states]
        ctx.scale, ctx.groups = scale, groups
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        q, k, v, out, *lses = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        slices = _slices(q.shape[1], k.shape[1], ctx.groups)
        wide = k.dtype in (torch.float32, torch.float64)
        acc: list[torch.Tensor] = []  # dk, dv of the key/value head being summed
        for i, (hq, hkv) in enumerate(slices):
            state = (lses[i], *ctx.rest[i])
            gq, gk, gv = _kernel_backward(
                dout[:, :, hq].transpose(1, 2), q[:, hq], k[:, hkv], v[:, hkv],
                out[:, :, hq].transpose(1, 2), state, ctx.scale,
            )  # fmt: skip
            dq[:, hq].copy_(gq)
            del gq
            first = i == 0 or slices[i - 1][1] != hkv
            last = i == len(slices) - 1 or slices[i + 1][1] != hkv
            if first and last:  # the group has its key/value heads to itself
                dk[:, hkv].copy_(gk)
                dv[:, hkv].copy_(gv)
            elif first:
                acc = [gk, gv] if wide else [gk.float(), gv.float()]
            else:
                acc[0].add_(gk)
                acc[1].add_(gv)
                if last:
                    dk[:, hkv].copy_(acc[0])
                    dv[:, hkv].copy_(acc[1])
                    acc = []
            del gk, gv
        return dq, dk, dv, None, None


def causal_attention_by_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """Causal attention in `groups` groups of whole key/value heads (module docstring).

    Args:
        q: (batch, heads, tokens, head_dim).
        k, v: (batch, kv_heads, tokens, head_dim); kv_heads divides heads.
        scale: the softmax scale (usually head_dim ** -0.5).
        groups: a divisor of kv_heads (whole key/value heads per call) or a multiple of it
            dividing heads (calls inside one key/value head); head_groups picks one.

    Returns:
        (batch, tokens, heads, head_dim), contiguous.

    Raises:
        ValueError: what `unsupported` names, or groups not dividing kv_heads.
    """
    why = unsupported(q, k, v)
    if why is not None:
        raise ValueError(f"causal_attention_by_heads: {why}")
    if groups not in _allowed(q.shape[1], k.shape[1]):
        raise ValueError(
            f"causal_attention_by_heads: groups must divide the {k.shape[1]} key/value heads or "
            f"be a multiple of them dividing the {q.shape[1]} query heads, got {groups}"
        )
    return CausalAttentionByHeads.apply(q, k, v, float(scale), groups)  # type: ignore[no-any-return]


_AGREED: dict[tuple[str, torch.dtype, int], bool] = {}


def agrees(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the op, in 2 and in 4 groups, gives what scaled_dot_product_attention gives (output and
    the three gradients) on a small grouped-query problem on this device, in this dtype and
    head size; checked once per (device type, dtype, head size), a failure logged once."""
    key = (device.type, dtype, head_dim)
    if key not in _AGREED:
        # Called from inside a model's forward: with gradients on, no autocast, and identity
        # saved-tensor hooks over whatever checkpointing or offloading hooks are active.
        with (
            torch.enable_grad(),
            torch.autocast(device.type, enabled=False),
            torch.autograd.graph.saved_tensors_hooks(_same, _same),
        ):
            _AGREED[key] = _check(device, dtype, head_dim)
    return _AGREED[key]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _check(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = ((1, 4, 200, head_dim), (1, 2, 200, head_dim), (1, 2, 200, head_dim))
    inputs = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    dout = torch.randn(1, 200, 4, head_dim, generator=gen).to(device, dtype)
    scale = head_dim**-0.5
    try:
        ref_in = [t.clone().requires_grad_() for t in inputs]
        ref = torch.nn.functional.scaled_dot_product_attention(
            ref_in[0], ref_in[1], ref_in[2], is_causal=True, scale=scale, enable_gqa=True
        ).transpose(1, 2)
        ref.backward(dout)
        pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        for groups in (2, 4):  # whole key/value heads; inside one key/value head
            got_in = [t.clone().requires_grad_() for t in inputs]
            got = causal_attention_by_heads(got_in[0], got_in[1], got_in[2], scale, groups)
            got.backward(dout)
            pairs.append((got.detach(), ref.detach()))
            pairs += [(a.grad, b.grad) for a, b in zip(got_in, ref_in)]
    except Exception as e:  # any failure of the direct kernel calls: use the unchunked path
        logger.warning(
            "attention by heads is off on %s %s (head size %d): %s: %s",
            device.type, dtype, head_dim, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
        )  # fmt: skip
        return False
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    for a, b in pairs:
        if a is None or b is None or a.shape != b.shape:
            ok = False
        else:
            scale_b = max(float(b.abs().max()), 1e-6)
            ok = bool(((a.float() - b.float()).abs().max() <= tol * scale_b).item())
        if not ok:
            logger.warning(
                "attention by heads is off on %s %s (head size %d): it disagrees with "
                "scaled_dot_product_attention", device.type, dtype, head_dim,
            )  # fmt: skip
            return False
    return True
