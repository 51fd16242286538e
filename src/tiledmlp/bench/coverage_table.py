"""The support matrix of the docs, rendered from the committed records of bench/coverage.py
(benchmarks/results/coverage/coverage.jsonl), so that the page says only what a run showed.

The page marks the generated part with `<!-- coverage-table -->` ... `<!-- /coverage-table -->`;
`python -m tiledmlp.bench.coverage_table` checks it against the records (exit 1 on a
difference), `--write` rewrites it. tests/bench/test_coverage.py runs the check.

Invariant: the marked part of the page is a pure function of the records file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "PAGE", "RECORDS", "check_page", "load", "render", "table", "write_page"]

ROOT = Path(__file__).resolve().parents[3]
RECORDS = ROOT / "benchmarks" / "results" / "coverage" / "coverage.jsonl"
#: the stacks of the matrix, in column order (their options: bench/coverage.py's STACKS)
COLUMNS = ("mlp", "mlp+loss+norms", "mlp+loss+norms+layers")

PAGE = ROOT / "docs" / "supported-models.md"
_MARK = re.compile(r"(<!-- coverage-table -->\n)(?P<body>.*?)(<!-- /coverage-table -->)", re.S)
_ORDER = ("mlp", "norm", "layer", "loss")


def load(path: Path = RECORDS) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, records) of a records file."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return lines[0], lines[1:]


def _cell(record: dict[str, Any]) -> str:
    status = record["status"]
    if status != "exact":
        return status
    tiled = record.get("tiled", {})
    return "exact: " + ", ".join(
        f"{kind}" if kind == "loss" else f"{kind} x{tiled[kind]}"
        for kind in _ORDER
        if kind in tiled
    )


def table(records: list[dict[str, Any]]) -> str:
    """The matrix: one row per architecture, one column per stack, then what each stack left
    untiled (or refused, or could not build) and why, one line per reason."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["model_type"], {})[r["stack"]] = r
    head = ["architecture", "class", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: list[str] = []
    for model_type in sorted(by):
        row = by[model_type]
        first = next(iter(row.values()))
        cells = [_cell(row[s]) if s in row else "" for s in COLUMNS]
        lines.append(f"| `{model_type}` | {first.get('class', '')} | " + " | ".join(cells) + " |")
        reasons: list[str] = []
        for s in COLUMNS:
            if s not in row:
                continue
            r = row[s]
            said = [r["detail"]] if r.get("detail") else []
            said += r.get("untiled", [])
            for why in said:
                line = f"{why} ({s})" if r["status"] == "exact" else f"{r['status']}: {why} ({s})"
                if r["status"] == "not buildable":
                    line = f"not buildable: {why}"
                if line not in reasons:
                    reasons.append(line)
        notes += [f"- `{model_type}`: {_escape(why)}" for why in reasons]
    out = "\n".join(lines) + "\n"
    if notes:
        out += (
            "\nWhat was left untiled, refused or not built, and why:\n\n" + "\n".join(notes) + "\n"
        )
    return out


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render(path: Path = RECORDS) -> str:
    """The generated part of the page, from the records file at `path`."""
    head, records = load(path)
    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    models = len({r["model_type"] for r in records})
    intro = (
        f"Generated with transformers {head['transformers']} and torch {head['torch']}: "
        f"{models} architectures x {len(COLUMNS)} stacks ({summary}).\n\n"
    )
    return intro + table(records)


def check_page(text: str, path: Path = RECORDS) -> list[str]:
    """One line per marked part of the page that differs from the records (none: it agrees)."""
    m = _MARK.search(text)
    if m is None:
        return ["the page has no <!-- coverage-table --> mark"]
    return [] if m["body"] == render(path) else ["the support matrix differs from its records"]


def write_page(page: Path = PAGE, path: Path = RECORDS) -> None:
    """Rewrites the marked part of the page from the records."""
    text = page.read_text()
    page.write_text(_MARK.sub(lambda m: m.group(1) + render(path) + m.group(3), text))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tiledmlp.bench.coverage_table",
        description="Checks (or with --write, rewrites) the support matrix of the docs against "
        "the committed records.",
    )
    p.add_argument("--write", action="store_true", help="rewrite the page from the records")
    a = p.parse_args(argv)
    if a.write:
        write_page()
        return 0
    wrong = check_page(PAGE.read_text())
    for line in wrong:
        print(f"{PAGE}: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
