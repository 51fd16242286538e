"""Time and device memory of full training steps of a Llama-shaped model, one stack per process.

Run as `python -m tiledmlp.bench.whole_step '<job JSON>'` it prints one JSON record: the model
is built from the job's Llama config (random init, nothing downloaded) on the job's device and
dtype, with the model's own non-reentrant gradient checkpointing, patched for the stack, and
runs forward with labels + backward: one warm-up step, then `steps` timed steps. Memory is that
of the timed steps: on CUDA `max_memory_allocated` and `max_memory_reserved` after a reset, and
what the device has in use beside them (`torch.cuda.mem_get_info`: CUDA context, cuBLAS
workspaces, other processes); on the CPU the process's peak resident memory (VmHWM) over the
timed steps.

Stacks are the planner's names: "untiled", "tiled_mlp", "tiled_mlp_loss",
"tiled_mlp_loss_offload", "tiled_mlp_loss_offload_norms", "tiled_layer".

Invariant: one process measures one (config, sequence length, stack); every stack starts from
the same seed and the same tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tiledmlp.config.stacks import STACK_OPTIONS, STACKS
from tiledmlp.patching import patch_model
from tiledmlp.patching.offloading import enable_checkpointing
from tiledmlp.process_memory import proc_status_bytes

__all__ = ["STACKS", "StepJob", "measure_whole_step"]

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
    """

    config: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 1024
    stack: str = "untiled"
    dtype: str = "bfloat16"
    device: str = "cuda"
    steps: int = 2


def measure_whole_step(job: StepJob) -> dict[str, Any]:
    """Measures `job` in this process; returns its record."""
    import transformers as tr

    if job.stack not in STACK_OPTIONS:
        raise ValueError(f"unknown stack {job.stack!r}; expected one of {STACKS}")
    device = torch.device(job.device)
    dtype = getattr(torch, job.dtype)
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(**{**job.config, "use_cache": False})
    model = tr.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model = model.to(device).train()
    enable_checkpointing(model)
    options = STACK_OPTIONS[job.stack]
    if options is not None:
        patch_model(model, None, **options)
    ids = torch.randint(0, cfg.vocab_size, (1, job.seq_len), device=device)
    cuda = device.type == "cuda"

    def step() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    step()  # warm-up: structure probes, kernels compiled, host buffers allocated
    record: dict[str, Any] = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from the current resident memory
    times = [step() for _ in range(max(1, job.steps))]
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        record.update(
            max_memory_allocated_mib=round(torch.cuda.max_memory_allocated(device) / MiB, 1),
            max_memory_reserved_mib=round(torch.cuda.max_memory_reserved(device) / MiB, 1),
            # In use on the device beside the caching allocator's reservation: the CUDA
            # context, cuBLAS/cuDNN workspaces and any other process on the card.
            outside_allocator_mib=round((total - free - reserved) / MiB, 1),
            device_total_mib=round(total / MiB, 1),
        )
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
        **record,
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m tiledmlp.bench.whole_step '<job JSON>'")
    job = StepJob(**json.loads(args[0]))
    print(json.dumps(measure_whole_step(job)), flush=True)


def job_json(job: StepJob) -> str:
    """The job as the JSON argument of `python -m tiledmlp.bench.whole_step`."""
    return json.dumps(asdict(job))


if __name__ == "__main__":
    main()
