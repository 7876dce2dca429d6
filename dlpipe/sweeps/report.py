"""A sweep's jobs side by side as a markdown table (sweeps.jobs names the jobs; sweeps.chart draws them).

A cell is the job's last logged value of a metric (MLflow keeps the latest step, here the last
epoch). The table stays whole whatever a name holds: MLflow's UI and markdown viewers split a row
at every `|`, so names are escaped; jobs that failed before they had a run are rows of "-" cells,
and notes under the table say which jobs ran the same settings. No Hydra or MLflow imports here.
"""

import re

from dlpipe.sweeps.jobs import Job, numbers, same_settings_notes

# (column title, metric) for the sweep table
COLUMNS = [
    ("samples/s", "samples_per_s"),
    ("data wait", "data_wait_frac"),
    ("epoch s", "epoch_time_s"),
    ("val loss", "val_loss"),
    ("val acc", "val_accuracy"),
    ("cpu %", "cpu_util"),
    ("gpu %", "gpu_util"),
    ("main rss MB", "rss_peak_mb"),
    ("first batch s", "first_batch_s"),  # dlpipe bench sweeps
    ("cpu/worker %", "cpu_per_worker_pct"),
    ("worker MB", "worker_rss_mean_mb"),
    ("tree peak MB", "tree_rss_peak_mb"),
]


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def markdown_name(name: str) -> str:
    """The name as one table cell: in a code span, so `*`, `_`, `<` or `[` stay text, fenced with
    more backticks than it holds, and with `|` escaped (tables split cells before reading spans)."""
    fence = "`" * (max(map(len, re.findall("`+", name)), default=0) + 1)
    pad = " " if name.startswith("`") or name.endswith("`") else ""
    return f"{fence}{pad}{name}{pad}{fence}".replace("|", "\\|")


def sweep_table(jobs: list[Job]) -> str:
    """A markdown table of the jobs (name, status, last epoch's metrics) and its notes.

    Columns are padded to one width so the printed table lines up as well."""
    # only what some job measured: a bench sweep has no loss, a training sweep no first-batch time
    columns = [(t, key) for t, key in COLUMNS if any(key in j.metrics for j in jobs)] or COLUMNS[:1]
    rows = [["#", "job", "status", *(t for t, _ in columns)]]
    for j in jobs:
        rows.append([str(j.number), markdown_name(j.name), j.status, *(_cell(j.metrics.get(k)) for _, k in columns)])
    widths = [max(3, *(len(row[i]) for row in rows)) for i in range(len(rows[0]))]  # a rule needs 3 dashes
    rows.insert(1, ["-" * w for w in widths])
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    notes = table_notes(jobs)
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

