"""A sweep's jobs side by side: a markdown table and a PNG bar chart, from MLflow `Run` objects.

Both show each child run's last logged value of a metric (MLflow keeps the latest step, here the
last epoch) and name a job by the overrides that differ between jobs. The best job is the
FINISHED run with the highest samples/s: a failed or killed job's numbers cover a partial run.
No Hydra here, and matplotlib is imported only when a plot is drawn.
"""

import textwrap
from pathlib import Path

# (column title, metric) for the sweep table; samples/s decides the best job
COLUMNS = [
    ("samples/s", "samples_per_s"),
    ("data wait", "data_wait_frac"),
    ("epoch s", "epoch_time_s"),
    ("val loss", "val_loss"),
    ("val acc", "val_accuracy"),
    ("cpu %", "cpu_util"),
    ("gpu %", "gpu_util"),
    ("rss MB", "rss_peak_mb"),
    ("first batch s", "first_batch_s"),  # dlpipe bench sweeps
    ("cpu/worker %", "cpu_per_worker_pct"),
    ("worker MB", "worker_rss_mean_mb"),
    ("tree peak MB", "tree_rss_peak_mb"),
]

# (panel title, metric, factor applied for display) for the plot. A panel is drawn only when some
# job logged its metric: gpu_util exists only where NVML measured it, and a missing GPU must not
# look like an idle one.
PANELS = [
    ("samples/s (higher is better)", "samples_per_s", 1.0),
    ("data wait, % of epoch (lower is better)", "data_wait_frac", 100.0),
    ("GPU utilisation % (higher is better)", "gpu_util", 1.0),
    ("peak RSS MB (lower is better)", "rss_peak_mb", 1.0),
]

BEST_COLOR = "#2ca02c"
OTHER_COLOR = "#8c9fb5"
UNFINISHED_COLOR = "#d9d9d9"


def ordered(children) -> list:
    """The jobs in the order they started, which is the sweep's order for the basic launcher."""
    return sorted(children, key=lambda r: r.info.start_time)


def job_names(children) -> dict[str, str]:
    """run_id -> the overrides that set this job apart; overrides shared by every job are noise."""
    runs = ordered(children)
    overrides = [r.data.tags.get("dlpipe.overrides", "").split() for r in runs]
    common = set.intersection(*map(set, overrides)) if overrides else set()
    return {
        r.info.run_id: " ".join(o for o in own if o not in common) or r.info.run_name or r.info.run_id
        for r, own in zip(runs, overrides)
    }


def best_run(children):
    """The FINISHED run with the highest samples/s, or None."""
    finished = [r for r in ordered(children) if r.info.status == "FINISHED" and "samples_per_s" in r.data.metrics]
    return max(finished, key=lambda r: r.data.metrics["samples_per_s"], default=None)


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def sweep_table(children) -> tuple[str, object | None, str]:
    """A markdown table of child runs (overrides vs their last epoch's metrics), the fastest run and its name."""
    names = job_names(children)
    # only what some job measured: a bench sweep has no loss, a training sweep no first-batch time
    columns = [(t, key) for t, key in COLUMNS if any(key in r.data.metrics for r in children)] or COLUMNS[:1]
    lines = ["| job | status | " + " | ".join(t for t, _ in columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for r in ordered(children):
        cells = " | ".join(_cell(r.data.metrics.get(key)) for _, key in columns)
        lines.append(f"| {names[r.info.run_id]} | {r.info.status} | {cells} |")
    best = best_run(children)
    return "\n".join(lines), best, names[best.info.run_id] if best else ""


def plot_panels(children) -> list[tuple[str, str, float]]:
    """The PANELS some child has a metric for, in PANELS order."""
    return [p for p in PANELS if any(p[1] in r.data.metrics for r in children)]


def sweep_plot(children, names: dict[str, str], path: Path) -> Path | None:
    """Draw one horizontal bar panel per metric, one bar per job, the best job highlighted; save a PNG.

    Returns the path written, or None when no child has a metric to plot. The panels' metric keys
    are also written into the PNG's Description text chunk (for tools and tests reading it back).
    """
    runs = [r for r in ordered(children) if r.data.metrics]
    panels = plot_panels(runs)
    if not panels:
        return None
    # The Figure API draws without pyplot, so no global backend is chosen or changed: this also
    # runs inside a training process that has its own matplotlib state, and on headless machines.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    best = best_run(runs)
    best_id = best.info.run_id if best else None
    labels = []
    for r in runs:
        label = "\n".join(textwrap.wrap(names.get(r.info.run_id) or r.info.run_name or r.info.run_id, 34))
        if r.info.status != "FINISHED":
            label += f"\n({r.info.status})"
        labels.append(label)
    colors = [
        BEST_COLOR if r.info.run_id == best_id else OTHER_COLOR if r.info.status == "FINISHED" else UNFINISHED_COLOR
        for r in runs
    ]
    lines_per_job = max(label.count("\n") + 1 for label in labels)
    height = 1.7 + len(runs) * (0.3 + 0.2 * lines_per_job)
    fig = Figure(figsize=(2.2 + 3.3 * len(panels), height), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    ys = list(range(len(runs)))
    for ax, (title, key, factor) in zip(axes, panels):
        values = [r.data.metrics.get(key) for r in runs]
        shown = [0.0 if v is None else v * factor for v in values]
        bars = ax.barh(ys, shown, color=colors, edgecolor=["black" if c == BEST_COLOR else "none" for c in colors])
        top = max(shown) or 1.0
        ax.set_xlim(0, top * 1.3)  # room for the value labels
        for bar, v, s in zip(bars, values, shown):
            text = "n/a" if v is None else f"{s:.1f}" if abs(s) >= 10 else f"{s:.3g}"
            ax.text(s + top * 0.02, bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_yticks(ys, labels, fontsize=8)
    axes[0].invert_yaxis()  # first job on top, as in the table (shared y: inverts every panel)
    if best is not None:
        axes[0].get_yticklabels()[ys[runs.index(best)]].set_fontweight("bold")
    headline = f"sweep: {len(runs)} jobs, last epoch of each"
    if best is not None:
        name = names.get(best_id) or best.info.run_name
        headline += f"; best: {name} ({best.data.metrics['samples_per_s']:.1f} samples/s)"
    fig.suptitle("\n".join(textwrap.wrap(headline, 40 + 30 * len(panels))), fontsize=10)
    legend = [Patch(facecolor=BEST_COLOR, edgecolor="black", label="best: highest samples/s among FINISHED"),
              Patch(facecolor=OTHER_COLOR, label="FINISHED"),
              Patch(facecolor=UNFINISHED_COLOR, label="FAILED or KILLED (partial run)")]
    fig.legend(handles=legend, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    path = Path(path)
    latin1 = headline.encode("latin-1", "replace").decode("latin-1")  # PNG text chunks are Latin-1
    fig.savefig(path, format="png", dpi=110, metadata={
        "Title": latin1,
        "Description": "panels: " + ", ".join(key for _, key, _ in panels),
    })
    return path
