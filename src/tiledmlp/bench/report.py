"""Markdown tables from benchmark records: one row per sequence length, variants side by side.

Invariant: every number in the table is read from the records; ratios are against the untiled
variant of the same sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["markdown_table"]


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """Rows: sequence length. Per variant: time (ms), peak (MiB), FLOPs / untiled; plus the
    time and memory change of each tiled variant against untiled."""
    names: list[str] = []
    for r in records:
        if r["variant"] not in names:
            names.append(r["variant"])
    by_seq: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_seq.setdefault(r["seq_len"], {})[r["variant"]] = r
    header = ["Seq Length"]
    for n in names:
        header += [f"{n} (ms)", f"{n} (MiB)"]
    others = [n for n in names if n != "untiled"]
    if "untiled" in names:
        for n in others:
            header += [f"{n} time (+%)", f"{n} memory (-%)", f"{n} FLOPs (x)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for seq in sorted(by_seq):
        row = by_seq[seq]
        cells = [str(seq)]
        for n in names:
            cell = row.get(n)
            cells += [
                "" if cell is None else f"{cell['time_ms']:.1f}",
                "" if cell is None else f"{cell['peak_mib']:.1f}",
            ]
        base = row.get("untiled")
        if base is not None:
            for n in others:
                other = row.get(n)
                if other is None:
                    cells += ["", "", ""]
                    continue
                cells.append(f"{100 * (other['time_ms'] / base['time_ms'] - 1):+.1f}")
                cells.append(f"{100 * (1 - other['peak_mib'] / base['peak_mib']):.1f}")
                cells.append(f"{other['flops'] / base['flops']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
