"""Streams (IterableDatasets) for the tests, importable by a `dlpipe` subprocess (tests/ is on its
PYTHONPATH): numbered rows, so that a test can count which samples an epoch saw."""

import torch
from torch.utils.data import IterableDataset, get_worker_info


class Rows(IterableDataset):
    """Numbered rows of `features` values (the row's number, then the epoch), the same on every pass;
    each DataLoader worker reads them all (it does not share itself out)."""

    def __init__(self, size: int = 40, features: int = 2, classes: int = 3, fail_at: int | None = None):
        self.size, self.features, self.num_classes, self.fail_at, self.epoch = size, features, classes, fail_at, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def row(self, i: int):
        values = torch.full((self.features,), float(self.epoch))
        values[0] = float(i)
        return values, i % self.num_classes

    def __iter__(self):
        for i in range(self.size):
            if i == self.fail_at:
                raise OSError("truncated record")
            yield self.row(i)


class SharedOut(Rows):
    """Shares itself out as PyTorch's IterableDataset docs show: worker k reads every Nth row."""

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        for i in range(worker, self.size, workers):
            yield self.row(i)


class Noise(Rows):
    """Other rows on every pass: no fingerprint can say who read what."""

    def __iter__(self):
        for _ in range(self.size):
            yield torch.randn(self.features), 0
