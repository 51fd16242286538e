"""`tiledmlp plan --measure`: the real step of the model cut to a few layers, at a few short
lengths, beside the planner's simulation of the same cut model (plan/measured.py).

Each length runs in a fresh process (`python -m tiledmlp.bench.whole_step`): on a GPU the card's
figure (max_memory_reserved plus the memory outside the allocator, per category where the
bench names them), on the CPU the process's peak resident memory; on a GPU one process at a
time, on the CPU a few at once. The simulation of the same cut model is exact (every layer
simulated) on the same device type.

Invariant: a stack's answer names which estimate stands; the lower one always does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tiledmlp.cli.common import UsageError
from tiledmlp.cli.plan_args import PlanArgs

__all__ = ["measure_stacks"]

MiB = 2**20
# measurement processes at once on the CPU (each holds the cut model and its step in memory)
MEASURED_AT_ONCE = 4


def _job_config(config: Any, layers: int) -> dict[str, Any]:
    text = config.get_text_config()
    if getattr(text, "model_type", None) != "llama":
        raise UsageError(
            f"--measure builds Llama-family models (model_type 'llama'), got "
            f"{getattr(text, 'model_type', None)!r}: plan this model without --measure"
        )
    fields = {k: v for k, v in text.to_dict().items() if not k.startswith("_")}
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    fields["num_hidden_layers"] = layers
    return fields


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One measurement in a fresh process: its record."""
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp.bench.whole_step", json.dumps(job)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--measure: the step at {job['seq_len']} tokens failed: {last}")
    return dict(json.loads(lines[-1]))


def _measure_all(jobs: list[dict[str, Any]], device: str) -> list[int]:
    """Each job's measured bytes, in order. On a GPU one process at a time: nothing else holds
    the card's memory while a step is measured. On the CPU each process's own peak is measured,
    so up to MEASURED_AT_ONCE run at once (at most one per CPU)."""
    if device != "cpu":
        return [_measured_bytes(_run_job(job)) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    from tiledmlp.plan.forked import available_cpus

    with ThreadPoolExecutor(max(1, min(available_cpus(), MEASURED_AT_ONCE))) as pool:
        return [_measured_bytes(record) for record in pool.map(_run_job, jobs)]


def _measured_bytes(record: dict[str, Any]) -> int:
    if "error" in record:
        raise UsageError(f"--measure: the step at {record['seq_len']} tokens: {record['error']}")
    if record.get("max_memory_reserved_mib") is not None:
        card = record["max_memory_reserved_mib"] + record.get("outside_allocator_mib", 0.0)
        return int(card * MiB)
    if record.get("process_peak_mib") is None:
        raise UsageError("--measure: this system reports no process peak (VmHWM) to measure")
    return int(record["process_peak_mib"] * MiB)


def measure_stacks(
    args: PlanArgs,
    config: Any,
    dtype: Any,
    stacks: dict[str, Any],
    known_peaks: dict[str, dict[int, int]] | None = None,
) -> None:
    """Adds "measured" to each stack's entry of `stacks` (plan_model's answer); the second
    search reuses plan_model's estimates (`known_peaks`, per stack)."""
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.config.stacks import stack_patch
    from tiledmlp.plan.device_overhead import device_overhead
    from tiledmlp.plan.estimate import estimate_step
    from tiledmlp.plan.layer import cut_config
    from tiledmlp.plan.measured import MeasuredPoint, fit_correction, measured_max_seq_len

    layers = args.measure_layers
    job_config = _job_config(config, layers)
    cut = cut_config(config, layers)
    dtype_name = str(dtype).removeprefix("torch.")
    jobs = [
        {"config": job_config, "seq_len": n, "stack": stack, "dtype": dtype_name,
         "device": args.device, "steps": 1}
        for stack in stacks for n in args.measure_lengths
    ]  # fmt: skip
    measured_bytes = iter(_measure_all(jobs, args.device))
    for stack, entry in stacks.items():
        overhead = device_overhead(args.device)
        points = []
        for n in args.measure_lengths:
            measured = next(measured_bytes)
            at = StepSpec(seq_len=n, dtype=dtype, checkpointing=True, tiles=args.num_tiles,
                          device_type=args.device,
                          expandable_segments=args.expandable_segments)  # fmt: skip
            sim = estimate_step(cut, at, stack_patch(stack, args.num_tiles), exact=True)
            card = sim.peak + overhead.total(sim.reserve, sim.attention)  # cards with room
            points.append(MeasuredPoint(n, measured, card))
        correction = fit_correction(points)
        measured_entry = {"layers": layers, **correction.as_json()}
        per_gpu = int(entry["per_gpu_mib"] * MiB)
        measured_entry["per_gpu_mib"] = round((per_gpu + correction.at(args.seq_len)) / MiB, 1)
        if "max_seq_len" in entry:
            step = StepSpec(seq_len=args.seq_len, dtype=dtype, checkpointing=True,
                            tiles=args.num_tiles, device_type=args.device,
                            optimizer=args.optimizer)  # fmt: skip
            measured_entry.update(
                measured_max_seq_len(
                    config,
                    int((args.memory_gb or 0) * 2**30),  # max_seq_len: --memory-gb's search
                    correction,
                    step=step,
                    patch=stack_patch(stack, args.num_tiles),
                    overhead=overhead,
                    simulated=entry["max_seq_len"],
                    known_peaks=None if known_peaks is None else known_peaks.get(stack),
                )
            )
            entry["max_seq_len"] = measured_entry["max_seq_len"]
        entry["measured"] = measured_entry
