"""What a training process holds on its device beyond the step's tensors: the device overhead.

The planner's peaks (plan/model.py) are tensor-level: every storage the step creates, exactly.
A CUDA process also holds memory no tensor accounts for. Each term, with its source:

- "outside_allocator": what the process holds outside PyTorch's caching allocator (the CUDA
  context and the modules of CUDA, cuBLAS, cuDNN and the attention kernels loaded into it):
  the largest of the figures measured beside whole training steps on an H100
  (benchmarks/results/gpu/2026-11-25-h100/whole_steps.jsonl, "outside_allocator_mib":
  766.8 to 848.8 MiB): 849 MiB.
- "cublas_workspace": PyTorch gives each cuBLAS handle and stream a workspace of
  CUBLAS_WORKSPACE_CONFIG's default 8.125 MiB (the 8,519,680-byte block every matmul user sees
  in a memory snapshot) and cuBLASLt 32 MiB on Hopper (4 MiB on Ampere cards of 24 GB and more;
  pytorch/pytorch#120925, after the cuBLAS guide's recommendation): 40.125 MiB, Hopper's,
  taken from the caching allocator.
- "attention_backward": buffers an attention backward allocates inside the kernel call, for
  the heads it is given, invisible to a tensor-level trace (its dq, dk and dv are tensors the
  simulation counts): what they add to the step's tensor peak at their moment. See Note
  [Attention backward buffers].
- "allocator": the caching allocator's reserve beyond the allocated peak, which an
  out-of-memory error counts. See Note [Allocator reserve].

Note [Attention backward buffers]: a model's own attention calls
`F.scaled_dot_product_attention`, which on Hopper runs cuDNN attention
(`aten._scaled_dot_product_cudnn_attention`; docs/guides/gpus.md), and so does the attention
core by head groups of tiled decoder layers (ops/attention/select.py: SDPA's kernel, per group).
cuDNN's backward takes one workspace per call: two float32 values per query element (a dq
accumulator among them) and a float32 row sum per query row, and 256 bytes more; grouped-query
attention is taken natively (no per-query-head dk and dv). The source is the caching
allocator's own trace of whole steps on an H100 (benchmarks/results/gpu/2026-11-26T0933-h100/
trace/, bench/allocator_trace.py): each attention backward requests dq, a second buffer of dq's
size, dk and dv (tensors, which the simulation's fake kernel creates as well) and then that
workspace, released before the call returns (1,077,936,384 bytes at 32K tokens, 4,311,744,768
at 128K, 32 query heads of 128). The H100 record of the op (benchmarks/results/gpu/2026-11-25-
h100/attention_by_heads.jsonl, "sdpa": 53,504 bytes per token for 32 query and 8 key/value
heads of 128, bf16) is exactly the row statistics, dq, the second buffer, dk, dv and the
workspace; with key/value repeated to 32 heads ("sdpa_repeat", 65,792) exactly the larger dk
and dv. The buffers exist while the call runs: the simulation
(plan/sim/phase_tracker.py) adds them to the trace at each attention backward call, for the call's
own query (one head group's, or under sequence parallelism the whole sequence with heads / P),
beside its outputs, so the allocator replays them in order and the term is what they add to the
step's tensor peak at their moment: nothing where the step peaks elsewhere (the loss, an MLP's
recompute), a whole call's buffers where it peaks inside an attention backward. Another
kernel (the attention-kernel option) gets its own buffers instead (AttentionBuffers.kernel;
ops/attention/buffers.py, Note [Kernel buffers]).

Note [Allocator reserve]: PyTorch's caching allocator keeps the segments it obtained from the
driver. Without expandable segments, a freed block can serve only requests no larger than
itself, and a segment is cut into blocks by the requests it served first, so a step whose
tensors change size from phase to phase holds segments it cannot reuse. The term is the
allocator's own rules (c10/cuda/CUDACachingAllocator.cpp: 512-byte rounding, the 2 MiB small
and 20 MiB large segments, best fit, splitting, merging; plan/sim/caching_allocator.py) replayed
on the step's allocation trace, every storage's creation and release in order, which the
simulation records (plan/sim/phase_tracker.py): the segments' total minus the step's tensor peak,
over every layer of the model (the first four simulated, the rest built from their record;
five where four do not show the middle layers: plan/estimate.py, plan/sim/deeper.py; with
AdamW stepping on the device, whose requests are not per layer, the larger of the 5- and
6-layer steps', plan/estimate.py). With `expandable_segments:True` (the
same file, Note [Expandable Segments]) each pool has one segment that grows by mapping pages
(20 MiB for the large pool) at its end when no free block is large enough; a freed block
still serves only requests no larger than itself, so the mapped range fragments as well: a
step whose loss frees 16 GiB of logits and then asks for other sizes maps new pages beyond
them. The term is the same trace
replayed through those rules (plan/sim/caching_allocator.py): on the H200 records of 2026-11-26
(benchmarks/results/gpu/2026-11-26-h200/suite/records.jsonl) the replay maps 62,682 MiB for the
4-layer untiled step at 32K tokens where the card reserved 62,684. The replay of a trace whose
repeated tiles ran once (plan/sim/periodic_tiles.py) maps the same pages, so it needs no exact
simulation; the reserve follows no line in the depth (which blocks a later request finds free
depends on every size before it), so it too is the whole depth's trace replayed, as above. In
both modes the attention backward's buffers are in
the trace at their calls; the cuBLAS workspaces are allocated before the step's first request.
Blocks the offloader's side-stream copies still use when their tensors die stay taken until the
phase ends (plan/sim/phase_tracker.py); a full card takes them back before an allocation fails, so
the plan's figure leaves them out and names them (StepEstimate.reclaimable).

On the CPU none of these terms exists (no context or workspaces are reserved from a device, the
allocator is the system's): the overhead is zero, and `--memory-gb` there is the memory the
step's tensors may use.

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
