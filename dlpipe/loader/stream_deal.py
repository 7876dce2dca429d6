"""Dealing a stream's epoch out to ranks and DataLoader workers by whole batches.

Position p of an epoch belongs to global batch p // batch_size; the batches go out in rounds of one
batch per rank (batch k to rank k % world), and a rank's rounds to its workers in turn (round q to
worker q % workers; in a resumed epoch the first round left goes to worker 0, where a DataLoader
starts). A DataLoader takes its workers' batches in turn, so each rank trains on its batches in the
order of the epoch whatever the number of workers: the batches of a run on 4 workers are those of a
run on 0 (the main process), and a resumed run skips whole rounds, on any number.

The last round, short of a batch for every rank, is split evenly between the ranks (one batch each,
so no rank waits for another at the epoch's end); with fewer items than ranks, training repeats
items of it so that every rank has one (as PyTorch's DistributedSampler pads), validation does not.
With drop_last it is dropped. Positions are numbered per epoch, so dealing needs only the position
count when the stream knows it (`mask`), or a round of items held while it does not (`items`).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ResumePoint:
    """The rounds of an epoch a resumed run already trained on: its workers leave them out. Set by the
    runner's `resume(epoch, rounds)` before that epoch's iter(); other epochs start at round 0."""

    epoch: int | None = None
    rounds: int = 0

    def start(self, epoch: int) -> int:
        """Deal.start for `epoch`."""
        return self.rounds if self.epoch == epoch else 0


@dataclass(frozen=True)
class Deal:
    """Which of the epoch's positions one worker of one rank yields."""

    batch_size: int
    workers: int = 1
    worker: int = 0
    world: int = 1
    rank: int = 0
    drop_last: bool = False
    pad: bool = True  # training: a rank without an item in the last round repeats one
    start: int = 0  # rounds already trained on in this epoch (a resumed run): not yielded

    @property
    def round_size(self) -> int:
        return self.batch_size * self.world

    def works(self, round_: int) -> bool:
        """Whether this worker yields this rank's batch of the round."""
        return round_ >= self.start and (round_ - self.start) % self.workers == self.worker

    def last_round(self, size: int) -> np.ndarray:
        """Positions within a last round of `size` items (0 < size < round_size) this rank takes."""
        if self.drop_last:
            return np.empty(0, dtype=np.int64)
        if size < self.world and self.pad:
            return np.array([self.rank % size])
        return np.arange(self.rank * size // self.world, (self.rank + 1) * size // self.world)

    def rank_items(self, total: int) -> int:
        """Items this rank takes of an epoch of `total` (all its workers together)."""
        full, rest = divmod(total, self.round_size)
        return full * self.batch_size + (len(self.last_round(rest)) if rest else 0)

    def rank_batches(self, total: int) -> Iterator[np.ndarray]:
        """This rank's batches of an epoch of `total` positions, one a round from round `start`: what
        all its workers yield together, in the order a DataLoader takes them (thread workers fetch
        them in this order; dlpipe.loader.stream_threads)."""
        full, rest = divmod(total, self.round_size)
        for round_ in range(self.start, full):
            first = round_ * self.round_size + self.rank * self.batch_size
            yield np.arange(first, first + self.batch_size)
        last = self.last_round(rest) if rest and self.start <= full else np.empty(0, dtype=np.int64)
        if len(last):
            yield full * self.round_size + last

    def mask(self, positions: np.ndarray, total: int) -> np.ndarray:
        """Which of `positions` (of an epoch of `total` items) this worker yields."""
        rounds, inside = np.divmod(positions, self.round_size)
        full = total // self.round_size
        works = (rounds >= self.start) & ((rounds - self.start) % self.workers == self.worker)
        mine = works & (rounds < full) & (inside // self.batch_size == self.rank)
        if total % self.round_size:
            mine |= works & (rounds == full) & np.isin(inside, self.last_round(total % self.round_size))
        return mine

    def items(self, stream: Iterator) -> Iterator:
        """This worker's items of a stream of unknown length, in order."""
        if self.world == 1:  # a round is one batch: its items are this worker's, or not, as they come
            for position, item in enumerate(stream):
                if self.works(position // self.batch_size):
                    yield item
            return
        held: list = []  # the round's items while it may be the last (whose split is not known before)
        round_ = 0
        for position, item in enumerate(stream):
            if self.works(round_):
                held.append(item)
            if (position + 1) % self.round_size == 0:
                yield from held[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
                held, round_ = [], round_ + 1
        if held:
            for inside in self.last_round(len(held)):
                yield held[inside]
