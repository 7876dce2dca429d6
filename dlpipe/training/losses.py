"""dlpipe's own losses, for what torch.nn's do not cover: token-level logits, and a model that computes
its own loss. Every other loss is any torch.nn loss (or callable) named by `_target_` in conf/loss/."""

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Targets with this value cost nothing: padded positions (dlpipe.loader.collate.PadSequences)."""


class CrossEntropy(nn.Module):
    """Mean cross-entropy over the last dimension: [B, C] logits with [B] class indices, or token-level
    [B, T, V] logits with [B, T] targets (torch.nn.CrossEntropyLoss wants the classes in dim 1).

    Args:
        label_smoothing: as in torch.nn.CrossEntropyLoss, in [0, 1).
        ignore_index: targets with this value are left out of the mean (padding).
    """

    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX):
        super().__init__()
        self.label_smoothing, self.ignore_index = label_smoothing, ignore_index

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2 or target.dim() != 1:  # token level: one row per position (a view each)
            logits, target = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
        total = F.cross_entropy(logits, target, reduction="sum", ignore_index=self.ignore_index,
                                label_smoothing=self.label_smoothing)
        # The mean over the targets that count; a batch of padding only is 0, not 0/0 = NaN.
        return total / (target != self.ignore_index).sum().clamp(min=1)


class ModelLoss:
    """`loss=model`: the model computed its loss itself (as Hugging Face models do when the batch
    holds `labels`) and returned it as `output["loss"]` or `output.loss`."""

    def __call__(self, output, target=None) -> torch.Tensor:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None:
            raise ValueError(f"loss=model: the model returned {type(output).__name__} without a `loss`; give it the "
                             "target fields (batch.input=null passes the whole batch) or pick a loss")
        return loss
