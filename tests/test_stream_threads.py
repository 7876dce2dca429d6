"""Thread workers for a stream that reads any position of its epoch (dlpipe.loader.stream_threads):
the loader yields the batches of the main process alone, and of worker processes, on every rank,
epoch, drop_last and resume point; parquet rows mixed in a shuffle window and augmented JPEGs from
tar shards alike. A stream that cannot read positions keeps worker processes, with a note."""

import numpy as np
import pytest
import torch
from stream_data import Rows
from test_parquet import write_rows
from test_tar_shards import write_tars

from dlpipe.data.parquet import ParquetStream
from dlpipe.data.shards import ShardedStream
from dlpipe.data.tar_shards import TarShards
from dlpipe.errors import DataError
from dlpipe.loader.build import build_loader
from dlpipe.loader.stream_threads import EpochPositions
from dlpipe.loader.threads import ThreadLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def parquet(tmp_path, buffer: int = 16) -> ParquetStream:
    write_rows(tmp_path / "rows")  # 90 rows in 12 row groups
    return ParquetStream(str(tmp_path / "rows"), ["id", "x"], "label", shuffle_buffer=buffer, seed=3)


def tars(tmp_path) -> TarShards:
    write_tars(tmp_path / "tars")  # 30 samples, 3 tars
    return TarShards(str(tmp_path / "tars"), shuffle_buffer=8, image_size=8, crop_size=6, augment=True, seed=1)


def build(stream, workers: int, method: str, **overrides):
    settings = dict(batch_size=4, num_workers=workers, pin_memory=False, prefetch_factor=2 if workers else None,
                    persistent_workers=False, shuffle=False, drop_last=False, timeout=0.0,
                    multiprocessing_context=None, seed=0, cuda=False, worker_method=method, stream_share="dlpipe")
    return build_loader(stream, **{**settings, **overrides})


def epoch(loader, number: int, resume_rounds: int | None = None) -> list:
    """The loader's batches of epoch `number`, set up as the runner sets an epoch up."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(number)
    else:
        loader.dataset.set_epoch(number)
    if resume_rounds is not None:
        loader.dataset.resume(number, resume_rounds)
    return list(loader)


def same(a: list, b: list) -> bool:
    flat = [torch.cat([t.flatten().double() for t in batch]) for batch in a]
    other = [torch.cat([t.flatten().double() for t in batch]) for batch in b]
    return len(flat) == len(other) and all(torch.equal(x, y) for x, y in zip(flat, other, strict=True))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_threads_yield_the_main_process_batches_on_every_rank_and_epoch(tmp_path, world, drop_last):
    stream = parquet(tmp_path)
    for rank in range(world):
        for role in ("train", "val"):
            alone = build(stream, 0, "process", rank=rank, world=world, drop_last=drop_last, role=role)
            plan = build(stream, 2, "thread", rank=rank, world=world, drop_last=drop_last, role=role)
            assert isinstance(plan.loader, ThreadLoader) and plan.worker_method == "thread" and not plan.notes
            for number in (0, 1):
                batches = epoch(plan.loader, number)
                assert same(batches, epoch(alone.loader, number)), (rank, role, number)
                assert len(batches) == len(plan.loader) == len(alone.loader)
    ids = torch.cat([x[:, 0] for x, _ in epoch(build(stream, 2, "thread").loader, 1)])
    assert sorted(ids.tolist()) == list(range(90))  # every row once, in an order of the epoch's drawing
    assert ids.tolist() != sorted(ids.tolist())


def test_threads_build_augmented_jpegs_as_worker_processes_do(tmp_path):
    stream = tars(tmp_path)
    processes, threads = build(stream, 2, "process"), build(stream, 3, "thread", prefetch_factor=4)
    for number in (0, 1):
        by_threads = epoch(threads.loader, number)
        assert same(by_threads, epoch(processes.loader, number))
        assert sorted(torch.cat([y for _, y in by_threads]).tolist()) == list(range(30))
    first, again = epoch(threads.loader, 0)[0][0], epoch(threads.loader, 1)[0][0]
    assert not torch.equal(first, again)  # another epoch, another order and other crops


@pytest.mark.parametrize("rounds", [0, 1, 5, 21, 22, 23, 30])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_resumed_epoch_on_threads_leaves_out_the_rounds_already_trained(tmp_path, rounds, drop_last):
    stream = parquet(tmp_path)
    alone = build(stream, 0, "process", drop_last=drop_last).loader
    straight = epoch(alone, 1)  # 22 batches of 4 rows, and one of 2 without drop_last
    loader = build(stream, 2, "thread", drop_last=drop_last).loader
    assert same(epoch(loader, 1, resume_rounds=rounds), straight[rounds:])
    assert same(epoch(loader, 2), epoch(alone, 2))  # the next epoch whole again


def test_rows_at_any_positions_are_those_the_epoch_reads_in_order(tmp_path):
    stream = parquet(tmp_path, buffer=7)
    for number in (0, 4):
        stream.set_epoch(number)
        in_order = np.concatenate(list(stream.windows()))
        positions = np.random.default_rng(number).permutation(len(in_order))
        assert np.array_equal(stream.rows_at(positions, number), in_order[positions])
    stream.set_epoch(0)
    view = EpochPositions(stream)
    assert len(view) == 90 and view.num_classes == stream.num_classes
    assert torch.equal(view[5][0], next(iter(build(stream, 0, "process", batch_size=6).loader))[0][5])


def test_a_stream_that_cannot_read_positions_keeps_worker_processes():
    plan = build(Rows(size=10), 2, "thread")
    assert plan.worker_method == "process" and plan.requested["worker_method"] == "thread"
    assert any("loader.worker_method=thread ignored" in note for note in plan.notes)
    assert build(parquet_like(), 2, "thread", stream_share="source").worker_method == "process"


def parquet_like() -> ShardedStream:
    class Numbers(ShardedStream):
        shard_rows = [5, 5]

        def read_rows(self, shard, rows):
            return [(torch.tensor([float(5 * shard + r)]), 0) for r in rows]
    return Numbers()


def test_a_failing_item_read_by_a_thread_names_its_file_and_member(tmp_path):
    stream = tars(tmp_path)
    shard = stream.shards[1]
    with open(shard.path, "r+b") as f:  # the member's JPEG bytes garbled where they lie in the tar
        f.seek(int(shard.offsets[0]))
        f.write(b"\0" * int(shard.sizes[0]))
    with pytest.raises(DataError) as caught:
        epoch(build(stream, 2, "thread").loader, 0)
    assert f"{shard.path} member {shard.names[0]!r} cannot be decoded" in str(caught.value)
