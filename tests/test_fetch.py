"""loader.fetch: whole batches gathered in one call where that gives exactly the per-item batches."""

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from dlpipe.data.sequences import TokenSequenceDataset
from dlpipe.data.tabular import TabularDataset, TabularRegression
from dlpipe.errors import ConfigError
from dlpipe.loader.build import build_loader
from dlpipe.loader.collate import PadSequences
from dlpipe.loader.faults import NamedErrors
from dlpipe.loader.fetch import BatchGather, find_gather, same_batch


def loader_of(dataset, fetch, **over):
    settings = dict(batch_size=8, num_workers=0, pin_memory=False, prefetch_factor=None, persistent_workers=False,
                    shuffle=True, drop_last=False, timeout=0.0, multiprocessing_context=None, seed=3, cuda=False)
    settings.update(over)
    return build_loader(dataset, fetch=fetch, **settings)


def epochs_of(plan, epochs=2):
    out = []
    for epoch in range(epochs):
        plan.loader.sampler.set_epoch(epoch)
        out.append(list(plan.loader))
    return out


class Augmenting(Dataset):
    """Accepts a list index but draws noise per call: its gather is not the per-item collate."""

    def __init__(self):
        self.x = torch.arange(40.0).reshape(20, 2)

    def __len__(self):
        return 20

    def __getitem__(self, index):
        return self.x[index] + torch.rand(self.x[index].shape), 0


class GathersItself(Dataset):
    """int-only __getitem__, and a __getitems__ that returns the collated batch (not a list of items)."""

    def __init__(self):
        self.x, self.y = torch.randn(30, 3), torch.arange(30)

    def __len__(self):
        return 30

    def __getitem__(self, index: int):
        return {"x": self.x[index], "y": int(self.y[index])}

    def __getitems__(self, indices):
        return {"x": self.x[indices], "y": self.y[indices]}


@pytest.mark.parametrize("dataset, how", [
    (TensorDataset(torch.randn(50, 4), torch.randint(0, 3, (50,))), "a list index"),
    (TabularDataset(size=64, num_features=5), "a list index"),
    (TabularRegression(size=64, num_features=5), "a list index"),
    (TokenSequenceDataset(size=32, seq_len=9, vocab_size=20), "a list index"),
    (TokenSequenceDataset(size=32, seq_len=9, vocab_size=20, as_dict=True), "a list index"),
    (GathersItself(), "__getitems__"),
])
def test_datasets_that_gather_are_found_and_give_the_same_batches_in_the_same_order(dataset, how):
    """Through dlpipe's wrappers and a Subset, shuffled over two epochs, with a short last batch: the
    batch fetch yields exactly the per-item collate of the same indices, in the per-item loader's order."""
    wrapped = NamedErrors(Subset(dataset, list(range(3, len(dataset)))))
    assert find_gather(wrapped)[0] == how
    batches = loader_of(wrapped, "batch")
    assert batches.fetch == "batch" and isinstance(batches.loader.dataset, BatchGather)
    order = batches.loader.sampler
    for epoch, got in enumerate(epochs_of(batches)):
        order.set_epoch(epoch)
        want = [default_collate([wrapped[i] for i in indices]) for indices in order]
        assert len(got) == len(want) and all(same_batch(a, b) for a, b in zip(got, want))
    if how == "a list index":  # PyTorch's own per-item path works too, and agrees batch for batch
        items = loader_of(wrapped, "item")
        assert all(same_batch(a, b) for a, b in zip(sum(epochs_of(items), []), sum(epochs_of(batches), []),
                                                   strict=True))
    first, second = epochs_of(batches)
    assert not same_batch(first[0], second[0])  # the epochs' orders differ: set_epoch reached the order


@pytest.mark.parametrize("dataset, why", [
    (Augmenting(), "a list index: not the per-item collate"),
    (TokenSequenceDataset(size=32, seq_len=9, vocab_size=20, min_seq_len=3), "a list index: TypeError"),
    (Subset(TensorDataset(torch.randn(10, 2)), []), "the dataset is empty"),
])
def test_datasets_that_cannot_gather_stay_item_by_item(dataset, why):
    how, reason = find_gather(dataset)
    assert how is None and why in reason
    if len(dataset):
        assert loader_of(dataset, "auto").fetch == "item"
        with pytest.raises(ConfigError, match="loader.fetch=batch: .* cannot gather a batch equal to its per-item"):
            loader_of(dataset, "batch")


def test_the_reason_names_the_datasets_own_refusal_not_dlpipes_wrapper():
    """Training wraps the dataset (NamedErrors), whose SampleError says nothing of why a list index
    failed: the reason quotes the dataset's own error."""
    from dlpipe.loader.faults import NamedErrors

    class OneAtATime(TensorDataset):
        def __getitem__(self, i):
            if isinstance(i, list):
                raise TypeError("one index at a time")
            return super().__getitem__(i)

    how, reason = find_gather(NamedErrors(OneAtATime(torch.randn(10, 2))))
    assert (how, reason) == (None, "a list index: TypeError: one index at a time")


def test_a_custom_collate_is_what_the_gather_must_equal():
    """Fixed-length tokens padded by PadSequences gain a lengths field the plain gather lacks: item by item."""
    tokens = TokenSequenceDataset(size=16, seq_len=6, vocab_size=10)
    assert find_gather(tokens)[0] == "a list index"
    assert find_gather(tokens, PadSequences())[0] is None


def test_drop_last_and_ranks_shard_the_same_way():
    """Two ranks, drop_last: each rank's batches are its per-item batches."""
    data = NamedErrors(TensorDataset(torch.arange(45.0).unsqueeze(1), torch.arange(45)))
    for rank in (0, 1):
        items = loader_of(data, "item", drop_last=True, rank=rank, world=2)
        batches = loader_of(data, "batch", drop_last=True, rank=rank, world=2)
        got, want = epochs_of(batches, 1)[0], epochs_of(items, 1)[0]
        assert len(got) == len(want) == 2 and all(same_batch(a, b) for a, b in zip(got, want))


def test_the_probe_leaves_the_random_streams_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    find_gather(Augmenting())
    assert torch.equal(torch.rand(3), expected)


def test_a_failing_item_in_a_gathered_batch_is_named():
    """The batch path keeps the per-item error message: the item that fails is named."""
    class Broken(TensorDataset):
        def __getitem__(self, index):
            if isinstance(index, list) and 7 in index or index == 7:
                raise ValueError("corrupt row")
            return super().__getitem__(index)

    wrapped = NamedErrors(Broken(torch.randn(12, 2)))
    with pytest.raises(Exception, match="dataset item 7: ValueError: corrupt row"):
        wrapped[[5, 6, 7]]


def test_same_batch_compares_structure_dtype_and_values():
    a = [torch.tensor([1, 2]), {"k": torch.tensor([1.0])}]
    assert same_batch(a, (torch.tensor([1, 2]), {"k": torch.tensor([1.0])}))
    assert not same_batch(a, [torch.tensor([1, 2]), {"k": torch.tensor([1.0], dtype=torch.float64)}])
    assert not same_batch(a, [torch.tensor([1, 3]), {"k": torch.tensor([1.0])}])
    assert not same_batch(a, [torch.tensor([1, 2]), {"j": torch.tensor([1.0])}])
    assert not same_batch([1, 2], [1, 2, 3])
