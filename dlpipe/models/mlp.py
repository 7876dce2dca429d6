"""A plain multilayer perceptron for the tabular dataset."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``depth`` hidden layers of Linear-ReLU(-Dropout), then a linear head.

    Deliberately without normalisation layers: its output for a sample does not depend on the rest
    of the batch, which tests of gradient accumulation and batch-size equivalence rely on.

    Args:
        in_features: length of the input vectors, >= 1.
        num_classes: number of output logits, >= 1.
        hidden: width of every hidden layer, >= 1.
        depth: number of hidden layers, >= 0 (0 gives logistic regression).
        dropout: dropout probability after each hidden ReLU, in [0, 1); 0 adds no layer.
    """

    def __init__(
        self, in_features: int = 32, num_classes: int = 4, hidden: int = 128, depth: int = 2, dropout: float = 0.0
    ):
        super().__init__()
        for key, value in (("in_features", in_features), ("num_classes", num_classes), ("hidden", hidden)):
            if value < 1:
                raise ValueError(f"model.{key}={value}: must be >= 1")
        if depth < 0:
            raise ValueError(f"model.depth={depth}: must be >= 0")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout}: must be >= 0 and < 1")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, in_features] float -> logits [B, num_classes]."""
        return self.net(features)
