"""The picture a `tiledmlp train` run leaves: its training loss (and evaluation loss, where it
evaluated) and its learning rate against the optimizer step, drawn from OUTPUT_DIR/metrics.jsonl
into OUTPUT_DIR/curve.png where matplotlib is installed, else into OUTPUT_DIR/curve.svg by the
standard library alone (train/curve_svg.py): every install draws it.

Invariant: the picture is drawn from the metrics file alone (what the run logged, a resumed run's
steps after the earlier ones'), so it shows what the file holds and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiledmlp.train.curve_svg import svg_curve

__all__ = ["CURVE_FILE", "CURVE_SVG", "curve_points", "draw_curve"]

CURVE_FILE = "curve.png"  # drawn by matplotlib
CURVE_SVG = "curve.svg"  # drawn without it


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
    """Draws metrics.jsonl's curves beside it: curve.png where matplotlib is installed, else
    curve.svg.

    Returns:
        (the picture's path, None), or (None, why none was drawn): the file was not written or
        holds no training loss.
    """
    if not metrics.is_file():
        return None, f"no curve drawn: {metrics} was not written"
    points = curve_points(metrics)
    if not points["loss"]:
        return None, f"no curve drawn: {metrics} holds no training loss"
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:  # the default install: the standard library draws it
        path = metrics.parent / CURVE_SVG
        path.write_text(svg_curve(points, title), encoding="utf-8")
        return path, None
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
