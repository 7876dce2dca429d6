"""Tabular classification: Gaussian class clusters, pre-generated as tensors (an in-memory workload)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from dlpipe.errors import DataError


def check_generator_args(size: int, num_features: int, noise: float, seed: int) -> None:
    """The arguments both generated tables share, each checked with the key a user would set."""
    if size < 1:
        raise DataError(f"dataset.size={size}: must be >= 1")
    if num_features < 1:
        raise DataError(f"dataset.num_features={num_features}: must be >= 1")
    if not noise >= 0:  # also rejects NaN
        raise DataError(f"dataset.noise={noise}: must be >= 0")
    if seed < 0:
        raise DataError(f"dataset.seed={seed}: must be >= 0")


class TabularDataset(Dataset):
    """Feature vectors scattered around one random centre per class.

    Centres are standard-normal points in num_features dimensions; each sample adds Gaussian noise
    with standard deviation ``noise`` to its class centre. Labels are balanced and shuffled. All
    data lives in two tensors built in ``__init__``, so an item costs a copy of one row: this is
    the dataset where ``num_workers=0`` wins.

    Args:
        size: number of samples, >= 1.
        num_features: length of each feature vector, >= 1.
        num_classes: number of classes, >= 2.
        noise: per-feature noise standard deviation, >= 0; at 0.5 with 32 features the classes are
            almost separable, around 3 they overlap heavily.
        seed: seed of the centres, labels and noise, >= 0.
    """

    def __init__(
        self, size: int = 8192, num_features: int = 32, num_classes: int = 4, noise: float = 0.5, seed: int = 0
    ):
        check_generator_args(size, num_features, noise, seed)
        if num_classes < 2:
            raise DataError(f"dataset.num_classes={num_classes}: must be >= 2")
        self.num_features = int(num_features)
        self.num_classes = int(num_classes)
        rng = np.random.default_rng(seed)
        centres = rng.standard_normal((num_classes, num_features), dtype=np.float32)
        labels = rng.permutation(np.arange(size) % num_classes)
        features = centres[labels] + np.float32(noise) * rng.standard_normal((size, num_features), dtype=np.float32)
        self.features = torch.from_numpy(features)
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int | list[int]) -> tuple[torch.Tensor, int | torch.Tensor]:
        if isinstance(index, list):  # a whole batch in one gather (loader.fetch): a copy already
            return self.features[index], self.labels[index]
        # clone(): a view would carry the whole feature storage when a worker sends an unbatched item.
        return self.features[index].clone(), int(self.labels[index])


class TabularRegression(Dataset):
    """A real-valued target from feature vectors: a random linear map plus a smooth nonlinearity and
    Gaussian noise, pre-generated as tensors like TabularDataset (an in-memory workload).

    target = x @ w / sqrt(num_features) + 0.5 * sin(2 * x[0]) + noise * N(0, 1), so a linear model
    explains most of the variance and a small MLP nearly all of it (R2 close to 1 - noise^2 / var).

    Args:
        size: number of samples, >= 1.
        num_features: length of each feature vector, >= 1.
        noise: standard deviation of the target noise, >= 0.
        seed: seed of the weights, features and noise, >= 0.
    """

    def __init__(self, size: int = 8192, num_features: int = 16, noise: float = 0.1, seed: int = 0):
        check_generator_args(size, num_features, noise, seed)
        self.num_features = int(num_features)
        rng = np.random.default_rng(seed)
        features = rng.standard_normal((size, num_features), dtype=np.float32)
        weights = rng.standard_normal(num_features).astype(np.float32)
        target = features @ weights / np.sqrt(num_features) + 0.5 * np.sin(2 * features[:, 0])
        target += np.float32(noise) * rng.standard_normal(size).astype(np.float32)
        self.features = torch.from_numpy(features)
        self.targets = torch.from_numpy(target.astype(np.float32))

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # a list gathers a whole batch (loader.fetch), already a copy; one item is cloned so a worker
        # does not send the whole storage with its view
        if isinstance(index, list):
            return self.features[index], self.targets[index]
        return self.features[index].clone(), self.targets[index].clone()
