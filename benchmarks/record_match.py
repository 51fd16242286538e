"""Every committed whole-step GPU record against today's plan of the same step, in the card's
categories: measured `max_memory_allocated` and `max_memory_reserved` beside the plan's
allocated (`peak_mib`) and reserved (`reserved_mib`) figures, planned again on the CPU.

A record carries what its step was (the Llama-3-8B shape cut to its layers, the tokens, the
stack, the dtype, checkpointing, the allocator's setting; no optimizer step), so each is planned
with `plan_model` as the planner plans it today; records of the same step share one plan.
`python -m benchmarks.record_match --write` plans them (minutes on 2 cores: the 4-layer steps at
131,072 tokens and the 8-layer long step), keeps the figures in
benchmarks/results/record-match.json and renders the table between the
`<!-- record-match -->` marks of docs/benchmarks.md; without --write it renders the committed
figures and exits 1 where the page differs (tests/bench/test_record_match.py).

Invariant: the table is a pure function of the records and the committed plans.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks import ROOT

__all__ = ["PLANS", "records", "render", "step_key"]

RECORDS = ROOT / "benchmarks" / "results" / "gpu"
PLANS = ROOT / "benchmarks" / "results" / "record-match.json"
PAGE = ROOT / "docs" / "benchmarks.md"
OFF = 0.03  # the bound the card's categories are held to
_MARK = re.compile(r"(<!-- record-match -->\n)(.*?)(<!-- /record-match -->)", re.S)

Record = dict[str, Any]


def _lines(path: Path) -> list[Record]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().startswith("{")]


def records() -> list[tuple[str, Record]]:
    """(the record's file under benchmarks/results/gpu, the record) of every completed whole
    step on a GPU with both peaks measured."""
    found: list[tuple[str, Record]] = []
    for pattern in ("*/whole_steps.jsonl", "*/long-step/step.jsonl",
                    "*/plan-measure-steps.jsonl"):  # fmt: skip
        for path in sorted(RECORDS.glob(pattern)):
            found += [(str(path.relative_to(RECORDS)), r) for r in _lines(path)]
    for path in sorted(RECORDS.glob("*/suite/records.jsonl")):
        found += [
            (str(path.relative_to(RECORDS)), r)
            for r in _lines(path)
            if r.get("part") in ("model_steps", "allocator") and r.get("status") == "ok"
        ]
    return [
        (f, r)
        for f, r in found
        if r.get("max_memory_allocated_mib") is not None
        and r.get("max_memory_reserved_mib") is not None
    ]


def _expandable(rec: Record) -> bool:
    """The allocator setting the record was measured with (the 2026-11-25 records predate the
    fields and ran without expandable segments)."""
    conf = rec.get("alloc_conf") or rec.get("cuda_alloc_conf") or ""
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def step_key(rec: Record) -> str:
    """What decides a record's plan, as one string (the plans' key)."""
    shape = (rec["layers"], rec["hidden"], rec["intermediate"], rec["vocab"])
    return json.dumps([*shape, rec["seq_len"], rec["stack"], rec["dtype"],
                       bool(rec["gradient_checkpointing"]), _expandable(rec)])  # fmt: skip


def _plan(rec: Record) -> dict[str, float]:
    """Today's plan of the record's step: allocated and reserved MiB."""
    import torch

    from tiledmlp.config.plan import StepSpec
    from tiledmlp.plan.layer import load_config
    from tiledmlp.plan.model import plan_model

    config = load_config("llama3-8b")
    shape = (config.hidden_size, config.intermediate_size, config.vocab_size)
    if shape != (rec["hidden"], rec["intermediate"], rec["vocab"]):
        raise ValueError(f"a record of shape {rec['hidden'], rec['intermediate'], rec['vocab']} "
                         f"is not the llama3-8b preset's {shape}")  # fmt: skip
    config.num_hidden_layers = rec["layers"]
    step = StepSpec(
        seq_len=rec["seq_len"],
        dtype=getattr(torch, rec["dtype"]),
        checkpointing=bool(rec["gradient_checkpointing"]),
        expandable_segments=_expandable(rec),
    )
    entry = plan_model(config, step, stacks=(rec["stack"],))[rec["stack"]]
    return {"allocated_mib": entry["peak_mib"], "reserved_mib": entry["reserved_mib"]}


def render(plans: dict[str, dict[str, float]]) -> str:
    """The table: one row per record, its measured and planned peaks and their ratios."""
    head = ["record", "stack", "tokens", "allocator", "allocated measured / planned MiB",
            "ratio", "reserved measured / planned MiB", "ratio"]  # fmt: skip
    rows = []
    for file, rec in records():
        plan = plans.get(step_key(rec))
        if plan is None:
            continue
        a = rec["max_memory_allocated_mib"] / plan["allocated_mib"]
        r = rec["max_memory_reserved_mib"] / plan["reserved_mib"]

        def ratio(x: float) -> str:
            return f"{x:.3f}" if abs(x - 1) <= OFF else f"**{x:.3f}**"

        rows.append([
            f"`{file}`", f"`{rec['stack']}`", f"{rec['seq_len']:,}",
            "expandable" if _expandable(rec) else "fixed",
            f"{rec['max_memory_allocated_mib']:,.0f} / {plan['allocated_mib']:,.0f}", ratio(a),
            f"{rec['max_memory_reserved_mib']:,.0f} / {plan['reserved_mib']:,.0f}", ratio(r),
        ])  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---|" + "---:|" * 4]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    within = sum(
        1
        for _, rec in records()
        if step_key(rec) in plans
        and all(
            abs(rec[f"max_memory_{k}_mib"] / plans[step_key(rec)][f"{k}_mib"] - 1) <= OFF
            for k in ("allocated", "reserved")
        )
    )
    lines += ["", f"{within} of {len(rows)} records within {OFF:.0%} in both categories "
              "(a ratio in bold is outside)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _page(plans: dict[str, dict[str, float]]) -> tuple[str, str]:
    text = PAGE.read_text()
    found = _MARK.search(text)
    if found is None:
        raise SystemExit(f"{PAGE}: no <!-- record-match --> ... <!-- /record-match --> marks")
    return text, text[: found.start(2)] + render(plans) + text[found.end(2) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="plan again and rewrite the page")
    args = parser.parse_args(argv)
    plans: dict[str, dict[str, float]] = {}
    if PLANS.exists():
        plans = json.loads(PLANS.read_text())["plans"]
    if args.write:
        plans = {}
        for _file, rec in records():
            key = step_key(rec)
            if key not in plans:
                plans[key] = _plan(rec)
                print(f"planned {key}: {plans[key]}", file=sys.stderr)
        PLANS.write_text(json.dumps({"planned_with": "plan_model, tiledmlp's planner at this "
                                     "commit", "plans": plans}, indent=1) + "\n")  # fmt: skip
    text, new = _page(plans)
    if args.write:
        PAGE.write_text(new)
        return 0
    if new != text:
        print(f"{PAGE}: the record-match table differs from the records' (--write)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
