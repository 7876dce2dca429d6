"""loader.worker_method=auto: processes or threads for the workers, decided on the built dataset.

Measured on this 2-CPU machine (issue 16): on JPEG decode 2 threads reached 0.94 of 2 processes, at
a fraction of the memory; with pure-Python augmentation holding the GIL they fell to 0.73. So
threads are chosen where a probe shows they are as fast as processes, and not for a dataset that
draws from the global RNGs (with threads those are the main process's, shared with training: neither
would be reproducible any more). Where /dev/shm cannot hold the batches in flight, processes would die
of a bus error, so threads are taken anyway; the same where the memory left (a cgroup's limit
included) cannot hold N worker processes. Processes that would be killed are worse than threads that
are not reproducible: then threads are taken for such a dataset too, and the reason says so. On a
free-threaded Python there is no GIL to share.
"""

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil
import torch
from torch.utils.data import Dataset, IterableDataset

from dlpipe.errors import user_message
from dlpipe.loader import policy
from dlpipe.loader.build import batch_bytes
from dlpipe.loader.fetch import BatchGather, same_batch
from dlpipe.loader.threads import ThreadLoader
from dlpipe.loader.worker_signals import SignalSafeLoader, start_helper_processes, worker_init_fn
from dlpipe.machine.hardware import memory_available_bytes, shm_free_bytes
from dlpipe.sample_rng import SampleBatch
from dlpipe.schema import LoaderConfig
from dlpipe.training import rng

THREAD_SCALING_MIN = 0.75
"""Threads are taken when N of them fetch at least 0.75 x N times as fast as the main process alone:
about what N worker processes reach after their pickling and hand-over (2 threads on JPEG decode reached 0.94 of 2
processes), and halfway between a dataset that holds the GIL (1x) and one that releases it (N x)."""
PROBE_SERIAL_S = 0.25
"""About how long each round fetches in this thread before it times N threads on the same items:
long enough that the threads' start-up (10-20 ms) costs them a tenth at most."""
PROBE_ROUNDS = 2
PROBE_TIMEOUT_S = 60.0
"""The process probe's wait for a batch (DataLoader timeout): a worker that hangs fails the probe,
not the launch."""
RNG_PROBE_ITEMS = 4
THREADS_AS_FAST = 0.95
"""Below THREAD_SCALING_MIN, N worker processes are timed on the same batches too, and threads are
taken when their predicted epoch is at least 0.95x as fast: within the probe's noise, threads save
N copies of this process's memory and a pickle of every batch. Processes do not always scale: on
224 px JPEGs (batches of 13 MB through /dev/shm) 2 processes ran at 0.85x the main process alone
while 2 threads reached 1.4x (benchmarks/loader_backends.py --image-size 224)."""


def fit(loader: LoaderConfig, raw_loader: dict, train_set: Dataset, collate_fn: Callable | None,
        reasons: dict[str, str], model_bytes: int = 0) -> LoaderConfig:
    """loader.worker_method=auto decided on the built training split, its reason added to `reasons`.
    Threads keep nothing across epochs, so automatic persistence goes with them. `model_bytes`: the
    CPU memory of a model already built in this process (its pages are never written by a worker)."""
    if not loader.num_workers or not len(train_set):  # type: ignore[arg-type]
        return replace(loader, worker_method="process")  # no workers: nothing to decide, PyTorch's default
    state = rng.capture()  # every fetch below may draw: the run's streams stay as they were
    try:
        inflight = policy.inflight_bytes(loader.num_workers, loader.prefetch_factor,
                                         batch_bytes(train_set, loader.batch_size, collate_fn))
        forbidden = processes_forbidden(loader.num_workers, inflight, shm_free_bytes(),
                                        max(private_bytes() - model_bytes, 0), memory_available_bytes())
        method, why = choose(train_set, loader, collate_fn, forbidden)
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
    """This process's own memory (USS: pages no other process shares). A forked worker comes to own
    every page it writes (refcounts written on reading a dataset's Python objects copy their pages:
    PyTorch's "memory leak" with workers); a spawned one imports the same modules and gets the dataset
    pickled whole: either way about this much each."""
    return psutil.Process().memory_full_info().uss


def processes_forbidden(num_workers: int, inflight: int, shm_free: int | None, private: int, available: int
                        ) -> str | None:
    """Why `num_workers` worker processes cannot run here (they would be killed), or None."""
    if policy.shm_overflow(inflight, shm_free):
        return ("/dev/shm cannot hold the batches worker processes keep in flight (they would die of a "
                "bus error); threads need none")
    if policy.ram_overflow(num_workers * private, inflight, available):
        return (f"{num_workers} worker processes, each holding up to this process's {private / 2**20:.0f} MB, and "
                f"{inflight / 2**20:.0f} MB of batches in flight could take "
                f"{(num_workers * private + inflight) / 2**20:.0f} MB, over {policy.RAM_SHARE:.0%} of the "
                f"{available / 2**20:.0f} MB of memory left (cgroup limits included): the out-of-memory killer "
                "would end them; threads share this process's memory")
    return None


def choose(dataset: Dataset, loader: LoaderConfig, collate_fn: Callable | None,
           forbidden: str | None) -> tuple[str, str]:
    """("thread" or "process", why) for `loader.num_workers` workers fetching `dataset` (a built split)
    as `loader` says (batch size, persistence, start method); `forbidden`: why processes cannot run
    here (processes_forbidden), or None."""
    num_workers = loader.num_workers
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return "thread", "this Python runs without the GIL (free-threaded): threads fetch in parallel, sharing memory"
    drawn = global_draws(dataset)
    if forbidden:
        return "thread", forbidden + (f"; the dataset draws from the global {drawn} RNG while fetching: with threads "
                                      "its draws are not reproducible" if drawn else "")
    if drawn:
        return "process", (f"the dataset draws from the global {drawn} RNG while fetching: threads would share "
                           "that stream with training and each other (draw from dlpipe.sample_rng.sample_generator() "
                           "to make threads possible)")
    scaling = max(num_workers, 2)  # one thread fetches as fast as the main process, GIL or not: 2 tell
    probe = Probe(dataset, scaling, loader.batch_size, collate_fn)
    if probe.threads_differ:
        return "process", (f"{scaling} threads fetched the probe's batches otherwise than the main process, which "
                           "fetched them alike every time: the dataset is not thread-safe (state such as an open "
                           "file shared by the threads); each worker process has its own copy")
    speedup = probe.serial_s / probe.threads.total_s
    if speedup >= THREAD_SCALING_MIN * scaling:
        return "thread", (f"{scaling} threads fetched {speedup:.2f}x as fast as the main process alone (the "
                          "dataset releases the GIL): as fast as processes, without their memory, start-up and "
                          "hand-over")
    if num_workers == 1:
        return "process", (f"2 threads fetched only {speedup:.2f}x as fast as the main process alone, under "
                           f"{THREAD_SCALING_MIN:g} x 2 (the dataset holds the GIL): one worker thread would take "
                           "the GIL from the training loop, one process fetches beside it")
    try:
        processes = probe.time_processes(loader.multiprocessing_context)
    except Exception as e:  # noqa: BLE001 - the threads fetched these batches: the job can run on them
        return "thread", (f"{num_workers} worker processes failed on batches {num_workers} threads fetched "
                          f"({type(e).__name__}: {user_message(e)[0]}): threads")
    items = len(dataset)  # type: ignore[arg-type]
    threads_s = probe.threads.epoch_s(items, probe.size, restarts=True)
    processes_s = processes.epoch_s(items, probe.size, restarts=not loader.persistent_workers)
    facts = (f"{num_workers} threads fetched {speedup:.2f}x as fast as the main process alone, under "
             f"{THREAD_SCALING_MIN:g} x {num_workers}; timed on the same batches, an epoch of {items} items would take "
             f"{threads_s:.2f} s with {num_workers} threads and {processes_s:.2f} s with {num_workers} "
             f"{'persistent ' if loader.persistent_workers else ''}processes")
    if threads_s * THREADS_AS_FAST <= processes_s:
        return "thread", f"{facts}: threads are as fast, without the processes' memory and hand-over"
    return "process", f"{facts} (the dataset holds the GIL)"


def global_draws(dataset: Dataset) -> str | None:
    """Which global RNG (torch, numpy, random) fetching a few training items advanced, or None.
    The items are fetched as training fetches them (a SampleBatch: sample_generator() is theirs)."""
    before = rng.capture()
    if isinstance(dataset, IterableDataset):  # a stream: its first items
        list(itertools.islice(dataset, RNG_PROBE_ITEMS))
    else:
        n = len(dataset)  # type: ignore[arg-type]
        BatchGather(dataset, None, lambda items: items)[SampleBatch(
            sorted({i * (n - 1) // max(RNG_PROBE_ITEMS - 1, 1) for i in range(min(RNG_PROBE_ITEMS, n))}), 0)]
    after = rng.capture()
    rng.restore(before)
    changed = [name for key, name in (("torch", "torch"), ("numpy", "numpy"), ("python", "random"))
               if not _same(before[key], after[key])]
    return " and ".join(changed) or None


@dataclass(frozen=True)
class Timed:
    """One way of fetching the probe's batches with `workers` workers: seconds to its first batch and
    to its last."""

    first_s: float
    total_s: float
    batches: int
    workers: int

    def epoch_s(self, items: int, batch_items: int, restarts: bool) -> float:
        """Predicted seconds for an epoch of `items` in batches of `batch_items`. N workers deliver in
        waves of N: the steady time per batch is the time after the first batch over the batches after
        the first wave (the probe has 2 waves at least); the start-up is the first batch's wait beyond
        one steady wave, paid again only when the workers start anew. Threads that hold the GIL are
        late with their first batch for contention, not start-up: it comes out as steady time."""
        per_batch = (self.total_s - self.first_s) / max(self.batches - self.workers, 1)
        startup = max(self.first_s - per_batch * self.workers, 0.0)
        return (startup if restarts else 0.0) + per_batch * items / batch_items


class Probe:
    """Some items fetched in this thread, then the same ones by `num_workers` threads (ThreadLoader,
    the loader training would use), and on demand by as many worker processes. In this thread, not in
    one worker thread: a lone worker that holds the GIL makes the pipeline's own threads wait for it,
    which would flatter N of them. The batches are sized by time, not by batch_size: about
    PROBE_SERIAL_S of items a round (2 to 4 batches per worker, one item each at least),
    PROBE_ROUNDS rounds unless a round takes over a second; the best round of each side is kept (a
    descheduled one is only slower)."""

    def __init__(self, dataset: Dataset, num_workers: int, batch_size: int, collate_fn: Callable | None):
        self.gather, self.num_workers = BatchGather(dataset, None, collate_fn), num_workers
        n = len(dataset)  # type: ignore[arg-type]
        started = time.perf_counter()
        self.gather[SampleBatch([0], 0)]
        item = max(time.perf_counter() - started, 1e-7)
        # slow items: fewer batches, but 2 waves at least (a start-up and a steady rate to tell apart)
        per_worker = max(2, min(4, int(PROBE_SERIAL_S / (num_workers * item))))
        count = per_worker * num_workers
        self.size = max(1, min(batch_size, n, int(PROBE_SERIAL_S / (count * item))))
        self.batches = [SampleBatch([(b * self.size + i) % n for i in range(self.size)], 0) for b in range(count)]
        self.rounds = PROBE_ROUNDS if count * self.size * item <= 4 * PROBE_SERIAL_S else 1  # a round of 1 s is steady
        serial, threads, expected, repeatable, differed = [], [], None, True, False
        for _ in range(self.rounds):  # interleaved
            started = time.perf_counter()
            fetched = [self.gather[batch] for batch in self.batches]
            serial.append(time.perf_counter() - started)
            if expected is None:
                expected = fetched
            repeatable = repeatable and _all_same(expected, fetched)
            by_threads = []
            threads.append(_time(ThreadLoader(self.gather, self.batches, num_workers=num_workers, prefetch_factor=2,
                                              pin_memory=False, timeout=0, generator=None), keep=by_threads))
            differed = differed or not _all_same(expected, by_threads)
        self.serial_s = min(serial)
        self.threads = min(threads, key=lambda t: t.total_s)
        # Threads share the dataset object; processes each get a copy. Where the main process fetches
        # the same batches alike every round but threads fetch them otherwise, the dataset keeps state
        # the threads trample (one file handle: a seek of one thread, then a read of another's).
        self.threads_differ = repeatable and differed

    def time_processes(self, context: str | None) -> Timed:
        """The same batches from `num_workers` worker processes (dlpipe's process loader, started
        anew each round as an epoch without persistent workers starts them), the best round; one
        round with spawn or forkserver, whose workers import torch each time."""
        start_helper_processes(context)  # first: multiprocessing starts them once, as the run needs them
        rounds = 1 if context in ("spawn", "forkserver") else self.rounds
        return min((_time(SignalSafeLoader(self.gather, batch_size=None, sampler=self.batches,
                                           num_workers=self.num_workers, prefetch_factor=2, timeout=PROBE_TIMEOUT_S,
                                           multiprocessing_context=context, worker_init_fn=worker_init_fn()))
                    for _ in range(rounds)), key=lambda t: t.total_s)


def _time(loader, keep: list | None = None) -> Timed:
    """Seconds from starting the workers to the first and to the last batch, start-up included (torchdata
    sleeps 10 ms, then starts its threads: a tenth of a probe round, which only errs towards processes).
    Measured from the consumer's side only once it is over: a GIL-holding dataset starves the consumer,
    which would see batches arrive in a burst. Not to the end of the stream, which torchdata polls every
    0.1 s (an epoch pays that once). `keep`: a list the batches are appended to."""
    keep = [] if keep is None else keep
    started = time.perf_counter()
    batches = iter(loader)
    keep.append(next(batches))
    first = time.perf_counter() - started
    for _ in range(len(loader) - 1):
        keep.append(next(batches))
    total = time.perf_counter() - started
    del batches  # a process loader's workers stop here, before the next round forks again
    return Timed(first, total, len(loader), loader.num_workers)


def _all_same(expected: list, fetched: list) -> bool:
    return len(expected) == len(fetched) and all(same_batch(a, b) for a, b in zip(expected, fetched, strict=True))


def _same(a, b) -> bool:
    """Whether two of rng.capture()'s states are equal (tensors, and lists or tuples of them and plain values)."""
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, list | tuple):  # numpy's [name, keys, pos, has_gauss, gauss], random's (version, internal, gauss)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
