"""The GPU tables of the docs, rendered from the committed records
(benchmarks/results/gpu/<date>-<device>/*.jsonl), so that a page never says what a record does
not.

A page marks each table with `<!-- gpu-table: FOLDER/KIND -->` ... `<!-- /gpu-table -->`
(FOLDER under benchmarks/results/gpu, KIND one of TABLES); `python -m benchmarks.gpu_records
PAGE...` checks every marked table against its records (exit 1 on a difference), `--write`
rewrites them. tests/bench/test_bench_gpu_records.py runs the check on the docs.

Invariant: a table is a pure function of its records file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import ROOT

__all__ = ["TABLES", "check_page", "render", "update_page"]

Record = dict[str, Any]

RECORDS = ROOT / "benchmarks" / "results" / "gpu"
_MARK = re.compile(
    r"(<!-- gpu-table: (?P<folder>[\w.-]+)/(?P<kind>\w+) -->\n)(?P<body>.*?)(<!-- /gpu-table -->)",
    re.S,
)


def _load(path: Path) -> list[Record]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _n(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _table(head: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def mlp_op(folder: Path) -> str:
    """The MLP op per length: each variant's median ms and peak MiB, ours against the faster
    of DeepSpeed's and Liger's."""
    records = [r for r in _load(folder / "mlp_op.jsonl") if "variant" in r]
    by = {(r["seq"], r["variant"]): r for r in records}
    rows = []
    names = ("untiled", "ours", "ours_auto", "deepspeed", "liger")
    for seq in sorted({r["seq"] for r in records}):
        got: dict[str, Record] = {v: by[(seq, v)] for v in names if (seq, v) in by}
        others = [got[v]["ms"] for v in ("deepspeed", "liger") if v in got]
        ours = got.get("ours")
        ratio = f"{ours['ms'] / min(others):.3f}" if ours and others else ""
        rows.append(
            [_k(seq), str(ours["tiles"] if ours else "")]
            + [_n(got[v]["ms"], 2) if v in got else "" for v in names]
            + [ratio]
            + [
                _n(got[v]["peak_mib"], 0) if v in got else ""
                for v in ("untiled", "ours", "deepspeed", "liger")
            ]
        )
    head = ["tokens", "tiles", "untiled ms", "ours ms", "ours auto ms", "DeepSpeed ms", "Liger ms"]
    head += ["ours / best other", "untiled MiB", "ours MiB", "DeepSpeed MiB", "Liger MiB"]
    return _table(head, rows)


def attention(folder: Path) -> str:
    """The attention core per length: SDPA against by groups of heads, time and step peak."""
    records = [r for r in _load(folder / "attention_by_heads.jsonl") if "variant" in r]
    by = {(r["seq"], r["variant"]): r for r in records}
    rows = []
    for seq in sorted({r["seq"] for r in records}):
        sdpa, heads = by.get((seq, "sdpa")), by.get((seq, "by_heads"))
        if not (sdpa and heads):
            continue
        rows.append(
            [
                _k(seq),
                _n(sdpa["ms"], 2),
                _n(heads["ms"], 2),
                str(heads["groups"]),
                f"{heads['ms'] / sdpa['ms']:.2f}",
                _n(sdpa["step_peak_mib"], 0),
                _n(heads["step_peak_mib"], 0),
            ]
        )
    head = ["tokens", "SDPA ms", "by heads ms", "groups", "time ratio", "SDPA step MiB"]
    head += ["by heads step MiB"]
    return _table(head, rows)


def whole_steps(folder: Path) -> str:
    """Whole steps per length and stack: time, allocated and reserved peaks, what the card held
    (reserved + outside the allocator)."""
    records = [r for r in _load(folder / "whole_steps.jsonl") if "time_ms" in r]
    records.sort(key=lambda r: (r["seq_len"], r["max_memory_allocated_mib"]))
    rows = [
        [
            _k(r["seq_len"]),
            r["stack"],
            _n(r["time_ms"]),
            _n(r["max_memory_allocated_mib"], 0),
            _n(r["max_memory_reserved_mib"], 0),
            f"{r['max_memory_reserved_mib'] / r['max_memory_allocated_mib'] - 1:.1%}",
            _n(r["max_memory_reserved_mib"] + r["outside_allocator_mib"], 0),
        ]
        for r in records
    ]
    head = ["tokens", "stack", "ms", "allocated MiB", "reserved MiB", "reserved beyond"]
    head += ["card MiB"]
    return _table(head, rows)


def _suite(folder: Path, part: str) -> list[Record]:
    """The suite's ok records of `part` in every records.jsonl under the folder."""
    return [
        r
        for path in sorted(folder.rglob("records.jsonl"))
        for r in _load(path)
        if r.get("part") == part and r.get("status") == "ok"
    ]


def _long_step(folder: Path) -> list[Record]:
    """The long step under folder/long-step/ (step.jsonl beside plan.json), each record with the
    planner's tensor peak and device overhead for its stack; none when the folder has none."""
    long = folder / "long-step"
    if not ((long / "step.jsonl").is_file() and (long / "plan.json").is_file()):
        return []
    plan = json.loads((long / "plan.json").read_text())["model"]
    records = []
    for r in _load(long / "step.jsonl"):
        got = plan.get(r.get("stack"), {})
        overhead = got.get("device_overhead_mib", 0.0)
        records.append({**r, "planned_peak_mib": got.get("peak_mib"),
                        "planned_device_overhead_mib": overhead})  # fmt: skip
    return records


def _steps_table(records: list[Record]) -> str:
    """Whole steps: time, the allocated peak beside the planner's tensor peak, the card's figure
    beside the planner's."""
    records = sorted(
        records, key=lambda r: (r["layers"], r["seq_len"], r["max_memory_allocated_mib"])
    )
    rows = []
    for r in records:
        card = r["max_memory_reserved_mib"] + r["outside_allocator_mib"]
        peak = r.get("planned_peak_mib")
        overhead = r.get("planned_device_overhead_mib", 0.0) + r.get("planned_reclaimable_mib", 0.0)
        planned = None if peak is None else peak + overhead
        rows.append(
            [
                str(r["layers"]),
                _k(r["seq_len"]),
                r["stack"],
                _n(r["time_ms"]),
                _n(r["max_memory_allocated_mib"], 0),
                "" if peak is None else f"{peak / r['max_memory_allocated_mib']:.3f}",
                _n(r["max_memory_reserved_mib"], 0),
                _n(r["outside_allocator_mib"], 0),
                _n(card, 0),
                "" if planned is None else f"{planned / card:.3f}",
            ]
        )
    head = ["layers", "tokens", "stack", "ms", "allocated MiB", "planned / allocated"]
    head += ["reserved MiB", "outside MiB", "card MiB", "planned / card"]
    return _table(head, rows)


def suite_steps(folder: Path) -> str:
    """The suite's whole steps (and the long step under long-step/): time, the allocated peak
    beside the planner's tensor peak, the card's figure beside the planner's."""
    return _steps_table(_suite(folder, "model_steps") + _long_step(folder))


def long_step(folder: Path) -> str:
    """The long step under long-step/ alone, in the columns of suite_steps (for a page that shows
    a later run's suite steps beside an earlier run's long step)."""
    return _steps_table(_long_step(folder))


def suite_attention(folder: Path) -> str:
    """The suite's attention part: SDPA against by groups of heads per length, with the kernel
    each variant ran ("not recorded" in records older than the field)."""
    records = _suite(folder, "attention")
    by = {(r["seq_len"], r["variant"]): r for r in records}
    rows = []
    for seq in sorted({r["seq_len"] for r in records}):
        sdpa, heads = by.get((seq, "sdpa")), by.get((seq, "by_heads"))
        if sdpa and heads:
            kernels = " / ".join(r.get("kernel") or "not recorded" for r in (sdpa, heads))
            rows.append([_k(seq), kernels, _n(sdpa["time_ms"], 1), _n(heads["time_ms"], 1),
                         str(heads["groups"]), f"{heads['time_ms'] / sdpa['time_ms']:.3f}",
                         _n(sdpa["step_peak_mib"], 0), _n(heads["step_peak_mib"], 0)])  # fmt: skip
    head = ["tokens", "kernel (SDPA / by heads)", "SDPA ms", "by heads ms", "groups"]
    head += ["time ratio", "SDPA step MiB", "by heads step MiB"]
    return _table(head, rows)


def suite_mlp_table(folder: Path) -> str:
    """The suite's MLP table: each variant's time and peak per length and tile count, ours
    against the better of DeepSpeed and Liger at the same tiles."""
    records = _suite(folder, "mlp_table")
    rows = []
    for seq in sorted({r["seq_len"] for r in records}):
        here = [r for r in records if r["seq_len"] == seq]
        peers = [r for r in here if r["variant"] in ("deepspeed", "liger")]
        for r in here:
            same = [p for p in peers if p["tiles"] == r["tiles"]]
            ours = r["variant"] == "tiled" and same
            rows.append(
                [
                    _k(seq),
                    r["variant"] if r["variant"] != "tiled" else f"ours ({r['num_tiles']})",
                    str(r["tiles"]),
                    _n(r["time_ms"], 2),
                    _n(r["peak_mib"], 0),
                    f"{r['time_ms'] / min(p['time_ms'] for p in same):.3f}" if ours else "",
                    f"{r['peak_mib'] - min(p['peak_mib'] for p in same):+,.0f}" if ours else "",
                ]
            )
    head = ["tokens", "variant", "tiles", "ms", "peak MiB", "time / best peer"]
    head += ["MiB over the lower peer"]
    return _table(head, rows)


TABLES: dict[str, Callable[[Path], str]] = {
    "mlp_op": mlp_op,
    "attention": attention,
    "whole_steps": whole_steps,
    "suite_steps": suite_steps,
    "suite_attention": suite_attention,
    "suite_mlp_table": suite_mlp_table,
    "long_step": long_step,
}


def render(folder: str, kind: str, root: Path = RECORDS) -> str:
    """The table `kind` of the records in root/folder.

    Raises:
        ValueError: an unknown kind or a folder without records.
    """
    if kind not in TABLES:
        raise ValueError(f"unknown GPU table {kind!r}; expected one of {sorted(TABLES)}")
    path = root / folder
    if not path.is_dir():
        raise ValueError(f"no records folder {path}")
    return TABLES[kind](path)


def check_page(text: str, root: Path = RECORDS) -> list[str]:
    """Every marked table of the page that differs from its records, as one line each."""
    wrong = []
    for m in _MARK.finditer(text):
        want = render(m["folder"], m["kind"], root)
        if m["body"] != want:
            wrong.append(f"{m['folder']}/{m['kind']}: the table differs from its records")
    return wrong


def update_page(text: str, root: Path = RECORDS) -> str:
    """The page with every marked table rendered from its records."""
    return _MARK.sub(lambda m: m.group(1) + render(m["folder"], m["kind"], root) + m.group(5), text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_records",
        description="Checks (or with --write, rewrites) the GPU tables of doc pages against the "
        "committed records.",
    )
    p.add_argument("pages", nargs="+", type=Path, help="Markdown pages with gpu-table marks")
    p.add_argument("--write", action="store_true", help="rewrite the tables from the records")
    a = p.parse_args(argv)
    status = 0
    for page in a.pages:
        text = page.read_text()
        if a.write:
            page.write_text(update_page(text))
            continue
        for line in check_page(text):
            print(f"{page}: {line}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
