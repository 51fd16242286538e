"""Where the CPU time of `tiledmlp plan --model M --seq-len N --memory-gb G` goes.

Plans every stack in this one process (no forked jobs, so each part's time is its own CPU time)
and times the planner's three parts around each estimate: the fake steps (a short model's step
run on fake tensors), the records deepened to the model's depth, and the caching allocator's
replays. Prints one JSON line.

    python benchmarks/plan_costs.py --model llama3-8b --seq-len 131072 --memory-gb 79.2
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from collections.abc import Callable
from typing import Any

PARTS = {"_run": "fake_steps", "deeper": "deepening", "replayed_reserve": "replays"}


def _timed(fn: Callable[..., Any], part: str, seconds: Any, calls: Any) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[part] += time.perf_counter() - start
            calls[part] += 1

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a preset (tiledmlp plan's)")
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--memory-gb", type=float, default=79.2)
    args = parser.parse_args()

    started = time.perf_counter()
    import transformers  # noqa: F401  (imported first: its time is start-up, not planning)

    from tiledmlp.config.plan import StepSpec
    from tiledmlp.plan import fake_step
    from tiledmlp.plan import model as plan_model_module
    from tiledmlp.plan.layer import load_config

    imported = time.perf_counter() - started
    seconds: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for name, part in PARTS.items():
        setattr(fake_step, name, _timed(getattr(fake_step, name), part, seconds, calls))
    config = load_config(args.model)
    start = time.perf_counter()
    planned = plan_model_module.plan_model(
        config,
        StepSpec(seq_len=args.seq_len),
        budget_bytes=int(args.memory_gb * 2**30),
        processes=1,
        auto_kernel=True,
    )
    total = time.perf_counter() - start
    print(json.dumps({
        "model": args.model, "seq_len": args.seq_len, "memory_gb": args.memory_gb,
        "imports_s": round(imported, 2), "planning_s": round(total, 2),
        **{f"{part}_s": round(seconds[part], 2) for part in PARTS.values()},
        **{f"{part}_calls": calls[part] for part in PARTS.values()},
        "max_seq_len": {stack: entry.get("max_seq_len") for stack, entry in planned.items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
