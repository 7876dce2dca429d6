"""How a DataLoader fetches: one item at a time (PyTorch's default: `__getitem__` per index, then the
collate function), or one gather per batch (`loader.fetch=batch`: a list of indices in, a collated
batch out).

On data already in memory the per-item path is mostly Python overhead: measured here (50,000 rows
of 32 floats, batch 64, main process) one indexed gather per batch delivered 521k samples/s against
195k per item. A dataset can gather when it accepts a list of indices (`TensorDataset`, dlpipe's
tabular and token datasets: `dataset[[3, 7, 9]]`) or has a `__getitems__` that returns the collated
batch. `auto` finds out by asking for a few batches both ways and keeping the gather only where it
equals the per-item collate exactly (same structure, dtypes and values), so a dataset that augments
per item, pads, or returns something else stays on the per-item path.

The batches go through the same sampler (EpochOrder: seeded order, DDP shards) wrapped in a
BatchSampler, so order, drop_last, resume and sharding are those of the per-item path.
"""

from collections.abc import Callable, Sequence

import torch
from torch.utils.data import BatchSampler, Dataset, Subset, default_collate

from dlpipe.errors import ConfigError
from dlpipe.sample_rng import SampleBatch
from dlpipe.training import rng

PROBE_INDICES = 8
"""Indices the gather is compared on, spread over the dataset (first, last and between)."""

GATHERS: dict[str, Callable] = {
    "a list index": lambda dataset, indices: dataset[list(indices)],
    "__getitems__": lambda dataset, indices: dataset.__getitems__(list(indices)),
}
"""How a dataset may gather a batch, in the order tried: list indexing first, because PyTorch's
contract for __getitems__ is a list of items (Subset and dlpipe's wrappers always have one)."""


class BatchGather(Dataset):
    """`dataset` seen one batch at a time: item `indices` (a list) is the collated batch, from one
    gather (`how`, a key of GATHERS) or, with `how` None, from the items and `item_collate` (thread
    workers fetch either way). `item_collate` is the collate the batches equal (None: default_collate)."""

    dlpipe_wrapper = True  # unwrapped() looks through it

    def __init__(self, dataset: Dataset, how: str | None, item_collate: Callable | None = None):
        self.dataset, self.how, self.item_collate = dataset, how, item_collate

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, indices: Sequence[int]):
        if self.how is None:  # as PyTorch's own fetcher: the dataset's __getitems__ where it has one
            getitems = getattr(self.dataset, "__getitems__", None)
            items = getitems(indices) if getitems else [self.dataset[i] for i in indices]
            return (self.item_collate or default_collate)(items)
        return GATHERS[self.how](self.dataset, indices)


class EpochBatches(BatchSampler):
    """The batches of an epoch's order. set_epoch goes on to the order (EpochOrder), as the runner
    calls it; each batch is a SampleBatch carrying a random stream (`stream`, else the order's: the
    epoch's), so the items draw from their own sample_generator() whoever fetches them
    (dlpipe.sample_rng). Without either, plain lists."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, stream: int | None = None):
        super().__init__(sampler, batch_size, drop_last)
        self.stream = stream

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        stream = self.stream if self.stream is not None else getattr(self.sampler, "stream", None)
        if stream is None:
            yield from super().__iter__()
            return
        for batch in super().__iter__():
            yield SampleBatch(batch, stream)


def fetch_mode(loader) -> str:
    """How a built loader fetches: "batch" (one gather per batch) or "item"."""
    gather = loader.dataset
    return "batch" if isinstance(gather, BatchGather) and gather.how is not None else "item"


def item_collate(loader):
    """The collate a loader's batches are made by from items (None: default_collate). A loader over a
    stream collates items itself (PyTorch's DataLoader, collate_fn)."""
    if isinstance(loader.dataset, BatchGather):
        return loader.dataset.item_collate
    return loader.collate_fn


def gather_for(dataset: Dataset, fetch: str, collate_fn: Callable | None) -> str | None:
    """How the loader of `dataset` gathers batches for loader.fetch (None: item by item)."""
    if fetch == "item":
        return None
    how, why = find_gather(dataset, collate_fn)
    if how is None and fetch == "batch":
        raise ConfigError([f"loader.fetch=batch: {type(unwrapped(dataset)).__name__} cannot gather a batch equal "
                           f"to its per-item collate ({why}); use loader.fetch=item or auto"])
    return how


def unwrapped(dataset: Dataset) -> Dataset:
    """The user's dataset inside dlpipe's wrappers and the train/validation Subsets. Only those: a
    user's dataset may keep something of its own in a `dataset` attribute (a Hugging Face table)."""
    while isinstance(dataset, Subset) or getattr(type(dataset), "dlpipe_wrapper", False):
        dataset = dataset.dataset
    return dataset


def find_gather(dataset: Dataset, collate_fn: Callable | None = None) -> tuple[str | None, str]:
    """(how `dataset` gathers a batch equal to the per-item collate, or None; why), from the first of
    GATHERS that gives exactly what `collate_fn` (None: default_collate) makes of the same items.
    The random streams are left as they were: fetching may draw from them."""
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        return None, "the dataset is empty"
    count = min(PROBE_INDICES, n)
    indices = sorted({round(k * (n - 1) / max(count - 1, 1)) for k in range(count)})
    collate = collate_fn or default_collate
    # Subset and dlpipe's wrappers have a __getitems__ that fetches item by item when the user's
    # dataset has none: asking it would only fetch the items twice.
    tried = {how: g for how, g in GATHERS.items() if how != "__getitems__" or hasattr(unwrapped(dataset), how)}
    state = rng.capture()
    try:
        reasons, expected = [], None
        for how, gather in tried.items():
            try:
                batch = gather(dataset, indices)
            except Exception as e:  # noqa: BLE001 - any dataset may refuse a list: that is the answer
                reasons.append(f"{how}: {_refusal(e)}")
                continue
            if expected is None:
                expected = collate([dataset[i] for i in indices])
            if same_batch(batch, expected):
                return how, f"{how} gives the per-item collate exactly on {len(indices)} indices"
            reasons.append(f"{how}: not the per-item collate")
        return None, "; ".join(reasons)
    finally:
        rng.restore(state)


def _refusal(error: Exception) -> str:
    """The dataset's own error for a list index, not dlpipe's SampleError around it: `TypeError: one
    index at a time`, cut to a line of 100 characters."""
    cause = error.__cause__ if isinstance(error.__cause__, Exception) else error
    text = str(cause).splitlines()[0][:100] if str(cause) else ""
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def same_batch(a, b) -> bool:
    """Equal batches: the same nesting (a tuple and a list count as one), dtypes, shapes and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(same_batch(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
