"""Time and device memory of full training steps of a Llama-shaped model, several stacks in a
row in one process, each isolated: `python -m tiledmlp.bench.whole_step '<job JSON>' [...]`
prints one JSON record per job (`tiledmlp plan --measure` runs it).

Invariant: every job starts from the same seed and the same tokens, and from an empty device: the
previous job's model, gradients and caches are released (`empty_cache`) and the peak statistics
reset before the next is built. A job that runs out of memory is recorded with its error and
the next one runs.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#bench-whole-step.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tiledmlp.allocator import allocator_setting, prefer_expandable_segments
from tiledmlp.bench.device import others_on_device_bytes
from tiledmlp.bench.peak_memory import TensorAddresses, categorise_peak
from tiledmlp.config.stacks import STACK_PATCHES, STACKS
from tiledmlp.models.build import build_causal_lm, llama_config
from tiledmlp.patching import patch_model
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.process_memory import proc_status_bytes

__all__ = ["STACKS", "StepJob", "measure_whole_step", "measure_whole_steps", "ready_for_step"]

MiB = 2**20


@dataclass(frozen=True)
class StepJob:
    """One measurement.

    Attributes:
        config: transformers.LlamaConfig keyword arguments.
        seq_len: tokens (batch 1).
        stack: one of STACKS.
        dtype: "bfloat16", "float32" or "float16".
        device: "cuda", "cpu", ...
        steps: timed steps after one warm-up step.
        peak_snapshot: on CUDA, the last timed step runs with the allocator's history recorded,
            its peak named by category.
    """

    config: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 1024
    stack: str = "untiled"
    dtype: str = "bfloat16"
    device: str = "cuda"
    steps: int = 2
    peak_snapshot: bool = True


_OTHERS: dict[str, int] = {}  # "bytes": other processes' device memory, measured by main()


def _others_bytes() -> int:
    """Other processes' memory on the device when this process started CUDA (0 if unknown)."""
    return _OTHERS.get("bytes", 0)


def _tensor_addresses(model: Any) -> TensorAddresses:
    """Where the weights and gradients live (optimizer state: none, this step has no optimizer)."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.untyped_storage().data_ptr()
        return start, start + t.untyped_storage().nbytes()

    params = list(model.parameters())
    return TensorAddresses(
        {
            "weights": [span(p) for p in params],
            "gradients": [span(p.grad) for p in params if p.grad is not None],
        }
    )


def _peak_by_category(model: Any, device: torch.device) -> dict[str, Any]:
    """The recorded step's peak grouped by category (the history stopped, gradients freed)."""
    mem = torch.cuda.memory
    try:
        snapshot = mem._snapshot(device)
    finally:
        mem._record_memory_history(enabled=None, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    grouped = categorise_peak(snapshot, _tensor_addresses(model), device=index)
    model.zero_grad(set_to_none=True)
    return {
        "peak_snapshot_mib": grouped["peak_mib"],
        "peak_categories_mib": grouped["categories_mib"],
    }


def measure_whole_step(job: StepJob) -> dict[str, Any]:
    """Measures `job` in this process; returns its record."""
    if job.stack not in STACK_PATCHES:
        raise ValueError(f"unknown stack {job.stack!r}; expected one of {STACKS}")
    device = torch.device(job.device)
    dtype = getattr(torch, job.dtype)
    cuda = device.type == "cuda"
    start_wall = time.perf_counter()
    cfg = llama_config(**job.config)
    model = build_causal_lm(cfg, device=device, dtype=dtype, seed=0, attn_implementation="sdpa")
    build_s = time.perf_counter() - start_wall
    ids = ready_for_step(model, job, cfg.vocab_size)

    def step(keep_grads: bool = False) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if not keep_grads:
            model.zero_grad(set_to_none=True)
        return elapsed

    step()  # warm-up: structure probes, kernels compiled, host buffers allocated
    record: dict[str, Any] = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from the current resident memory
    steps = max(1, job.steps)
    record_peak = cuda and job.peak_snapshot
    times = []
    for i in range(steps):
        last = i == steps - 1
        if last and record_peak:
            # Python stacks per allocation: a few microseconds each, small against a step
            torch.cuda.synchronize(device)
            torch.cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", device=device
            )
        times.append(step(keep_grads=last and record_peak))
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        record.update(
            max_memory_allocated_mib=round(torch.cuda.max_memory_allocated(device) / MiB, 1),
            max_memory_reserved_mib=round(torch.cuda.max_memory_reserved(device) / MiB, 1),
            # In use on the device beside the caching allocator's reservation: this process's
            # CUDA context and cuBLAS/cuDNN workspaces (other processes' memory, measured
            # before this process started CUDA, taken off)
            outside_allocator_mib=round((total - free - reserved - _others_bytes()) / MiB, 1),
            others_on_device_mib=round(_others_bytes() / MiB, 1),
            device_total_mib=round(total / MiB, 1),
        )
        if record_peak:
            record.update(_peak_by_category(model, device))
    else:
        hwm = proc_status_bytes("VmHWM")
        record["process_peak_mib"] = None if hwm is None else round(hwm / MiB, 1)
    return {
        "seq_len": job.seq_len,
        "stack": job.stack,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "dtype": job.dtype,
        "gradient_checkpointing": True,
        "time_ms": round(1000 * statistics.median(times), 2),
        "times_ms": [round(1000 * t, 2) for t in times],
        "build_s": round(build_s, 2),
        "wall_s": round(time.perf_counter() - start_wall, 2),
        "cuda_alloc_conf": allocator_setting()["value"] if cuda else None,
        **record,
    }


def ready_for_step(model: Any, job: StepJob, vocab_size: int) -> torch.Tensor:
    """`job`'s built model made ready for its step: the model's own non-reentrant gradient
    checkpointing, patched for the stack; returns the step's tokens (the same on every
    device)."""
    enable_checkpointing(model)
    patch = STACK_PATCHES[job.stack]
    if patch is not None:
        patch_model(model, patch)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (1, job.seq_len), generator=gen)
    return ids.to(torch.device(job.device))


def _release(device: torch.device) -> None:
    """Nothing of the previous job left on the device; its peak statistics restarted."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_whole_steps(jobs: list[StepJob]) -> Iterator[dict[str, Any]]:
    """Measures the jobs one after another in this process, each isolated; yields one record
    per job (an out-of-memory job as {"seq_len", "stack", "error"})."""
    for job in jobs:
        device = torch.device(job.device)
        _release(device)
        try:
            record = measure_whole_step(job)
        except torch.OutOfMemoryError as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            record = {
                "seq_len": job.seq_len,
                "stack": job.stack,
                "error": f"OutOfMemoryError: {first}",
            }
        _release(device)  # outside the handler: its traceback no longer holds the model
        yield record


def main(argv: list[str] | None = None) -> None:
    prefer_expandable_segments()  # before CUDA initialises; a user's setting is kept
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m tiledmlp.bench.whole_step '<job JSON>' [...]")
    jobs = [StepJob(**json.loads(a)) for a in args]
    if any(j.device.startswith("cuda") for j in jobs) and not torch.cuda.is_initialized():
        others = others_on_device_bytes()
        if others is not None:
            _OTHERS["bytes"] = others
    for record in measure_whole_steps(jobs):
        print(json.dumps(record), flush=True)


def job_json(job: StepJob) -> str:
    """The job as a JSON argument of `python -m tiledmlp.bench.whole_step`."""
    return json.dumps(asdict(job))


if __name__ == "__main__":
    main()
