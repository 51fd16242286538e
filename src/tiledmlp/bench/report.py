"""Markdown tables from benchmark records: the table of the tiled-MLP pull requests, one row per
sequence length.

Columns: Seq Length | Regular (ms) | Tiled (ms) | Time, tiled vs regular | Regular (MB) |
Tiled (MB) | Memory, tiled vs regular, then, when present, DeepSpeed's TiledMLP (ms, MB) and the
FLOP ratio of each tiled variant. "Regular" is the untiled MLP, "Tiled" is tiledmlp. The time
column gives the tiled time against regular in words ("25.0% slower", "3.0% faster"), the memory
column the tiled peak against regular ("75.0% less", "2.0% more"). MB are 2**20 bytes.

Invariant: every number in the table is read from the records; ratios are against the untiled
variant of the same sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["CONTRACT_COLUMNS", "markdown_table"]

CONTRACT_COLUMNS = (
    "Seq Length",
    "Regular (ms)",
    "Tiled (ms)",
    "Time, tiled vs regular",
    "Regular (MB)",
    "Tiled (MB)",
    "Memory, tiled vs regular",
)


Row = dict[str, Any] | None


def _ms(r: Row) -> str:
    return "" if r is None else f"{r['time_ms']:.1f}"


def _mb(r: Row) -> str:
    return "" if r is None else f"{r['peak_mib']:.1f}"


def _change(r: Row, base: Row, key: str, *, saving: bool) -> str:
    """Percent change of r[key] against base[key], in words: memory "75.0% less" / "3.0% more"
    (saving), time "25.0% slower" / "10.0% faster"."""
    if r is None or base is None or not base[key]:
        return ""
    change = 100 * (r[key] / base[key] - 1)
    if saving:
        return f"{-change:.1f}% less" if change <= 0 else f"{change:.1f}% more"
    return f"{change:.1f}% slower" if change >= 0 else f"{-change:.1f}% faster"


def _flops(r: Row, base: Row) -> str:
    if r is None or base is None or not base["flops"]:
        return ""
    return f"{r['flops'] / base['flops']:.3f}"


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """The table of `records` (any mix of "untiled", "tiled", "deepspeed", "liger" variants):
    the contract columns, then time and memory of each peer present, tiles and FLOP ratios."""
    by_seq: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_seq.setdefault(r["seq_len"], {})[r["variant"]] = r
    peers = [(v, label) for v, label in _PEERS if any(r["variant"] == v for r in records)]
    header = list(CONTRACT_COLUMNS)
    for _, label in peers:
        header += [f"{label} (ms)", f"{label} (MB)"]
    header += ["Tiles", "Tiled FLOPs (x)"]
    header += [f"{label} FLOPs (x)" for _, label in peers]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for seq in sorted(by_seq):
        row = by_seq[seq]
        base, tiled = row.get("untiled"), row.get("tiled")
        cells = [
            str(seq),
            _ms(base),
            _ms(tiled),
            _change(tiled, base, "time_ms", saving=False),
            _mb(base),
            _mb(tiled),
            _change(tiled, base, "peak_mib", saving=True),
        ]
        for v, _ in peers:
            cells += [_ms(row.get(v)), _mb(row.get(v))]
        cells += ["" if tiled is None else str(tiled["tiles"]), _flops(tiled, base)]
        cells += [_flops(row.get(v), base) for v, _ in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_PEERS = (("deepspeed", "DeepSpeed"), ("liger", "Liger"))
