"""Plots shared by the labs."""
from __future__ import annotations


def _fmt(v: float) -> str:
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def achieved_vs_peak(items, title: str = ""):
    """One bar pair per item: `items` is a list of (what, achieved, peak or None, unit).
    Returns the matplotlib figure (the notebook shows it; `report.Recorder.figure` saves it)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(items), figsize=(4.5 * len(items), 3.2), squeeze=False)
    for ax, (what, achieved, peak, unit) in zip(axes[0], items):
        labels, values, colors = ["achieved"], [achieved], ["tab:blue"]
        if peak:
            labels.append("peak")
            values.append(peak)
            colors.append("lightgray")
        ax.bar(labels, values, color=colors)
        share = f" = {achieved / peak:.0%} of peak" if peak else " (no published peak)"
        ax.set_title(f"{what}: {_fmt(achieved)} {unit}{share}", fontsize=10)
        ax.set_ylabel(unit)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
