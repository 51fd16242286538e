"""What each of PyTorch's attention kernels allocates for causal self-attention beyond q, k, v,
the output and their gradients, by mechanism, and the choice of a kernel by those bytes.

One call of causal attention over `heads` query and `kv_heads` key/value heads of `head_dim`,
`tokens` query (= key) rows per sequence, `batch` sequences, q, k and v of `itemsize` bytes per
element. The kernels are SDPA's backends, in its priority order on Hopper (SPEED_ORDER: the
fastest first; docs/guides/gpus.md), with "by_heads" (the attention core by head groups,
ops/attention/heads.py, calling SDPA's own kernel per group) after SDPA's first: See Note
[Kernel order]. See Note [Kernel buffers] for each figure's source.

`kernel_for` is the choice of the attention-kernel option: a named kernel is that kernel;
"auto" is SDPA's own choice (the first usable kernel of the order other than by_heads) where its
backward buffers fit the budget, else the first (fastest) usable kernel whose buffers do, else the one with the
smallest buffers.

Invariant: every figure is a pure function of the shape and the kernel's name (no device, no
torch call), so the planner and a training run on any rank compute the same bytes and choose
the same kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KERNEL_NAMES",
    "SPEED_ORDER",
    "AttentionShape",
    "KernelChoice",
    "backward_buffer_bytes",
    "config_heads",
    "forward_state_bytes",
    "kernel_for",
    "unusable",
    "usable_kernels",
]


def config_heads(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of a transformers config's text decoder (its
    key/value heads are its query heads where it names none; its head size the hidden size per
    head where it names none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return heads, kv, head_dim


# Note [Kernel buffers]
# ~~~~~~~~~~~~~~~~~~~~~
# Buffers a backward call allocates inside the kernel (no tensor the caller sees), per kernel:
# - cudnn: one workspace of two float32 values per query element (a dq accumulator among them)
#   and one float32 per query row and head, plus 256 bytes; grouped-query attention taken
#   natively. Source: the caching allocator's traces of whole steps on an H100
#   (benchmarks/results/gpu/2026-11-26T0933-h100/trace/: 1,077,936,384 bytes per call at 32K
#   tokens, 4,311,744,768 at 128K, 32 query heads of 128).
# - flash (PyTorch's FlashAttention-2, flash_api.cpp: mha_bwd): softmax_d, float32
#   (batch, heads, tokens rounded up to 128); dq_accum, float32 (batch, tokens rounded up to
#   128, heads, head_dim rounded up to 8 and then to 32, or to 64 above 128); and with fewer
#   key/value heads than query heads, dk and dv expanded to every query head in q's dtype
#   (batch, tokens, heads, head_dim rounded up to 8), summed into dk and dv at the end. For
#   grouped-query attention this is as much as cuDNN's workspace: the flash kernel saves memory
#   against cuDNN only where every query head has its own key/value head.
# - efficient (the CUTLASS memory-efficient kernel, attention_backward.cu): delta, float32
#   (batch, heads, tokens), and, for float16/bfloat16, a float32 dq accumulator in its
#   workspace (tokens x heads x head_dim). Its split-keys staging of dk and dv (kernels whose
#   gradients do not stay in registers) is not counted: the figure is a lower bound there. It
#   takes no grouped-query attention in one call (key/value heads must equal query heads).
# - math (SDPA's composite path): the attention probabilities (batch, heads, tokens, tokens)
#   kept for the backward and their gradient there, each in float32 (the math path computes
#   float16/bfloat16 inputs in float32): quadratic in the length, a reference path only.
# - by_heads (the attention core by head groups, ops/attention/heads.py): the kernel SDPA
#   selects (cuDNN on Hopper) called once per group of heads, head_groups(...) groups: one
#   group's cuDNN workspace, (heads / groups) x tokens x (2 x head_dim + 1) float32 values and
#   256 bytes (the op's own tensors, one group's output and gradients in flight, are tensors the
#   simulation counts).
# Forward state kept for the backward (forward_state_bytes): the float32 log-sum-exp per query
# row and head (efficient: rows rounded up to 32), math: the float32 probabilities.

# Note [Kernel order]
# ~~~~~~~~~~~~~~~~~~~
# SDPA's priority on Hopper is cuDNN, flash, memory-efficient, math: the fastest first. The
# attention core by heads runs SDPA's own kernel per group of heads: on an H200 (2026-11-26,
# benchmarks/results/gpu/2026-11-26-h200/suite/records.jsonl, docs/benchmarks.md) at 1.030x,
# 1.021x and 1.010x SDPA's time at 32K, 128K and 256K tokens, where the flash kernel ran at
# 306-321 TFLOP/s against cuDNN's 559-615: by_heads comes right after cuDNN. It is never SDPA's
# own choice (auto without a bound never takes it).

KERNEL_NAMES: tuple[str, ...] = ("cudnn", "by_heads", "flash", "efficient", "math")
SPEED_ORDER: tuple[str, ...] = KERNEL_NAMES  # the fastest first (Note [Kernel order])
CUDNN_EXTRA = 256  # bytes beyond the float32 values in every cuDNN backward workspace


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class AttentionShape:
    """One attention call's shape.

    Attributes:
        batch: sequences.
        heads: query heads.
        kv_heads: key/value heads (a divisor of heads).
        tokens: query (= key) rows per sequence.
        head_dim: per-head size.
        itemsize: bytes per element of q, k and v.
    """

    batch: int
    heads: int
    kv_heads: int
    tokens: int
    head_dim: int
    itemsize: int = 2

    @property
    def grouped(self) -> bool:
        """Whether key/value heads are shared by several query heads."""
        return self.kv_heads != self.heads


@dataclass(frozen=True)
class KernelChoice:
    """The attention-kernel option: "auto" (with the bytes one attention backward's buffers may
    take, or None: no bound, SDPA's own choice) or one of KERNEL_NAMES.

    Attributes:
        name: "auto" or a kernel name.
        budget_bytes: auto's bound; None for a named kernel or an unbounded auto.
    """

    name: str = "auto"
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.name != "auto" and self.name not in KERNEL_NAMES:
            raise ValueError(
                f"attention_kernel must be auto, auto:<GB> or one of {', '.join(KERNEL_NAMES)}, "
                f"got {self.name!r}"
            )
        if self.budget_bytes is not None and (self.name != "auto" or self.budget_bytes <= 0):
            raise ValueError(
                f"attention_kernel: a bound of {self.budget_bytes} bytes needs auto and a "
                "positive size (auto:<GB>)"
            )

    def __str__(self) -> str:
        if self.budget_bytes is None:
            return self.name
        return f"auto:{self.budget_bytes / 2**30:g}"


def backward_buffer_bytes(kernel: str, shape: AttentionShape) -> int:
    """Bytes one backward call of `kernel` allocates beyond dq, dk and dv (Note [Kernel
    buffers]).

    Raises:
        ValueError: an unknown kernel name.
    """
    b, h, t, d = shape.batch, shape.heads, shape.tokens, shape.head_dim
    if kernel == "cudnn":
        return b * t * h * (2 * d + 1) * 4 + CUDNN_EXTRA
    if kernel == "by_heads":
        from tiledmlp.ops.attention.heads import head_groups  # imports torch: only here

        groups = head_groups(b, h, shape.kv_heads, t, head_dim=d, itemsize=shape.itemsize)
        return b * t * (h // groups) * (2 * d + 1) * 4 + CUDNN_EXTRA
    if kernel == "flash":
        d8 = _up(d, 8)
        rows = _up(t, 128)
        size = b * h * rows * 4 + b * rows * h * _up(d8, 32 if d8 <= 128 else 64) * 4
        if shape.grouped:
            size += 2 * b * t * h * d8 * shape.itemsize
        return size
    if kernel == "efficient":
        accum = b * t * h * d * 4 if shape.itemsize < 4 else 0
        return b * h * t * 4 + accum
    if kernel == "math":
        return 2 * b * h * t * t * 4
    raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNEL_NAMES}")


def forward_state_bytes(kernel: str, shape: AttentionShape) -> int:
    """Bytes the forward of `kernel` keeps for its backward beside q, k, v and the output
    (Note [Kernel buffers])."""
    b, h, t = shape.batch, shape.heads, shape.tokens
    if kernel in ("cudnn", "by_heads", "flash"):
        return b * h * t * 4
    if kernel == "efficient":
        return b * h * _up(t, 32) * 4
    if kernel == "math":
        return b * h * t * t * 4
    raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNEL_NAMES}")


def unusable(kernel: str, shape: AttentionShape, device_type: str, dtype: str) -> str | None:
    """Why `kernel` cannot run the call on `device_type` ("cuda", "cpu", ...) in `dtype`
    ("bfloat16", "float16", "float32", ...), in one line; None where it can (PyTorch's own
    eligibility rules, sdp_utils.cpp, by device, dtype, head size and grouped heads)."""
    if kernel not in KERNEL_NAMES:
        return f"unknown attention kernel {kernel!r}; expected auto or one of {KERNEL_NAMES}"
    if kernel == "math" or (kernel == "by_heads" and device_type == "cpu"):
        return None  # by_heads: the CPU's flash kernel by groups
    if device_type != "cuda":
        return f"the {kernel} attention kernel runs on CUDA GPUs, not on {device_type}"
    low = dtype in ("bfloat16", "float16")
    if kernel in ("cudnn", "by_heads", "flash"):
        if not low:
            return f"the {kernel} attention kernel takes bfloat16 or float16, not {dtype}"
        if shape.head_dim % 8 or shape.head_dim > 256:
            return (
                f"the {kernel} attention kernel takes head sizes of multiples of 8 up to 256, "
                f"not {shape.head_dim}"
            )
    if kernel == "efficient" and shape.grouped:
        return (
            f"the efficient attention kernel takes no grouped-query attention in one call "
            f"({shape.heads} query, {shape.kv_heads} key/value heads); use flash or cudnn"
        )
    return None


def usable_kernels(shape: AttentionShape, device_type: str, dtype: str) -> tuple[str, ...]:
    """The kernels that can run the call, fastest first (SPEED_ORDER)."""
    return tuple(k for k in SPEED_ORDER if unusable(k, shape, device_type, dtype) is None)


def kernel_for(
    choice: str, shape: AttentionShape, usable: Sequence[str], budget: int | None
) -> str | None:
    """The kernel an attention call runs under the attention-kernel option `choice`.

    Args:
        choice: "auto" or a name of KERNEL_NAMES.
        shape: the call's shape.
        usable: the kernels that can run the call, fastest first (SDPA's order).
        budget: bytes the backward's own buffers may take (None: no bound).

    Returns:
        The named kernel for a named choice; for "auto" None where SDPA's own choice (the first
        of `usable` other than by_heads) fits the budget (SDPA then selects as it would), else
        the first of `usable` whose buffers fit, else the one with the smallest buffers.

    Raises:
        ValueError: an unknown choice.
    """
    if choice != "auto":
        if choice not in KERNEL_NAMES:
            raise ValueError(
                f"attention kernel must be auto or one of {KERNEL_NAMES}, not {choice!r}"
            )
        return choice
    if not usable or budget is None:
        return None
    sizes = {k: backward_buffer_bytes(k, shape) for k in usable}
    own = next((k for k in usable if k != "by_heads"), None)
    if own is not None and sizes[own] <= budget:
        return None
    fitting = [k for k in usable if sizes[k] <= budget]
    return fitting[0] if fitting else min(usable, key=lambda k: (sizes[k], usable.index(k)))
