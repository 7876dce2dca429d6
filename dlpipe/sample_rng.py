"""Randomness per sample: a generator that depends on (seed, epoch, sample index) only.

PyTorch seeds each worker process from base_seed + worker_id, so an item's random augmentation
depends on which worker fetched it: change num_workers, switch to thread workers or resume after
`dlpipe tune` changed the loader, and the same sample is augmented differently. A dataset that draws
from `sample_generator()` instead gets the same draws for a sample in a given epoch whoever fetches
it, in a worker process, a thread or the main process, and a resumed run sees exactly the batches of
the uninterrupted one (docs/checkpoints.md: "Exact resume"):

    def __getitem__(self, i):
        flip = torch.rand((), generator=dlpipe.sample_rng.sample_generator()) < 0.5

Validation batches have one stream for every epoch, so a dataset that draws there scores the same
samples the same way each time. Outside dlpipe's loaders (a user's own loop) it returns None, and
torch's functions then draw from the global RNG as they would without it.

Batches of indices are SampleBatch lists (dlpipe.loader.fetch.EpochBatches): they carry their
stream (seed and epoch) and survive pickling to worker processes, so a persistent worker learns
the epoch from each batch without being told. dlpipe's dataset wrapper
(dlpipe.loader.faults.NamedErrors) names the sample being fetched with `fetching()`.
"""

import threading

import torch

_current = threading.local()
"""Per thread: thread workers fetch several samples at once in one process."""

_MIX = 0x9E3779B97F4A7C15  # the golden-ratio constant of splitmix64: spreads neighbouring streams apart
_MASK = (1 << 63) - 1


class SampleBatch(list):
    """A batch of dataset indices that knows its epoch's random stream (seed * 1_000_003 + epoch,
    the stream EpochOrder shuffles with)."""

    def __init__(self, indices, stream: int):
        super().__init__(indices)
        self.stream = stream

    def __reduce__(self):
        return SampleBatch, (list(self), self.stream)


def epoch_stream(seed: int, epoch: int) -> int:
    """The random stream of an epoch: the seed of its order and, with a sample's index, of its draws."""
    return seed * 1_000_003 + epoch


def sample_seed(stream: int, index: int) -> int:
    """The seed of sample `index` in the epoch of `stream`: a function of both only."""
    return ((stream * _MIX) ^ (index * 0xBF58476D1CE4E5B9 + 1)) & _MASK


def fetching(stream: int | None, index: int = 0) -> None:
    """Name the sample this thread fetches now (None: none, sample_generator() gives None). A plain
    attribute write per item: this sits on the per-item path of every training fetch."""
    _current.sample = None if stream is None else (stream, index)
    _current.generator = None


def sample_generator() -> torch.Generator | None:
    """The generator of the sample being fetched (seeded from seed, epoch and index), or None
    outside dlpipe's loaders. The same object for repeated calls within one fetch, so
    successive draws continue one stream."""
    sample = getattr(_current, "sample", None)
    if sample is None:
        return None
    if _current.generator is None:
        _current.generator = torch.Generator().manual_seed(sample_seed(*sample))
    return _current.generator
