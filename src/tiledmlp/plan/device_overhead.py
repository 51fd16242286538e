"""What a training process holds on its device beyond the step's tensors: the device overhead.

The planner's peaks (plan/model.py) are tensor-level: every storage the step creates, exactly.
A CUDA process also holds memory no tensor accounts for. Each term, with its source:

- "cuda_context": the CUDA context and the kernels loaded into it. With lazy module loading
  (PyTorch sets CUDA_MODULE_LOADING=LAZY since 1.13) PyTorch measured 287,047,680 bytes for the
  context against 666,632,192 loaded eagerly (pytorch/pytorch#86509); cuBLAS, cuDNN and the
  attention kernels a training step loads add to it: 512 MiB.
- "cublas_workspace": PyTorch gives each cuBLAS handle and stream a workspace of
  CUBLAS_WORKSPACE_CONFIG's default 8.125 MiB (the 8,519,680-byte block every matmul user sees
  in a memory snapshot) and cuBLASLt 32 MiB on Hopper (4 MiB on Ampere cards of 24 GB and more;
  pytorch/pytorch#120925, after the cuBLAS guide's recommendation): 40.125 MiB, Hopper's.
- "attention_backward": the flash-attention backward (PyTorch's SDPA flash kernel, a copy of
  flash-attention's mha_bwd) allocates inside the kernel call, for the heads it is given, a
  float32 accumulator for dq (tokens x heads x head_dim) and float32 row sums (heads x tokens),
  and, for grouped-query attention (fewer key/value heads than query heads at the kernel), dk
  and dv expanded to the query heads (2 x tokens x heads x head_dim in the model's dtype), all
  invisible to a tensor-level trace; one layer at a time. Under sequence parallelism the kernel
  sees the whole sequence with heads / P (and the key/value heads Ulysses sends). With tiled
  decoder layers the attention core runs by groups of heads
  (ops/attention_heads.py: head_groups), and the buffers are one group's.
- "allocator": PyTorch's caching allocator rounds every block up (512 bytes; large blocks come
  from 2 MiB-granular segments) and cannot always reuse freed blocks for differently sized
  requests (fragmentation: reserved minus allocated). Modelled as a fraction of the peak
  (tensors plus the attention buffers), from the two observations made on an H100 80GB
  (79.2 GiB as torch reports it; bf16 8B shape, checkpointing, weights and gradients on the
  card): an untiled step at 32K tokens did not fit (this planner: 70.9 GiB of tensors and
  1.0 GiB of attention buffers), which needs a fraction above 9.3%; a step with the tiled loss
  at 128K tokens fit (69.8 GiB of tensors, 4.0 GiB of attention buffers), which allows at most
  6.6%. No one fraction explains both; 11% predicts the out-of-memory step and errs on the safe
  side for the other (3.3 GiB over the card). `python -m tiledmlp.bench.suite` records
  max_memory_reserved / max_memory_allocated and the memory outside the allocator per step, to
  replace this term with measured figures.

On the CPU none of these terms exists (no context or workspaces are reserved from a device, the
allocator is the system's): the overhead is zero, and `--memory-gb` there is the memory the
step's tensors may use.

Invariant: the overhead is a non-negative function of the tensor-level peak and the tokens per
GPU, affine in the peak; it is zero on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiledmlp.ops.attention_heads import attention_buffer_bytes, head_groups
from tiledmlp.sequence_parallel.attention import kv_repeat

__all__ = ["AttentionKernel", "DeviceOverhead", "device_overhead"]

MiB = 2**20
_CONTEXT = 512 * MiB
_CUBLAS = int(8.125 * MiB) + 32 * MiB
_ALLOCATOR_FRACTION = 0.11


@dataclass(frozen=True)
class AttentionKernel:
    """What one layer's attention kernel sees on a GPU, for its backward's own buffers.

    Attributes:
        heads: the model's query heads.
        kv_heads: its key/value heads.
        head_dim: per-head size.
        itemsize: bytes per element of the model's dtype.
        sequence_parallel_size: P (Ulysses): the kernel sees the whole sequence, heads / P.
        by_heads: the attention core runs by groups of heads (tiled decoder layers).
    """

    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    sequence_parallel_size: int = 1
    by_heads: bool = False

    def buffer_bytes(self, tokens: int) -> int:
        """The backward's buffers for `tokens` tokens per GPU (ops/attention_heads.py)."""
        p = self.sequence_parallel_size
        seq, heads = tokens * p, self.heads // p
        kv = self.kv_heads * kv_repeat(self.heads, self.kv_heads, p) // p
        groups = head_groups(1, heads, kv, seq) if self.by_heads else 1
        return attention_buffer_bytes(1, heads, kv, seq, self.head_dim, self.itemsize, groups)


@dataclass(frozen=True)
class DeviceOverhead:
    """A device's overhead beyond the step's tensors.

    Attributes:
        fixed: bytes per term that do not depend on the step ("cuda_context", ...).
        attention: the attention kernel whose backward buffers no tensor shows
            ("attention_backward"); None: none (the CPU).
        fraction: allocator rounding and fragmentation, as a fraction of the peak.
    """

    fixed: dict[str, int]
    attention: AttentionKernel | None
    fraction: float

    def terms(self, peak: int, tokens: int) -> dict[str, int]:
        """Each term in bytes, for a step whose tensors peak at `peak` bytes over `tokens`
        tokens per GPU."""
        attention = self.attention.buffer_bytes(tokens) if self.attention is not None else 0
        return {
            **self.fixed,
            "attention_backward": attention,
            "allocator": int(self.fraction * (peak + attention)),
        }

    def total(self, peak: int, tokens: int) -> int:
        """The whole overhead in bytes (see `terms`)."""
        return sum(self.terms(peak, tokens).values())

    def as_json(self, peak: int, tokens: int) -> dict[str, Any]:
        """{"device_overhead_mib", "device_overhead_breakdown_mib"} for a plan's JSON."""
        terms = self.terms(peak, tokens)
        return {
            "device_overhead_mib": round(sum(terms.values()) / MiB, 1),
            "device_overhead_breakdown_mib": {k: round(v / MiB, 1) for k, v in terms.items()},
        }


def device_overhead(
    config: Any,
    device_type: str,
    *,
    itemsize: int = 2,
    sequence_parallel_size: int = 1,
    by_heads: bool = False,
) -> DeviceOverhead:
    """The overhead of a training process for the model `config` on `device_type`.

    Args:
        config: a transformers config (its text config's attention heads and head size).
        device_type: "cuda" (any accelerator is planned as a CUDA GPU) or "cpu".
        itemsize: bytes per element of the model's dtype (2: bf16).
        sequence_parallel_size: Ulysses' P.
        by_heads: the attention core runs by head groups (tiled decoder layers).

    Returns:
        A DeviceOverhead; all zero on the CPU.
    """
    if device_type == "cpu":
        return DeviceOverhead(fixed={"cuda_context": 0, "cublas_workspace": 0}, attention=None,
                              fraction=0.0)  # fmt: skip
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kernel = AttentionKernel(heads, kv_heads, head_dim, itemsize, sequence_parallel_size, by_heads)
    return DeviceOverhead(
        fixed={"cuda_context": _CONTEXT, "cublas_workspace": _CUBLAS},
        attention=kernel,
        fraction=_ALLOCATOR_FRACTION,
    )
