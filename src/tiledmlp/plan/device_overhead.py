"""What a training process holds on its device beyond the step's tensors: the device overhead.

The planner's peaks (plan/model.py) are tensor-level: every storage the step creates, exactly.
A CUDA process also holds memory no tensor accounts for:

- "outside_allocator": what the process holds outside PyTorch's caching allocator (the CUDA
  context and the modules loaded into it), measured beside whole steps on an H100;
- "cublas_workspace": the cuBLAS and cuBLASLt workspaces, taken from the caching allocator;
- "attention_backward": buffers an attention backward allocates inside the kernel call,
  invisible to a tensor-level trace: what they add to the step's tensor peak at their moment
  (Note [Attention backward buffers]);
- "allocator": the caching allocator's reserve beyond the allocated peak, which an
  out-of-memory error counts (Note [Allocator reserve]).

On the CPU none of these terms exists: the overhead is zero, and `--memory-gb` there is the
memory the step's tensors may use. The figures, their sources and both Notes:
docs/how-it-works/planner.md, "Device overhead".

Invariant: the overhead is a non-negative function of the step's simulated trace (the attention
buffers' share of its peak, the replayed allocator reserve); it is zero on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiledmlp.ops.attention.buffers import AttentionShape, backward_buffer_bytes
from tiledmlp.ops.attention.heads import attention_buffer_bytes

__all__ = [
    "CUBLAS_WORKSPACES",
    "AttentionBuffers",
    "DeviceOverhead",
    "attention_call_bytes",
    "device_overhead",
]

MiB = 2**20
_OUTSIDE_ALLOCATOR = 849 * MiB  # whole_steps.jsonl: the largest outside_allocator_mib, rounded up
# cuBLAS's and cuBLASLt's workspaces, as the caching allocator serves them (the first matmul)
CUBLAS_WORKSPACES = (int(8.125 * MiB), 32 * MiB)
_CUBLAS = sum(CUBLAS_WORKSPACES)


def attention_call_bytes(batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int) -> int:
    """The workspace one cuDNN attention backward call allocates beyond its tensors, for the
    call's heads and key/value heads (Note [Attention backward buffers];
    ops/attention/heads.py: attention_buffer_bytes)."""
    return attention_buffer_bytes(batch, heads, kv_heads, tokens, head_dim, 0, 1, "cudnn")


@dataclass(frozen=True)
class AttentionBuffers:
    """The attention backward's own buffers on a GPU, per call (plan/sim/phase_tracker.py's
    KernelBuffers): every fused attention backward op the simulation dispatches (on fake
    tensors the CPU's kernel stands for the device's: the same shapes) gets `kernel`'s
    (ops/attention/buffers.py, Note [Kernel buffers]; cuDNN's: SDPA's choice on Hopper).

    Attributes:
        kernel: "cudnn", "by_heads" (cuDNN's workspace for each group's call), "flash",
            "efficient" or "math".
    """

    kernel: str = "cudnn"

    def names(self, func: Any) -> bool:
        name = str(getattr(func, "_name", func))
        return "attention" in name and "backward" in name

    def nbytes(self, func: Any, args: Any) -> int:
        # (grad_out, query, key, value, out, ...) for every fused kernel, q, k and v each
        # (batch, heads, tokens, head_dim)
        (batch, heads, tokens, head_dim), kv_heads = args[1].shape, args[2].shape[1]
        # by_heads: each call is one group's, through SDPA's kernel (cuDNN on Hopper)
        if self.kernel in ("cudnn", "by_heads"):
            return attention_call_bytes(batch, heads, kv_heads, tokens, head_dim)
        shape = AttentionShape(batch, heads, kv_heads, tokens, head_dim, args[1].element_size())
        return backward_buffer_bytes(self.kernel, shape)


@dataclass(frozen=True)
class DeviceOverhead:
    """A device's overhead beyond the step's tensors.

    Attributes:
        fixed: bytes per term that do not depend on the step ("outside_allocator", ...).
        buffers: the attention backward's own buffers, for the simulation to add at their calls
            ("attention_backward"); None: none (the CPU).
        replayed: the allocator's reserve is the step's own, replayed through the caching
            allocator's rules (Note [Allocator reserve]); False on the CPU.
    """

    fixed: dict[str, int]
    buffers: AttentionBuffers | None
    replayed: bool = False

    def terms(self, reserve: int = 0, attention: int = 0) -> dict[str, int]:
        """Each term in bytes, for a step whose replayed allocator reserve beyond its allocated
        peak is `reserve` (StepEstimate.full_card_reserve) and whose attention backward's
        buffers add `attention` to its tensor peak (StepEstimate.attention); both are counted
        when `replayed`."""
        replayed = self.replayed
        return {
            **self.fixed,
            "attention_backward": attention if replayed else 0,
            "allocator": reserve if replayed else 0,
        }

    def total(self, reserve: int = 0, attention: int = 0) -> int:
        """The whole overhead in bytes (see `terms`)."""
        return sum(self.terms(reserve, attention).values())

    def as_json(self, reserve: int = 0, attention: int = 0) -> dict[str, Any]:
        """{"device_overhead_mib", "device_overhead_breakdown_mib"} for a plan's JSON."""
        terms = self.terms(reserve, attention)
        return {
            "device_overhead_mib": round(sum(terms.values()) / MiB, 1),
            "device_overhead_breakdown_mib": {k: round(v / MiB, 1) for k, v in terms.items()},
        }


def device_overhead(device_type: str, attention_kernel: str = "cudnn") -> DeviceOverhead:
    """The overhead of a training process on `device_type`: "cuda" (any accelerator is
    planned as a CUDA GPU, its attention backward's buffers `attention_kernel`'s) or "cpu"
    (all zero). The allocator's reserve and the attention
    buffers' share are the step's own (StepEstimate.reserve, .attention), simulated under the
    allocator setting and on the device type the step is planned for (estimate_step)."""
    if device_type == "cpu":
        return DeviceOverhead(fixed={"outside_allocator": 0, "cublas_workspace": 0},
                              buffers=None)  # fmt: skip
    return DeviceOverhead(
        fixed={"outside_allocator": _OUTSIDE_ALLOCATOR, "cublas_workspace": _CUBLAS},
        buffers=AttentionBuffers(attention_kernel),
        replayed=True,
    )
