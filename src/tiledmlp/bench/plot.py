"""A PNG of benchmark records: peak memory and time against sequence length, one line per
variant (the `bench` extra installs matplotlib).

Invariant: every point is read from the records; nothing is smoothed or extrapolated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiledmlp.extras import install_command

__all__ = ["LABELS", "plot_records"]

LABELS = {
    "untiled": "Regular",
    "tiled": "Tiled (tiledmlp)",
    "deepspeed": "DeepSpeed TiledMLP",
    "liger": "Liger tiled SwiGLU",
}


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# The `bench` extra, in the form that works from the current folder (tiledmlp/extras.py).
INSTALL_HINT = f"{install_command('bench')} (or pip install matplotlib)"


def matplotlib_available() -> bool:
    """Whether plot_records can draw (matplotlib importable)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_records(records: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Writes the two-panel plot of `records` to `path` (PNG).

    Raises:
        ValueError: matplotlib is not installed (with the command that installs it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(f"the plot needs matplotlib: {INSTALL_HINT}") from None
    variants = [v for v in LABELS if any(r["variant"] == v for r in records)]
    lengths = sorted({r["seq_len"] for r in records})
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in variants:
        rows = sorted((r for r in records if r["variant"] == v), key=lambda r: r["seq_len"])
        seqs = [r["seq_len"] for r in rows]
        ax_mem.plot(seqs, [r["peak_mib"] for r in rows], marker="o", label=LABELS[v])
        ax_time.plot(seqs, [r["time_ms"] for r in rows], marker="o", label=LABELS[v])
    for ax, ylabel in ((ax_mem, "peak memory (MB)"), (ax_time, "forward + backward (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_tokens(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_mem.set_title("Peak memory")
    ax_time.set_title("Time")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
