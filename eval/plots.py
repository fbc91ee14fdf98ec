"""PNG plots of a report: the AL histogram, per-position acceptance, and tokens/s and latency against D.

Figures are built with `matplotlib.figure.Figure` (no pyplot), so nothing depends on or changes the
caller's backend or global figure state.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from draftsmith.eval.markdown import draft_label

FILES = {
    "al_histogram": "al_histogram.png",
    "position_acceptance": "position_acceptance.png",
    "speed_vs_draft_len": "speed_vs_draft_len.png",
}


def write_plots(report: dict, out_dir: Path) -> dict[str, Path]:
    paths = {}
    for name, draw in (("al_histogram", al_histogram), ("position_acceptance", position_acceptance),
                       ("speed_vs_draft_len", speed_vs_draft_len)):
        fig = draw(report)
        path = Path(out_dir) / FILES[name]
        fig.savefig(path, dpi=110, bbox_inches="tight")
        paths[name] = path
    return paths


def al_histogram(report: dict) -> Figure:
    """Share of rounds emitting k tokens, k = 1 .. D + 1, one panel per mode, one bar group per D."""
    modes = report["settings"]["modes"]
    fig = Figure(figsize=(5 * len(modes), 3.6))
    for m, mode in enumerate(modes):
        ax = fig.add_subplot(1, len(modes), m + 1)
        rows = [r for r in report["acceptance"] if r["mode"] == mode]
        width = 0.8 / max(len(rows), 1)
        for j, row in enumerate(rows):
            ks = list(range(1, len(row["emitted_share"])))
            ax.bar([k - 0.4 + width * (j + 0.5) for k in ks], row["emitted_share"][1:], width,
                   label=f"D={row['draft_len']} (AL {row['al']:.2f})")
        ax.set_xlabel("tokens emitted per round")
        ax.set_ylabel("share of rounds")
        ax.set_title(f"AL histogram, {mode}")
        ax.legend(fontsize=8)
    return fig


def position_acceptance(report: dict) -> Figure:
    """Conditional acceptance rate per draft position with its CI, one line per (mode, D)."""
    fig = Figure(figsize=(6, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    for row in report["acceptance"]:
        points = [p for p in row["positions"] if p["rate"] is not None]
        if not points:
            continue
        xs = [p["position"] for p in points]
        ys = [p["rate"] for p in points]
        errors = [[y - p["rate_ci"][0] for y, p in zip(ys, points)], [p["rate_ci"][1] - y for y, p in zip(ys, points)]]
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=f"{row['mode']} D={row['draft_len']}")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accept i | accepted < i)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=8)
    return fig


def speed_vs_draft_len(report: dict) -> Figure:
    """Tokens/s (left) and per-token latency p50 / p95 (right) against D; D = 0 is plain decoding. The
    adaptive row (its D the most it drafts) is a dotted level line across the sweep."""
    fig = Figure(figsize=(11, 3.8))
    rate_ax, latency_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    groups: dict = {}
    for row in report["speed"]:
        groups.setdefault((row["mode"], row["batch_size"]), []).append(row)
    for g, ((mode, batch), rows) in enumerate(groups.items()):
        for row in (r for r in rows if r["decoder"] == "adaptive"):
            rate_ax.axhline(row["tokens_per_s"], linestyle=":", color=f"C{g % 10}",
                            label=f"{mode}, B={batch}, {draft_label(row)}")
        rows = sorted((r for r in rows if r["decoder"] != "adaptive"), key=lambda r: r["draft_len"])
        xs = [r["draft_len"] for r in rows]
        label, color = f"{mode}, B={batch}", f"C{g % 10}"
        rate_ax.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", color=color, label=label)
        for q, style in (("p50", "-"), ("p95", "--")):
            values = [_number(r["latency_ms"][q]) for r in rows]
            latency_ax.plot(xs, values, style, marker="o", color=color, label=f"{label} {q}")
    for ax in (rate_ax, latency_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    rate_ax.set_xlabel("draft length D (0 = plain)")
    rate_ax.set_ylabel("tokens/s")
    rate_ax.set_title("Throughput")
    latency_ax.set_xlabel("draft length D (0 = plain)")
    latency_ax.set_ylabel("ms per token")
    latency_ax.set_title("Per-token latency")
    rate_ax.legend(fontsize=8)
    latency_ax.legend(fontsize=7)
    return fig


def _number(value) -> float:
    return float("nan") if value is None else value
