"""A user's own task, as a new user would bring it: dict samples (Hugging Face style) and a model
that computes its own loss when it is given the labels. Used by the CLI tests through _target_."""

import torch
from torch import nn
from torch.utils.data import Dataset


class DictDataset(Dataset):
    """{"features": [num_features] float, "labels": int}: two Gaussian classes."""

    def __init__(self, size: int = 512, num_features: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (size,), generator=g)
        centres = torch.randn(2, num_features, generator=g) * 2
        self.features = centres[self.labels] + 0.5 * torch.randn(size, num_features, generator=g)
        self.num_features = num_features

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"features": self.features[index].clone(), "labels": int(self.labels[index])}


class SelfLossClassifier(nn.Module):
    """model(features=..., labels=None) -> {"logits": [B, 2]} plus "loss" when labels are given."""

    def __init__(self, num_features: int = 8):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(num_features, 16), nn.ReLU(), nn.Linear(16, 2))

    @classmethod
    def from_width(cls, num_features: int, width: int = 16) -> "SelfLossClassifier":
        """A factory, as third-party models often have (`Net.from_name(...)`): a _target_ may name it."""
        model = cls(num_features)
        model.head[0], model.head[2] = nn.Linear(num_features, width), nn.Linear(width, 2)
        return model

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class StopAfterSteps:
    """A user callback (no base class needed): stops training after `steps` optimizer steps and
    writes what it saw to `record` (a file path), one line per hook call."""

    def __init__(self, steps: int, record: str):
        self.steps, self.record = steps, record

    def _write(self, line: str) -> None:
        with open(self.record, "a") as f:
            f.write(line + "\n")

    def on_train_start(self, trainer) -> None:
        self._write("train_start")

    def on_step_end(self, trainer, step: int) -> None:
        if step == self.steps:
            trainer.request_stop(f"StopAfterSteps: {step} steps")

    def on_epoch_end(self, trainer, epoch: int, metrics: dict) -> None:
        self._write(f"epoch_end {epoch} {sorted(metrics)[:1]}")

    def on_train_end(self, trainer, history: list) -> None:
        self._write(f"train_end {len(history)}")


class Crashes:
    """A user callback with a bug."""

    def on_epoch_end(self, trainer, epoch: int, metrics: dict) -> None:
        raise KeyError("val_f1")
