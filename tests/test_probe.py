"""Automatic workers fitted to the data: a cheap in-process fetch means no workers.

The probe's timing runs on a fake clock that only items and collates advance, by known amounts, so
its answer and its early stop are exact. What real data measures (in-memory rows under the 50 us
threshold, JPEG decode above) is in benchmarks/fetch_probe.py.
"""

import pytest
import torch
from fake_clock import FakeClock, install
from faulty_data import SlowDataset
from torch.utils.data import Dataset, TensorDataset, default_collate

from dlpipe.loader.fitting import fit_loader_to_data
from dlpipe.loader.policy import CHEAP_ITEM_S
from dlpipe.loader.probe import item_fetch_seconds
from dlpipe.schema import LoaderConfig

AUTO_RAW = {"num_workers": "${auto_workers:}", "prefetch_factor": "${auto_prefetch:${.num_workers}}",
            "persistent_workers": "${auto_persistent:${.num_workers},${trainer.epochs},0}"}


def auto_loader(workers=2):
    """fetch=item, worker_method=process: these tests are about the worker count; loader.fetch=auto and
    loader.worker_method=auto have their own (tests/test_fetch.py, tests/test_threads.py)."""
    return LoaderConfig(num_workers=workers, prefetch_factor=2, persistent_workers=True, batch_size=64,
                        fetch="item", worker_method="process")


def in_memory():
    return TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """time.perf_counter, as the probe reads it: moves only when an item or a collate costs time."""
    return install(monkeypatch)


class ClockedItems(Dataset):
    """Each item costs `item_s` on the fake clock; `fetched` lists the indices asked for, in order."""

    def __init__(self, clock: FakeClock, item_s: float, size: int = 1000):
        self.clock, self.item_s, self.size = clock, item_s, size
        self.fetched: list[int] = []

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        self.clock.advance(self.item_s)
        self.fetched.append(i)
        return torch.zeros(4), i % 2


class ClockedCollate:
    """default_collate that costs `batch_s` on the fake clock per call; `sizes` lists the batch sizes."""

    def __init__(self, clock: FakeClock, batch_s: float):
        self.clock, self.batch_s = clock, batch_s
        self.sizes: list[int] = []

    def __call__(self, items):
        self.clock.advance(self.batch_s)
        self.sizes.append(len(items))
        return default_collate(items)


def test_probe_answers_the_mean_fetch_and_collate_time_per_item(clock):
    """Two batches of 64 from items spread over the dataset, after an untimed warm-up of two items:
    (128 items + 2 collates) / 128. Powers of two keep the sums exact."""
    data = ClockedItems(clock, item_s=2**-17)
    collate = ClockedCollate(clock, batch_s=64 * 2**-17)
    assert item_fetch_seconds(data, 64, collate_fn=collate) == 2 * 2**-17
    warm_up, timed = data.fetched[:2], data.fetched[2:]
    assert len(warm_up) == 2 and collate.sizes == [2, 64, 64]
    assert len(timed) == len(set(timed)) == 128 and max(timed) > 0.8 * len(data)  # spread, not the first rows


def test_probe_stops_once_enough_time_is_spent(clock):
    """Items of 2**-8 s (3.9 ms) pass enough_s=10 ms at the third: three timed items, not 128, and
    the answer is still the time per item (the short batch is collated and counted)."""
    data = ClockedItems(clock, item_s=2**-8)
    collate = ClockedCollate(clock, batch_s=0.0)
    started = clock.now
    assert item_fetch_seconds(data, 64, enough_s=0.01, collate_fn=collate) == 2**-8
    assert len(data.fetched) == 2 + 3 and collate.sizes == [2, 3]
    assert clock.now - started == 5 * 2**-8  # the probe's whole cost: warm-up and three items


def test_probe_of_a_tiny_dataset_reads_it_once(clock):
    data = ClockedItems(clock, item_s=2**-12, size=10)
    assert item_fetch_seconds(data, 64) == 2**-12
    assert sorted(data.fetched[2:]) == list(range(10))


@pytest.mark.parametrize("item_us, workers", [(5, 0), (49, 0), (51, 2), (400, 2)])
def test_automatic_workers_follow_the_probed_fetch_time(clock, item_us, workers):
    """Under CHEAP_ITEM_S (50 us) per item the workers go, and the reason gives the measured time."""
    loader, why = fit_loader_to_data(AUTO_RAW, auto_loader(), 3, ClockedItems(clock, item_s=item_us * 1e-6,
                                                                               size=2000))
    assert loader.num_workers == workers
    if workers == 0:
        assert why["loader.num_workers"].startswith(f"0 (auto: items take {item_us:.1f} us each")
        assert f"under the {CHEAP_ITEM_S * 1e6:.0f} us" in why["loader.num_workers"]
    else:
        assert "loader.num_workers" not in why


def test_automatic_workers_go_for_data_in_memory(clock):
    loader, why = fit_loader_to_data(AUTO_RAW, auto_loader(), 3, ClockedItems(clock, item_s=5e-6, size=4096))
    assert why["loader.num_workers"].startswith("0 (auto: items take")
    assert "the CPU budget alone would give 2" in why["loader.num_workers"]
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (0, None, False)
    assert why["loader.persistent_workers"].startswith("False (auto: no workers to keep")


def test_automatic_workers_stay_for_slow_items_and_user_values_are_never_changed():
    slow = SlowDataset(size=2000, delay_s=0.005)  # 32 batches an epoch: 16 per worker, enough to keep them
    loader, why = fit_loader_to_data(AUTO_RAW, auto_loader(), 3, slow)
    assert loader == auto_loader()
    assert why == {"loader.persistent_workers": "True (auto: saves a worker start-up per epoch "
                                                 "(2 workers, 3 epochs, 32 batches an epoch))"}
    user = {**AUTO_RAW, "num_workers": 2, "persistent_workers": True}
    assert fit_loader_to_data(user, auto_loader(), 3, in_memory()) == (auto_loader(), {})


def test_persistence_is_decided_again_on_the_built_split():
    """A dataset without a `size` key leaves the resolver guessing; the built split settles it with the
    same rule the lint applies (5 batches an epoch for 2 workers is too few to keep them)."""
    slow = SlowDataset(size=300, delay_s=0.005)
    loader, why = fit_loader_to_data(AUTO_RAW, auto_loader(), 3, slow)
    assert loader.num_workers == 2 and loader.persistent_workers is False
    assert "2.5 batches per worker per epoch, under 10" in why["loader.persistent_workers"]
