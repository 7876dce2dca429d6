"""Streams of shards whose sizes are known before reading (parquet footers, tar headers), with an
epoch order that depends on (seed, epoch) alone.

A stream read by DataLoader workers usually has an order that depends on how many workers read it:
each worker reads its own shards and the loader takes their batches in turn. Then a run resumed on
another number of workers (or ranks) sees other samples next. Here the order is computed instead:
the shards in an order drawn from (seed, epoch), their rows in windows of `shuffle_buffer` rows, each
window's rows in an order drawn from (seed, epoch, window). Position p of the epoch is one row, on any
number of workers and ranks; dlpipe's loader (dlpipe.loader.streams.StreamShare) deals the positions
out by whole batches and asks each worker for its own through `read_positions`, which reads only
the rows asked for and builds each item (`build`: decoding, augmentation) as it is handed out. A
resume needs no state but (epoch, batches done).

The window replaces a reservoir shuffle buffer: both mix rows across neighbouring shards in memory
bounded by the buffer; the window's order can be computed without reading, the reservoir's cannot.
Each worker reads (decodes) every shard that holds one of its rows, so workers decode the same
shards: cheap next to building the items for rows (formats decode shards in C), and the price of an
order that does not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from dlpipe.sample_rng import epoch_stream, fetching

WINDOW_ROWS = 1024
"""Rows read together when the stream is not shuffled (shuffle_buffer=0): in order, in chunks."""


class ShardedStream(IterableDataset):
    """Base of a stream of shards of known sizes. A subclass sets `shard_rows` (rows of each shard,
    in its files' order), `shuffle_buffer` and `seed`, and implements `read_rows(shard, rows)` (and
    `build(record)` where making an item costs more than reading it)."""

    shard_rows: Sequence[int]
    shuffle_buffer: int = 0
    seed: int = 0
    epoch: int = 0

    def read_rows(self, shard: int, rows: np.ndarray) -> Sequence:
        """The records of `rows` (sorted, unique row numbers) of shard `shard`, in that order: what is
        read from the shard for each (a row's values, a member's bytes), before `build` makes an item."""
        raise NotImplementedError

    def build(self, record):
        """The item of a record (decoding, augmentation): called as the item is handed out, under its
        row's random draws, so an augmentation drawing from dlpipe.sample_rng.sample_generator() draws
        the same for a row in an epoch on any worker. The record itself by default."""
        return record

    def record_bytes(self) -> int:
        """Bytes one row's record takes (read, not yet built), for the memory a window holds."""
        return 0

    def buffer_bytes(self) -> int:
        """The most bytes one reader of the stream holds at once, a window of records (each worker
        reading it holds its own): for the loader's memory estimate (dlpipe.loader.stream_fit)."""
        return (self.shuffle_buffer or WINDOW_ROWS) * self.record_bytes()

    @property
    def num_rows(self) -> int:
        return int(sum(self.shard_rows))

    def set_epoch(self, epoch: int) -> None:
        """Called by dlpipe at each epoch's start (in the main process: workers start anew with it)."""
        self.epoch = int(epoch)

    def shard_order(self, epoch: int | None = None) -> np.ndarray:
        """An epoch's order of the shards (this epoch's by default): drawn from (seed, epoch) when
        shuffled, else the files' order."""
        if not self.shuffle_buffer:
            return np.arange(len(self.shard_rows))
        return np.random.default_rng([self.seed, self.epoch if epoch is None else epoch]).permutation(
            len(self.shard_rows))

    def windows(self) -> Iterator[np.ndarray]:
        """This epoch's rows as global row numbers (shard offset + row), window after window: the
        shards in shard_order(), each window of `shuffle_buffer` rows in its own drawn order."""
        offsets = self.shard_offsets()
        size = self.shuffle_buffer or WINDOW_ROWS
        pending: list[np.ndarray] = []
        held = 0
        index = 0
        for shard in self.shard_order():
            rows = np.arange(offsets[shard], offsets[shard + 1], dtype=np.int64)
            while len(rows):
                take = rows[:size - held]
                rows = rows[len(take):]
                pending.append(take)
                held += len(take)
                if held == size:
                    yield self._mixed(np.concatenate(pending), index, self.epoch)
                    pending, held, index = [], 0, index + 1
        if held:
            yield self._mixed(np.concatenate(pending), index, self.epoch)

    def _mixed(self, window: np.ndarray, index: int, epoch: int) -> np.ndarray:
        if not self.shuffle_buffer:
            return window
        return window[np.random.default_rng([self.seed, epoch, index]).permutation(len(window))]

    def rows_at(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        """The global row numbers at `positions` of epoch `epoch`, as windows() orders that epoch,
        computed for those windows alone: window w holds the epoch's shard-ordered rows
        w * size ... (w + 1) * size - 1, in its drawn order."""
        positions = np.asarray(positions, dtype=np.int64)
        size = self.shuffle_buffer or WINDOW_ROWS
        order = self.shard_order(epoch)
        rows = np.asarray(self.shard_rows, dtype=np.int64)[order]
        starts = np.concatenate([[0], np.cumsum(rows)])  # where each shard begins in the epoch's sequence
        in_sequence = np.empty_like(positions)
        windows = positions // size
        for window in np.unique(windows):
            where = windows == window
            first = int(window) * size
            length = min(size, self.num_rows - first)
            mixed = self._mixed(np.arange(first, first + length), int(window), epoch)
            in_sequence[where] = mixed[positions[where] - first]
        shard = np.searchsorted(starts, in_sequence, side="right") - 1
        return self.shard_offsets()[order[shard]] + in_sequence - starts[shard]

    def items_at(self, positions: np.ndarray, epoch: int) -> list:
        """The items at `positions` of epoch `epoch`, in that order, read and built as read_positions
        builds them (each under its row's random draws): for thread workers fetching batches of an
        epoch's positions (dlpipe.loader.stream_threads)."""
        return list(self._read_ids(self.rows_at(positions, epoch), self.shard_offsets(), epoch))

    def shard_offsets(self) -> np.ndarray:
        """The global row number of each shard's first row, and the row count at the end."""
        return np.concatenate([[0], np.cumsum(np.asarray(self.shard_rows, dtype=np.int64))])

    def read_positions(self, keep: Callable[[np.ndarray], np.ndarray]) -> Iterator:
        """The items at this epoch's positions p where `keep(positions)` is True (a boolean mask over
        an array of positions), in order; only those are read and built."""
        offsets = self.shard_offsets()
        position = 0
        for window in self.windows():
            chosen = window[keep(np.arange(position, position + len(window)))]
            position += len(window)
            if len(chosen):
                yield from self._read_ids(chosen, offsets, self.epoch)

    def _read_ids(self, ids: np.ndarray, offsets: np.ndarray, epoch: int) -> Iterator:
        """Items of global row numbers `ids`, in their order: each shard asked once for its rows' records,
        each item built as it is handed out (a window's records are small next to its built items)."""
        shards = np.searchsorted(offsets, ids, side="right") - 1
        records: list = [None] * len(ids)
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            rows = ids[where] - offsets[shard]
            order = np.argsort(rows, kind="stable")
            for slot, record in zip(where[order], self.read_rows(int(shard), rows[order]), strict=True):
                records[slot] = record
        stream = epoch_stream(self.seed, epoch)
        try:
            for sample, record in zip(ids, records, strict=True):
                fetching(stream, int(sample))
                yield self.build(record)
        finally:
            fetching(None)

    def __iter__(self) -> Iterator:
        """The epoch's items; in a DataLoader worker only every Nth from the worker's own offset, so a
        plain DataLoader over the stream yields each item once (dlpipe deals whole batches instead)."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.read_positions(lambda positions: positions % workers == worker)
