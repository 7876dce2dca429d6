"""Dealing a stream's batches to ranks and workers (dlpipe.loader.stream_deal, loader.streams.StreamShare):
each rank's batches are the same, in the same order, on any number of workers; a resumed epoch's are
the rest of them; ranks end an epoch with as many batches each; every item once (or, where the last
round has fewer items than ranks, training repeats some as DistributedSampler pads)."""

import numpy as np
import pytest
import torch
from stream_data import Rows
from test_parquet import write_rows

from dlpipe.data.parquet import ParquetStream
from dlpipe.loader.stream_deal import Deal
from dlpipe.loader.streams import StreamShare
from dlpipe.loader.worker_signals import SignalSafeLoader, worker_init_fn

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def batches(items: list, size: int, drop_last: bool) -> list[list]:
    out = [items[i:i + size] for i in range(0, len(items), size)]
    return out[:-1] if drop_last and out and len(out[-1]) < size else out


def in_turn(per_worker: list[list]) -> list:
    """The batches as a DataLoader takes them: worker 0, 1, ... in turn, a worker that ends left out."""
    out, turn, taken, ended = [], 0, [0] * len(per_worker), [False] * len(per_worker)
    while not all(ended):
        w, turn = turn % len(per_worker), turn + 1
        if ended[w]:
            continue
        if taken[w] < len(per_worker[w]):
            out.append(per_worker[w][taken[w]])
            taken[w] += 1
        else:
            ended[w] = True
    return out


def rank_batches(total: int, size: int, world: int, rank: int, workers: int, drop_last: bool, pad: bool,
                 start: int = 0, counted: bool = True) -> list[list[int]]:
    """The positions of one rank's batches, as its DataLoader hands them out."""
    per_worker = []
    for worker in range(workers):
        deal = Deal(size, workers, worker, world, rank, drop_last, pad, start)
        items = ([int(p) for p in np.flatnonzero(deal.mask(np.arange(total), total))] if counted
                 else list(deal.items(iter(range(total)))))
        per_worker.append(batches(items, size, drop_last))
    return in_turn(per_worker)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last, pad", [(False, True), (False, False), (True, True)])
def test_batches_do_not_depend_on_the_workers_and_ranks_end_together(world, drop_last, pad):
    for total in range(0, 41):
        for size in (1, 3, 4):
            one = [rank_batches(total, size, world, rank, 1, drop_last, pad) for rank in range(world)]
            for workers in (1, 2, 3):
                for counted in (True, False):  # a stream that counts its items, or one read as it comes
                    assert [rank_batches(total, size, world, rank, workers, drop_last, pad, counted=counted)
                            for rank in range(world)] == one, (total, size, workers, counted)
                for start in range(len(one[0]) + 1):  # a resumed epoch: the rounds after `start`
                    assert [rank_batches(total, size, world, rank, workers, drop_last, pad, start)
                            for rank in range(world)] == [b[start:] for b in one], (total, size, workers, start)
            for start in range(len(one[0]) + 2):  # thread workers take a rank's batches as one list
                assert [[batch.tolist() for batch in Deal(size, 1, 0, world, rank, drop_last, pad, start)
                         .rank_batches(total)] for rank in range(world)] == [b[start:] for b in one], (total, start)
            if pad or drop_last:  # training: DDP needs as many steps on every rank
                assert len({len(b) for b in one}) == 1, (total, size)
            seen = sorted(p for b in one for batch in b for p in batch)
            round_ = size * world
            if drop_last:
                assert seen == list(range(total // round_ * round_))
            elif not pad or total % round_ == 0 or total % round_ >= world:
                assert seen == list(range(total))  # each once
            else:  # fewer items than ranks in the last round: one each, some twice
                assert set(seen) == set(range(total)) and len(seen) == total // round_ * round_ + world


def loader_batches(stream, workers: int, batch_size: int = 4, **share) -> list[list[int]]:
    """The first feature (a row number) of each item of each batch a real DataLoader makes."""
    shared = StreamShare(stream, share=True, batch_size=batch_size, **share)
    loader = SignalSafeLoader(shared, batch_size=batch_size, num_workers=workers,
                              worker_init_fn=worker_init_fn() if workers else None)
    return [features[:, 0].long().tolist() for features, _ in loader]


def test_real_workers_make_the_main_processs_batches_and_a_resume_makes_the_rest(tmp_path):
    straight = loader_batches(Rows(size=30), 0)
    assert straight == [list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)]
    assert loader_batches(Rows(size=30), 3) == straight
    shared = StreamShare(Rows(size=30), share=True, batch_size=4)
    shared.resume(epoch=1, rounds=3)
    shared.set_epoch(1)
    loader = SignalSafeLoader(shared, batch_size=4, num_workers=2, worker_init_fn=worker_init_fn())
    assert [f[:, 0].long().tolist() for f, _ in loader] == straight[3:]
    shared.set_epoch(2)  # the next epoch is whole again
    assert [f[:, 0].long().tolist() for f, _ in loader] == straight


def test_ranks_split_a_parquet_stream_that_builds_only_its_own_rows(tmp_path, monkeypatch):
    write_rows(tmp_path / "rows")  # 90 rows; id is the first feature
    stream = ParquetStream(str(tmp_path / "rows"), ["id", "x"], "label", shuffle_buffer=16, seed=3)
    every = loader_batches(stream, 0)
    assert sorted(i for b in every for i in b) == list(range(90)) and every != sorted(every)  # mixed
    assert loader_batches(stream, 2) == every
    built = []
    read_rows = ParquetStream.read_rows
    monkeypatch.setattr(ParquetStream, "read_rows", lambda self, shard, rows: built.extend(rows) or
                        read_rows(self, shard, rows))
    ranks = [loader_batches(stream, 0, world=2, rank=rank) for rank in (0, 1)]
    assert len(built) == 90  # each rank built only its own rows
    assert [len(b) for b in ranks] == [12, 12]  # 90 rows, rounds of 8: 11 whole, then 2 rows to each rank
    assert sorted(i for b in ranks for batch in b for i in batch) == list(range(90))
    assert [b for pair in zip(*ranks, strict=True) for b in pair][:22] == every[:22]  # rank 0, 1, 0, 1, ...
    assert len(StreamShare(stream, share=True, batch_size=4, world=2, rank=1)) == 45  # the loader's length


def test_a_parquet_streams_order_is_drawn_from_seed_and_epoch(tmp_path):
    write_rows(tmp_path / "rows")
    stream = ParquetStream(str(tmp_path / "rows"), ["id", "x"], "label", shuffle_buffer=16, seed=3)
    first = [int(f[0]) for f, _ in stream]
    assert [int(f[0]) for f, _ in stream] == first
    stream.set_epoch(1)
    assert [int(f[0]) for f, _ in stream] != first
    assert torch.is_tensor(next(iter(stream))[0])
