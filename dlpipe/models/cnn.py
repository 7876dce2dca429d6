"""A small convolutional classifier for the vision datasets."""

from __future__ import annotations

import torch
from torch import nn


def _block(c_in: int, c_out: int, pool: bool) -> nn.Sequential:
    # bias=False: BatchNorm's shift makes a conv bias redundant.
    layers = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU blocks (width, 2*width, 4*width channels), global average pool, linear head.

    The first two blocks halve the resolution; the adaptive pool makes the head independent of the
    input size, so any H, W >= 4 works (the vision datasets give 56 or so).

    Args:
        num_classes: number of output logits, >= 1.
        in_channels: channels of the input images (3 for RGB), >= 1.
        width: channels of the first block, >= 1; parameters grow with width squared.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 32):
        super().__init__()
        for key, value in (("num_classes", num_classes), ("in_channels", in_channels), ("width", width)):
            if value < 1:
                raise ValueError(f"model.{key}={value}: must be >= 1")
        self.features = nn.Sequential(
            _block(in_channels, width, pool=True),
            _block(width, 2 * width, pool=True),
            _block(2 * width, 4 * width, pool=False),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[B, in_channels, H, W] float -> logits [B, num_classes]."""
        return self.head(self.features(images))
