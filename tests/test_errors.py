"""User-facing errors: one line each, intact across pickling, stripped of worker tracebacks."""

import pickle

import pytest
from torch.utils.data import DataLoader, Dataset

from dlpipe.errors import ConfigError, DataError, user_message


def test_config_error_survives_pickling():
    """Launchers pickle a failed job's exception: the problems must come back as they were."""
    err = ConfigError(["loader.num_workers=-1: must be >= 0", "trainer.epochs=0: must be >= 1"])
    back = pickle.loads(pickle.dumps(err))
    assert back.problems == err.problems and str(back) == str(err)


class _BadItem(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise DataError(f"dataset.root='/x': image {i} cannot be decoded")


def test_worker_error_becomes_one_line():
    """A DataError raised in a real DataLoader worker is shown as its own message plus the worker."""
    loader = DataLoader(_BadItem(), batch_size=2, num_workers=1)
    with pytest.raises(DataError) as err:
        next(iter(loader))
    assert "Original Traceback" in str(err.value)  # what PyTorch does to it
    [line] = user_message(err.value)
    assert line.startswith("dataset.root='/x': image 0 cannot be decoded (DataLoader worker process 0")


def test_plain_errors_keep_their_lines():
    """Errors raised in the main process are shown as they are, one line per problem."""
    assert user_message(ConfigError(["a=1: bad", "b=2: bad"])) == ["a=1: bad", "b=2: bad"]
    assert user_message(RuntimeError()) == ["RuntimeError"]
