"""The picture a `tiledmlp train` run leaves: its training loss (and evaluation loss, where it
evaluated) and its learning rate against the optimizer step, drawn from OUTPUT_DIR/metrics.jsonl
into OUTPUT_DIR/curve.png when matplotlib is installed (a note naming the install otherwise).

Invariant: the picture is drawn from the metrics file alone (what the run logged, a resumed run's
steps after the earlier ones'), so it shows what the file holds and nothing else.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from tiledmlp.extras import install_command

__all__ = ["CURVE_FILE", "curve_points", "draw_curve"]

CURVE_FILE = "curve.png"


def curve_points(metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of "loss", "eval_loss" and "learning_rate" in the metrics file, in step
    order, the last record of a step winning (a resumed run logs the steps after its
    checkpoint again)."""
    series: dict[str, dict[int, float]] = {"loss": {}, "eval_loss": {}, "learning_rate": {}}
    for line in metrics.read_text(encoding="utf-8").splitlines():
        if not line.startswith("{"):
            continue
        record: dict[str, Any] = json.loads(line)
        for key, points in series.items():
            value = record.get(key)
            if isinstance(value, int | float) and "step" in record:
                points[int(record["step"])] = float(value)
    return {key: sorted(points.items()) for key, points in series.items()}


def draw_curve(metrics: Path, title: str) -> tuple[Path | None, str | None]:
    """Draws metrics.jsonl's curves into curve.png beside it.

    Returns:
        (the picture's path, None), or (None, why none was drawn): matplotlib is not installed
        (with the command that installs it), or the file holds no training loss.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return None, (
            f"no curve drawn: matplotlib is not installed ({install_command('bench')}, or pip "
            "install matplotlib); the losses are in " + str(metrics)
        )
    if not metrics.is_file():
        return None, f"no curve drawn: {metrics} was not written"
    points = curve_points(metrics)
    if not points["loss"]:
        return None, f"no curve drawn: {metrics} holds no training loss"
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)  # files only: no display, no global backend
    ax_loss, ax_lr = fig.subplots(1, 2)
    for key, label, style in (("loss", "training loss", "-"), ("eval_loss", "eval loss", "o--")):
        if points[key]:
            steps, values = zip(*points[key])
            ax_loss.plot(steps, values, style, label=label, markersize=4)
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    if points["learning_rate"]:
        steps, values = zip(*points["learning_rate"])
        ax_lr.plot(steps, values, color="tab:orange")
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in (ax_loss, ax_lr):
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = metrics.parent / CURVE_FILE
    fig.savefig(path, dpi=100)
    return path, None
