"""Streams (IterableDatasets) for the tests, importable by a `dlpipe` subprocess (tests/ is on its
PYTHONPATH): numbered rows, so that a test can count which samples an epoch saw."""

import os
import signal

import torch
from torch.utils.data import IterableDataset, get_worker_info

from dlpipe.data.parquet import SyntheticTabularParquet


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


def signal_once(marker: str, group: bool) -> None:
    """SIGTERM to this process, or to the job's whole process group, unless `marker` says it was done."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.killpg(os.getpgid(0), signal.SIGTERM) if group else os.kill(os.getpid(), signal.SIGTERM)


class SignalsItself(IterableDataset):
    """tests/faulty_data.py's SignalsItself as a stream that does not share itself out: Gaussian class
    clusters with noise from a generator of (epoch, row), the same on every pass. In epoch `epoch`
    (1: the first), the `at`-th row read by a DataLoader worker (the main process reads the stream too,
    to fit the loader) sends SIGTERM to the job's process group, once (`marker`)."""

    num_classes = 3

    def __init__(self, marker: str, at: int, size: int = 120, num_features: int = 4, epoch: int = 2):
        g = torch.Generator().manual_seed(0)
        self.y = torch.arange(size) % self.num_classes
        self.x = torch.randn(self.num_classes, num_features, generator=g)[self.y]
        self.x += 0.5 * torch.randn(size, num_features, generator=g)
        self.marker, self.at, self.signal_epoch, self.epoch = marker, at, epoch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        in_worker = get_worker_info() is not None
        for i in range(len(self.y)):
            if in_worker and self.epoch == self.signal_epoch and i + 1 == self.at:
                signal_once(self.marker, group=True)
            noise = torch.randn(self.x.shape[1], generator=torch.Generator().manual_seed(self.epoch * 100_003 + i))
            yield self.x[i] + 0.3 * noise, int(self.y[i])


class SignalsItselfParquet(SyntheticTabularParquet):
    """The tabular recipe's parquet stream; in epoch `epoch`, the `at`-th row a DataLoader worker builds
    sends SIGTERM to the job's process group, once (`marker`)."""

    def __init__(self, marker: str, at: int, epoch: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.marker, self.at, self.signal_epoch, self.built = marker, at, epoch, 0

    def read_rows(self, shard, rows):
        for item in super().read_rows(shard, rows):
            if get_worker_info() is not None and self.epoch == self.signal_epoch:
                self.built += 1
                if self.built == self.at:
                    signal_once(self.marker, group=True)
            yield item


class Ragged(Rows):
    """Rows whose feature vectors grow with the row number: PyTorch's default collate cannot stack them."""

    def row(self, i: int):
        return torch.arange(float(1 + i % 3)), i % self.num_classes


class SplitsByRank(Rows):
    """Splits itself between ranks (by torchrun's RANK and WORLD_SIZE, as Hugging Face's
    split_dataset_by_node does) and then among its DataLoader workers, unevenly: rank 0 reads the
    first `first` rows, the other ranks share the rest; each rank's workers take every Nth of its rows."""

    def __init__(self, first: int = 30, **kwargs):
        super().__init__(**kwargs)
        self.first = first

    def __iter__(self):
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            mine = range(self.size)
        else:
            mine = range(self.first) if rank == 0 else range(self.first + rank - 1, self.size, world - 1)
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        for i in mine[worker::workers]:
            yield self.row(i)
