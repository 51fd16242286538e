"""A PNG of the whole-model planner's breakdown: for each stack, GiB per GPU against tokens,
stacked by what is alive at the peak (weights, gradients, ..., recompute, the device overhead),
with the card's memory drawn across; and one panel of every stack's total, where each stack
meets the card, i.e. the length beyond which the part it adds stops paying.

Reads the JSON records `tiledmlp plan --json` writes (one {"command", "machine", "result"}
object per line, or the bare result), merged by sequence length: a stack planned by a later
record (e.g. with --stacks) joins the earlier ones. Run as
`python -m benchmarks.breakdown_plot RECORDS.jsonl OUT.png [--memory-gb 79.2]`; without
matplotlib it draws nothing and says how to install it.

Invariant: every point is a figure of a record; nothing is interpolated or extrapolated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiledmlp.bench.plot import INSTALL_HINT, _tokens, matplotlib_available

__all__ = ["breakdown_series", "main", "plot_breakdown", "read_plans"]

GiB_PER_MiB = 1 / 1024
# bottom to top: what every step holds, then what grows with the sequence
COMPONENTS = (
    "weights",
    "grads",
    "optimizer",
    "gathered",
    "reduce_scatter",
    "all_to_all",
    "activations",
    "checkpoints",
    "loss",
    "recompute",
    "attention_backward",
    "cublas_workspace",
    "device_overhead",
)


def read_plans(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The plan results in `paths` (JSON lines of records, or a JSON record or result)."""
    out = []
    for path in paths:
        text = Path(path).read_text()
        try:
            items = [json.loads(text)]
        except json.JSONDecodeError:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        out += [item.get("result", item) for item in items]
    return out


def breakdown_series(plans: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """{stack: {seq_len: {component: GiB}}} from plan results; a later plan of the same stack
    and length replaces an earlier one.

    Raises:
        ValueError: a result without a whole-model plan (no "model"), or a component the plot
            does not draw (every part of a stack's peak is drawn).
    """
    series: dict[str, dict[int, dict[str, float]]] = {}
    for plan in plans:
        if "model" not in plan:
            raise ValueError("a record without a whole-model plan: run tiledmlp plan --model")
        for stack, entry in plan["model"].items():
            parts = {k: v * GiB_PER_MiB for k, v in entry["breakdown_mib"].items()}
            unknown = sorted(set(parts) - set(COMPONENTS))
            if unknown:
                raise ValueError(f"components the plot does not draw: {unknown}; add them to "
                                 "COMPONENTS")  # fmt: skip
            parts["device_overhead"] = entry.get("device_overhead_mib", 0.0) * GiB_PER_MiB
            series.setdefault(stack, {})[int(plan["seq_len"])] = parts
    return series


def plot_breakdown(
    plans: Sequence[dict[str, Any]], path: Path, title: str, memory_gb: float | None = None
) -> Path:
    """Writes the panels (one per stack, stacked by component, and the totals) to `path`.

    Raises:
        ValueError: matplotlib is not installed (with the command that installs it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(f"the plot needs matplotlib: {INSTALL_HINT}") from None
    series = breakdown_series(plans)
    stacks = list(series)
    cols = 3
    rows = -(-(len(stacks) + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    tab10 = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    palette = [*tab10, "#393b79", "#ffbb78", (0.2, 0.2, 0.2)]  # the overhead dark, on top
    colours = dict(zip(COMPONENTS, palette, strict=True))
    for ax, stack in zip(axes.flat, stacks, strict=False):
        lengths = sorted(series[stack])
        present = [c for c in COMPONENTS if any(series[stack][n].get(c, 0) for n in lengths)]
        ys = [[series[stack][n].get(c, 0.0) for n in lengths] for c in present]
        ax.stackplot(lengths, ys, labels=present, colors=[colours[c] for c in present])
        _axes(ax, stack, lengths, memory_gb)
    totals = axes.flat[len(stacks)]
    totals.set_yscale("log")
    for stack in stacks:
        lengths = sorted(series[stack])
        totals.plot(lengths, [sum(series[stack][n].values()) for n in lengths], marker="o",
                    label=stack)  # fmt: skip
    _axes(totals, "every stack: total per GPU", sorted({n for s in series.values() for n in s}),
          memory_gb)  # fmt: skip
    totals.legend(fontsize=7)
    for ax in list(axes.flat)[len(stacks) + 1 :]:
        ax.axis("off")
    seen: dict[str, Any] = {}
    for ax in list(axes.flat)[: len(stacks)]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=6, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(n: int) -> str:
    return f"{n // 2**20}M" if n >= 2**20 and n % 2**20 == 0 else _tokens(n)


def _axes(ax: Any, title: str, lengths: list[int], memory_gb: float | None) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [_label(n) for n in lengths], fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("tokens (per sequence)", fontsize=8)
    ax.set_ylabel("GiB per GPU", fontsize=8)
    if memory_gb is not None:
        ax.axhline(memory_gb, color="black", linestyle="--", linewidth=1)
        top = ax.get_ylim()[1]
        if ax.get_yscale() == "linear" and top > 4 * memory_gb:
            ax.set_ylim(0, 4 * memory_gb)
            ax.set_title(f"{title} (cut at {4 * memory_gb:g} GiB)", fontsize=9)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.breakdown_plot RECORDS... OUT.png [--memory-gb GB]`."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.breakdown_plot")
    p.add_argument("records", nargs="+", type=Path, help="tiledmlp plan --json records")
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("--memory-gb", type=float, default=None, help="draw the card's memory")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    plans = read_plans(args.records)
    if not matplotlib_available():
        sys.stderr.write(f"no plot drawn: matplotlib is not installed ({INSTALL_HINT})\n")
        return 0
    first = plans[0] if plans else {}
    name = str(first.get("model_name"))
    model = Path(name).stem if name.endswith(".json") else name  # a config file: its name
    title = args.title or (
        f"{model}: peak per GPU by component, {first.get('engine', 'ddp')}"
        + (" + offloaded parameters" if first.get("offload_params") else "")
        + f", optimizer {first.get('optimizer')}"
        + (
            f", {first['sequence_parallel_size']} GPUs"
            if first.get("sequence_parallel_size", 1) > 1
            else ""
        )
    )
    try:
        plot_breakdown(plans, args.out, title, args.memory_gb)
    except ValueError as e:
        sys.stderr.write(f"breakdown_plot: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
