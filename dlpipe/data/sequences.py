"""Token sequences from a fixed sparse Markov chain: a language-modelling workload without a corpus."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from dlpipe.errors import DataError

# Each token has this many possible successors, so the best achievable loss is about
# ln(_SUCCESSORS) nats or less, far below the ln(vocab_size) of guessing: clearly learnable.
_SUCCESSORS = 4


class TokenSequenceDataset(Dataset):
    """Next-token prediction on sequences drawn from a random sparse Markov chain.

    The chain (which tokens may follow which, and how likely) is fixed by ``seed``; all tokens are
    generated once in ``__init__`` and kept as one LongTensor, so items cost a slice and a copy.
    An item is ``(x, y)``: two LongTensors of length seq_len with ``y[t] == x[t + 1]``; with
    ``as_dict`` it is ``{"input_ids": x, "labels": y}``.

    With ``min_seq_len`` the lengths vary: item i has a length drawn once, uniformly from
    [min_seq_len, seq_len], and is the prefix of the item the fixed-length dataset (same seed) has
    at i. Such items do not stack: use a padding collate (dlpipe.loader.collate.PadSequences).

    Args:
        size: number of sequences, >= 1.
        seq_len: length of x and y (each sequence holds seq_len + 1 tokens), >= 1; with
            min_seq_len, the longest length.
        vocab_size: number of distinct tokens, >= 2; also ``num_classes`` (targets are token ids).
        seed: seed of the chain, the sequences and their lengths, >= 0.
        min_seq_len: shortest length, 1 to seq_len; None: every item is seq_len long.
        as_dict: items as dicts ``{"input_ids", "labels"}`` (the Hugging Face layout) instead of tuples.
    """

    def __init__(self, size: int = 4096, seq_len: int = 64, vocab_size: int = 128, seed: int = 0,
                 min_seq_len: int | None = None, as_dict: bool = False):
        if size < 1:
            raise DataError(f"dataset.size={size}: must be >= 1")
        if seq_len < 1:
            raise DataError(f"dataset.seq_len={seq_len}: must be >= 1")
        if vocab_size < 2:
            raise DataError(f"dataset.vocab_size={vocab_size}: must be >= 2")
        if seed < 0:
            raise DataError(f"dataset.seed={seed}: must be >= 0")
        if min_seq_len is not None and not 1 <= min_seq_len <= seq_len:
            raise DataError(f"dataset.min_seq_len={min_seq_len}: must be from 1 to dataset.seq_len={seq_len}, "
                            "or null for fixed-length items")
        self.seq_len = int(seq_len)
        self.vocab_size = self.num_classes = int(vocab_size)
        self.as_dict = bool(as_dict)
        self.tokens = torch.from_numpy(_markov_tokens(size, seq_len + 1, vocab_size, seed))
        self.lengths = None
        if min_seq_len is not None:
            # A generator of its own: the tokens stay those of the fixed-length dataset with this seed.
            lengths = np.random.default_rng([seed, 1]).integers(min_seq_len, seq_len, size, endpoint=True)
            self.lengths = torch.from_numpy(lengths)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int | list[int]) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        if isinstance(index, list):  # a whole batch in one gather (loader.fetch)
            if self.lengths is not None:
                raise TypeError("variable-length sequences are padded per batch: fetch them item by item")
            rows = self.tokens[index]
            x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            return {"input_ids": x, "labels": y} if self.as_dict else (x, y)
        row = self.tokens[index]
        if self.lengths is not None:
            row = row[: int(self.lengths[index]) + 1]
        # clone(): a view would carry the whole token storage when a worker sends an unbatched item.
        x, y = row[:-1].clone(), row[1:].clone()
        return {"input_ids": x, "labels": y} if self.as_dict else (x, y)


def _markov_tokens(size: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """int64 [size, length] walks of a chain where each token has a few weighted successors."""
    rng = np.random.default_rng(seed)
    k = min(_SUCCESSORS, vocab)
    successors = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(vocab)])
    cumulative = np.cumsum(rng.dirichlet(np.ones(k), size=vocab), axis=1)  # [vocab, k]
    tokens = np.empty((size, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, vocab, size)
    rows = np.arange(size)
    for t in range(1, length):  # vectorised over sequences, sequential in time
        prev = tokens[:, t - 1]
        # Count thresholds below u: the inverse-CDF pick of a successor; min() guards rounding at 1.0.
        pick = np.minimum((rng.random(size)[:, None] > cumulative[prev]).sum(axis=1), k - 1)
        tokens[rows, t] = successors[prev, pick]
    return tokens
