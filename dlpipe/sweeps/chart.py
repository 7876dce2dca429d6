"""A sweep's jobs as bar charts, one panel per metric, each marking its own best job.

The samples/s and epoch time panels mark the fastest job and the objective's panel the best one
only where the sweep's verdict names them beyond its noise (sweeps.verdict): otherwise no bar is
green there, and the title says which jobs are indistinguishable. Each other panel's best is judged
by that panel's direction (less data wait is better), among FINISHED jobs only (a failed or killed
job's numbers cover a partial run), and marked only beyond the sweep's noise of that metric, as
the objective is (sweeps.noise.panel_ranking): values equal as shown, or a lead smaller than a
job's last epoch-to-epoch change, mark none, and no lead over a contended job's data wait or GPU use
is a finding. CPU use is
shown but never ranked: a share of the CPU budget is neither good nor bad by itself (more CPU
buying more samples/s is cores put to work, less CPU at fewer samples/s is cores left idle); the
samples/s panel says which setting won.
"""

import textwrap
from pathlib import Path
from typing import NamedTuple

from dlpipe.sweeps.jobs import Job, same_settings_notes
from dlpipe.sweeps.noise import panel_ranking
from dlpipe.sweeps.verdict import SweepVerdict, judge

# Imported inside functions: matplotlib (over half a second), only when a sweep's chart is drawn at its
# end; sweeps.callback imports this module, and Hydra loads that callback for every job, `dlpipe plan` too.


class Panel(NamedTuple):
    title: str
    metric: str
    factor: float
    """Applied for display (a fraction shown in percent)."""
    better: int
    """+1: higher is better, -1: lower is better, 0: not ranked."""


# A panel is drawn only when some job logged its metric: gpu_util exists only where NVML measured
# it, and a missing GPU must not look like an idle one.
PANELS = [
    Panel("samples/s (higher is better)", "samples_per_s", 1.0, +1),
    Panel("data wait, % of epoch (lower is better)", "data_wait_frac", 100.0, -1),
    Panel("epoch time s (lower is better)", "epoch_time_s", 1.0, -1),
    Panel("CPU, % of budget (not ranked)", "cpu_util", 1.0, 0),
    Panel("GPU utilisation % (higher is better)", "gpu_util", 1.0, +1),
    # the process tree: workers hold most of a loader setting's memory, the main process little of it
    Panel("peak RSS MB, process + workers (lower is better)", "tree_rss_peak_mb", 1.0, -1),
]
TIMED = {"data_wait_frac", "gpu_util"}
"""Shares of an epoch's time: a contended job's are no finding (sweeps.noise.panel_ranking)."""
FOLLOWS = {"epoch_time_s": "samples_per_s"}
"""Panels whose winner is another's: epoch time is samples/s seen from the other side."""

BEST_COLOR = "#2ca02c"
OTHER_COLOR = "#8c9fb5"
UNFINISHED_COLOR = "#d9d9d9"


def shown(value: float, percent: bool = False) -> str:
    """A bar's value as printed beside it; a percentage as dlpipe prints data wait everywhere (4.0%)."""
    if percent:
        return f"{value:.1f}%"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def plot_panels(jobs: list[Job], verdict: SweepVerdict | None = None, monitored: list[str] = ()) -> list[Panel]:
    """The panels some job has a metric for: samples/s, the objective, the other monitored metrics
    (not ranked: their direction may be unknown), then the rest of PANELS in order."""
    extra = []
    if verdict is not None and verdict.objective is not None:
        o = verdict.objective
        extra.append(Panel(f"{o.metric}, objective ({'higher' if o.higher else 'lower'} is better)", o.metric, 1.0,
                           +1 if o.higher else -1))
    extra += [Panel(f"{m}, monitored (not ranked)", m, 1.0, 0) for m in monitored
              if m not in {p.metric for p in extra} | {p.metric for p in PANELS}]
    return [p for p in [PANELS[0], *extra, *PANELS[1:]] if any(p.metric in j.metrics for j in jobs)]


def panel_best(jobs: list[Job], panel: Panel, verdict: SweepVerdict | None = None) -> list[Job]:
    """The jobs the panel marks: the verdict's winner where it ranks the panel's metric, else the
    FINISHED job best by the panel's own direction where it leads beyond the sweep's noise of that
    metric (sweeps.noise.panel_ranking) and as shown; none where no job does, or only one job has the
    metric."""
    marked = verdict.marked(FOLLOWS.get(panel.metric, panel.metric)) if verdict is not None else None
    if marked is not None:
        return marked if panel.better else []
    if not panel.better:
        return []
    ranking = panel_ranking(jobs, panel.metric, panel.better > 0, timed=panel.metric in TIMED)
    if ranking is None or len(ranking.ranked) < 2 or ranking.winner is None:
        return []
    top, second = (shown(j.metrics[panel.metric] * panel.factor, panel.factor == 100.0) for j in ranking.ranked[:2])
    return [] if top == second else [ranking.winner]  # a lead the bars cannot show is none


def describe(panels: list[Panel], bests: list[list[Job]], jobs: list[Job], verdict: SweepVerdict) -> str:
    """What the chart shows, for the PNG's Description chunk: tools and tests read it back."""
    lines = ["panels: " + ", ".join(p.metric for p in panels)]
    for panel, best in zip(panels, bests):
        marked = " ".join(str(j.number) for j in best) or ("none" if panel.better else "not ranked")
        lines.append(f"best {panel.metric}: {marked}")
    lines += [f"verdict: {sentence}" for sentence in verdict.sentences()]
    lines += [f"same settings: {note}" for note in same_settings_notes(jobs)]
    return "\n".join(lines)


def headline(jobs: list[Job], verdict: SweepVerdict) -> str:
    """The chart's title: how many jobs, the best and the fastest (or which are indistinguishable),
    and which jobs ran the same settings."""
    text = f"sweep: {len(jobs)} jobs, last epoch of each; {verdict.headline()}"
    return "; ".join([text, *same_settings_notes(jobs)])


def label(job: Job) -> str:
    text = "\n".join(textwrap.wrap(f"#{job.number} {job.name}", 34))
    return text if job.finished else f"{text}\n({job.status})"


def sweep_plot(jobs: list[Job], path: Path, verdict: SweepVerdict | None = None,
               monitored: list[str] = ()) -> Path | None:
    """Draw one horizontal bar panel per metric, one bar per job with numbers, each panel's best
    marked (the verdict's winners only beyond noise: by default, the fastest judged on `jobs`
    alone); save a PNG. Returns the path written, or None when no job has a metric to plot."""
    jobs = [j for j in jobs if j.metrics]
    verdict = verdict or judge(jobs, None)
    panels = plot_panels(jobs, verdict, monitored)
    if not panels:
        return None
    # The Figure API draws without pyplot, so no global backend is chosen or changed: this also
    # runs inside a training process that has its own matplotlib state, and on headless machines.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    labels = [label(j) for j in jobs]
    lines_per_job = max(text.count("\n") + 1 for text in labels)
    height = 1.9 + len(jobs) * (0.3 + 0.2 * lines_per_job)
    fig = Figure(figsize=(2.2 + 3.3 * len(panels), height), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    bests = [panel_best(jobs, panel, verdict) for panel in panels]
    for ax, panel, best in zip(axes, panels, bests):
        draw_panel(ax, jobs, panel, best)
    axes[0].set_yticks(range(len(jobs)), labels, fontsize=8)
    axes[0].invert_yaxis()  # first job on top, as in the table (shared y: inverts every panel)
    title = headline(jobs, verdict)
    fig.suptitle("\n".join(textwrap.wrap(title, 40 + 30 * len(panels))), fontsize=10)
    legend = [Patch(facecolor=BEST_COLOR, edgecolor="black",
                    label="best in its panel, among FINISHED (speed, objective: only beyond the sweep's noise)"),
              Patch(facecolor=OTHER_COLOR, label="FINISHED"),
              Patch(facecolor=UNFINISHED_COLOR, label="FAILED or KILLED (partial run)")]
    fig.legend(handles=legend, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    path = Path(path)
    latin1 = {k: v.encode("latin-1", "replace").decode("latin-1")  # PNG text chunks are Latin-1
              for k, v in {"Title": title, "Description": describe(panels, bests, jobs, verdict)}.items()}
    fig.savefig(path, format="png", dpi=110, metadata=latin1)
    return path


def draw_panel(ax, jobs: list[Job], panel: Panel, best: list[Job]) -> None:
    """One panel: a bar per job (a missing metric reads n/a, never 0), the panel's best outlined."""
    values = [j.metrics.get(panel.metric) for j in jobs]
    bar_values = [0.0 if v is None else v * panel.factor for v in values]
    colors = [BEST_COLOR if j in best else OTHER_COLOR if j.finished else UNFINISHED_COLOR for j in jobs]
    edges = ["black" if j in best else "none" for j in jobs]
    bars = ax.barh(range(len(jobs)), bar_values, color=colors, edgecolor=edges)
    top = max(bar_values) or 1.0
    ax.set_xlim(0, top * 1.3)  # room for the value labels
    for bar, v, x in zip(bars, values, bar_values):
        label = "n/a" if v is None else shown(x, panel.factor == 100.0)
        ax.text(x + top * 0.02, bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    ax.set_title(panel.title, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
