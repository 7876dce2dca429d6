"""Pieces the data_wait and fetch_probe scripts share: a dataset slow by construction, the median and
min-max cells of a table, and how a script ends."""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset


class SlowItems(Dataset):
    """Loading is slow by construction: every item sleeps `item_s` (a sleep lasts at least that long)."""

    def __init__(self, items: int, item_s: float):
        self.items, self.item_s = items, item_s

    def __len__(self):
        return self.items

    def __getitem__(self, i):
        time.sleep(self.item_s)
        return torch.zeros(8), i % 2


def spread(values: list[float], fmt: str) -> tuple[str, str]:
    """(median, "min-max"), each formatted with `fmt`."""
    return fmt.format(statistics.median(values)), f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def finish(report: str, out: Path | None) -> int:
    """Print the report, write it to `out` when given; the exit status is 0 whatever the figures:
    a benchmark is a measurement, not a test."""
    print(report, end="")
    if out:
        out.write_text(report)
    sys.stdout.flush()
    return 0
