"""dlpipe.loader.build.build_loader: normalised settings, memory estimates, seeding with real workers."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset, get_worker_info

from dlpipe.loader.build import build_loader

N, FEATURES = 20, 8


def tensor_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, FEATURES, generator=g), torch.randint(0, 3, (N,), generator=g))


def build(dataset, **overrides):
    settings = dict(
        batch_size=4,
        num_workers=0,
        pin_memory=False,
        prefetch_factor=None,
        persistent_workers=False,
        shuffle=False,
        drop_last=False,
        timeout=0,
        multiprocessing_context=None,
        seed=0,
        cuda=False,
    )
    settings.update(overrides)
    return build_loader(dataset, **settings)


# --- normalisation notes --------------------------------------------------------------------------


def test_settings_that_need_workers_are_dropped_with_one_note_each():
    """num_workers=0 drops prefetch_factor, persistent_workers and multiprocessing_context, one note per key."""
    ds = tensor_dataset()
    plan = build(ds, prefetch_factor=4, persistent_workers=True, multiprocessing_context="spawn")
    assert len(plan.notes) == 3
    for key in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
        assert sum(f"loader.{key}" in note for note in plan.notes) == 1, (key, plan.notes)
    assert all(note.startswith("train: ") for note in plan.notes)
    # the loader PyTorch would have rejected is built and works
    features = torch.cat([x for x, _ in plan.loader])
    assert torch.equal(features, ds.tensors[0])


def test_notes_are_prefixed_with_the_role():
    """The role passed to build_loader prefixes every note (so train and val notes can be told apart)."""
    plan = build(tensor_dataset(), prefetch_factor=2, role="val")
    assert len(plan.notes) == 1
    assert plan.notes[0].startswith("val: ") and "loader.prefetch_factor" in plan.notes[0]


def test_pin_memory_without_cuda_is_turned_off_quietly():
    """pin_memory=True with cuda=False builds an unpinned loader; the lint (not a loader note) says
    so, once per run rather than once per loader."""
    plan = build(tensor_dataset(), pin_memory=True, cuda=False)
    assert plan.loader.pin_memory is False and plan.notes == []
    # what the run records: the value the DataLoader got, and the one asked for beside it
    assert plan.settings["pin_memory"] is False and plan.requested == {"pin_memory": True}
    pinned = build(tensor_dataset(), pin_memory=True, cuda=True)  # builds on a CPU-only machine too
    assert pinned.settings["pin_memory"] is True and pinned.requested == {}


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_workers=0),
        dict(num_workers=2, prefetch_factor=3, persistent_workers=True, multiprocessing_context="spawn"),
    ],
)
def test_consistent_settings_give_no_notes_and_pass_through(settings):
    """A consistent configuration is built as given, with no notes."""
    plan = build(tensor_dataset(), **settings)
    assert plan.notes == []
    assert plan.loader.num_workers == settings["num_workers"]
    if settings["num_workers"]:
        assert plan.loader.prefetch_factor == settings["prefetch_factor"]
        assert plan.loader.persistent_workers is True


# --- memory estimates -----------------------------------------------------------------------------


def test_batch_and_inflight_bytes_estimates():
    """batch_bytes is batch_size x bytes of one item; inflight is workers x prefetch x batch_bytes."""
    ds = tensor_dataset()
    x, y = ds[0]
    item_bytes = x.nelement() * x.element_size() + y.element_size()  # float32 [8] + one int64
    assert item_bytes == FEATURES * 4 + 8
    plan = build(ds, batch_size=5, num_workers=2, prefetch_factor=3)
    assert plan.batch_bytes == 5 * item_bytes
    assert plan.inflight_bytes == 2 * 3 * plan.batch_bytes
    assert build(ds, batch_size=5).inflight_bytes == 0  # no workers hold nothing ahead


def collated_bytes(batch) -> int:
    return sum(t.nelement() * t.element_size() for t in batch)


def test_batch_bytes_matches_the_collated_batch_for_numpy_and_python_items():
    """Items of a NumPy array and a Python int are estimated as the collated batch (int -> int64) really is."""
    items = [(np.full(FEATURES, i, dtype=np.float32), i) for i in range(N)]
    plan = build(items, batch_size=5)
    first = next(iter(plan.loader))
    assert first[1].dtype == torch.int64
    assert plan.batch_bytes == collated_bytes(first) == 5 * (FEATURES * 4 + 8)
    tensors = build(tensor_dataset(), batch_size=5)
    assert tensors.batch_bytes == collated_bytes(next(iter(tensors.loader)))


def test_inflight_bytes_uses_the_prefetch_factor_the_loader_really_uses():
    """With workers and prefetch_factor=None (loader=pytorch) the estimate uses PyTorch's default prefetch."""
    plan = build(tensor_dataset(), batch_size=5, num_workers=2, prefetch_factor=None)
    assert plan.loader.prefetch_factor >= 1  # what PyTorch will actually prefetch per worker
    assert plan.inflight_bytes == 2 * plan.loader.prefetch_factor * plan.batch_bytes


# --- seeding and order ----------------------------------------------------------------------------


class RandomDraws(Dataset):
    """Each item: (worker id, a draw from Python's `random`, a draw from NumPy's global generator)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        info = get_worker_info()
        return torch.tensor([info.id if info else -1, random.random(), np.random.rand()], dtype=torch.float64)


def draws(seed: int) -> torch.Tensor:
    # fork: without per-worker seeding every worker would inherit the parent's random/NumPy state.
    # (torch >= 2 seeds both in its workers too; seed_worker reseeds them from the same seed.)
    plan = build(RandomDraws(), batch_size=1, num_workers=2, seed=seed, multiprocessing_context="fork")
    return torch.cat(list(plan.loader))


def test_workers_draw_different_random_numbers():
    """Two real (forked) workers draw different `random` and NumPy sequences: each worker is seeded."""
    rows = draws(seed=0)
    per_worker = [rows[rows[:, 0] == w] for w in (0, 1)]
    assert all(len(p) == 6 for p in per_worker)
    assert not torch.equal(per_worker[0][:, 1], per_worker[1][:, 1])  # Python random
    assert not torch.equal(per_worker[0][:, 2], per_worker[1][:, 2])  # NumPy


def test_worker_random_streams_are_reproducible_from_the_seed():
    """The same seed gives the same worker draws (whatever the parent's RNG state); another seed differs."""
    first = draws(seed=7)
    random.random(), np.random.rand(), torch.rand(())  # move every parent generator on
    again = draws(seed=7)
    other = draws(seed=8)
    assert torch.equal(first, again)
    assert not torch.equal(first[:, 1:], other[:, 1:])


def shuffled_order(seed: int, num_workers: int = 0) -> list[int]:
    ds = TensorDataset(torch.arange(32))
    plan = build(ds, batch_size=4, shuffle=True, seed=seed, num_workers=num_workers)
    return torch.cat([b[0] for b in plan.loader]).tolist()


def test_shuffle_order_is_fixed_by_the_seed():
    """The same seed gives the same shuffled order (independent of the global torch RNG); another seed differs."""
    torch.manual_seed(1)
    first = shuffled_order(seed=3)
    torch.manual_seed(2)
    again = shuffled_order(seed=3)
    other = shuffled_order(seed=4)
    assert sorted(first) == list(range(32)) and first != list(range(32))
    assert first == again
    assert first != other
    assert shuffled_order(seed=3, num_workers=2) == first  # workers do not change the order


class _Index(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return i


def test_epoch_order_depends_only_on_seed_and_epoch_even_with_persistent_workers():
    """A resumed run (fresh loader, set_epoch(2)) sees epoch 2 in the order the original run saw it."""
    original = build_loader(_Index(), batch_size=4, num_workers=1, pin_memory=False, prefetch_factor=2,
                            persistent_workers=True, shuffle=True, drop_last=False, timeout=0,
                            multiprocessing_context=None, seed=7, cuda=False).loader
    orders = []
    for epoch in (1, 2):
        original.sampler.set_epoch(epoch)
        orders.append([int(i) for batch in original for i in batch])
    assert orders[0] != orders[1] and sorted(orders[1]) == list(range(24))
    resumed = build_loader(_Index(), batch_size=4, num_workers=0, pin_memory=False, prefetch_factor=None,
                           persistent_workers=False, shuffle=True, drop_last=False, timeout=0,
                           multiprocessing_context=None, seed=7, cuda=False).loader
    resumed.sampler.set_epoch(2)
    assert [int(i) for batch in resumed for i in batch] == orders[1]


def test_more_workers_than_cpus_warn_through_the_lint_only():
    """PyTorch's own worker-count warning (at construction and per iterator) is silenced where the
    loader makes it, and nowhere else: the lint says it against the real budget, with the fix."""
    import os
    import warnings

    too_many = len(os.sched_getaffinity(0)) + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = build(tensor_dataset(), num_workers=too_many)
        assert len(list(plan.loader)) == 5
        torch.utils.data.DataLoader(tensor_dataset(), num_workers=too_many)  # a plain DataLoader still warns
    messages = [str(w.message) for w in caught if "worker processes" in str(w.message)]
    assert len(messages) == 1


def test_an_unset_prefetch_is_recorded_as_what_the_workers_keep_ready():
    """With workers, prefetch_factor=None is PyTorch's default of 2: the effective value says so, so
    `loader=pytorch` and `loader.prefetch_factor=2` record the same loader; without workers, nothing."""
    from dlpipe.loader.build import normalise

    asked = {"prefetch_factor": None, "persistent_workers": False, "multiprocessing_context": None, "timeout": 0,
             "pin_memory": False}
    effective, requested, notes = normalise(2, asked, cuda=False)
    assert effective["prefetch_factor"] == 2 and requested == {"prefetch_factor": None} and notes == []
    effective, requested, _ = normalise(0, asked, cuda=False)
    assert effective["prefetch_factor"] is None and requested == {}
