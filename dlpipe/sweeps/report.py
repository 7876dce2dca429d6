"""A sweep's jobs side by side as a markdown table (sweeps.jobs names the jobs; sweeps.chart draws them).

A row is a job, numbered as Hydra numbers it (`#0`); a cell is the job's last logged value of a
metric (MLflow keeps the latest step, here the last epoch). Columns: samples/s, the objective and
the monitored metric, every other validation metric the jobs logged, then the loader's and the
machine's figures (memory labelled as the peak where the metric is one). The table stays whole
whatever a name holds: MLflow's UI and markdown viewers split a row at every `|`, so names are
escaped; jobs that failed before they had a run are rows of "-" cells, and notes under the table say
which jobs won beyond the sweep's noise and which ran the same settings. No Hydra or MLflow imports here.
"""

import re

from dlpipe.sweeps.jobs import Job, numbers, same_settings_notes
from dlpipe.sweeps.objective import Objective

# (column title, metric, how a cell shows its value) for the sweep table; the objective, the monitored
# metric and every other validation metric come between the first and the rest (sweep_columns)
COLUMNS = [
    ("samples/s", "samples_per_s", "number"),
    ("data wait", "data_wait_frac", "percent"),  # a percentage, as every human-facing dlpipe text says it
    ("epoch s", "epoch_time_s", "number"),
    ("cpu %", "cpu_util", "number"),
    ("gpu %", "gpu_util", "number"),
    ("main peak RSS MB", "rss_peak_mb", "number"),
    ("first batch s", "first_batch_s", "number"),  # dlpipe bench sweeps
    ("cpu/worker %", "cpu_per_worker_pct", "number"),
    ("mean worker RSS MB", "worker_rss_mean_mb", "number"),
    ("tree peak RSS MB", "tree_rss_peak_mb", "number"),
]


def _cell(v: float | None, kind: str = "number") -> str:
    if v is None:
        return "-"
    if kind == "percent":
        return f"{v * 100:.1f}%"
    return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"


def sweep_columns(jobs: list[Job], objective: Objective | None = None, monitored: list[str] = ()) -> list[tuple]:
    """The columns some job has a value for: samples/s, then the objective, the monitored metrics and
    every other validation metric (a user's `metrics.<name>` is `val_<name>`), then the rest."""
    logged = {k for j in jobs for k in j.metrics}
    fixed = {metric for _, metric, _ in COLUMNS}
    first = [objective.metric] if objective else []
    middle = [m for m in dict.fromkeys([*first, *monitored, "val_loss", *sorted(logged)])
              if m in logged and m not in fixed and (m.startswith("val_") or m in first or m in monitored)]
    roles = {m: [r for r, named in (("objective", first), ("monitored", monitored)) if m in named] for m in middle}
    shown = [(f"{m} ({', '.join(r)})" if r else m, m, "number") for m, r in roles.items()]
    columns = [*(c for c in COLUMNS[:1] if c[1] in logged), *shown, *(c for c in COLUMNS[1:] if c[1] in logged)]
    return columns or COLUMNS[:1]


def markdown_name(name: str) -> str:
    """The name as one table cell: in a code span, so `*`, `_`, `<` or `[` stay text, fenced with
    more backticks than it holds, and with `|` escaped (tables split cells before reading spans)."""
    fence = "`" * (max(map(len, re.findall("`+", name)), default=0) + 1)
    pad = " " if name.startswith("`") or name.endswith("`") else ""
    return f"{fence}{pad}{name}{pad}{fence}".replace("|", "\\|")


def sweep_table(jobs: list[Job], objective: Objective | None = None, monitored: list[str] = (),
                verdicts: list[str] = ()) -> str:
    """A markdown table of the jobs (Hydra's `#N`, name, status, last epoch's metrics) and its notes,
    `verdicts` (the sweep's best and fastest, sweeps.verdict) first among them.

    Columns are padded to one width so the printed table lines up as well."""
    # only what some job measured: a bench sweep has no loss, a training sweep no first-batch time
    columns = sweep_columns(jobs, objective, monitored)
    rows = [["#", "job", "status", *(t for t, _, _ in columns)]]
    for j in jobs:
        cells = (_cell(j.metrics.get(k), kind) for _, k, kind in columns)
        rows.append([f"#{j.number}", markdown_name(j.name), j.status, *cells])
    widths = [max(3, *(len(row[i]) for row in rows)) for i in range(len(rows[0]))]  # a rule needs 3 dashes
    rows.insert(1, ["-" * w for w in widths])
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    notes = [f"- {v}." for v in verdicts] + table_notes(jobs)
    return "\n".join(lines + ([""] + notes if notes else []))


def table_notes(jobs: list[Job]) -> list[str]:
    """What the table's cells cannot say: same settings, values dlpipe changed, jobs without a run."""
    notes = [f"- {note}." for note in same_settings_notes(jobs)]
    if any(j.ran_other for j in jobs):
        notes.append("- `(ran X)`: the job ran X, not the value asked for (its param `requested.<key>` holds that).")
    no_run = [j for j in jobs if j.run_id is None]
    if no_run:
        who = "job {} failed before it" if len(no_run) == 1 else "jobs {} failed before they"
        notes.append(f"- {who.format(numbers(no_run))} had a run: no numbers; the error is in the sweep's output.")
    return notes

