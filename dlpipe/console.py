"""What a person sees in the terminal: a progress line per epoch and the end-of-run table."""

import sys
import time
from typing import TextIO


class Progress:
    """A one-line progress bar with samples/s and data-wait share, redrawn at most 10 times a second.

    When the stream is not a terminal (CI logs, Slurm output files) it prints one line per epoch
    instead of carriage-return redraws that would fill the log.
    """

    def __init__(self, epoch: int, epochs: int, total: int | None, enabled: bool = True, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interactive = enabled and self.stream.isatty()
        self.prefix = f"epoch {epoch}/{epochs}"
        self.total = total
        self._last_draw = 0.0

    def update(self, done: int, samples_per_s: float, data_wait_frac: float) -> None:
        if not self.interactive:
            return
        now = time.monotonic()
        if now - self._last_draw < 0.1 and done != self.total:
            return
        self._last_draw = now
        self.stream.write("\r" + self._line(done, samples_per_s, data_wait_frac))
        self.stream.flush()

    def close(self, done: int, samples_per_s: float, data_wait_frac: float, extra: str = "") -> None:
        if not self.enabled:
            return
        line = self._line(done, samples_per_s, data_wait_frac) + (f"  {extra}" if extra else "")
        self.stream.write(("\r" if self.interactive else "") + line + "\n")
        self.stream.flush()

    def _line(self, done: int, samples_per_s: float, data_wait_frac: float) -> str:
        if self.total:
            width = 24
            filled = min(width, int(width * done / self.total))
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}"
        else:
            bar = f"{done} batches"
        return f"{self.prefix} {bar}  {samples_per_s:8.1f} samples/s  data wait {100 * data_wait_frac:4.1f}%"


# (column title, metric key, format): the epoch and what it computed, then how it ran. Every other
# `val_<name>` a row holds (a metric of `metrics`) gets a column between the two (summary_columns).
RESULT_COLUMNS = [
    ("epoch", "epoch", "{:.0f}"),
    ("train loss", "train_loss", "{:.4f}"),
    ("val loss", "val_loss", "{:.4f}"),
    ("val acc", "val_accuracy", "{:.3f}"),
    ("val r2", "val_r2", "{:.3f}"),
]
RUN_COLUMNS = [
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("data wait", "data_wait_frac", "{:.1%}"),  # a share of the epoch, as a percentage wherever a person reads it
    ("epoch s", "epoch_time_s", "{:.2f}"),
    ("cpu %", "cpu_util", "{:.0f}"),
    ("gpu %", "gpu_util", "{:.0f}"),
    ("peak rss MB", "rss_peak_mb", "{:.0f}"),  # the main process's largest sample of the epoch
]
USER_METRIC_FORMAT = "{:.4f}"  # as the losses: 1.0000 for a perfect F1, not 1


def summary_columns(rows: list[dict[str, float]]) -> list[tuple[str, str, str]]:
    """The columns some row has a value for, each user metric (`val_<name>`) after the known
    validation ones, in the order the rows first hold them."""
    def present(columns):
        return [c for c in columns if any(c[1] in r for r in rows)]

    results, runs = present(RESULT_COLUMNS), present(RUN_COLUMNS)
    known, titles = {c[1] for c in RESULT_COLUMNS + RUN_COLUMNS}, {c[0] for c in results + runs}
    users = dict.fromkeys(k for r in rows for k in r if k.startswith("val_") and k not in known)
    # titled like the known ones (`val f1`), by the key where that title is taken (`val_acc` beside accuracy)
    shown = [(title if (title := k.replace("_", " ", 1)) not in titles else k, k, USER_METRIC_FORMAT) for k in users]
    return [*results, *shown, *runs]


def summary_table(rows: list[dict[str, float]]) -> str:
    """A plain-text table of per-epoch metrics; columns with no values at all are left out."""
    cols = summary_columns(rows)
    cells = [[title for title, _, _ in cols]]
    for r in rows:
        cells.append([fmt.format(r[key]) if key in r else "-" for _, key, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
