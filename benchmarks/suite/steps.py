"""The suite's whole-model parts (benchmarks/suite/run.py): whole training steps per length and stack
with the planner's prediction beside them ("model_steps"), the attention core by groups of heads
against SDPA ("attention"), and one long stack with and without expandable segments
("allocator").

Isolation: every length of "model_steps" runs in a fresh process, its stacks in a row there
(bench/whole_step.py releases each one before the next); each allocator setting in a fresh
process (the setting is read when CUDA starts); the attention core in this process, the device
emptied and its peak statistics reset around every measurement. The planner (`tiledmlp plan`,
CPU only) runs in the background from the first whole step on, one process per length.

Invariant: a task raises on failure or returns only records it measured; a stack it had no time
for is returned as a skip with its reason, never as a measurement.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import budget
from benchmarks.suite.parts import Context, Record, Task, _margin
from tiledmlp.allocator import ALLOC_CONF_ENV, EXPANDABLE, allocator_setting
from tiledmlp.bench.whole_step import StepJob, job_json

__all__ = ["allocator_tasks", "attention_tasks", "model_steps_tasks", "run_steps"]

MiB = 2**20


# -- whole steps ------------------------------------------------------------------------------


def _job_seconds(ctx: Context, seq: int, stack: str) -> float:
    """One whole-step job: its recorded wall time (build, warm-up and one step; plus the other
    timed steps), else the cost model (build + warm-up + timed steps), its step scaled by the
    records' ratio. The allocator's history is recorded during the last timed step (a small
    cost, not a step of its own)."""
    sz = ctx.sizes
    steps = 1 + max(1, sz.model_steps)
    key = (sz.model["hidden_size"], sz.model["num_hidden_layers"], seq, stack)
    recorded = ctx.corrections.whole_step_s.get(key)
    if recorded is not None:
        wall, step = recorded
        return wall + (steps - 2) * step
    step_s = budget.whole_step_flops(sz.model, seq, stack) / ctx.machine.flops
    if ctx.corrections.whole_step_ratio is not None:
        step_s *= ctx.corrections.whole_step_ratio
    dtype_bytes = 2 if sz.model_dtype != "float32" else 4
    build = budget.model_bytes(sz.model, dtype_bytes) / ctx.machine.bandwidth + 1.0
    return build + steps * step_s


def run_steps(
    jobs: list[StepJob], timeout: float, env: dict[str, str] | None = None
) -> list[Record]:
    """The jobs in one fresh process (bench/whole_step.py), one record each: a job the process
    did not finish (crash, deadline) is recorded with the reason."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiledmlp.bench.whole_step", *map(job_json, jobs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
        why = f"exited {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        why = f"stopped at the deadline ({timeout:.0f} s)"
    done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    tail = " | ".join(err.strip().splitlines()[-3:])[-400:]
    for job in jobs[len(done) :]:
        done.append({"seq_len": job.seq_len, "stack": job.stack, "error": f"{why}: {tail}"})
    return done


def _config_dir(ctx: Context) -> Path:
    folder = ctx.out / "model-config"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **ctx.sizes.model}
        )
    )
    return folder


def _expandable() -> bool:
    """Whether this process's allocator setting turns expandable segments on (the whole steps'
    processes inherit it)."""
    value = allocator_setting()["value"].replace(" ", "").lower()
    return "expandable_segments:true" in value


def _start_plans(ctx: Context) -> None:
    """The planner for every length, in the background (CPU only: it overlaps the GPU work)."""
    if any(k.startswith("plan-") for k in ctx.background):
        return
    folder = _config_dir(ctx)
    for seq, stacks in ctx.sizes.model_lengths:
        args = ["-m", "tiledmlp", "plan", "--model", str(folder), "--seq-len", str(seq)]
        args += ["--dtype", ctx.sizes.model_dtype, "--gradient-checkpointing", "--json"]
        args += ["--device", "cuda" if ctx.cuda else "cpu", "--stacks", ",".join(stacks)]
        if not _expandable():
            args += ["--expandable-segments", "false"]  # the planner's default is true
        ctx.background[f"plan-{seq}"] = subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )


def _plan(ctx: Context, seq: int, wait_s: float) -> tuple[Record, str | None]:
    """The planner's JSON for `seq` (waiting at most wait_s), or ({}, why not)."""
    proc = ctx.background.get(f"plan-{seq}")
    if proc is None:
        return {}, "not started"
    try:
        out, err = proc.communicate(timeout=max(0.1, wait_s))
    except subprocess.TimeoutExpired:
        return {}, f"not finished within {wait_s:.0f} s"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {}, f"exited {proc.returncode}: {err.strip().splitlines()[-1:]}"
    return json.loads(lines[-1]), None


def _with_plan(record: Record, plan: Record, why: str | None) -> Record:
    """The planner's figures for the record's stack beside it: the tensor-level peak (compare
    with max_memory_allocated), its categories (compare with peak_categories_mib) and the
    device overhead (with it, compare with reserved + outside_allocator)."""
    predicted = plan.get("model", {}).get(record.get("stack"), {})
    record["planned_peak_mib"] = predicted.get("peak_mib")
    record["planned_breakdown_mib"] = predicted.get("breakdown_mib")
    record["planned_device_overhead_mib"] = predicted.get("device_overhead_mib")
    record["planned_device_overhead_breakdown_mib"] = predicted.get("device_overhead_breakdown_mib")
    # held for the offloader's copies beyond per_gpu_mib while the card has room (the suite's do)
    record["planned_reclaimable_mib"] = predicted.get("reclaimable_mib", 0.0)
    if why is not None:
        record["plan"] = why
    return record


def _skip(seq: int, stack: str, reason: str, estimate: float) -> Record:
    return {"seq_len": seq, "stack": stack, "skip_reason": reason, "estimate_s": estimate}


def model_steps_tasks(ctx: Context) -> list[Task]:
    """One task per length: its stacks in one process, those that fit the time left in order;
    a task's estimate is its first stack's (the rest are checked when it runs)."""
    sz = ctx.sizes
    tasks = []
    for seq, stacks in sz.model_lengths:
        each = {s: _margin(_job_seconds(ctx, seq, s)) for s in stacks}
        first = budget.ceil_s(_margin(ctx.machine.process_s) + each[stacks[0]])

        def run(
            left: float,
            seq: int = seq,
            stacks: tuple[str, ...] = stacks,
            each: dict[str, float] = each,
        ) -> list[Record]:
            _start_plans(ctx)
            start = time.perf_counter()
            spend = _margin(ctx.machine.process_s)
            jobs, skipped = [], []
            for stack in stacks:
                need = each[stack]
                if spend + need > left:
                    reason = f"estimated {need:.0f} s, {max(0.0, left - spend):.0f} s left"
                    skipped.append(_skip(seq, stack, reason, need))
                    continue
                spend += need
                jobs.append(_step_job(ctx, seq, stack))
            records = run_steps(jobs, timeout=left) if jobs else []
            wait = max(0.0, left - (time.perf_counter() - start)) if jobs else 0.0
            plan, why = _plan(ctx, seq, min(wait, 120.0)) if jobs else ({}, None)
            return [_with_plan(r, plan, why) for r in records] + skipped

        after = dict(sz.model_after).get(seq)
        total = budget.ceil_s(_margin(ctx.machine.process_s) + sum(each.values()))
        tasks.append(Task("model_steps", f"seq_len={seq}", first, run, after, total))
    return tasks


def _step_job(ctx: Context, seq: int, stack: str) -> StepJob:
    """The suite's whole step of `stack` at `seq` tokens on its model, dtype and device."""
    sz = ctx.sizes
    return StepJob(
        config=sz.model,
        seq_len=seq,
        stack=stack,
        dtype=sz.model_dtype,
        device=str(ctx.device),
        steps=sz.model_steps,
    )


# -- the allocator -----------------------------------------------------------------------------


def allocator_tasks(ctx: Context) -> list[Task]:
    """One long stack in two fresh processes: PYTORCH_CUDA_ALLOC_CONF expandable_segments False,
    then True, each record with its peak's categories as in "model_steps"."""
    sz = ctx.sizes
    seq, stack = sz.alloc_seq_len, sz.alloc_stack
    one = _margin(ctx.machine.process_s + _job_seconds(ctx, seq, stack))

    def run(left: float) -> list[Record]:
        records = []
        job = _step_job(ctx, seq, stack)
        start = time.perf_counter()
        for value in ("expandable_segments:False", EXPANDABLE):
            env = {**os.environ, ALLOC_CONF_ENV: value}
            env.pop("TILEDMLP_ALLOC_CONF_DEFAULTED", None)
            remaining = left - (time.perf_counter() - start)
            (record,) = run_steps([job], timeout=remaining, env=env)
            record["alloc_conf"] = value
            records.append(record)
        return records

    return [Task("allocator", f"{stack} seq_len={seq}", budget.ceil_s(2 * one), run)]


# -- the attention core ------------------------------------------------------------------------


def _attention_step(
    ctx: Context, fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeats: int
) -> tuple[float, float | None, list[torch.Tensor]]:
    """(median ms, step peak MiB above what was allocated before, [out, dq, dk, dv])."""
    grads: list[torch.Tensor] = []
    times = []
    peak = None
    for i in range(1 + repeats):
        for t in (q, k, v):
            t.grad = None
        gc.collect()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
        if ctx.cuda:
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / MiB
        if i:
            times.append(1000 * (time.perf_counter() - start))
        grads = [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]
    return statistics.median(times), peak, grads


def attention(ctx: Context, seq: int) -> list[Record]:
    """SDPA (causal, GQA) against the attention core by groups of heads at one length: time,
    step peak, the kernel each ran and the largest difference of (out, dq, dk, dv), relative to
    SDPA's largest. The core runs as a tiled layer runs it: the kernel SDPA selects that passed
    its self-check, in that kernel's groups."""
    from tiledmlp.ops.attention.heads import causal_attention_by_heads
    from tiledmlp.ops.attention.select import call_groups, choose_kernel, sdpa_kernel_name

    sz = ctx.sizes
    dtype = getattr(torch, sz.model_dtype)
    heads, kv, d = sz.attention_heads, sz.attention_kv_heads, sz.attention_head_dim
    gen = torch.Generator(device=ctx.device).manual_seed(0)

    def make(h: int) -> torch.Tensor:
        t = torch.randn(1, h, seq, d, generator=gen, device=ctx.device, dtype=dtype)
        return t.requires_grad_()

    q, k, v = make(heads), make(kv), make(kv)
    scale = d**-0.5
    kernel = choose_kernel(q, k, v)
    if kernel is None:
        raise RuntimeError(f"no fused attention kernel passed its self-check on {ctx.device}")
    groups = call_groups(kernel, q, k)
    kernels = {"sdpa": sdpa_kernel_name(q, k, v), "by_heads": kernel.name}

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)

    def by_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention_by_heads(q, k, v, scale, groups, kernel)

    records = []
    results = {}
    for name, fn in (("sdpa", sdpa), ("by_heads", by_heads)):
        ms, peak, grads = _attention_step(ctx, fn, q, k, v, sz.attention_repeats)
        results[name] = grads
        records.append(
            {
                "seq_len": seq,
                "variant": name,
                "groups": groups if name == "by_heads" else 1,
                "kernel": kernels[name],
                "heads": heads,
                "kv_heads": kv,
                "head_dim": d,
                "dtype": sz.model_dtype,
                "time_ms": round(ms, 2),
                "step_peak_mib": None if peak is None else round(peak, 1),
            }
        )
    diffs = [
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        for a, b in zip(results["by_heads"], results["sdpa"])
    ]
    records[-1]["max_rel_diff"] = float(f"{max(diffs):.3e}")
    del q, k, v, results
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return records


def _attention_task(ctx: Context, seq: int, left: float) -> list[Record]:
    del left  # a few steps of one op
    return attention(ctx, seq)


def attention_tasks(ctx: Context) -> list[Task]:
    """One task per length; estimate: 2 variants x (1 + repeats) steps of 7 S^2 h_attn FLOPs,
    the by-heads variant at the records' ratio of its time to SDPA's where they have one."""
    sz = ctx.sizes
    tasks = []
    slower = ctx.corrections.attention_by_heads_ratio or 2.0
    for seq in sz.attention_seq_lens:
        flops = budget.attention_step_flops(seq, sz.attention_heads, sz.attention_head_dim)
        per_step = flops / ctx.machine.flops * (ctx.corrections.attention_ratio or 1.0)
        seconds = (1 + sz.attention_repeats) * per_step * (1 + slower) + 1.0
        tasks.append(
            Task(
                "attention",
                f"seq_len={seq}",
                _margin(seconds),
                partial(_attention_task, ctx, seq),
            )
        )
    return tasks
