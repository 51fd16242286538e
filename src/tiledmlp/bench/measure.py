"""One benchmark measurement: one MLP variant at one sequence length, in this process or in a
fresh one.

A measurement builds the SwiGLU MLP (seed 0), its input and upstream gradient, runs the variant
on 8 tokens outside the measurement (structure probe, kernel warm-up), then measures: on the CPU
the process-level peak of the first full step (VmHWM, reset through /proc/self/clear_refs, before
any full-size step has grown the allocator's caches), tensor-level peak memory
(bench/memory.py), FLOPs (bench/flops.py), and wall-clock time (median of `repeats` steps after
`warmup` untimed ones).

Run as `python -m tiledmlp.bench.measure '<job JSON>'` it prints the record as one JSON line:
that is how the harness isolates each measurement in a fresh process on the CPU (allocator
caches, thread pools and page-cache state of one measurement never reach the next).

Invariant: a record depends only on its job (and the machine); the same job gives the same
memory and FLOP figures in any process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tiledmlp.bench.flops import count_flops
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.bench.variants import Variant, make_variant
from tiledmlp.models.mlps import GatedMLP
from tiledmlp.process_memory import process_peak_bytes

__all__ = ["Job", "measure", "measure_in_subprocess", "memory_snapshot"]

MiB = 2**20


@dataclass(frozen=True)
class Job:
    """What one measurement runs.

    Attributes:
        hidden, intermediate: the SwiGLU MLP's shape.
        seq_len: tokens (batch 1).
        dtype: "float32", "bfloat16" or "float16".
        device: "cpu", "cuda", "npu", ...
        variant: "untiled", "tiled" or "deepspeed".
        num_tiles: the variant's tile policy (None for untiled).
        repeats: timed steps (the median is reported).
        warmup: untimed steps before timing.
    """

    hidden: int
    intermediate: int
    seq_len: int
    dtype: str
    device: str
    variant: str
    num_tiles: int | str | None
    repeats: int = 3
    warmup: int = 1


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure(job: Job) -> dict[str, Any]:
    """Measures `job` in this process; returns its record (without the environment)."""
    device = torch.device(job.device)
    dtype = getattr(torch, job.dtype)
    torch.manual_seed(0)
    mlp = GatedMLP(job.hidden, job.intermediate).to(device=device, dtype=dtype)
    x = torch.randn(1, job.seq_len, job.hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(1, job.seq_len, job.hidden, device=device, dtype=dtype)
    alive = tensor_bytes(*mlp.parameters(), x, dy)
    v: Variant = make_variant(job.variant, job.num_tiles)

    def step() -> torch.Tensor:
        y = v.forward(mlp, x)
        y.backward(dy)
        return y  # alive until the step's end, as in training

    def reset() -> None:
        x.grad = None
        mlp.zero_grad(set_to_none=True)

    v.forward(mlp, x[:, :8])  # one-time structure probe and kernel warm-up, on 8 tokens
    reset()
    # The process-level peak first, while no full-size step has grown the allocator's caches.
    process = process_peak_bytes(step, alive) if device.type == "cpu" else None
    reset()
    peak = peak_bytes(step, alive, device)
    reset()
    flops = count_flops(step)
    reset()
    for _ in range(job.warmup):
        step()
        reset()
    times = []
    for _ in range(job.repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
        reset()
    return {
        "seq_len": job.seq_len,
        "variant": job.variant,
        "num_tiles": v.num_tiles,
        "tiles": v.tiles(mlp, x),
        "time_ms": round(1000 * statistics.median(times), 3),
        "times_ms": [round(1000 * t, 3) for t in times],
        "peak_mib": round(peak / MiB, 2),
        "process_peak_mib": None if process is None else round(process / MiB, 2),
        "flops": flops,
        "repeats": job.repeats,
    }


def memory_snapshot(job: Job, path: str) -> str:
    """Records the CUDA caching allocator's history over one step of `job` (after a warm-up
    step) and writes the snapshot to `path` (a pickle for https://pytorch.org/memory_viz): every
    allocation of the step with its stack, to find what outlives its use.

    Raises:
        ValueError: the job's device is not CUDA (the allocator history is CUDA's).
    """
    device = torch.device(job.device)
    if device.type != "cuda":
        raise ValueError(
            f"a memory snapshot records the CUDA allocator's history; the device is "
            f"{job.device!r}: run it on a GPU (--device cuda)"
        )
    dtype = getattr(torch, job.dtype)
    torch.manual_seed(0)
    mlp = GatedMLP(job.hidden, job.intermediate).to(device=device, dtype=dtype)
    x = torch.randn(1, job.seq_len, job.hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(1, job.seq_len, job.hidden, device=device, dtype=dtype)
    v = make_variant(job.variant, job.num_tiles)
    v.forward(mlp, x).backward(dy)  # warm-up: kernels compiled, caches as in training
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        v.forward(mlp, x).backward(dy)
        torch.cuda.synchronize(device)
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


def measure_in_subprocess(job: Job, timeout: float = 3600.0) -> dict[str, Any]:
    """Measures `job` in a fresh Python process (same interpreter and torch thread count).

    Raises:
        RuntimeError: the process failed; its last lines of stderr are in the message.
    """
    cmd = [sys.executable, "-m", "tiledmlp.bench.measure", json.dumps(asdict(job))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = "\n".join(res.stderr.strip().splitlines()[-8:])
        raise RuntimeError(
            f"measurement of {job.variant} at {job.seq_len} tokens failed in its subprocess "
            f"(exit {res.returncode}):\n{tail}"
        )
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m tiledmlp.bench.measure '<job JSON>'")
    job = Job(**json.loads(args[0]))
    print(json.dumps(measure(job)), flush=True)


if __name__ == "__main__":
    main()
