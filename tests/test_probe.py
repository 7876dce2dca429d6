"""Automatic workers fitted to the data: a cheap in-process fetch means no workers."""

import time

import torch
from faulty_data import SlowDataset
from torch.utils.data import TensorDataset

from dlpipe.loader.policy import CHEAP_ITEM_S
from dlpipe.loader.probe import item_fetch_seconds
from dlpipe.schema import LoaderConfig
from dlpipe.tasks.build import fit_loader_to_data

AUTO_RAW = {"num_workers": "${auto_workers:}", "prefetch_factor": "${auto_prefetch:${.num_workers}}",
            "persistent_workers": "${auto_persistent:${.num_workers},${trainer.epochs},0}"}


def auto_loader(workers=2):
    return LoaderConfig(num_workers=workers, prefetch_factor=2, persistent_workers=True, batch_size=64)


def in_memory():
    return TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))


def test_probe_tells_memory_from_slow_items_and_stays_cheap():
    assert item_fetch_seconds(in_memory(), 64) < CHEAP_ITEM_S
    started = time.perf_counter()
    assert item_fetch_seconds(SlowDataset(size=1000, delay_s=0.005), 64) > 10 * CHEAP_ITEM_S
    assert time.perf_counter() - started < 0.5  # stopped after ~10 ms, not 2 x 64 x 5 ms


def test_automatic_workers_go_for_data_in_memory():
    loader, why = fit_loader_to_data(AUTO_RAW, auto_loader(), 3, in_memory())
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
