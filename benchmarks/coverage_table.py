"""The support matrix of the docs, rendered from the committed records of benchmarks/coverage.py
(benchmarks/results/coverage/coverage.jsonl), so that the page says only what a run showed.

The page opens with the popular families' rows (`<!-- coverage-popular -->` ...
`<!-- /coverage-popular -->`) and ends with the whole matrix, grouped: architectures that tile,
refused ones, not buildable ones (`<!-- coverage-table -->` ... `<!-- /coverage-table -->`);
`python -m benchmarks.coverage_table` checks it against the records (exit 1 on a
difference), `--write` rewrites it. tests/bench/test_coverage.py runs the check.

Invariant: the marked parts of the page are a pure function of the records file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import ROOT

__all__ = [
    "COLUMNS",
    "FAMILIES",
    "PAGE",
    "RECORDS",
    "check_page",
    "load",
    "popular",
    "render",
    "render_popular",
    "table",
    "write_page",
]


RECORDS = ROOT / "benchmarks" / "results" / "coverage" / "coverage.jsonl"
#: the stacks of the matrix, in column order (their options: benchmarks/coverage.py's STACKS)
COLUMNS = ("mlp", "mlp+loss+norms", "mlp+loss+norms+layers")

PAGE = ROOT / "docs" / "supported-models.md"
_MARK = re.compile(r"(<!-- coverage-table -->\n)(?P<body>.*?)(<!-- /coverage-table -->)", re.S)
_POPULAR = re.compile(
    r"(<!-- coverage-popular -->\n)(?P<body>.*?)(<!-- /coverage-popular -->)", re.S
)
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


#: the families people fine-tune at long context, as the page's first table names them
FAMILIES = (
    ("Llama", "llama"),
    ("Qwen2", "qwen2"),
    ("Qwen3", "qwen3"),
    ("Qwen3-MoE", "qwen3_moe"),
    ("Mistral", "mistral"),
    ("Gemma 2", "gemma2"),
    ("Gemma 3", "gemma3_text"),
    ("Phi-3", "phi3"),
    ("GPT-OSS", "gpt_oss"),
    ("DeepSeek-V3", "deepseek_v3"),
)
#: the matrix's groups: (heading, which rows), in page order
_GROUPS = (
    ("Architectures that tile", "at least one stack exact"),
    ("Refused, with the reason", "no stack exact, patch_model refused"),
    ("Not buildable here", "no stack could be built at tiny sizes"),
)


def _by_type(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["model_type"], {})[r["stack"]] = r
    return by


def _group(row: dict[str, dict[str, Any]]) -> int:
    """The index in _GROUPS of an architecture's row."""
    statuses = {r["status"] for r in row.values()}
    if "exact" in statuses:
        return 0
    return 2 if statuses == {"not buildable"} else 1


def popular(records: list[dict[str, Any]]) -> str:
    """The page's first table: the FAMILIES' rows of the matrix, cells as the matrix has them."""
    by = _by_type(records)
    head = ["family", "architecture", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, model_type in FAMILIES:
        row = by.get(model_type, {})
        cells = [_cell(row[s]) if s in row else "not run" for s in COLUMNS]
        lines.append(f"| {family} | `{model_type}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table(records: list[dict[str, Any]]) -> str:
    """The matrix in its groups (_GROUPS): one row per architecture, one column per stack, each
    group followed by what its stacks left untiled (or refused, or could not build) and why,
    one line per reason."""
    by = _by_type(records)
    out: list[str] = []
    for index, (heading, _) in enumerate(_GROUPS):
        types = [t for t in sorted(by) if _group(by[t]) == index]
        if types:
            out.append(f"### {heading} ({len(types)})\n\n" + _rows(by, types))
    return "\n".join(out)


def _rows(by: dict[str, dict[str, dict[str, Any]]], types: list[str]) -> str:
    """The table of `types` and the reasons under it."""
    head = ["architecture", "class", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: list[str] = []
    for model_type in types:
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


def render_popular(path: Path = RECORDS) -> str:
    """The generated first table of the page, from the records file at `path`."""
    return popular(load(path)[1])


def check_page(text: str, path: Path = RECORDS) -> list[str]:
    """One line per marked part of the page that differs from the records (none: it agrees)."""
    wrong = []
    for mark, name, rendered in (
        (_POPULAR, "coverage-popular", render_popular),
        (_MARK, "coverage-table", render),
    ):
        m = mark.search(text)
        if m is None:
            wrong.append(f"the page has no <!-- {name} --> mark")
        elif m["body"] != rendered(path):
            what = "popular families' table" if mark is _POPULAR else "support matrix"
            wrong.append(f"the {what} differs from its records")
    return wrong


def write_page(page: Path = PAGE, path: Path = RECORDS) -> None:
    """Rewrites the marked parts of the page from the records."""
    text = page.read_text()
    text = _POPULAR.sub(lambda m: m.group(1) + render_popular(path) + m.group(3), text)
    page.write_text(_MARK.sub(lambda m: m.group(1) + render(path) + m.group(3), text))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.coverage_table",
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
