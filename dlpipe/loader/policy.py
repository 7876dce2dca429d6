"""Every DataLoader rule and constant, once. The resolvers (config.decisions), the fit to the data
(tasks.build), the pre-flight lint, the tuner's memory guard and the loader builder all call these,
so an automatic value and the advice about it cannot disagree.

No torch and nothing read at import: config resolvers import this module.
"""

import math

PREFETCH_DEFAULT = 2
"""Batches each worker keeps ready: PyTorch's own default; RAM held grows linearly with it."""

SHM_SHARE = 0.5
"""In-flight batches may take this share of free /dev/shm (workers hand batches over through it)."""

RAM_SHARE = 0.8
"""Workers and their in-flight batches may take this share of available memory."""

CHEAP_ITEM_S = 50e-6
"""Below this fetch time per item in the main process, the data is in memory and a worker's hand-over
(pickling into shared memory, a queue round-trip, waking the main process) costs more than the fetch
it saves. Measured here: rows of an in-memory tensor take 5-10 us each, JPEG decode items 200-400 us;
256-row batches ran at 182k samples/s without workers and 122k with 2 (benchmarks/loader_tuning.py)."""

MIN_BATCHES_PER_WORKER = 10
"""Persistent workers save each worker one start-up (50-90 ms, more with spawn) per epoch and hold
their memory all run, through validation too, when the validation loader's own workers run beside
them. A worker that produces fewer batches than this per epoch serves an epoch too short for the
saving to matter against that memory."""

MAX_WORKERS_PER_CPU = 8
MAX_WORKERS_FLOOR = 16
"""loader.num_workers above max(MAX_WORKERS_PER_CPU x the CPU budget, MAX_WORKERS_FLOOR) is refused:
each worker is a process with its own copy of the dataset, and measured here 8 workers on 2 CPUs were
already 14% slower than 2. The bound leaves room for loaders that wait on slow storage, not for
10,000 forks before the first batch."""


def max_workers(cpu_budget: int) -> int:
    """The most loader.num_workers accepted with this CPU budget (see MAX_WORKERS_PER_CPU)."""
    return max(MAX_WORKERS_PER_CPU * cpu_budget, MAX_WORKERS_FLOOR)


AUTO_RESOLVERS = {
    "num_workers": "auto_workers",
    "pin_memory": "cuda_available",
    "prefetch_factor": "auto_prefetch",
    "persistent_workers": "auto_persistent",
}
"""Loader key -> the resolver that sets it automatically in conf/loader/auto.yaml."""


def is_auto(raw_value, resolver: str) -> bool:
    """Whether a config value, before interpolation, is left to `resolver` (`${resolver:...}`)."""
    return isinstance(raw_value, str) and raw_value.startswith("${" + resolver + ":")


def prefetch_in_effect(num_workers: int, prefetch_factor: int | None) -> int:
    """Batches each worker really keeps ready (PyTorch uses its default when the setting is None)."""
    return 0 if num_workers == 0 else prefetch_factor or PREFETCH_DEFAULT


def inflight_bytes(num_workers: int, prefetch_factor: int | None, batch_bytes: int) -> int:
    """Bytes the workers hold ready, all of it through /dev/shm: workers x prefetch x batch bytes."""
    return num_workers * prefetch_in_effect(num_workers, prefetch_factor) * batch_bytes


def shm_overflow(inflight: int, shm_free: int | None) -> bool:
    """Whether in-flight batches would take more than SHM_SHARE of the free shared memory."""
    return shm_free is not None and inflight > SHM_SHARE * shm_free


def ram_overflow(workers_bytes: float, inflight: int, available: int) -> bool:
    """Whether workers holding `workers_bytes` of their own plus the batches in flight would take more
    than RAM_SHARE of the memory available (hardware.memory_available_bytes: cgroup limits included)."""
    return workers_bytes + inflight > RAM_SHARE * available


def train_samples(dataset_size: int, val_fraction: float) -> int:
    """Training items of a dataset of `dataset_size` (the split's arithmetic: loader.split)."""
    if val_fraction <= 0 or dataset_size <= 0:
        return dataset_size
    return max(dataset_size - max(1, round(dataset_size * val_fraction)), 0)


def batches_per_epoch(train_size: int, batch_size: int, world: int = 1, drop_last: bool = False) -> int:
    """Training batches per rank and epoch (each rank gets ceil(size / world) items, padded like
    DistributedSampler; see loader.build.EpochOrder)."""
    per_rank = math.ceil(train_size / max(world, 1))
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


def persist_workers(num_workers: int, epochs: int, batches: int | None) -> tuple[bool, str]:
    """(keep workers across epochs?, why). `batches`: training batches per rank and epoch, None
    when not known yet (the dataset has no `size`: tasks.build decides again once it is built)."""
    facts = f"{num_workers} workers, {epochs} epochs, {'unknown' if batches is None else batches} batches an epoch"
    if num_workers == 0:
        return False, f"no workers to keep ({facts})"
    if epochs <= 1:
        return False, f"a single epoch: nothing to reuse the workers for ({facts})"
    if batches is not None and batches < MIN_BATCHES_PER_WORKER * num_workers:
        return False, (f"{batches / num_workers:.1f} batches per worker per epoch, under {MIN_BATCHES_PER_WORKER}: "
                       f"the start-up saved is too small to hold the workers all run ({facts})")
    return True, f"saves a worker start-up per epoch ({facts})"
