"""loader.worker_method=auto: processes or threads for the workers, decided on the built dataset.

Measured on this 2-CPU machine (issue 16): on JPEG decode 2 threads reached 0.94 of 2 processes, at
a fraction of the memory; with pure-Python augmentation holding the GIL they fell to 0.73. So
threads are chosen where a probe shows they scale, and never for a dataset that draws from the
global RNGs (with threads those are the main process's, shared with training: neither would be
reproducible any more). Where /dev/shm cannot hold the batches in flight, processes would die of a
bus error, so threads are taken anyway; the same where the memory left (a cgroup's limit included)
cannot hold N forks of this process; on a free-threaded Python there is no GIL to share.
"""

import random
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from torch.utils.data import Dataset

from dlpipe.loader import policy
from dlpipe.loader.fetch import BatchGather
from dlpipe.loader.threads import ThreadLoader
from dlpipe.sample_rng import SampleBatch
from dlpipe.schema import LoaderConfig

THREAD_SCALING_MIN = 0.75
"""Threads are taken when N of them fetch at least 0.75 x N times as fast as the main process alone:
about what N worker processes reach after their pickling and hand-over (2 threads on JPEG decode reached 0.94 of 2
processes), and halfway between a dataset that holds the GIL (1x) and one that releases it (N x)."""
PROBE_SERIAL_S = 0.25
"""About how long each round fetches in this thread before it times N threads on the same items:
long enough that the threads' start-up (10-20 ms) costs them a tenth at most."""
PROBE_ROUNDS = 2
RNG_PROBE_ITEMS = 4


def fit(loader: LoaderConfig, raw_loader: dict, train_set: Dataset, collate_fn: Callable | None,
        reasons: dict[str, str]) -> LoaderConfig:
    """loader.worker_method=auto decided on the built training split, its reason added to `reasons`.
    Threads keep nothing across epochs, so automatic persistence goes with them."""
    if not loader.num_workers or not len(train_set):  # type: ignore[arg-type]
        return replace(loader, worker_method="process")  # no workers: nothing to decide, PyTorch's default
    from dlpipe.hardware import memory_available_bytes, shm_free_bytes
    from dlpipe.loader.build import batch_bytes
    from dlpipe.training import rng

    state = rng.capture()  # every fetch below may draw: the run's streams stay as they were
    try:
        inflight = policy.inflight_bytes(loader.num_workers, loader.prefetch_factor,
                                         batch_bytes(train_set, loader.batch_size, collate_fn))
        forbidden = processes_forbidden(loader.num_workers, inflight, shm_free_bytes(), private_bytes(),
                                        memory_available_bytes())
        method, why = choose(train_set, loader.num_workers, loader.batch_size, collate_fn, forbidden)
    finally:
        rng.restore(state)
    loader = replace(loader, worker_method=method)
    reasons["loader.worker_method"] = f"{method} (auto: {why})"
    if method == "thread" and loader.persistent_workers and policy.is_auto(raw_loader["persistent_workers"],
                                                                          "auto_persistent"):
        loader = replace(loader, persistent_workers=False)
        reasons["loader.persistent_workers"] = "False (auto: thread workers start in microseconds: nothing to keep)"
    return loader


def private_bytes() -> int:
    """This process's own memory (USS: pages no other process shares). A worker process is a fork of
    it and comes to own every page it writes: refcounts written on reading a dataset's Python
    objects copy their pages (PyTorch's "memory leak" with workers), so USS is what each may grow to."""
    import psutil

    return psutil.Process().memory_full_info().uss


def processes_forbidden(num_workers: int, inflight: int, shm_free: int | None, private: int, available: int
                        ) -> str | None:
    """Why `num_workers` worker processes cannot run here (they would be killed), or None."""
    if policy.shm_overflow(inflight, shm_free):
        return ("/dev/shm cannot hold the batches worker processes keep in flight (they would die of a "
                "bus error); threads need none")
    if policy.ram_overflow(num_workers * private, inflight, available):
        return (f"{num_workers} worker processes, each a fork of this {private / 2**20:.0f} MB process, and "
                f"{inflight / 2**20:.0f} MB of batches in flight could take "
                f"{(num_workers * private + inflight) / 2**20:.0f} MB, over {policy.RAM_SHARE:.0%} of the "
                f"{available / 2**20:.0f} MB of memory left (cgroup limits included): the out-of-memory killer "
                "would end them; threads share this process's memory")
    return None


def choose(dataset: Dataset, num_workers: int, batch_size: int, collate_fn: Callable | None,
           forbidden: str | None) -> tuple[str, str]:
    """("thread" or "process", why) for `num_workers` workers fetching `dataset` (a built split);
    `forbidden`: why processes cannot run here (processes_forbidden), or None."""
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return "thread", "this Python runs without the GIL (free-threaded): threads fetch in parallel, sharing memory"
    if forbidden:
        return "thread", forbidden
    drawn = global_draws(dataset)
    if drawn:
        return "process", (f"the dataset draws from the global {drawn} RNG while fetching: threads would share "
                           "that stream with training and each other (draw from dlpipe.sample_rng.sample_generator() "
                           "to make threads possible)")
    speedup = thread_speedup(dataset, num_workers, batch_size, collate_fn)
    if speedup >= THREAD_SCALING_MIN * num_workers:
        return "thread", (f"{num_workers} threads fetched {speedup:.2f}x as fast as the main process alone (the "
                          "dataset releases the GIL): as fast as processes, without their memory, start-up and "
                          "hand-over")
    return "process", (f"{num_workers} threads fetched only {speedup:.2f}x as fast as the main process alone, under "
                       f"{THREAD_SCALING_MIN:g} x {num_workers} (the dataset holds the GIL)")


def global_draws(dataset: Dataset) -> str | None:
    """Which global RNG (torch, numpy, random) fetching a few training items advanced, or None.
    The items are fetched as training fetches them (a SampleBatch: sample_generator() is theirs)."""
    n = len(dataset)  # type: ignore[arg-type]
    before = _states()
    BatchGather(dataset, None, lambda items: items)[SampleBatch(
        sorted({i * (n - 1) // max(RNG_PROBE_ITEMS - 1, 1) for i in range(min(RNG_PROBE_ITEMS, n))}), 0)]
    after = _states()
    changed = [name for name in before if not _same(before[name], after[name])]
    _restore(before)
    return " and ".join(changed) or None


def thread_speedup(dataset: Dataset, num_workers: int, batch_size: int, collate_fn: Callable | None) -> float:
    """Time to fetch some items in this thread / time for `num_workers` threads (ThreadLoader, the
    loader training would use) to fetch the same ones. In this thread, not in one worker thread: a
    lone worker that holds the GIL makes the pipeline's own threads wait for it, which would flatter
    N of them. The probe's batches are sized by time, not by batch_size: about PROBE_SERIAL_S of
    items a round (1 to 4 batches per worker, one item each at least), PROBE_ROUNDS rounds unless a
    round takes over a second; the best round of each side is kept (a descheduled one is only slower)."""
    gather = BatchGather(dataset, None, collate_fn)
    n = len(dataset)  # type: ignore[arg-type]
    started = time.perf_counter()
    gather[SampleBatch([0], 0)]
    item = max(time.perf_counter() - started, 1e-7)
    per_worker = max(1, min(4, int(PROBE_SERIAL_S / (num_workers * item))))  # slow items: fewer, 1 at least
    count = per_worker * num_workers
    size = max(1, min(batch_size, n, int(PROBE_SERIAL_S / (count * item))))
    batches = [SampleBatch([(b * size + i) % n for i in range(size)], 0) for b in range(count)]
    rounds = PROBE_ROUNDS if count * size * item <= 4 * PROBE_SERIAL_S else 1  # a round of a second is steady
    serial, parallel = [], []
    for _ in range(rounds):  # interleaved
        started = time.perf_counter()
        for batch in batches:
            gather[batch]
        serial.append(time.perf_counter() - started)
        parallel.append(_time(ThreadLoader(gather, batches, num_workers=num_workers, prefetch_factor=2,
                                           pin_memory=False, timeout=0, generator=None)))
    return min(serial) / max(min(parallel), 1e-9)


def _time(loader: ThreadLoader) -> float:
    """Seconds from starting the threads to the last batch, start-up included (torchdata sleeps 10 ms,
    then starts its threads: a tenth of a probe round, which only errs towards processes). Measured
    from the consumer's side only once it is over: a GIL-holding dataset starves the consumer, which
    would see batches arrive in a burst. Not to the end of the stream, which torchdata polls every
    0.1 s (an epoch pays that once)."""
    started = time.perf_counter()
    batches = iter(loader)
    for _ in range(len(loader)):
        next(batches)
    return time.perf_counter() - started


def _states() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, tuple):  # numpy's (name, keys, pos, has_gauss, gauss) and random's (version, internal, gauss)
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def _restore(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["random"])
