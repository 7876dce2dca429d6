"""Build DataLoaders with consistent settings, and estimate the memory they hold.

PyTorch raises deep inside DataLoader for combinations that a config can easily produce (a
prefetch_factor with 0 workers, persistent workers with none to keep); here they are normalised
and every change is returned as a note for the run log.
"""

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, SequentialSampler

from dlpipe.loader import policy
from dlpipe.loader.collate import collate_first
from dlpipe.loader.fetch import BatchGather, EpochBatches, fetch_mode, gather_for, unwrapped
from dlpipe.loader.stream_threads import thread_stream_loader
from dlpipe.loader.streams import StreamShare, is_stream, reads_positions
from dlpipe.loader.threads import ThreadLoader, worker_method_of
from dlpipe.loader.worker_signals import SignalSafeLoader, worker_init_fn
from dlpipe.sample_rng import epoch_stream
from dlpipe.schema import LoaderConfig


@dataclass(frozen=True)
class LoaderPlan:
    """The DataLoader that was built plus what it holds in memory and what was changed."""

    loader: DataLoader
    notes: list[str]
    batch_bytes: int
    """Bytes of one collated batch (see batch_bytes())."""
    inflight_bytes: int
    """Bytes the workers hold ready: num_workers x prefetch_factor x batch_bytes."""
    settings: dict = dataclasses.field(default_factory=dict)
    """The normalised settings (NORMALISED keys) the DataLoader got."""
    requested: dict = dataclasses.field(default_factory=dict)
    """key -> the value asked for, for each of `settings` that normalise() changed, and worker_method
    where thread was asked with no workers (the main process fetches)."""
    fetch: str = "item"
    """How the DataLoader fetches: "item", or "batch" (one gather per batch: loader.fetch)."""
    worker_method: str = "process"
    """Who fetches when there are workers: "process" (PyTorch's) or "thread" (loader.worker_method)."""


class EpochOrder(Sampler[int]):
    """This rank's sample order for one epoch, depending only on (seed, epoch), like DistributedSampler.

    The default RandomSampler draws from the DataLoader's generator, which persistent workers
    consume differently from fresh ones, so a resumed run would see another order and skip or
    repeat samples. The runner calls set_epoch() before each epoch.

    With several ranks, every rank draws the same permutation and takes every world-th index
    from its own offset, so one optimizer step of N ranks sees the same samples as one process
    with N times the batch. Training pads the order (repeating its first indices) to a multiple
    of the world size, because DDP needs every rank to take the same number of steps; validation
    does not pad, so every sample is scored exactly once.
    """

    def __init__(self, size: int, seed: int, *, shuffle: bool = True, rank: int = 0, world: int = 1, pad: bool = True):
        self.size, self.seed, self.epoch = size, seed, 0
        self.shuffle, self.rank, self.world, self.pad = shuffle, rank, world, pad

    @property
    def stream(self) -> int:
        """The epoch's random stream: its order's seed, and (dlpipe.sample_rng) its samples'."""
        return epoch_stream(self.seed, self.epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.pad:
            return -(-self.size // self.world)
        return len(range(self.rank, self.size, self.world))

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.stream)).tolist()
        else:
            order = list(range(self.size))
        if self.pad and self.world > 1 and order:
            short = len(self) * self.world - self.size
            order += (order * (short // len(order) + 1))[:short]
        return iter(order[self.rank::self.world])


def sample_bytes(dataset: Dataset) -> int:
    """Bytes of the tensors/arrays in one item (0 if the dataset is empty or not introspectable)."""
    if len(dataset) == 0:  # type: ignore[arg-type]
        return 0
    return _nbytes(dataset[0])


ESTIMATE_ITEMS = 16
"""Items batch_bytes() collates with a custom collate_fn: the longest of 16 uniformly spread lengths
is expected at 94% of their range (of 64: 98%); long-tailed lengths, or a dataset sorted by length,
are estimated lower."""


def batch_bytes(dataset: Dataset, batch_size: int, collate_fn: Callable | None = None) -> int:
    """Bytes of one collated batch, estimated without a DataLoader.

    With default_collate every item has the same shapes (else it cannot stack them), so the first
    item's bytes times batch_size is exact. A custom collate (padding) may add fields (lengths, a
    mask) and size a batch by its longest item, which the first item does not show: then a real
    batch of the first ESTIMATE_ITEMS items (fewer than batch_size, so a slow dataset pays a few
    fetches, not a batch) is collated and scaled to batch_size. The padded length is the longest of
    those items, a little short of the longest of a whole batch.
    """
    if collate_fn is None:
        return sample_bytes(dataset) * batch_size
    n = min(batch_size, ESTIMATE_ITEMS, len(dataset))  # type: ignore[arg-type]
    if n == 0:
        return 0
    return _nbytes(collate_fn([dataset[i] for i in range(n)])) * batch_size // n


def stream_batch_bytes(stream: IterableDataset, batch_size: int, collate_fn: Callable | None = None) -> int:
    """batch_bytes of a stream: its first items (ESTIMATE_ITEMS at most, fewer than a batch), read in
    this process, collated and scaled to batch_size; 0 for an empty stream."""
    items = list(itertools.islice(stream, min(batch_size, ESTIMATE_ITEMS)))
    if not items:
        return 0
    return _nbytes(collate_first(items, collate_fn, "the stream's items")) * batch_size // len(items)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.nelement()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    if isinstance(obj, (int, float, bool)):
        return 8  # collated into an int64/float64 tensor
    return 0


def dataloader_settings(loader: LoaderConfig) -> dict:
    """build_loader's keyword arguments from the loader config (less what is not a DataLoader setting:
    the validation batch size and the tune provenance). `collate_fn` is still the config's node:
    dlpipe.loader.fitting.loader_settings builds it."""
    settings = dataclasses.asdict(loader)
    del settings["val_batch_size"], settings["tuned_on"]
    return settings


NORMALISED = ("pin_memory", "prefetch_factor", "persistent_workers", "timeout", "multiprocessing_context")
"""The loader keys normalise() may change; every other key reaches the DataLoader as configured."""


def normalise(num_workers: int, asked: dict, cuda: bool,
              worker_method: str = "process") -> tuple[dict, dict, list[str]]:
    """(the NORMALISED settings PyTorch accepts for `num_workers`, key -> the value asked for of each
    one changed, a note per change but pin_memory's: the lint says that once a run, with the fix).
    The one place train, bench, tune (each trial) and `dlpipe plan` get their effective loader values from."""
    out, notes = dict(asked), []
    if num_workers == 0:
        if out["prefetch_factor"] is not None:
            notes.append(f"loader.prefetch_factor={out['prefetch_factor']} ignored: it needs num_workers > 0")
            out["prefetch_factor"] = None
        if out["persistent_workers"]:
            notes.append("loader.persistent_workers=true ignored: there are no workers to keep (num_workers=0)")
            out["persistent_workers"] = False
        if out["multiprocessing_context"] is not None:
            notes.append(f"loader.multiprocessing_context={out['multiprocessing_context']} ignored: num_workers=0")
            out["multiprocessing_context"] = None
        if out["timeout"]:  # PyTorch asserts timeout == 0 without workers: there is no worker to wait for
            notes.append(f"loader.timeout={out['timeout']} ignored: it bounds the wait for a worker's batch "
                         "(num_workers=0)")
            out["timeout"] = type(out["timeout"])(0)  # 0.0 for a float: recorded as the config records it
    elif out["prefetch_factor"] is None:  # PyTorch's own default then: record what the workers really keep ready
        out["prefetch_factor"] = policy.PREFETCH_DEFAULT
    if num_workers and worker_method == "thread":
        if out["persistent_workers"]:
            notes.append("loader.persistent_workers=true ignored: thread workers start in microseconds, there is "
                         "nothing to keep")
            out["persistent_workers"] = False
        if out["multiprocessing_context"] is not None:
            notes.append(f"loader.multiprocessing_context={out['multiprocessing_context']} ignored: thread workers")
            out["multiprocessing_context"] = None
    if out["pin_memory"] and not cuda:
        out["pin_memory"] = False  # PyTorch would warn on every epoch; dlpipe.lint says it once, with the fix
    return out, {key: value for key, value in asked.items() if out[key] != value}, notes


def build_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int | None,
    persistent_workers: bool,
    shuffle: bool,
    drop_last: bool,
    timeout: float,
    multiprocessing_context: str | None,
    seed: int,
    cuda: bool,
    collate_fn: Callable | None = None,
    role: str = "train",
    rank: int = 0,
    world: int = 1,
    fetch: str = "item",
    worker_method: str = "process",
    stream_share: str = "source",
) -> LoaderPlan:
    """A DataLoader for `dataset`; `cuda` says whether batches will go to a CUDA device. With
    `world` > 1 it loads this rank's share (see EpochOrder); `batch_size` is per rank. `collate_fn`
    turns a list of items into a batch (None: PyTorch's default_collate); a config's
    loader.collate_fn node is built by dlpipe.loader.fitting.loader_settings. `fetch` (loader.fetch):
    item, batch (one gather per batch; a ConfigError if the dataset cannot) or auto. `worker_method`
    (loader.worker_method): process (PyTorch's worker processes) or thread (dlpipe.loader.threads);
    auto is decided before (dlpipe.loader.fitting.fit_loader_to_data) and builds processes here."""
    _check_collate(collate_fn)
    if is_stream(dataset):
        return build_stream_loader(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                                   prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                                   shuffle=shuffle, drop_last=drop_last, timeout=timeout,
                                   multiprocessing_context=multiprocessing_context, seed=seed, cuda=cuda,
                                   collate_fn=collate_fn, role=role, rank=rank, world=world, fetch=fetch,
                                   worker_method=worker_method, share=stream_share == "dlpipe")
    asked = dict(zip(NORMALISED, (pin_memory, prefetch_factor, persistent_workers, timeout, multiprocessing_context),
                     strict=True))
    asked_method = worker_method
    worker_method = "thread" if worker_method == "thread" and num_workers > 0 else "process"
    settings, requested, notes = normalise(num_workers, asked, cuda, worker_method)
    if asked_method == "thread" and worker_method != "thread":
        # recorded, so that a sweep over worker_method x num_workers says which jobs ran alike
        requested["worker_method"] = asked_method
        notes.append("loader.worker_method=thread ignored: num_workers=0 (the main process fetches)")

    # The generator fixes the per-worker base seed (EpochOrder fixes the order); each worker then seeds
    # torch, `random` and NumPy from base_seed + worker_id itself, so augmentations differ per
    # worker and repeat for the same seed without a worker_init_fn.
    generator = torch.Generator()
    generator.manual_seed(seed + rank)  # ranks augment differently; the order (EpochOrder) is shared
    training = role == "train"
    # Training always has an EpochOrder (seeded by epoch, shuffled or not): its batches carry the
    # epoch's random stream for each sample's sample_generator(). Validation scores in dataset order,
    # with one stream for every epoch: what changes between its scores is the model alone.
    order = (EpochOrder(len(dataset), seed, shuffle=shuffle and training, rank=rank, world=world, pad=training)
             if training or world > 1 else SequentialSampler(dataset))
    batches = EpochBatches(order, batch_size, drop_last, stream=None if training else -1 - seed)
    # One path for every loader: the sampler hands out whole batches of indices (batch_size=None, PyTorch's
    # own way to fetch batches), and BatchGather turns each into the collated batch, by one gather
    # (loader.fetch=batch) or item by item and the collate, as PyTorch's fetcher would.
    gather = BatchGather(dataset, gather_for(dataset, fetch, collate_fn), collate_fn)
    if worker_method == "thread":
        loader = ThreadLoader(gather, batches, num_workers=num_workers, prefetch_factor=settings["prefetch_factor"],
                              pin_memory=settings["pin_memory"], timeout=settings["timeout"], generator=generator)
    else:
        workers = {"num_workers": num_workers, **settings, "generator": generator,
                   "worker_init_fn": worker_init_fn() if num_workers > 0 else None}
        # Validation's workers start from the same base seed every pass, as its batches carry one
        # stream: a dataset drawing from the global RNGs in them draws the same each epoch, so a
        # resumed run (whose validation generator starts afresh) validates as the straight run did.
        # Training's generator is checkpointed instead.
        loader = SignalSafeLoader(gather, batch_size=None, sampler=batches, reseed=None if training else seed + rank,
                                  **workers)
    batch = batch_bytes(dataset, batch_size, collate_fn)
    inflight = policy.inflight_bytes(num_workers, settings["prefetch_factor"], batch)
    return LoaderPlan(loader, [f"{role}: {n}" for n in notes], batch, inflight, settings, requested,
                      fetch_mode(loader), worker_method_of(loader))


def _check_collate(collate_fn) -> None:
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__} (a loader.collate_fn "
                        "node is built by dlpipe.loader.fitting.loader_settings)")


def build_stream_loader(stream: IterableDataset, *, batch_size: int, num_workers: int, pin_memory: bool,
                        prefetch_factor: int | None, persistent_workers: bool, shuffle: bool, drop_last: bool,
                        timeout: float, multiprocessing_context: str | None, seed: int, cuda: bool,
                        collate_fn: Callable | None, role: str, rank: int, world: int, fetch: str,
                        worker_method: str, share: bool) -> LoaderPlan:
    """build_loader for a stream (loader.streams): PyTorch's DataLoader over it, item by item in worker
    processes, each keeping its own batches of this rank's with `share` (loader.stream_share=dlpipe);
    thread workers where dlpipe deals a stream that reads positions (loader.stream_threads: the same
    batches); what a stream cannot take is a note."""
    notes, requested = [], {}
    training = role == "train"
    stream = unwrapped(stream)
    if shuffle and training:
        notes.append("loader.shuffle=true ignored: a stream is read in its own order (shuffle it at the source, "
                     "e.g. a shuffle buffer)")
    if fetch == "batch":
        requested["fetch"] = fetch
        notes.append("loader.fetch=batch ignored: a stream is read item by item")
    method = "thread" if worker_method == "thread" and num_workers else "process"
    if method == "thread" and not (share and reads_positions(stream)):
        method, requested["worker_method"] = "process", worker_method
        notes.append("loader.worker_method=thread ignored: threads would share one reader of the stream (thread "
                     "workers need a stream that reads any position of its epoch, dealt by dlpipe)")
    if persistent_workers and num_workers and method == "process":
        # set_epoch (StreamShare's: the epoch, a resume) runs in this process; persistent workers keep
        # the copy they started with
        persistent_workers, requested["persistent_workers"] = False, True
        notes.append("loader.persistent_workers=true ignored: the stream's set_epoch(epoch) reaches workers only "
                     "when they start anew")
    asked = dict(zip(NORMALISED, (pin_memory, prefetch_factor, persistent_workers, timeout, multiprocessing_context),
                     strict=True))
    settings, changed, more = normalise(num_workers, asked, cuda, method)
    generator = torch.Generator()
    generator.manual_seed(seed + rank)  # each worker's torch, random and NumPy seeds, as for map datasets
    if method == "thread":  # the items draw from their rows' streams (dlpipe.sample_rng), not the generator
        loader = thread_stream_loader(stream, batch_size=batch_size, drop_last=drop_last and training, rank=rank,
                                      world=world, pad=training, collate_fn=collate_fn, num_workers=num_workers,
                                      prefetch_factor=settings["prefetch_factor"], pin_memory=settings["pin_memory"],
                                      timeout=settings["timeout"], generator=generator)
    else:
        shared = StreamShare(stream, share=share, batch_size=batch_size, drop_last=drop_last and training,
                             rank=rank, world=world, pad=training)
        loader = SignalSafeLoader(shared, batch_size=batch_size, drop_last=drop_last and training,
                                  collate_fn=collate_fn, num_workers=num_workers, generator=generator,
                                  worker_init_fn=worker_init_fn() if num_workers > 0 else None,
                                  reseed=None if role == "train" else seed + rank, **settings)
    batch = stream_batch_bytes(stream, batch_size, collate_fn)
    inflight = policy.inflight_bytes(num_workers, settings["prefetch_factor"], batch)
    return LoaderPlan(loader, [f"{role}: {n}" for n in notes + more], batch, inflight, settings,
                      {**changed, **requested}, "item", method)
