"""One command that measures everything within a time budget:
`python -m benchmarks.suite [--budget SECONDS] [--out DIR] [--smoke]`.

Parts, in order of value: whole steps of a Llama-shaped model per length and stack, each
record with the bytes alive at its peak by category and the planner's prediction beside them
("model_steps", benchmarks/suite/steps.py); the attention core by groups of heads against SDPA
("attention"); one long stack with and without expandable segments ("allocator"); the MLP table
against DeepSpeed and Liger ("mlp_table"); the weight-gradient error of bf16 against float32
("grad_error"); the fused kernels against their references ("kernels"); activation
offloading's overhead and host memory ("offload"); `tiledmlp train` tiled against untiled
("train"); `pytest -m gpu` ("gpu_tests"). The 256K whole step runs after the allocator part,
the 64K ones last (after the GPU tests). `--smoke` runs every part at toy sizes on whatever device there
is.

The budget: every piece of work has an estimate (benchmarks/budget.py: a cost model from the sizes,
corrected by the committed GPU records of the same device kind); a piece whose estimate passes
the deadline is skipped and recorded with its reason; the summary is always written.

Writes DIR/records.jsonl (one JSON object per line: "part", "status" — "ok", "error" or
"skipped" —, the environment, "what" (the piece), "seconds", "estimate_s", then the part's own
fields) and DIR/summary.md (a table per part, the skips, every error). DIR defaults to
benchmarks/results/gpu/<date>-<device>/ in a source checkout (with "-smoke" for toy sizes).

Invariant: a piece that fails is recorded with its error and the suite goes on; the exit status
is 0 only when nothing failed (skips are not failures).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import budget
from benchmarks.suite import parts as suite_parts
from benchmarks.suite import steps as suite_steps
from benchmarks.suite.parts import ROOT, Context, Task
from benchmarks.suite.sizes import full_sizes, smoke_sizes
from tiledmlp.allocator import allocator_setting, prefer_expandable_segments
from tiledmlp.bench.device import device_name, resolve_device
from tiledmlp.bench.harness import git_sha, package_versions

__all__ = [
    "DEFAULT_BUDGET_S",
    "PARTS",
    "default_out",
    "dry_run",
    "main",
    "plan_tasks",
    "run_suite",
]

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 420.0


# name -> the part's tasks, in order of value
PARTS: dict[str, Callable[[Context], list[Task]]] = {
    "model_steps": suite_steps.model_steps_tasks,
    "attention": suite_steps.attention_tasks,
    "allocator": suite_steps.allocator_tasks,
    "mlp_table": suite_parts.mlp_table_tasks,
    "grad_error": suite_parts.grad_error_tasks,
    "kernels": suite_parts.kernels_tasks,
    "offload": suite_parts.offload_tasks,
    "train": suite_parts.train_tasks,
    "gpu_tests": suite_parts.gpu_tests_tasks,
}


def _environment(device: torch.device, smoke: bool, budget_s: float) -> dict[str, Any]:
    return {
        "smoke": smoke,
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "git_sha": git_sha(),
        "versions": package_versions(),
        "budget_s": budget_s,
        "cuda_alloc_conf": allocator_setting(),
    }


def _slug(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else budget.device_slug(device_name(device))


def default_out(device: torch.device, smoke: bool, today: datetime.date | None = None) -> Path:
    """benchmarks/results/gpu/<date>-<device>[-smoke]/ of the source checkout (else of the
    current folder)."""
    base = ROOT if (ROOT / "benchmarks").is_dir() else Path(".")
    day = (today or datetime.date.today()).isoformat()
    return (
        base
        / "benchmarks"
        / "results"
        / "gpu"
        / f"{day}-{_slug(device)}{'-smoke' if smoke else ''}"
    )


def _recorded(ctx: Context, task: Task) -> Task:
    """The task with its estimate from a record of the same task on this device kind at these
    sizes, where there is one: its measured seconds, margin included (the first piece of a
    task that can do part of its work keeps the cost model's share of it)."""
    seconds = ctx.corrections.task_s.get((task.part, task.what, ctx.sizes.smoke))
    if seconds is None:
        return task
    whole = budget.ceil_s(seconds * budget.MARGIN)
    if task.total_s is None:
        return dataclasses.replace(task, estimate_s=whole)
    share = task.estimate_s / task.total_s if task.total_s > 0 else 1.0
    return dataclasses.replace(task, estimate_s=budget.ceil_s(whole * share), total_s=whole)


def plan_tasks(ctx: Context, parts: Sequence[str] = ()) -> list[Task]:
    """Every task of the chosen parts (default: all), in the order they run: with its part in
    the order of PARTS, or right after the part it names (`Task.after`), then as listed."""
    names = list(parts) or list(PARTS)
    index = {name: i for i, name in enumerate(PARTS)}
    tasks = [_recorded(ctx, t) for name in names for t in PARTS[name](ctx)]
    return sorted(tasks, key=lambda t: index[t.part] if t.after is None else index[t.after] + 0.5)


def _context(dev: torch.device, smoke: bool, out: Path) -> Context:
    """The parts' context: sizes, the cost model of the device and its records' corrections."""
    sizes = smoke_sizes(dev) if smoke else full_sizes()
    corrections = budget.load_corrections(
        ROOT / "benchmarks" / "results" / "gpu", _slug(dev), sizes.model
    )
    return Context(sizes, dev, out, budget.machine_for(dev.type), corrections)


def dry_run(
    *, smoke: bool = False, device: str | None = None, parts: Sequence[str] = (), budget_s: float
) -> str:
    """What a run would do, by the estimates alone (nothing runs): each task in order with its
    estimate, the running total and whether it fits the budget, as a Markdown table."""
    dev = resolve_device(device)
    ctx = _context(dev, smoke, Path("unused"))
    lines = [
        f"Estimates for {device_name(dev)} ({'toy' if smoke else 'full'} sizes), budget "
        f"{budget_s:.0f} s; margin {budget.MARGIN}x included.",
        "",
        "| part | what | first piece s | all s | running total s | fits |",
        "|---|---|---|---|---|---|",
    ]
    total = 0.0
    for task in plan_tasks(ctx, parts):
        whole = task.total_s if task.total_s is not None else task.estimate_s
        fits = (
            "yes"
            if total + whole <= budget_s
            else "part"
            if total + task.estimate_s <= budget_s
            else "no"
        )
        total += {"yes": whole, "part": task.estimate_s, "no": 0.0}[fits]
        lines.append(
            f"| {task.part} | {task.what} | {task.estimate_s:.1f} | {whole:.1f} | {total:.1f} | {fits} |"
        )
    return "\n".join(lines) + "\n"


def run_suite(
    out: Path | None = None,
    *,
    smoke: bool = False,
    device: str | None = None,
    parts: Sequence[str] = (),
    budget_s: float = DEFAULT_BUDGET_S,
    command: str | None = None,
) -> list[dict[str, Any]]:
    """Runs the suite's tasks within the budget, appending each record to out/records.jsonl as
    it comes, then writes out/summary.md.

    Args:
        out: the output folder (created); default: `default_out`.
        smoke: toy sizes.
        device: "cuda", "cpu", ...; default: the first accelerator, else the CPU.
        parts: names of the parts to run (default: all, in order of value).
        budget_s: seconds; a task whose estimate passes the deadline is skipped.
        command: the command line that ran the suite, for the summary.

    Returns:
        Every record written.

    Raises:
        ValueError: an unknown part name or a budget that is not a positive number.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; expected some of {list(PARTS)}")
    if not (budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(f"--budget must be a positive number of seconds, got {budget_s}")
    start = time.perf_counter()
    deadline = start + budget_s
    dev = resolve_device(device)
    out = out if out is not None else default_out(dev, smoke)
    env = _environment(dev, smoke, budget_s)
    env["command"] = command
    out.mkdir(parents=True, exist_ok=True)
    ctx = _context(dev, smoke, out)
    records: list[dict[str, Any]] = []
    try:
        with (out / "records.jsonl").open("w") as f:
            for task in plan_tasks(ctx, parts):
                got = _run_task(task, deadline - time.perf_counter(), budget_s, env)
                _release_cache(dev)
                for r in got:
                    f.write(json.dumps(r) + "\n")
                f.flush()
                records += got
                print(f"{task.part} {task.what}: {_status_line(got)}", file=sys.stderr, flush=True)
    finally:
        ctx.close()
        used = round(time.perf_counter() - start, 1)
        (out / "summary.md").write_text(summary_markdown(records, env, used))
    return records


def _release_cache(device: torch.device) -> None:
    """The suite's own cached device memory returned after each task: a whole step measured
    next, in its own process, sees the card as free as this process can leave it."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _run_task(
    task: Task, left: float, budget_s: float, env: dict[str, Any]
) -> list[dict[str, Any]]:
    """The task's records, or one record of its skip or its error."""
    head = {"part": task.part, **env, "what": task.what, "estimate_s": task.estimate_s}
    if task.estimate_s > left:
        reason = f"estimated {task.estimate_s:.0f} s, {max(left, 0):.0f} s left of the {budget_s:.0f} s budget"
        return [{**head, "status": "skipped", "reason": reason, "seconds": 0.0}]
    start = time.perf_counter()
    logger.info("suite: %s %s (estimated %.0f s)", task.part, task.what, task.estimate_s)
    try:
        got = task.run(left)
    except Exception as e:
        logger.debug("suite: %s failed:\n%s", task.part, traceback.format_exc())
        message = (str(e).strip().splitlines() or [""])[0][:500]
        got = [{"status": "error", "error": f"{type(e).__name__}: {message}"}]
    seconds = round(time.perf_counter() - start, 1)
    records = []
    for r in got:
        r = dict(r)
        if "skip_reason" in r:  # a piece of the task it had no time for
            status, extra = "skipped", {"reason": r.pop("skip_reason")}
        elif r.get("status") == "error" or r.get("error"):
            status, extra = "error", {}
        else:
            status, extra = "ok", {}
        r.pop("status", None)
        records.append({**head, "status": status, **extra, "seconds": seconds, **r})
    return records


def _status_line(records: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    seconds = records[0]["seconds"] if records else 0
    return ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({seconds} s)"


_SKIP = {"part", "status", "seconds", "estimate_s", "versions", "git_sha", "python", "machine"}
_SKIP |= {"threads", "reason"}


def summary_markdown(records: list[dict[str, Any]], env: dict[str, Any], used_s: float) -> str:
    """One section per part: its records as a table (the environment columns left out), its
    errors; then every skip with its reason."""
    alloc = env["cuda_alloc_conf"]
    lines = [
        f"# Measurement suite{' (smoke: toy sizes)' if env['smoke'] else ''}",
        "",
        f"{env['device_name']}, torch {env['torch']}, git {env['git_sha']}, "
        f"packages {json.dumps(env['versions'])}; PYTORCH_CUDA_ALLOC_CONF "
        f"{alloc['value'] or 'unset'} (set by {alloc['set_by']}).",
        "",
        f"Budget {env['budget_s']:.0f} s, used {used_s} s.",
        "",
    ]
    if env.get("command"):
        lines += [f"Command: `{env['command']}`", ""]
    env_keys = set(env) | _SKIP
    done = [r for r in records if r["status"] != "skipped"]
    for part in dict.fromkeys(r["part"] for r in done):
        rows = [r for r in done if r["part"] == part]
        seconds = {r["what"]: r["seconds"] for r in rows}
        lines += [f"## {part} ({round(sum(seconds.values()), 1)} s)", ""]
        for r in rows:
            if r["status"] == "error" and "stack" not in r:
                lines += [f"**error** ({r['what']}): {r['error']}", ""]
        rows = [r for r in rows if not (r["status"] == "error" and "stack" not in r)]
        if not rows:
            continue
        cols = list(dict.fromkeys(k for r in rows for k in r if k not in env_keys))
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in rows:
            lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
        lines.append("")
    skipped = [r for r in records if r["status"] == "skipped"]
    if skipped:
        lines += ["## Skipped", "", "| part | what | reason |", "|---|---|---|"]
        for r in skipped:
            what = r["what"] if "stack" not in r else f"{r['what']} {r['stack']}"
            lines.append(f"| {r['part']} | {what} | {r['reason']} |")
        lines.append("")
    failed = list(dict.fromkeys(r["part"] for r in records if r["status"] == "error"))
    lines.append(f"Parts failed: {', '.join(failed)}." if failed else "Nothing failed.")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "; ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return str(value).replace("|", "/")


def main(argv: Sequence[str] | None = None) -> int:
    prefer_expandable_segments()  # before CUDA initialises; a user's setting is kept
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suite",
        description="Measures everything that fits the time budget (whole-model steps with "
        "each byte at the peak named and the planner's prediction, the attention core, the "
        "allocator setting, the MLP table, gradient error, kernels, offloading, training, GPU "
        "tests) and writes records.jsonl and summary.md.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: benchmarks/results/gpu/<date>-<device>/ of the checkout)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help=f"time budget: what would pass it is skipped and recorded (default: {DEFAULT_BUDGET_S:.0f})",
    )
    p.add_argument("--smoke", action="store_true", help="toy sizes (minutes on a CPU)")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: an accelerator)")
    p.add_argument(
        "--parts",
        default=None,
        help=f"comma-separated subset of {','.join(PARTS)} (default: all)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run within the budget by the estimates, and run nothing",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING)
    parts = [s.strip() for s in a.parts.split(",")] if a.parts else []
    try:
        if a.dry_run:
            unknown = [p for p in parts if p not in PARTS]
            if unknown:
                raise ValueError(f"unknown parts {unknown}; expected some of {list(PARTS)}")
            print(dry_run(smoke=a.smoke, device=a.device, parts=parts, budget_s=a.budget), end="")
            return 0
        out = a.out if a.out is not None else default_out(resolve_device(a.device), a.smoke)
        records = run_suite(
            out,
            smoke=a.smoke,
            device=a.device,
            parts=parts,
            budget_s=a.budget,
            command=" ".join(
                ["python -m benchmarks.suite", *(sys.argv[1:] if argv is None else argv)]
            ),
        )
    except ValueError as e:
        print(f"benchmarks.suite: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'records.jsonl'} ({len(records)} records) and {out / 'summary.md'}")
    return 0 if all(r["status"] != "error" for r in records) else 1
