"""Automatic workers fitted to the data: a cheap in-process fetch means no workers."""

import time

import torch
from torch.utils.data import TensorDataset

from dlpipe.build import fit_workers_to_data
from dlpipe.config.decisions import CHEAP_ITEM_S
from dlpipe.data.probe import item_fetch_seconds
from faulty_data import SlowDataset

AUTO_RAW = {"loader": {"num_workers": "${auto_workers:}", "prefetch_factor": "${auto_prefetch:${.num_workers}}",
                       "persistent_workers": "${auto_persistent:${.num_workers},${trainer.epochs},100}"}}


def resolved_loader(workers=2):
    return {"loader": {"num_workers": workers, "prefetch_factor": 2, "persistent_workers": True, "batch_size": 64}}


def in_memory():
    return TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))


def test_probe_tells_memory_from_slow_items_and_stays_cheap():
    assert item_fetch_seconds(in_memory(), 64) < CHEAP_ITEM_S
    started = time.perf_counter()
    assert item_fetch_seconds(SlowDataset(size=1000, delay_s=0.005), 64) > 10 * CHEAP_ITEM_S
    assert time.perf_counter() - started < 0.5  # stopped after ~10 ms, not 2 x 64 x 5 ms


def test_automatic_workers_go_for_data_in_memory():
    resolved = resolved_loader()
    why = fit_workers_to_data(AUTO_RAW, resolved, in_memory())
    assert why.startswith("0 (auto: items take") and "the CPU budget alone would give 2" in why
    assert resolved["loader"] == {"num_workers": 0, "prefetch_factor": None, "persistent_workers": False, "batch_size": 64}


def test_automatic_workers_stay_for_slow_items_and_user_values_are_never_changed():
    resolved = resolved_loader()
    assert fit_workers_to_data(AUTO_RAW, resolved, SlowDataset(size=1000, delay_s=0.005)) is None
    assert resolved == resolved_loader()
    user = {"loader": {**AUTO_RAW["loader"], "num_workers": 2}}
    assert fit_workers_to_data(user, resolved, in_memory()) is None
    assert resolved == resolved_loader()
