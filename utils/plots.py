"""Plots and Markdown tables shared by the labs."""
from __future__ import annotations


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table: one row of ``header`` cells, then ``rows`` (cells are formatted with str)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def achieved_vs_peak(items, title: str = ""):
    """One bar pair per item: `items` is a list of (what, achieved, peak or None, unit).
    Returns the matplotlib figure (the notebook shows it; `record.Recorder.figure` saves it)."""
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


def serving_load(closed, opened, *, slo_ttft_s=None, slo_tpot_s=None, ceiling=None, title: str = ""):
    """Lab 05's load tests at a glance, from ``utils.llm.loadgen`` level summaries (closed loop: ``closed``, open
    loop: ``opened``): (1) the knee, time per output token against output tokens/s as load grows; (2) TTFT
    and TPOT percentiles against the offered request rate, with the SLO and the goodput; (3) output tokens/s
    against concurrency under ``ceiling(c)``, the bandwidth ceiling in tokens/s (None: not drawn)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for runs, mode, marker in ((closed, "closed loop", "o"), (opened, "open loop", "s")):
        if not runs:
            continue
        x = [r["output_tokens_per_s"] for r in runs]
        for q, style in (("p50", "-"), ("p90", "--")):
            ax1.plot(x, [1e3 * r["tpot"][q] for r in runs], marker + style, label=f"{mode}, TPOT {q}")
        for r, xi in zip(runs, x):
            load = f"c={r['load']:g}" if r["mode"] == "concurrency" else f"{r['load']:.2g}/s"
            ax1.annotate(load, (xi, 1e3 * r["tpot"]["p50"]), fontsize=7, xytext=(3, -9), textcoords="offset points")
    if slo_tpot_s:
        ax1.axhline(1e3 * slo_tpot_s, color="gray", ls=":", label="TPOT SLO")
    ax1.set_xlabel("output tokens/s (all requests)")
    ax1.set_ylabel("time per output token, ms")
    ax1.set_title("the knee: throughput bought with latency", fontsize=10)
    ax1.legend(fontsize=7)

    if opened:
        rate = [r["load"] for r in opened]
        for what, color in (("ttft", "tab:blue"), ("tpot", "tab:orange")):
            for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                ax2.plot(rate, [1e3 * r[what][q] for r in opened], "o" + style, color=color,
                         label=f"{what.upper()} {q}")
        for slo, color in ((slo_ttft_s, "tab:blue"), (slo_tpot_s, "tab:orange")):
            if slo:
                ax2.axhline(1e3 * slo, color=color, lw=0.8, alpha=0.6)
        ax2.set_yscale("log")
        twin = ax2.twinx()
        twin.plot(rate, [r["requests_per_s"] for r in opened], "k^-", lw=0.8, label="completed req/s")
        twin.plot(rate, [r["goodput_requests_per_s"] for r in opened], "g^-", lw=0.8, label="goodput req/s")
        twin.set_ylabel("requests/s")
        twin.set_ylim(bottom=0)
        twin.legend(fontsize=7, loc="lower right")
        ax2.legend(fontsize=6, loc="upper left", ncol=2)
    ax2.set_xlabel("offered request rate, requests/s (Poisson)")
    ax2.set_ylabel("ms (thin lines: the SLO)")
    ax2.set_title("latency as the request rate grows", fontsize=10)

    if closed:
        c = [r["load"] for r in closed]
        ax3.plot(c, [r["output_tokens_per_s"] for r in closed], "o-", label="measured")
        ax3.plot(c, [closed[0]["output_tokens_per_s"] * x / c[0] for x in c], "k:", lw=0.8,
                 label=f"perfect scaling from c={c[0]:g}")
        if ceiling is not None:
            grid = np.geomspace(min(c), max(c), 50)
            ax3.plot(grid, [ceiling(x) for x in grid], "r-", lw=1, label="bandwidth ceiling")
        ax3.set_xscale("log", base=2)
        ax3.set_yscale("log")
        ax3.legend(fontsize=7)
    ax3.set_xlabel("concurrent requests (closed loop)")
    ax3.set_ylabel("output tokens/s")
    ax3.set_title("saturation against the ceiling", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
