"""The GPU figures of the README and the benchmarks page, drawn from the committed records
(benchmarks/results/gpu/), as the tables are (benchmarks/gpu_records.py).

Two figures: the peak memory of a whole training step of the Llama-3-8B shape against the
sequence length, per stack, measured on an H100 and on an H200, with the planner's line beside
the measured points; and the time and peak of the MLP op, ours against DeepSpeed's and Liger's
tiled MLPs at the same tiles. Each figure's data (every number it draws) is also written to a JSON
sidecar, docs/assets/gpu-figures.json: `python -m benchmarks.figures --check` compares it
with the records (PNG bytes vary with the matplotlib version; the numbers do not), and CI runs
that check (tests/bench/test_figures.py).

Invariant: a figure draws the numbers of its sidecar entry and nothing else, and that entry is
a pure function of the records.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.gpu_records import RECORDS, ROOT
from tiledmlp.config.stacks import STACKS

__all__ = ["FIGURES", "SIDECAR", "check", "figure_data", "planned_allocated", "write"]

ASSETS = ROOT / "docs" / "assets"
SIDECAR = ASSETS / "gpu-figures.json"
MiB_PER_GiB = 1024

# figure name -> (records folder per card, what it draws)
MEMORY_RUNS = {"H100": "2026-11-26T0933-h100", "H200": "2026-11-26T0339-h200"}
MLP_RUN = "2026-11-26T0339-h200"
FIGURES = {"gpu-memory-8b": "memory", "gpu-mlp-op": "mlp"}

# the stacks from least to most tiled, as the legend lists them
_STACKS = STACKS
_MLP_VARIANTS = {"untiled": "untiled", "tiled": "ours", "deepspeed": "DeepSpeed", "liger": "Liger"}


def _records(folder: Path, part: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.rglob("records.jsonl")):
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("part") == part and r.get("status") == "ok":
                    out.append(r)
    return out


def _gib(mib: float) -> float:
    return round(mib / MiB_PER_GiB, 3)


# the planned terms that go through the caching allocator: a record planned before they were
# counted as allocated holds them in its device overhead (plan/model.py, _device_entry)
_ALLOCATED_TERMS = ("attention_backward", "cublas_workspace")
OFF = 0.03  # a point further than this from its planned line is marked with its ratio


def planned_allocated(record: dict[str, Any]) -> float:
    """The plan's allocated MiB of a record (what max_memory_allocated measures): its planned
    peak, with the attention buffers and workspaces a record of an earlier plan kept in its
    device overhead."""
    overhead = record.get("planned_device_overhead_breakdown_mib") or {}
    return float(record["planned_peak_mib"]) + sum(overhead.get(k, 0.0) for k in _ALLOCATED_TERMS)


def memory_data(root: Path = RECORDS) -> dict[str, Any]:
    """Per card: its name and memory, and per stack the (tokens, measured allocated GiB,
    planned allocated GiB) of each length it ran."""
    cards = {}
    for card, folder in MEMORY_RUNS.items():
        records = _records(root / folder, "model_steps")
        first = records[0]
        stacks = {}
        for stack in _STACKS:
            rows = sorted((r for r in records if r["stack"] == stack), key=lambda r: r["seq_len"])
            if rows:
                stacks[stack] = [
                    [r["seq_len"], _gib(r["max_memory_allocated_mib"]), _gib(planned_allocated(r))]
                    for r in rows
                ]
        cards[card] = {
            "folder": f"benchmarks/results/gpu/{folder}",
            "device": first["device_name"],
            "device_gib": _gib(first["device_total_mib"]),
            "layers": first["layers"],
            "hidden": first["hidden"],
            "intermediate": first["intermediate"],
            "stacks": stacks,
        }
    return cards


def mlp_data(root: Path = RECORDS) -> dict[str, Any]:
    """Per variant (ours at the same tiles as DeepSpeed and Liger, arctic), the (tokens, ms, peak
    MiB) of each length."""
    records = _records(root / MLP_RUN, "mlp_table")
    first = records[0]
    series: dict[str, list[list[float]]] = {}
    for seq in sorted({r["seq_len"] for r in records}):
        here = [r for r in records if r["seq_len"] == seq]
        peers = [r for r in here if r["variant"] in ("deepspeed", "liger")]
        tiles = {p["tiles"] for p in peers}
        for r in here:
            ours_same = (
                r["variant"] == "tiled" and r["tiles"] in tiles and r["num_tiles"] == "arctic"
            )
            if r["variant"] in ("untiled", "deepspeed", "liger") or ours_same:
                series.setdefault(_MLP_VARIANTS[r["variant"]], []).append(
                    [seq, round(r["time_ms"], 3), round(r["peak_mib"], 1)]
                )
    return {
        "folder": f"benchmarks/results/gpu/{MLP_RUN}",
        "device": first["device_name"],
        "dtype": first["dtype"],
        "hidden": first["hidden"],
        "intermediate": first["intermediate"],
        "series": series,
    }


def figure_data(root: Path = RECORDS) -> dict[str, Any]:
    """Every figure's numbers, keyed by figure name (the sidecar's content)."""
    return {"gpu-memory-8b": memory_data(root), "gpu-mlp-op": mlp_data(root)}


def _k(tokens: float) -> str:
    return f"{int(tokens) // 1024}K"


def _draw_memory(data: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(data), sharey=True)
    colors = dict(zip(_STACKS, ("#444444", "#8c564b", "#1f77b4", "#17becf", "#2ca02c", "#d62728")))
    for ax, got in zip(axes, data.values()):
        lengths: set[int] = set()
        for stack, rows in got["stacks"].items():
            seqs = [r[0] for r in rows]
            lengths.update(seqs)
            color = colors[stack]
            ax.plot(seqs, [r[2] for r in rows], "--", color=color, alpha=0.7, linewidth=1.2)
            hollow = stack == "untiled"  # the same peak as tiled_mlp: drawn around it
            ax.plot(seqs, [r[1] for r in rows], "s" if hollow else "o", color=color, label=stack,
                    markersize=11 if hollow else 6, fillstyle="none" if hollow else "full")  # fmt: skip
            for seq, measured, planned in rows:  # a point off its line: its ratio beside it
                if planned and abs(measured / planned - 1) > OFF:
                    ax.annotate(f"{measured / planned:.2f}x", (seq, measured), fontsize=7,
                                color=color, xytext=(4, 4), textcoords="offset points")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(lengths), [_k(n) for n in sorted(lengths)])
        ax.minorticks_off()
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(
            f"{got['device']} ({got['device_gib']:.0f} GiB)",
            fontsize=10,
        )
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("peak allocated memory (GiB)")
    axes[-1].legend(fontsize=8, loc="upper right")
    some = next(iter(data.values()))
    fig.suptitle(
        f"One training step, Llama-3-8B shape cut to {some['layers']} layers (hidden "
        f"{some['hidden']}, intermediate {some['intermediate']}), bf16, batch 1\nallocated "
        f"memory, measured (points) and planned (dashed); a point more than {OFF:.0%} off its "
        "line shows measured / planned",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _draw_mlp(data: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_time, ax_mem = fig.subplots(1, 2)
    lengths: set[int] = set()
    untiled = {r[0]: r[1] for r in data["series"]["untiled"]}
    for name, rows in data["series"].items():
        seqs = [r[0] for r in rows]
        lengths.update(seqs)
        style = "o-" if name == "ours" else "o--"
        ax_time.plot(seqs, [r[1] / untiled[r[0]] for r in rows], style, label=name)
        ax_mem.plot(seqs, [r[2] / MiB_PER_GiB for r in rows], style, label=name)
    ax_mem.set_yscale("log")
    for ax, label in ((ax_time, "time / the untiled MLP's time"), (ax_mem, "peak allocated (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(lengths), [_k(n) for n in sorted(lengths)])
        ax.minorticks_off()
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=9)
    ax_time.set_title("Time of the MLP op (forward + backward), against untiled", fontsize=10)
    ax_mem.set_title("Peak memory of the MLP op", fontsize=10)
    fig.suptitle(
        f"SwiGLU MLP hidden {data['hidden']}, intermediate {data['intermediate']}, "
        f"{data['dtype']}, {data['device']}; tiled variants at the same tiles",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write(out: Path = ASSETS, root: Path = RECORDS) -> list[Path]:
    """Draws every figure into `out` (PNG) and writes the sidecar; returns the files."""
    data = figure_data(root)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, kind in FIGURES.items():
        path = out / f"{name}.png"
        (_draw_memory if kind == "memory" else _draw_mlp)(data[name], path)
        written.append(path)
    sidecar = out / SIDECAR.name
    sidecar.write_text(json.dumps(data, indent=1) + "\n")
    return [*written, sidecar]


def check(out: Path = ASSETS, root: Path = RECORDS) -> list[str]:
    """What differs between the committed figures and the records, one line each."""
    sidecar = out / SIDECAR.name
    wrong = [
        f"{out / (n + '.png')} is missing" for n in FIGURES if not (out / f"{n}.png").is_file()
    ]
    if not sidecar.is_file():
        return [*wrong, f"{sidecar} is missing"]
    committed = json.loads(sidecar.read_text())
    for name, want in figure_data(root).items():
        if committed.get(name) != want:
            wrong.append(f"{name}: {sidecar} differs from the records")
    return wrong


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.figures",
        description="Draws the GPU figures of the docs from the committed records "
        "(docs/assets/gpu-*.png and gpu-figures.json), or with --check compares them.",
    )
    p.add_argument("--check", action="store_true", help="compare, write nothing (exit 1 on a "
                   "difference)")  # fmt: skip
    a = p.parse_args(argv)
    if a.check:
        wrong = check()
        for line in wrong:
            print(line, file=sys.stderr)
        return 1 if wrong else 0
    try:
        files = write()
    except ImportError:
        print("the figures need matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    print("wrote " + ", ".join(str(f.relative_to(ROOT)) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
