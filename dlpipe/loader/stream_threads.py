"""Thread workers for a stream that reads any position of its epoch (dlpipe.data.shards.ShardedStream:
parquet row groups, tar shards).

Such a stream is a map dataset over one epoch's positions: position p is one row, its item built
under that row's random draws (dlpipe.sample_rng), whoever builds it. So the thread workers of map
datasets (dlpipe.loader.threads, torchdata.nodes) apply to it unchanged: the sampler hands out this
rank's batches of positions in the dealt order (loader.stream_deal.Deal.rank_batches), the threads
read and build each batch, and the loader yields exactly the batches of worker processes, or of the
main process alone: the same order, the same augmentations, the same resume. A stream that cannot
read positions has a single reader, which threads would have to share: it keeps worker processes.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from dlpipe.errors import DataError
from dlpipe.loader.fetch import BatchGather, unwrapped
from dlpipe.loader.stream_deal import Deal, ResumePoint
from dlpipe.loader.streams import StreamError
from dlpipe.loader.threads import ThreadLoader


class PositionBatch(list):
    """A batch of an epoch's positions that knows its epoch: a thread still building a batch of the
    last epoch when the next one starts builds it for its own."""

    def __init__(self, positions, epoch: int):
        super().__init__(positions)
        self.epoch = epoch

    def __reduce__(self):
        return PositionBatch, (list(self), self.epoch)


class EpochPositions(Dataset):
    """A stream that reads positions, seen as a map dataset over the positions of one epoch (the
    epoch the runner last set, or a PositionBatch's own). Item p is the stream's item at position p."""

    dlpipe_wrapper = True  # dlpipe.loader.fetch.unwrapped() looks through it, to the stream

    def __init__(self, stream: IterableDataset):
        self.dataset, self.epoch = unwrapped(stream), 0

    def __len__(self) -> int:
        return self.dataset.num_rows

    def __getattr__(self, name):
        # num_classes and the like read as on the stream; `dataset` guarded for unpickling in a worker
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __getitem__(self, position: int):
        return self.__getitems__([position])[0]

    def __getitems__(self, positions: Sequence[int]) -> list:
        epoch = getattr(positions, "epoch", self.epoch)
        try:
            return self.dataset.items_at(np.asarray(list(positions), dtype=np.int64), epoch)
        except DataError:
            raise
        except Exception as e:
            place = f"position {positions[0]}" if len(positions) == 1 else \
                f"positions {positions[0]}..{positions[-1]}"
            raise StreamError(f"a stream item at {place} of epoch {epoch}: {type(e).__name__}: {e}") from e


class DealtBatches:
    """The sampler of a thread loader over a stream: this rank's batches of each epoch's positions,
    dealt as worker processes would take them (Deal), from the first round not yet trained on."""

    def __init__(self, positions: EpochPositions, batch_size: int, drop_last: bool, rank: int, world: int,
                 pad: bool):
        self.positions, self.batch_size = positions, batch_size
        self.deal = Deal(batch_size, world=world, rank=rank, drop_last=drop_last, pad=pad)
        self.epoch, self.resumed = 0, ResumePoint()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.positions.set_epoch(epoch)
        if hasattr(self.positions.dataset, "set_epoch"):
            self.positions.dataset.set_epoch(epoch)  # as a stream's loader does: what reads it sees the epoch

    def resume(self, epoch: int, rounds: int) -> None:
        """Leave out the first `rounds` rounds of `epoch` (StreamShare.resume, for threads)."""
        self.resumed = ResumePoint(epoch, rounds)

    def __len__(self) -> int:
        """Batches of a whole epoch (a resumed epoch yields fewer: its runner skips no batches)."""
        items, size = self.deal.rank_items(len(self.positions)), self.batch_size
        return -(-items // size)

    def __iter__(self) -> Iterator[PositionBatch]:
        deal = replace(self.deal, start=self.resumed.start(self.epoch))
        for batch in deal.rank_batches(len(self.positions)):
            yield PositionBatch(batch.tolist(), self.epoch)


class DealtGather(BatchGather):
    """The thread loader's dataset: batches of positions in, collated batches out; and, to the runner,
    a stream dealt by dlpipe (`share`, `resume`) as StreamShare is for worker processes."""

    share = True

    def __init__(self, positions: EpochPositions, batches: DealtBatches, collate_fn: Callable | None):
        super().__init__(positions, None, collate_fn)
        self.batches = batches

    def resume(self, epoch: int, rounds: int) -> None:
        self.batches.resume(epoch, rounds)


def thread_stream_loader(stream: IterableDataset, *, batch_size: int, drop_last: bool, rank: int, world: int,
                         pad: bool, collate_fn: Callable | None, num_workers: int, prefetch_factor: int,
                         pin_memory: bool, timeout: float, generator) -> ThreadLoader:
    """A ThreadLoader over a stream that reads positions (streams.reads_positions): `num_workers`
    threads build this rank's dealt batches."""
    positions = EpochPositions(stream)
    batches = DealtBatches(positions, batch_size, drop_last, rank, world, pad)
    return ThreadLoader(DealtGather(positions, batches, collate_fn), batches, num_workers=num_workers,
                        prefetch_factor=prefetch_factor, pin_memory=pin_memory, timeout=timeout,
                        generator=generator)
