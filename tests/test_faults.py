"""Data faults name the sample (index in the user's dataset, file when known) and the likely cause."""

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from dlpipe.loader.faults import NamedErrors, SampleError, explain_loader_failure
from dlpipe.schema import LoaderConfig


class Files(Dataset):
    """A dataset with a `samples` list of (path, label), like the image folder; item 5 is broken."""

    num_classes = 2

    def __init__(self):
        self.samples = [(f"/data/img{i}.jpg", i % 2) for i in range(8)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        if i == 5:
            raise OSError("truncated JPEG")
        return torch.zeros(2), self.samples[i][1]


def test_error_names_the_users_index_and_file_through_subsets():
    """Through a train/val Subset, the message gives the original index and the file."""
    wrapped = NamedErrors(Subset(Files(), [7, 5, 1]))
    with pytest.raises(SampleError, match=r"^dataset item 5 \(/data/img5.jpg\): OSError: truncated JPEG$"):
        wrapped[1]
    assert len(wrapped) == 3 and NamedErrors(Files()).num_classes == 2  # behaves like the wrapped dataset


def test_batched_fetch_keeps_the_fast_path_and_still_names_the_sample():
    """DataLoader's batched __getitems__ is used; a failing batch is narrowed down to its sample."""
    data = NamedErrors(Subset(TensorDataset(torch.arange(10.0), torch.arange(10)), list(range(10))))
    batch = next(iter(DataLoader(data, batch_size=4)))
    assert batch[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    broken = NamedErrors(Subset(Files(), list(range(8))))
    with pytest.raises(SampleError, match="dataset item 5"):
        broken.__getitems__([4, 5, 6])


def test_wrapper_pickles_for_worker_processes():
    """Spawned workers unpickle the dataset: the wrapper survives the round trip."""
    back = pickle.loads(pickle.dumps(NamedErrors(Files())))
    assert len(back) == 8 and back[0][1] == 0


@pytest.mark.parametrize(
    "message, expected",
    [
        ("DataLoader worker (pid(s) 123) exited unexpectedly", "out-of-memory killer or a full /dev/shm"),
        ("DataLoader worker (pid 77) is killed by signal: Killed. ", "try fewer loader.num_workers (now 4)"),
        ("DataLoader timed out after 5 seconds", "loader.timeout=5: no batch arrived"),
        ("mat1 and mat2 shapes cannot be multiplied", None),
    ],
)
def test_loader_failures_get_a_likely_cause(message, expected):
    """Worker deaths and timeouts are explained with the settings to change; other errors are not touched."""
    loader = LoaderConfig(num_workers=4, prefetch_factor=2, batch_size=64, timeout=5)
    why = explain_loader_failure(RuntimeError(message), loader)
    assert (why is None) if expected is None else (expected in why)
