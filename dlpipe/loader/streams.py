"""Streams: datasets read in order (a torch IterableDataset: no length, no index), such as a reader
of files or a Hugging Face dataset in streaming mode.

A DataLoader hands each worker a copy of the stream. A stream that does not share itself out
(by `get_worker_info()`) then yields every sample once per worker, each epoch: the classic
duplicate-samples mistake. Whether a stream shares itself out is measured here, not guessed: two
worker processes read its first items (`shares_itself`). One that does not is dealt out by
`StreamShare`: each worker keeps its own batches, so every sample is trained on once an epoch, in an
order that does not depend on the workers, at the cost of every worker reading (and skipping) the
whole stream; a stream that can read any position (dlpipe.data.shards) builds only its own.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from dlpipe.errors import DataError
from dlpipe.loader.fetch import unwrapped
from dlpipe.loader.stream_deal import Deal, ResumePoint
from dlpipe.loader.worker_signals import SignalSafeLoader, worker_init_fn

PROBE_ITEMS = 8
"""Items each probing worker reads: enough to tell a share from the whole stream, few enough to
cost a fraction of a second on a reader of files."""


class StreamError(DataError):
    """An item of a stream could not be produced; names its place in the stream (and worker)."""


def is_stream(dataset: Dataset) -> bool:
    """Whether `dataset` (or the user's dataset in dlpipe's wrappers) is read in order, not by index."""
    return isinstance(unwrapped(dataset), IterableDataset)


def size_of(dataset: Dataset) -> int | None:
    """Samples in a split; None for a stream, which is not counted before it is read."""
    return None if is_stream(dataset) else len(dataset)  # type: ignore[arg-type]


def buffer_bytes(dataset: Dataset) -> int:
    """What one reader of a stream holds at once (its `buffer_bytes()`: a shuffle window), or 0."""
    stream = unwrapped(dataset)
    return int(stream.buffer_bytes()) if is_stream(stream) and callable(getattr(stream, "buffer_bytes", None)) else 0


def reads_positions(dataset: Dataset) -> bool:
    """Whether the dataset is a stream that builds only the items of the positions asked for
    (`read_positions`, dlpipe.data.shards.ShardedStream) and counts them (`num_rows`)."""
    stream = unwrapped(dataset)
    return callable(getattr(stream, "read_positions", None)) and hasattr(stream, "num_rows")


class StreamShare(IterableDataset):
    """The stream as one DataLoader worker of one rank reads it: its failures named by their place in
    the stream and, with `share=True`, only this worker's batches (loader.stream_deal.Deal: whole
    batches in the epoch's order, the same on any number of workers). A stream that reads any of its
    positions (`read_positions`, dlpipe.data.shards.ShardedStream) builds only those; another is read
    whole by every worker, which keeps its own. `set_epoch` reaches the stream (a Hugging Face
    stream reshuffles its shards and buffer by it); `resume(epoch, rounds)` leaves out the batches
    a resumed epoch already trained on."""

    dlpipe_wrapper = True  # dlpipe.loader.fetch.unwrapped() looks through it

    def __init__(self, stream: IterableDataset, share: bool, batch_size: int = 1, drop_last: bool = False,
                 rank: int = 0, world: int = 1, pad: bool = True):
        self.dataset, self.share = stream, share
        self.batch_size, self.drop_last, self.pad = batch_size, drop_last, pad
        self.rank, self.world = rank, world
        self.epoch, self.resumed = 0, ResumePoint()

    def __getattr__(self, name):
        # num_classes and the like read as on the stream; `dataset` guarded for unpickling in a worker
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # workers start anew each epoch (build_stream_loader): each copy has it
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def resume(self, epoch: int, rounds: int) -> None:
        """Leave out the first `rounds` rounds of batches of `epoch` (one batch per rank each)."""
        self.resumed = ResumePoint(epoch, rounds)

    def __len__(self) -> int:
        """Items this rank takes an epoch, where dlpipe deals a stream that counts its rows
        (dlpipe.data.shards): then a DataLoader over it has a length (progress, a schedule's steps)."""
        if not (self.share and reads_positions(self.dataset)):
            raise TypeError(f"a stream ({type(self.dataset).__name__}) has no length")
        deal = Deal(self.batch_size, world=self.world, rank=self.rank, drop_last=self.drop_last, pad=self.pad)
        return deal.rank_items(self.dataset.num_rows)

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        where = f" (worker {worker} of {workers})" if workers > 1 else ""
        if not self.share:
            return self._named(iter(self.dataset), where)
        deal = Deal(self.batch_size, workers, worker, self.world, self.rank, self.drop_last, self.pad,
                    self.resumed.start(self.epoch))
        if reads_positions(self.dataset):
            total = self.dataset.num_rows
            return self._named(self.dataset.read_positions(lambda positions: deal.mask(positions, total)), where,
                               counted=False)
        return deal.items(self._named(iter(self.dataset), where))

    @staticmethod
    def _named(items: Iterator, where: str, counted: bool = True) -> Iterator:
        """The items; a failure as a StreamError naming the item's place in the stream (when `counted`:
        the items are the stream's own, in its order) and the worker."""
        position = 0
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as e:
                place = f"stream item {position}" if counted else "a stream item"
                raise StreamError(f"{place}{where}: {type(e).__name__}: {e}") from e
            yield item
            position += 1


def fingerprint(item) -> str:
    """A digest of an item's values (tensors and arrays by their bytes, shape and dtype), equal for
    equal items whichever process produced them (a worker hands arrays over as tensors)."""
    digest = hashlib.sha1()

    def feed(value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray):
            digest.update(f"{value.dtype}{value.shape}".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):  # alike: a worker's default_convert may turn one into the other
            digest.update(f"sequence{len(value)}".encode())
            for part in value:
                feed(part)
        else:
            digest.update(pickle.dumps(value))

    feed(item)
    return digest.hexdigest()


def first_fingerprints(stream: IterableDataset, count: int) -> list[str]:
    """Fingerprints of the stream's first `count` items, read in this process."""
    return [fingerprint(item) for item in itertools.islice(stream, count)]


class _ByWorker(IterableDataset):
    """A stream's items tagged with the worker that yielded them: the probe's view of who read what
    (a worker that yields nothing leaves no turn of its own in the loader's output)."""

    def __init__(self, stream: IterableDataset):
        self.stream = stream

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        return ((worker, item) for item in self.stream)


def shares_itself(stream: IterableDataset, context: str | None, timeout_s: float) -> tuple[bool | None, str]:
    """(whether the stream gives each DataLoader worker its own share of the items, why): two worker
    processes read up to PROBE_ITEMS items each, compared with the stream's first items read here.
    None where it cannot be told: the stream yields other items on each pass through it."""
    here = first_fingerprints(stream, PROBE_ITEMS)
    if here != first_fingerprints(stream, PROBE_ITEMS):
        return None, "its first items differ between two passes in this process"
    loader = SignalSafeLoader(_ByWorker(stream), batch_size=None, num_workers=2, multiprocessing_context=context,
                              timeout=timeout_s, worker_init_fn=worker_init_fn())
    by_worker: list[list[str]] = [[], []]
    # The workers take turns while both have items: 2 x PROBE_ITEMS items are each one's first
    # PROBE_ITEMS, or all from one worker where the other yields none (the rest is not read).
    for position, (worker, item) in enumerate(loader):
        if len(by_worker[worker]) < PROBE_ITEMS:
            by_worker[worker].append(fingerprint(item))
        if position + 1 == 2 * PROBE_ITEMS:
            break
    first, second = by_worker
    if first == second == here[:len(first)] and first:
        return False, f"2 workers each yielded the stream's first {len(first)} items"
    if not first or not second:
        return True, ("one of 2 workers yielded the stream's items and the other none (the stream gives itself to "
                      "fewer workers, e.g. a Hugging Face stream with fewer shards than workers)")
    if first != second:
        return True, "2 workers yielded different items (the stream shares itself out by get_worker_info())"
    return None, "2 workers yielded the same items, but not the ones read in this process"
