"""The CUDA caching allocator's own trace of a whole step, from the process's first allocation:
every block it handed out and took back, and every segment it took from the driver.

Run as `python -m benchmarks.allocator_trace '<job JSON>' OUT.json.gz` (a whole_step.StepJob:
config, seq_len, stack, dtype; the allocator setting is PYTORCH_CUDA_ALLOC_CONF's, read when
CUDA starts). The model is built on the device, made ready as whole_step.py makes its steps
(ready_for_step: checkpointing, patched for the stack, the same tokens), and runs a warm-up
step and one more; the allocator's history is recorded from before the build
(`torch.cuda.memory._record_memory_history`). OUT holds:

- "events": [action, address, bytes, stream, frame] per allocator event, in order; action one of
  ACTIONS ("alloc": bytes as requested; "free_completed": the block back in its pool;
  "segment_alloc"/"segment_map": bytes taken from the driver); frame: an index into "frames",
  the innermost Python frame in tiledmlp, transformers or torch.nn (or "" if none);
- "phases": how many events each phase ended at ("build", "warmup", "step");
- "segments": the segments held at the end, [address, total bytes, allocated bytes, pool];
- the job, the allocator setting, max_memory_allocated and max_memory_reserved.

The trace is what a replay of the allocator's rules (the planner's plan/sim/caching_allocator.py) is
checked against: the same requests in the same order must take the same segments.

Invariant: nothing but the job runs in the process; the history is on before CUDA's first
allocation.
"""

from __future__ import annotations

import gzip
import json
import sys
from typing import Any

import torch

from tiledmlp.allocator import allocator_setting
from tiledmlp.bench.whole_step import StepJob, ready_for_step
from tiledmlp.models.build import build_causal_lm, llama_config

__all__ = ["ACTIONS", "compact_trace", "record_step_trace"]

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")  # fmt: skip
_OURS = ("tiledmlp/", "transformers/", "torch/nn/", "torch/utils/checkpoint", "torch/autograd/")


def _frame(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in the code that decides what a step allocates."""
    for f in frames:
        name = str(f.get("filename", ""))
        if any(part in name for part in _OURS):
            short = name.split("site-packages/")[-1].split("src/")[-1]
            return f"{short}:{f.get('line', 0)} {f.get('name', '')}"
    return ""


def compact_trace(trace: list[dict[str, Any]]) -> tuple[list[list[Any]], list[str]]:
    """The allocator's trace entries as [action, address, bytes, stream, frame index], and the
    frames they name (each once)."""
    frames: dict[str, int] = {}
    events = []
    for e in trace:
        action = e["action"]
        frame = _frame(e.get("frames") or []) if action == "alloc" else ""
        index = frames.setdefault(frame, len(frames))
        events.append([action, int(e["addr"]), int(e["size"]), int(e.get("stream", 0)), index])
    return events, list(frames)


def record_step_trace(job: StepJob) -> dict[str, Any]:
    """Builds, warms up and steps `job`'s model with the allocator's history on; returns the
    record described in the module docstring."""
    device = torch.device(job.device)
    if device.type != "cuda":
        raise SystemExit("allocator_trace: the allocator's trace exists on CUDA only")
    mem = torch.cuda.memory
    torch.cuda.init()  # the context only: no allocation before the history is on
    mem._record_memory_history(enabled="all", context="alloc", stacks="python", device=device)
    phases: dict[str, int] = {}

    def mark(name: str) -> None:
        torch.cuda.synchronize(device)
        phases[name] = len(mem._snapshot(device)["device_traces"][_index(device)])

    cfg = llama_config(**job.config)
    model = build_causal_lm(cfg, device=device, dtype=getattr(torch, job.dtype), seed=0,
                            attn_implementation="sdpa")  # fmt: skip
    ids = ready_for_step(model, job, cfg.vocab_size)
    mark("build")
    for name in ("warmup", "step"):
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        mark(name)
    snapshot = mem._snapshot(device)
    mem._record_memory_history(enabled=None, device=device)
    events, frames = compact_trace(snapshot["device_traces"][_index(device)])
    segments = [
        [
            int(s["address"]),
            int(s["total_size"]),
            int(s["allocated_size"]),
            str(s.get("segment_type", "")),
        ]
        for s in snapshot["segments"]
        if s.get("device", _index(device)) == _index(device)
    ]
    return {
        "job": {
            "config": job.config,
            "seq_len": job.seq_len,
            "stack": job.stack,
            "dtype": job.dtype,
        },
        "cuda_alloc_conf": allocator_setting()["value"],
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device),
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        "phases": phases,
        "segments": segments,
        "frames": frames,
        "events": events,
    }


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m benchmarks.allocator_trace '<job JSON>' OUT.json.gz")
    record = record_step_trace(StepJob(**json.loads(args[0])))
    with gzip.open(args[1], "wt") as f:
        json.dump(record, f, separators=(",", ":"))
    n = len(record["events"])
    print(f"{args[1]}: {n} events, reserved {record['max_memory_reserved'] / 2**20:,.0f} MiB, "
          f"allocated {record['max_memory_allocated'] / 2**20:,.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
