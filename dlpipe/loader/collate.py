"""Collate functions for `loader.collate_fn`: batches of samples whose tensors differ in length.

PyTorch's default_collate stacks, so items of different lengths fail with "stack expects each
tensor to be equal size". PadSequences pads them to the longest in the batch instead and says
which positions are real. `collate_first` collates a split's first items before anything is
tracked, so items that do not collate are one line with that fix, not a traceback.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

from dlpipe.loader.faults import SampleError


def collate_first(items: list, collate_fn=None, what: str = "dataset items"):
    """`collate_fn` (None: default_collate) of a split's first items; items it cannot put into one
    batch are a SampleError naming the fix (one line, exit 2, before anything is tracked)."""
    try:
        return (collate_fn or default_collate)(items)
    except (TypeError, RuntimeError) as e:
        raise SampleError(f"{what} 0-{len(items) - 1} do not collate into a batch ({type(e).__name__}: {e}); "
                          "variable-length items need loader.collate_fn (e.g. dlpipe.loader.collate.PadSequences)"
                          ) from e


@dataclass(frozen=True)
class PadSequences:
    """Pad variable-length tensors (along dim 0) to the batch's longest, on the right.

    Items are tuples/lists or dicts. In each field, tensors (or NumPy arrays) of one or more
    dimensions whose shapes differ are padded with `torch.nn.utils.rnn.pad_sequence` (only dim 0
    may differ); every other field (numbers, equal-shape tensors, strings) collates as
    default_collate does. Returns:

    - tuple/list items `(input, target, *rest)`: the tuple `(inputs, targets, *rest, lengths)`:
      inputs [B, T, ...] padded with `pad_value`, targets [B, T', ...] padded with
      `target_pad_value`, the rest with `pad_value`, and `lengths` an int64 [B] tensor, each input's
      length along dim 0 before padding (the real positions of inputs[i] are [:lengths[i]]).
    - dict items: a dict with the same keys, padded the same way (the `target_field` with
      `target_pad_value`), plus `mask_field`: an int64 [B, T] tensor, 1 at the real positions of the
      input field and 0 at padding, T its padded length (the Hugging Face `attention_mask`). The
      input field is the first key other than `target_field` and `mask_field`. Items that bring
      their own `mask_field` have it padded with 0 instead.

    The default target padding, -100, is cross-entropy's ignore_index: padded positions cost no loss
    and no gradient. Right-padding leaves a causal model's outputs at real positions unchanged.
    A plain frozen dataclass, so it pickles to spawn workers.

    Args:
        pad_value: fills padded positions of every field but the target and the mask (0: a token id
            or a zero feature).
        target_pad_value: fills padded target positions (-100: ignored by cross-entropy).
        target_field: dict items: the target's key (tuple items: the second element).
        mask_field: dict items: the key of the mask added to the batch.
    """

    pad_value: float = 0
    target_pad_value: int = -100
    target_field: str = "labels"
    mask_field: str = "attention_mask"

    def __call__(self, items: list):
        first = items[0]
        if isinstance(first, dict):
            return self._dicts(items)
        if isinstance(first, (tuple, list)):
            fields = tuple(_collate([item[i] for item in items], f"element {i}",
                                    self.target_pad_value if i == 1 else self.pad_value)
                           for i in range(len(first)))
            return (*fields, _lengths([item[0] for item in items], "element 0 (the input)"))
        raise TypeError(f"PadSequences: items must be tuples/lists (input, target, ...) or dicts, "
                        f"got {type(first).__name__}")

    def _dicts(self, items: list[dict]) -> dict:
        batch = {}
        for key in items[0]:
            pad = self.target_pad_value if key == self.target_field else 0 if key == self.mask_field else self.pad_value
            batch[key] = _collate([item[key] for item in items], f"field {key!r}", pad)
        if self.mask_field not in batch:
            source = next((k for k in batch if k not in (self.target_field, self.mask_field)), None)
            if source is None:
                raise TypeError(f"PadSequences: dict items need an input field besides {self.target_field!r} "
                                f"to build {self.mask_field!r} from; they have: {', '.join(map(str, batch))}")
            lengths = _lengths([item[source] for item in items], f"field {source!r} (the input)")
            positions = torch.arange(int(lengths.max()) if len(lengths) else 0)
            batch[self.mask_field] = (positions < lengths[:, None]).long()
        return batch


def _collate(values: list, name: str, pad: float):
    """One field of the batch: padded when its tensors differ in shape, else default_collate."""
    tensors = [torch.as_tensor(v) if isinstance(v, np.ndarray) else v for v in values]
    ragged = (all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors)
              and len({t.shape for t in tensors}) > 1)
    if not ragged:
        return default_collate(values)
    if len({t.shape[1:] for t in tensors}) > 1:
        shapes = sorted({tuple(t.shape) for t in tensors})
        raise ValueError(f"PadSequences: {name} differs beyond dim 0 ({shapes[0]} and {shapes[-1]}); "
                         "only the first dimension (the sequence) is padded")
    return pad_sequence(tensors, batch_first=True, padding_value=pad)


def _lengths(values: list, name: str) -> torch.Tensor:
    """int64 [B]: each value's size along dim 0."""
    if not all(isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim > 0 for v in values):
        kinds = sorted({type(v).__name__ for v in values})
        raise TypeError(f"PadSequences: {name} must be a tensor or array with a length (dim >= 1), "
                        f"got {', '.join(kinds)}")
    return torch.tensor([v.shape[0] for v in values], dtype=torch.long)
