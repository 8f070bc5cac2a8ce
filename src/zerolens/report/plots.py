"""PNG plots of a verify summary and of a sweep (matplotlib, headless). Pure functions of the JSON.

Plotting never decides a verdict: if matplotlib is missing, the caller says so in one line and
the run goes on.
"""
from __future__ import annotations

from pathlib import Path

from zerolens.units import MiB

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


# What is alive at a peak, grouped as the peak replay names it (peaks.py), the reduce bucket among the
# backend transients.
PEAK_GROUPS = (("param", "parameters"), ("grad", "gradients"), ("optimizer_state", "optimizer states"),
               ("comm_buffer", "comm buffers"), ("activation", "activations saved"),
               ("backend_transient", "backend temporaries (reduce buckets, gathers)"),
               (("optimizer_transient", "autograd_transient", "forward_transient"), "other temporaries"),
               (("workspace_and_earlier", "unattributed", "allocator_slack"), "workspaces, rounding, unnamed"))


def peak_components(rank: dict) -> tuple[str, dict] | None:
    """The phase of the rank's highest peak on the last step and bytes per PEAK_GROUPS label (CUDA)."""
    anatomy = rank.get("peak_anatomy")
    if not anatomy:
        return None
    phase, top = max(anatomy.items(), key=lambda kv: kv[1]["allocator_peak"])
    parts = top["components"]
    return phase, {label: sum(parts.get(k, 0) for k in ((keys,) if isinstance(keys, str) else keys))
                   for keys, label in PEAK_GROUPS}


def memory_plot(summary: dict, path: Path, buckets: dict[str, int] | None = None) -> Path:
    """Left: per strategy and rank, what is held after backward by component (the moment the
    gradients are all there: after the step DeepSpeed frees its own). Middle, on a scale of its own
    (a peak can be many times what is held): what is alive at the rank's highest peak, on CUDA by
    component from the peak replay, on the CPU the tensor tracker's total with the reduce bucket
    (`buckets`: its bytes per strategy, allocated on every backward) drawn in it where the peak is
    backward's. Right: the gradients each rank holds after backward as a share of the baseline's,
    against 1/N."""
    plt = _pyplot()
    n = summary["world_size"]
    bars = [(name, r) for name, s in summary["strategies"].items() for r in s["ranks"]]
    base = summary["strategies"][summary["baseline"]]["ranks"]
    fig, (kept_ax, peak_ax, share_ax) = plt.subplots(1, 3, figsize=(max(10, 1.6 * len(bars) + 5), 4.8),
                                                     gridspec_kw={"width_ratios": [2, 2, 1.4]})
    colors = plt.get_cmap("tab10").colors
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for i, (key, label) in enumerate(COMPONENTS[:4]):
        heights = [r[key] / MiB for _, r in bars]
        kept_ax.bar(x, heights, 0.7, bottom=bottom, color=colors[i], label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    labels = [f"{name}\nr{r['rank']}" for name, r in bars]
    kept_ax.set_xticks(x, labels, fontsize=7)
    kept_ax.set_ylabel("MiB per rank")
    kept_ax.set_title(f"Held after backward ({n} ranks, {summary['precision']})", fontsize=10)
    kept_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    anatomies = [peak_components(r) for _, r in bars]
    if any(anatomies):
        bottom = [0.0] * len(bars)
        for i, (_, label) in enumerate(PEAK_GROUPS):
            heights = [a[1][label] / MiB if a else 0 for a in anatomies]
            peak_ax.bar(x, heights, 0.7, bottom=bottom, color=colors[i % 10], hatch="//", edgecolor="white",
                        label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        phases = [a[0] if a else "-" for a in anatomies]
    else:
        phases = [max(("forward", "backward", "step"), key=lambda p: r.get(f"peak_during_{p}") or 0) for _, r in bars]
        peaks = [(r["peak_bytes"] or 0) / MiB for _, r in bars]
        bucket = [((buckets or {}).get(name, 0) if phase == "backward" else 0) / MiB
                  for (name, _), phase in zip(bars, phases)]
        peak_ax.bar(x, [p - b for p, b in zip(peaks, bucket)], 0.7, color="0.6",
                    label="everything else (tensor tracker's total)")
        if any(bucket):
            peak_ax.bar(x, bucket, 0.7, bottom=[p - b for p, b in zip(peaks, bucket)], color=colors[5], hatch="//",
                        edgecolor="white", label="of which the reduce bucket (every backward)")
    peak_ax.set_xticks(x, [f"{label}\n{phase}" for label, phase in zip(labels, phases)], fontsize=7)
    peak_ax.set_ylabel("MiB per rank")
    peak_ax.set_title("Alive at the highest peak (its phase below)", fontsize=10)
    peak_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    shares = [r["grad_bytes_after_backward"] / base[r["rank"]]["grad_bytes_after_backward"] for _, r in bars]
    share_ax.bar(x, shares, color=colors[1])
    share_ax.axhline(1 / n, color="black", linestyle="--", linewidth=1, label=f"1/N = {1 / n:.3f}")
    share_ax.set_xticks(x, labels, fontsize=7)
    share_ax.set_ylabel(f"gradient bytes / {summary['baseline']}'s")
    share_ax.set_title("Gradients held after backward", fontsize=10)
    share_ax.legend(fontsize=7)
    return _save(fig, path)


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*")


def loss_plot(strategy_losses: dict[str, list[float]], path: Path, title: str) -> Path:
    """Each strategy's loss per step, every curve with a line style and markers of its own, so that one
    drawn over another still shows; a curve equal to an earlier one step for step says so in the legend."""
    from matplotlib.ticker import MaxNLocator
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn: dict[str, list[float]] = {}
    for i, (name, losses) in enumerate(strategy_losses.items()):
        same = next((other for other, seen in drawn.items() if seen == list(losses)), None)
        ax.plot(range(len(losses)), losses, label=name + (f" (identical to {same})" if same else ""), linewidth=1.2,
                linestyle=LINE_STYLES[i % len(LINE_STYLES)], marker=MARKERS[i % len(MARKERS)],
                markevery=max(1, len(losses) // 8), markersize=4, markerfacecolor="none")
        drawn[name] = list(losses)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def verify_plots(summary: dict, out: Path, buckets: dict[str, int] | None = None) -> list[Path]:
    """memory.png and loss.png; `buckets`: each strategy's reduce bucket allocated on every backward, bytes."""
    return [memory_plot(summary, out / "memory.png", buckets),
            loss_plot({n: s["losses"] for n, s in summary["strategies"].items()}, out / "loss.png",
                      f"Loss per step, {summary['world_size']} ranks, {summary['precision']}")]


def sweep_plots(points: list[dict], out: Path) -> list[Path]:
    """Gradient bytes per rank against N beside each strategy's unsharded/N line; peak against N;
    losses at every N; peak against the reduce bucket size and against the model's size where the
    sweep varies them; stacked components and step time of every point."""
    plt = _pyplot()
    from zerolens.strategies import registry
    paths = []
    strategies = list(points[0]["strategies"])
    buckets = sorted({p["reduce_bucket_size"] for p in points})
    presets = list(dict.fromkeys(p["preset"] for p in points))
    # The plots over N follow the first point's model and bucket size (a pair that has points even
    # when some of the sweep's points failed).
    by_n = sorted((p for p in points if p["reduce_bucket_size"] == points[0]["reduce_bucket_size"]
                   and p["preset"] == points[0]["preset"]), key=lambda p: p["world_size"])
    ns = [p["world_size"] for p in by_n]
    for key, ylabel, name in (("grad_bytes_after_backward", "gradient MiB per rank (largest rank)", "grad_vs_n.png"),
                              ("peak_bytes", "peak MiB per rank (largest rank)", "peak_vs_n.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in strategies:
            line, = ax.plot(ns, [_mib_or_nan(p["strategies"][s][key]) for p in by_n], marker="o", label=s)
            if key == "grad_bytes_after_backward":  # what an exact 1/N (or whole) split would hold
                ax.plot(ns, [p["strategies"][s]["unsharded_grad_bytes"] * registry.spec(s).gradient_share(p["world_size"]) / MiB
                             for p in by_n], linestyle="--", color=line.get_color(), linewidth=0.9)
        ax.set_xlabel("ranks N")
        ax.set_xticks(ns)
        ax.set_ylabel(ylabel)
        ax.set_title(by_n[0]["preset"] + (" (dashed: unsharded x 1/N, or whole)" if key == "grad_bytes_after_backward" else ""))
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / name))
    paths.append(loss_vs_n_plot(by_n, out / "loss_vs_n.png"))
    n0 = ns[0]
    for varied, key, xlabel, name in ((buckets, "reduce_bucket_size", "reduce_bucket_size (elements)", "peak_vs_bucket.png"),
                                      (presets, "params", "parameters", "peak_vs_model_size.png")):
        if len(varied) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in strategies:
            rows = sorted((p[key], p["strategies"][s]["peak_bytes"]) for p in points
                          if p["world_size"] == n0 and p["strategies"][s]["peak_bytes"] is not None
                          and (key == "params" or p["preset"] == by_n[0]["preset"])
                          and (key == "reduce_bucket_size" or p["reduce_bucket_size"] == by_n[0]["reduce_bucket_size"]))
            ax.plot([x for x, _ in rows], [v / MiB for _, v in rows], marker="o", label=s)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"peak MiB per rank, N={n0}")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / name))
    paths.append(components_plot(points, out / "components.png"))
    paths.append(step_time_plot(points, out / "step_time.png"))
    paths.append(loss_plot({s: points[0]["strategies"][s]["losses"] for s in strategies}, out / "loss.png",
                           f"Loss per step, {points[0]['preset']}, N={points[0]['world_size']}"))
    return paths


def loss_vs_n_plot(by_n: list[dict], path: Path) -> Path:
    """One panel per strategy: its loss per step at every N (same model and bucket)."""
    plt = _pyplot()
    strategies = list(by_n[0]["strategies"])
    fig, axes = plt.subplots(1, len(strategies), figsize=(3.6 * len(strategies) + 1, 3.8), squeeze=False, sharey=True)
    for ax, s in zip(axes[0], strategies):
        for p in by_n:
            losses = p["strategies"][s]["losses"]
            ax.plot(range(len(losses)), losses, linewidth=1.0, label=f"N={p['world_size']}, batch {p['global_batch']}")
        ax.set_title(s)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel(f"loss (global batch), {by_n[0]['preset']}")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path)


def _mib_or_nan(value: int | None) -> float:
    return value / MiB if value is not None else float("nan")


def _point_label(p: dict) -> str:
    return f"{p['preset']}\nN={p['world_size']}, bucket {p['reduce_bucket_size']:.0e}"


def components_plot(points: list[dict], path: Path) -> Path:
    """One panel per strategy: per-component memory of the largest rank at every sweep point, stacked."""
    plt = _pyplot()
    strategies = list(points[0]["strategies"])
    fig, axes = plt.subplots(1, len(strategies), figsize=(max(7, 1.2 * len(points) * len(strategies) + 2), 4.5),
                             squeeze=False, sharey=True)
    for ax, s in zip(axes[0], strategies):
        x = range(len(points))
        bottom = [0.0] * len(points)
        for key, label in COMPONENTS:
            heights = [p["strategies"][s][key] / MiB for p in points]
            ax.bar(x, heights, bottom=bottom, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(list(x), [_point_label(p) for p in points], fontsize=7)
        ax.set_title(s)
    axes[0][0].set_ylabel("MiB per rank (largest rank)")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path)


def step_time_plot(points: list[dict], path: Path) -> Path:
    """Median step time of each strategy at every sweep point, grouped bars."""
    plt = _pyplot()
    strategies = list(points[0]["strategies"])
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(points) * len(strategies) + 2), 4.5))
    width = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        times = [p["strategies"][s]["step_time_s"] for p in points]
        ax.bar([j + i * width for j in range(len(points))], [t * 1e3 if t is not None else 0 for t in times],
               width=width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))], [_point_label(p) for p in points], fontsize=7)
    ax.set_ylabel("median step time (ms), slowest rank")
    ax.set_title("Step time (verify's measured steps; zerolens bench for throughput)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def bench_plot(summary: dict, path: Path) -> Path:
    """Step time of each strategy, and on CUDA its peak memory per rank beside it (on CPU bench has no
    allocator to read, so no panel)."""
    plt = _pyplot()
    names = list(summary["strategies"])
    peaks = [summary["strategies"][n]["peak_bytes"] for n in names]
    with_memory = summary["device"] == "cuda"
    fig, axes = plt.subplots(1, 2 if with_memory else 1, figsize=((max(8, 1.6 * len(names) + 4)) if with_memory
                                                                 else max(5, 1.2 * len(names) + 2), 4))
    time_ax = axes[0] if with_memory else axes
    time_ax.bar(names, [summary["strategies"][n]["step_time_s"] * 1e3 for n in names])
    time_ax.set_ylabel("median step time (ms)")
    time_ax.set_title(f"Step time, {summary['preset']}, {summary['world_size']} ranks")
    if with_memory:
        memory_ax = axes[1]
        if None not in peaks:
            memory_ax.bar(names, [p / 2**30 for p in peaks], color="tab:orange")
            memory_ax.set_ylabel("peak allocated per rank (GiB, largest rank)")
            memory_ax.set_title("Peak memory")
        else:
            memory_ax.set_axis_off()
            memory_ax.text(0.5, 0.5, "peaks not reported: earlier strategies' memory\nwas still allocated "
                           "(see bench.md)", ha="center", va="center")
    return _save(fig, path)
