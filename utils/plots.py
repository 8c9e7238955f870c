"""Plots and Markdown tables shared by the labs."""
from __future__ import annotations

import math


def md_cell(value) -> str:
    """``value`` as one Markdown table cell: a ``|`` escaped (it would end the cell), a line break a space."""
    return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table: one row of ``header`` cells, then ``rows`` (cells are formatted with str, `md_cell`)."""
    lines = ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(md_cell(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def invalid_reason(achieved: float, peak: float | None) -> str | None:
    """Why a measured value cannot be a measurement of what it says (above the peak it is set against, or not a
    finite positive number), or None."""
    if not math.isfinite(achieved) or achieved <= 0:
        return "not a finite positive value"
    if peak and achieved > peak:
        return (f"{achieved / peak:.0%} of the peak: above it, so not a measurement of the work alone "
                "(the timer, the clock or a cache)")
    return None


def achieved_vs_peak(items, title: str = ""):
    """One bar pair per item: `items` is a list of (what, achieved, peak or None, unit[, reason]); `reason` (or
    `invalid_reason`) marks a value as unreliable: its bar is drawn hollow and hatched, the reason under it.
    Returns the matplotlib figure (the notebook shows it; `record.Recorder.figure` saves it)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(items), figsize=(4.5 * len(items), 3.2), squeeze=False)
    for ax, item in zip(axes[0], items):
        what, achieved, peak, unit = item[:4]
        reason = (item[4] if len(item) > 4 else None) or invalid_reason(achieved, peak)
        labels, values, colors = ["achieved"], [achieved if math.isfinite(achieved) else 0.0], ["tab:blue"]
        if peak:
            labels.append("peak")
            values.append(peak)
            colors.append("lightgray")
        bars = ax.bar(labels, values, color=colors)
        if reason:
            bars[0].set_facecolor("none")
            bars[0].set_edgecolor("tab:red")
            bars[0].set_hatch("//")
            ax.set_xlabel(f"unreliable: {reason}", fontsize=8, color="tab:red", wrap=True)
        share = f" = {achieved / peak:.0%} of peak" if peak and math.isfinite(achieved) else (
            "" if peak else " (no published peak)")
        ax.set_title(f"{what}: {_fmt(achieved) if math.isfinite(achieved) else achieved} {unit}{share}", fontsize=10)
        ax.set_ylabel(unit)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _reasons(why) -> list[str]:
    """A point's doubt as a list of reasons: None or [] (none), one reason, or a list of them."""
    return [why] if isinstance(why, str) else list(why or [])


def _hollow(ax, bad, color):
    if bad:
        ax.plot([x for x, _, _ in bad], [y for _, y, _ in bad], ls="none", marker="o", markersize=9,
                markerfacecolor="white", markeredgecolor=color, zorder=3)


def line_with_doubts(ax, xs, ys, doubts, *, label: str, x_name: str = "x", **style):
    """One line of a sweep: points with no doubt filled, those that failed their validity test (``doubts``: the
    reasons per point, a list or one string, empty or None for none) hollow, so noise is never drawn as data.
    Returns the doubted points' reasons."""
    line, = ax.plot(xs, ys, marker="o", label=label, **style)
    bad = [(x, y, _reasons(why)) for x, y, why in zip(xs, ys, doubts) if _reasons(why)]
    _hollow(ax, bad, line.get_color())
    return [f"{label} at {x_name} {x:,}: {'; '.join(why)}" for x, _, why in bad]


def points_with_doubts(ax, xs, ys, doubts, *, label: str, names=None, **style):
    """Separate measured points (a scatter, a roofline's dots), drawn as `line_with_doubts` draws a line's: the
    doubted ones hollow. `names` (one per point) say which point a returned reason is about."""
    names = list(names) if names is not None else [f"{x:,.4g}" for x in xs]
    points = ax.plot(xs, ys, ls="none", marker="o", label=label, zorder=3, **style)[0]
    bad = [(x, y, (name, _reasons(why))) for x, y, why, name in zip(xs, ys, doubts, names) if _reasons(why)]
    _hollow(ax, bad, points.get_color())
    return [f"{label}, {name}: {'; '.join(why)}" for _, _, (name, why) in bad]


def lane_map(threads: int = 256, widths=(32, 64)):
    """How a block of `threads` threads splits into wavefronts/warps of each width: one row per width,
    threads coloured by their wave, lane 0 of each wave marked."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(widths), 1, figsize=(10, 1.1 * len(widths) + 0.6), squeeze=False)
    for ax, width in zip(axes[:, 0], widths):
        wave = np.arange(threads) // width
        ax.imshow(wave[None, :], aspect="auto", cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
        for w in range(threads // width):
            ax.text(w * width + width / 2 - 0.5, 0, f"wave {w}: lanes 0..{width - 1}", ha="center", va="center",
                    fontsize=8, color="white")
        ax.set_yticks([])
        ax.set_ylabel(f"{width} lanes", rotation=0, ha="right", va="center")
        ax.set_xticks(range(0, threads + 1, 32))
    axes[-1, 0].set_xlabel("threadIdx.x")
    fig.suptitle(f"a block of {threads} threads", fontsize=10)
    fig.tight_layout()
    return fig
