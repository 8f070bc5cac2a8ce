"""PNG plots of a verify summary and of a sweep (matplotlib, headless). Pure functions of the JSON.

Plotting never decides a verdict: if matplotlib is missing, the caller says so in one line and
the run goes on.
"""
from __future__ import annotations

from pathlib import Path

from .report import MiB

COMPONENTS = (("param_bytes", "parameters"), ("grad_bytes_after_backward", "gradients (after backward)"),
              ("optimizer_state_bytes", "optimizer states"),
              ("comm_buffer_bytes_after_backward", "comm buffers (after backward)"),
              ("activation_bytes_after_forward", "activations saved"))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=120, format="png")
    tmp.replace(path)  # never a half-written plot
    return path


def memory_plot(summary: dict, path: Path) -> Path:
    """Stacked per-component memory of every rank under every strategy, with the peak beside it."""
    plt = _pyplot()
    bars = [(f"{name}\nrank {r['rank']}", r) for name, s in summary["strategies"].items() for r in s["ranks"]]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(bars) + 2), 4.5))
    x = range(len(bars))
    bottom = [0.0] * len(bars)
    for key, label in COMPONENTS:
        heights = [r[key] / MiB for _, r in bars]
        ax.bar(x, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    peaks = [r["peak_bytes"] / MiB if r["peak_bytes"] is not None else None for _, r in bars]
    if any(p is not None for p in peaks):
        ax.scatter([i for i, p in zip(x, peaks) if p is not None], [p for p in peaks if p is not None],
                   marker="_", s=400, color="black", label="peak", zorder=3)
    ax.set_xticks(list(x), [b for b, _ in bars], fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Memory per rank by component, {summary['world_size']} ranks, {summary['precision']}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def loss_plot(strategy_losses: dict[str, list[float]], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in strategy_losses.items():
        ax.plot(range(len(losses)), losses, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def verify_plots(summary: dict, out: Path) -> list[Path]:
    return [memory_plot(summary, out / "memory.png"),
            loss_plot({n: s["losses"] for n, s in summary["strategies"].items()}, out / "loss.png",
                      f"Loss per step, {summary['world_size']} ranks, {summary['precision']}")]


def sweep_plots(points: list[dict], out: Path) -> list[Path]:
    """Gradient bytes per rank against N beside the baseline's 1/N curve; peak against N; peak
    against the reduce bucket size where the sweep varies it; losses of the first point."""
    plt = _pyplot()
    paths = []
    strategies = list(points[0]["strategies"])
    baseline = points[0]["baseline"]
    buckets = sorted({p["reduce_bucket_size"] for p in points})
    first_bucket = [p for p in points if p["reduce_bucket_size"] == buckets[0]]
    ns = [p["world_size"] for p in first_bucket]
    for key, ylabel, name in (("grad_bytes_after_backward", "gradient MiB per rank (largest rank)", "grad_vs_n.png"),
                              ("peak_bytes", "peak MiB per rank (largest rank)", "peak_vs_n.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in strategies:
            ax.plot(ns, [p["strategies"][s][key] / MiB if p["strategies"][s][key] is not None else float("nan")
                         for p in first_bucket], marker="o", label=s)
        if key == "grad_bytes_after_backward":
            n0 = first_bucket[0]["world_size"]
            base = first_bucket[0]["strategies"][baseline][key] * n0 / MiB
            ax.plot(ns, [base / n for n in ns], linestyle="--", color="gray",
                    label=f"{baseline} at N={n0}, x {n0}/N" if n0 > 1 else f"{baseline} at N=1, x 1/N")
        ax.set_xlabel("ranks N")
        ax.set_xticks(ns)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / name))
    if len(buckets) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        n0 = ns[0]
        for s in strategies:
            rows = sorted((p["reduce_bucket_size"], p["strategies"][s]["peak_bytes"]) for p in points
                          if p["world_size"] == n0 and p["strategies"][s]["peak_bytes"] is not None)
            ax.plot([b for b, _ in rows], [v / MiB for _, v in rows], marker="o", label=s)
        ax.set_xscale("log")
        ax.set_xlabel("reduce_bucket_size (elements)")
        ax.set_ylabel(f"peak MiB per rank, N={n0}")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / "peak_vs_bucket.png"))
    paths.append(loss_plot({s: points[0]["strategies"][s]["losses"] for s in strategies}, out / "loss.png",
                           f"Loss per step, N={points[0]['world_size']}"))
    return paths
