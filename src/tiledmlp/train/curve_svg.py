"""A run's curve as an SVG file, with the standard library alone: two panels (the training loss
with the evaluation loss where there is one; the learning rate) against the optimizer step, each
with its axes, ticks at round values, tick labels, axis labels and a grid, under one title.

Invariant: every point given is drawn inside its panel's axes (the axes span round values that
hold all the points), and the file is a complete SVG document that a browser opens as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

__all__ = ["nice_ticks", "svg_curve"]

_WIDTH, _HEIGHT = 900, 360
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 16, 40, 48  # a panel's margins (tick labels, axis labels)
_COLORS = {"loss": "#1f77b4", "eval_loss": "#d62728", "learning_rate": "#ff7f0e"}
_FONT = 'font-family="DejaVu Sans, Helvetica, Arial, sans-serif"'

Points = Sequence[tuple[float, float]]


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """About `count` round values (1, 2, 2.5 or 5 times a power of ten apart) from at or below
    `lo` to at or above `hi`; integers only where `integer`. An empty span is widened around
    its one value."""
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1.0, float(round(step)))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [k * step for k in range(first, last + 1)]


def _label(value: float, ticks: Sequence[float]) -> str:
    """A tick's label, with as many decimals as the ticks' spacing needs (scientific notation
    for very small or large values, as learning rates are)."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else abs(value) or 1.0
    largest = max(abs(t) for t in ticks)
    if value == 0:
        return "0"
    if largest < 1e-2 or largest >= 1e5:
        return f"{value:.{max(0, _digits(step / 10 ** math.floor(math.log10(largest))))}e}"
    return f"{value:.{_digits(step)}f}"


def _digits(step: float) -> int:
    """Decimals that show a multiple of `step` exactly (2.5 needs one more than 2 or 5)."""
    digits = max(0, -math.floor(math.log10(step) + 1e-9))
    return digits + (1 if round(step / 10**-digits, 6) % 1 else 0)


class _Panel:
    """One panel's placement and its data-to-pixel mapping."""

    def __init__(self, x0: float, width: float, xs: list[float], ys: list[float]) -> None:
        self.x0, self.width = x0 + _LEFT, width - _LEFT - _RIGHT
        self.y0, self.height = _TOP, _HEIGHT - _TOP - _BOTTOM
        self.xticks = nice_ticks(min(xs), max(xs), 6, integer=True)
        self.yticks = nice_ticks(min(ys), max(ys), 5)

    def px(self, x: float) -> float:
        lo, hi = self.xticks[0], self.xticks[-1]
        return self.x0 + (x - lo) / (hi - lo) * self.width

    def py(self, y: float) -> float:
        lo, hi = self.yticks[0], self.yticks[-1]
        return self.y0 + self.height - (y - lo) / (hi - lo) * self.height

    def axes(self, ylabel: str) -> list[str]:
        out = [
            f'<rect x="{self.x0:.1f}" y="{self.y0:.1f}" width="{self.width:.1f}" '
            f'height="{self.height:.1f}" fill="white" stroke="#333"/>'
        ]
        bottom = self.y0 + self.height
        for t in self.xticks:
            x = self.px(t)
            out.append(
                f'<line x1="{x:.1f}" y1="{self.y0:.1f}" x2="{x:.1f}" y2="{bottom:.1f}" '
                'stroke="#ddd"/>'
                f'<line x1="{x:.1f}" y1="{bottom:.1f}" x2="{x:.1f}" y2="{bottom + 5:.1f}" '
                'stroke="#333"/>'
                f'<text x="{x:.1f}" y="{bottom + 18:.1f}" text-anchor="middle">'
                f"{_label(t, self.xticks)}</text>"
            )
        for t in self.yticks:
            y = self.py(t)
            right = self.x0 + self.width
            out.append(
                f'<line x1="{self.x0:.1f}" y1="{y:.1f}" x2="{right:.1f}" y2="{y:.1f}" '
                'stroke="#ddd"/>'
                f'<line x1="{self.x0 - 5:.1f}" y1="{y:.1f}" x2="{self.x0:.1f}" y2="{y:.1f}" '
                'stroke="#333"/>'
                f'<text x="{self.x0 - 8:.1f}" y="{y + 4:.1f}" text-anchor="end">'
                f"{_label(t, self.yticks)}</text>"
            )
        mid_x, mid_y = self.x0 + self.width / 2, self.y0 + self.height / 2
        out.append(
            f'<text x="{mid_x:.1f}" y="{_HEIGHT - 10}" text-anchor="middle">optimizer step</text>'
            f'<text x="{self.x0 - 64:.1f}" y="{mid_y:.1f}" text-anchor="middle" '
            f'transform="rotate(-90 {self.x0 - 64:.1f} {mid_y:.1f})">{escape(ylabel)}</text>'
        )
        return out

    def line(self, points: Points, color: str, dashed: bool = False, dots: bool = False) -> str:
        coords = " ".join(f"{self.px(x):.1f},{self.py(y):.1f}" for x, y in points)
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        out = f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>'
        if dots:
            out += "".join(
                f'<circle cx="{self.px(x):.1f}" cy="{self.py(y):.1f}" r="3" fill="{color}"/>'
                for x, y in points
            )
        return out


def svg_curve(series: dict[str, list[tuple[int, float]]], title: str) -> str:
    """The SVG document of a run's curves.

    Args:
        series: (step, value) pairs in step order under "loss" (at least one), "eval_loss" and
            "learning_rate" (either may be empty).
        title: the line above the panels.

    Returns:
        The document's text.
    """
    loss, evals, lr = series["loss"], series.get("eval_loss", []), series.get("learning_rate", [])
    if not loss:
        raise ValueError("svg_curve: expected at least one training loss point, got none")
    half = _WIDTH / 2
    left_points = [*loss, *evals]
    left = _Panel(0, half, [p[0] for p in left_points], [p[1] for p in left_points])
    body = [*left.axes("loss"), left.line(loss, _COLORS["loss"])]
    legend = [("training loss", _COLORS["loss"], "")]
    if evals:
        body.append(left.line(evals, _COLORS["eval_loss"], dashed=True, dots=True))
        legend.append(("eval loss", _COLORS["eval_loss"], ' stroke-dasharray="5,4"'))
    x, y = left.x0 + left.width - 120, left.y0 + 8
    body.append(
        f'<rect x="{x - 6:.1f}" y="{y - 2:.1f}" width="122" height="{len(legend) * 18 + 4}" '
        'fill="white" stroke="#bbb"/>'
    )
    for i, (name, color, dash) in enumerate(legend):
        row = y + 10 + i * 18
        body.append(
            f'<line x1="{x:.1f}" y1="{row:.1f}" x2="{x + 24:.1f}" y2="{row:.1f}" '
            f'stroke="{color}" stroke-width="1.8"{dash}/>'
            f'<text x="{x + 30:.1f}" y="{row + 4:.1f}">{name}</text>'
        )
    if lr:
        right = _Panel(half, half, [p[0] for p in lr], [p[1] for p in lr])
        body += [*right.axes("learning rate"), right.line(lr, _COLORS["learning_rate"])]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" {_FONT} font-size="12">\n'
        f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>\n'
        f'<text x="{_WIDTH / 2:.1f}" y="22" text-anchor="middle" font-size="13">'
        f"{escape(title)}</text>\n" + "\n".join(body) + "\n</svg>\n"
    )
