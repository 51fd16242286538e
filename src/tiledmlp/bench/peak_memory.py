"""What is alive at the device's memory peak, by named category: the allocator's history
(`torch.cuda.memory._record_memory_history`, then `_snapshot()`) replayed to the moment the
allocated bytes were highest, and every allocation alive then put in one category.

Categories (in MiB), first match wins:
- weights, gradients, optimizer state: the allocation holds a tensor of that kind, known by
  its address at the end of the step (`TensorAddresses`) and never freed between the peak and the
  snapshot;
- by the innermost Python frame that a rule of `FRAME_RULES` knows: the loss tile, the
  attention kernel's buffers, offloading's device buffers (its copies back from the host), the
  current layer's recompute (torch.utils.checkpoint's unpack hook on the stack: the backward
  re-running a layer), checkpointed layer inputs (allocated inside a checkpointed call during
  the forward: a layer's output, saved as the next layer's input);
- before recording: alive at the peak, allocated before the history started;
- the rest by allocating frame: "other: file:line function" of the innermost frame outside torch,
  or "other: no Python frame" (the autograd engine's own allocations in the backward).

Invariant: the categories of one peak sum to the bytes alive at that peak (the allocator's
block sizes, as max_memory_allocated counts them). Pure functions over the snapshot dict, so
they are tested on the CPU with hand-built snapshots in PyTorch's documented format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FRAME_RULES",
    "PeakAllocation",
    "TensorAddresses",
    "categorise_peak",
    "peak_allocations",
]

MiB = 2**20

# A free is requested, then completed once no stream uses the block; memory stops counting as
# allocated at the request (the completion follows it at once on one stream).
_FREES = ("free_requested", "free_completed")
RECOMPUTE = "current layer's recompute"
CHECKPOINTED = "checkpointed layer inputs"
BEFORE = "before recording"

# (category, substrings of "filename:function"). The innermost frame that matches any rule
# names the allocation: a recompute's attention is the attention's, a layer's output allocated
# inside torch's checkpoint (wrapped or not by offloading's checkpoint) is a checkpointed input.
FRAME_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("offloading device buffers", ("tiledmlp/ops/offloading/saved_inputs.py",)),
    ("loss tile", ("tiledmlp/ops/loss", "tiledmlp/ops/lm_head", "tiled_cross_entropy")),
    (
        "attention kernel buffers",
        (
            "scaled_dot_product",
            "sdpa_attention",
            "flash_attention",
            "tiledmlp/ops/attention_",
            "attention_by_heads",
        ),
    ),
    (RECOMPUTE, ("checkpoint.py:unpack_hook", "checkpoint.py:recompute_fn")),
    (CHECKPOINTED, ("torch/utils/checkpoint.py",)),
)


@dataclass(frozen=True)
class PeakAllocation:
    """One allocation alive at the peak: its address, size (bytes) and allocating frames."""

    addr: int
    size: int
    frames: tuple[Mapping[str, Any], ...] = ()
    before_recording: bool = False
    freed_after_peak: bool = False


@dataclass(frozen=True)
class TensorAddresses:
    """Address ranges (start, end) of tensors known at the snapshot, by category name."""

    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def category_of(self, addr: int, size: int) -> str | None:
        for name, spans in self.ranges.items():
            for start, end in spans:
                if addr <= start < addr + size or start <= addr < end:
                    return name
        return None


def peak_allocations(
    snapshot: Mapping[str, Any], device: int = 0
) -> tuple[int, list[PeakAllocation]]:
    """Replays the device's trace to its highest allocated total.

    Args:
        snapshot: `torch.cuda.memory._snapshot()` (segments, device_traces).
        device: the index into device_traces.

    Returns:
        (bytes alive at the peak, the allocations alive then). Allocations made before the
        history started count from the beginning: those still active in the segments and those
        the trace frees without having allocated them.
    """
    traces: Sequence[Sequence[Mapping[str, Any]]] = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    allocated_in_trace = {e["addr"] for e in trace if e.get("action") == "alloc"}
    alive: dict[int, PeakAllocation] = {}
    seen: set[int] = set()
    for e in trace:  # frees of allocations older than the history
        if e.get("action") == "alloc":
            seen.add(e["addr"])
        elif e.get("action") in _FREES and e["addr"] not in seen:
            alive[e["addr"]] = PeakAllocation(e["addr"], int(e["size"]), before_recording=True)
            seen.add(e["addr"])
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated" and b["address"] not in allocated_in_trace:
                alive[b["address"]] = PeakAllocation(
                    b["address"], int(b["size"]), tuple(b.get("frames", ())), before_recording=True
                )
    total = sum(a.size for a in alive.values())
    peak, at_peak, peak_index = total, dict(alive), -1
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            alive[e["addr"]] = PeakAllocation(e["addr"], int(e["size"]), tuple(e.get("frames", ())))
            total += int(e["size"])
            if total > peak:
                peak, at_peak, peak_index = total, dict(alive), i
        elif action in _FREES and e["addr"] in alive:  # the first of the two frees counts
            total -= alive.pop(e["addr"]).size
    freed_later = {e["addr"] for e in trace[peak_index + 1 :] if e.get("action") in _FREES}
    result = [
        PeakAllocation(a.addr, a.size, a.frames, a.before_recording, a.addr in freed_later)
        for a in at_peak.values()
    ]
    return peak, result


def _where(frame: Mapping[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('name', '?')}"


def _user_frame(frames: Iterable[Mapping[str, Any]]) -> str:
    """The innermost frame outside torch's own Python code (frames come innermost first)."""
    frames = list(frames)
    for f in frames:
        name = str(f.get("filename", ""))
        if "/torch/" not in name and not name.startswith("<") and name not in ("", "??"):
            # within tiledmlp, the path inside the package; elsewhere the last two parts
            inside = name.rpartition("/tiledmlp/")[2] if "/tiledmlp/" in name else ""
            short = inside or "/".join(name.split("/")[-2:])
            return f"{short}:{f.get('line', '?')} {f.get('name', '?')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
    return "no Python frame"


def categorise(allocation: PeakAllocation, tensors: TensorAddresses | None = None) -> str:
    """The category of one allocation alive at the peak (rules in the module docstring)."""
    if tensors is not None and not allocation.freed_after_peak:
        known = tensors.category_of(allocation.addr, allocation.size)
        if known is not None:
            return known
    for frame in allocation.frames:  # innermost first
        where = _where(frame)
        for name, needles in FRAME_RULES:
            if any(n in where for n in needles):
                return name
    if allocation.before_recording:
        return BEFORE
    return f"other: {_user_frame(allocation.frames)}"


def categorise_peak(
    snapshot: Mapping[str, Any],
    tensors: TensorAddresses | None = None,
    *,
    device: int = 0,
    top_other: int = 8,
) -> dict[str, Any]:
    """The allocations alive at the device peak, grouped and summed in MiB.

    Args:
        snapshot: `torch.cuda.memory._snapshot()`.
        tensors: addresses of the weights, gradients and optimizer state at the snapshot.
        device: the device's index into device_traces.
        top_other: "other: ..." frames kept by name, largest first; the rest are summed into
            "other: remaining frames".

    Returns:
        {"peak_mib": total, "categories_mib": {category: MiB}, largest first}.
    """
    peak, alive = peak_allocations(snapshot, device)
    sums: dict[str, int] = {}
    for a in alive:
        name = categorise(a, tensors)
        sums[name] = sums.get(name, 0) + a.size
    others = sorted((k for k in sums if k.startswith("other: ")), key=lambda k: -sums[k])
    rest = sum(sums.pop(k) for k in others[top_other:])
    if rest:
        sums["other: remaining frames"] = rest
    ordered = dict(sorted(sums.items(), key=lambda kv: -kv[1]))
    return {
        "peak_mib": round(peak / MiB, 1),
        "categories_mib": {k: round(v / MiB, 1) for k, v in ordered.items()},
    }
