"""Thread workers (`loader.worker_method=thread`): batches fetched by threads of the main process.

Worker processes pay for their start-up, a pickle of every batch through shared memory, and a copy
of the dataset's memory each; threads pay none of that but share one GIL. Where `__getitem__`
spends its time in code that releases the GIL (image decoding in PIL, file reads, NumPy and torch
kernels), threads fetch about as fast as processes at a fraction of the memory, and they need no
/dev/shm. The thread pool is torchdata.nodes' ParallelMapper (in order, a bounded number of batches
in flight); this module only makes it look like the DataLoader the runner, bench and tune expect.

What stays the same as with processes: the order (the same EpochOrder batches), each sample's
randomness where the dataset draws it from dlpipe.sample_rng.sample_generator(), loader.timeout,
pin_memory, and the error naming the failing sample. What differs: the global RNGs (torch, random,
NumPy) are the main process's, shared by every thread, so a dataset that draws from them is not
reproducible with threads (loader.worker_method=auto picks threads for one only where processes
would be killed: /dev/shm or memory too small; its reason then says so).
"""

import atexit
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator

from torch._utils import ExceptionWrapper
from torchdata.nodes import IterableWrapper, ParallelMapper, PinMemory, Prefetcher

from dlpipe.loader.fetch import BatchGather, EpochBatches

_END = object()

_fetch_cpu = [0.0]  # CPU seconds worker threads spent in _Fetch, all loaders of this process
_fetch_cpu_lock = threading.Lock()


def fetch_cpu_seconds() -> float:
    """CPU seconds this process's worker threads have spent fetching batches, since it started.
    A process's CPU times do not say which thread spent them, and torchdata's threads are anonymous,
    so the map function counts its own thread's CPU (time.thread_time, nanoseconds) per batch: the
    resource sampler moves this share from the main process's CPU to the workers'."""
    with _fetch_cpu_lock:
        return _fetch_cpu[0]


def worker_method_of(loader) -> str:
    """"thread" for thread workers, else "process" (PyTorch's: also with no workers at all)."""
    return getattr(loader, "worker_method", "process")


class ThreadLoader:
    """A DataLoader-like iterable: `batches` (EpochBatches over the epoch's order) fetched through
    `gather` (a BatchGather: one gather, or items then their collate) by `num_workers` threads.

    prefetch_factor means what it means for processes: batches in flight per worker."""

    worker_method = "thread"
    persistent_workers = False  # threads start in microseconds: there is nothing to keep
    multiprocessing_context = None
    batch_size = None  # the batches come from `sampler` (an EpochBatches), as with loader.fetch=batch

    def __init__(self, gather: BatchGather, batches: EpochBatches, *, num_workers: int, prefetch_factor: int,
                 pin_memory: bool, timeout: float, generator):
        self.dataset, self.sampler = gather, batches
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.pin_memory, self.timeout, self.generator = pin_memory, timeout, generator
        self.collate_fn = None
        self._epoch: weakref.ref | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator:
        graph, count = [self._pipeline()], len(self)  # in a list: _retire drops the only reference
        _open[id(graph)] = graph
        epoch = _with_timeout(graph, count, self.timeout) if self.timeout else _unwrap_errors(graph, count)
        # Weak: an epoch the runner drops (limit_train_batches, a stop) takes its graph with it, and
        # the graph's threads end within torchdata's 0.1 s poll instead of idling through validation.
        self._epoch = weakref.ref(epoch)
        return epoch

    def shutdown(self) -> None:
        """Stop the threads of an epoch still held somewhere now: closing its iterator drops the graph."""
        epoch = self._epoch() if self._epoch is not None else None
        if epoch is not None:
            epoch.close()
        self._epoch = None

    def _pipeline(self):
        """The epoch's torchdata.nodes graph: batches of indices -> threads -> (pinning) -> prefetch.
        ParallelMapper keeps at most 2 batches per worker in flight (max_concurrent may only lower it,
        to one per worker); a Prefetcher holds the rest of a larger prefetch_factor."""
        per_worker = max(1, self.prefetch_factor)
        node = ParallelMapper(IterableWrapper(self.sampler), _Fetch(self.dataset), num_workers=self.num_workers,
                              in_order=True, method="thread",
                              max_concurrent=self.num_workers if per_worker == 1 else None)
        if self.pin_memory:
            node = PinMemory(node)
        if per_worker > 2:
            node = Prefetcher(node, prefetch_factor=(per_worker - 2) * self.num_workers)
        return node


class _Failed:
    """A batch that raised in a worker thread, carried to the consumer as an ordinary item: a real
    ExceptionWrapper would be raised again, and re-wrapped, by torchdata's own Prefetcher or
    PinMemory thread on its way, and name that thread instead of the worker."""

    def __init__(self, wrapper: ExceptionWrapper):
        self.wrapper = wrapper


class _Fetch:
    """The map function: a batch of indices -> the batch, or _Failed naming where it happened
    (torchdata's own wrapper would say "in _apply_udf"; PyTorch's says which worker)."""

    def __init__(self, gather: BatchGather):
        self.gather = gather

    def __call__(self, indices):
        started = time.thread_time()
        try:
            return self.gather[indices]
        except Exception:  # noqa: BLE001 - handed to the main thread, which raises it (_unwrap_errors)
            return _Failed(ExceptionWrapper(where="in a DataLoader worker thread"))
        finally:
            spent = time.thread_time() - started
            with _fetch_cpu_lock:
                _fetch_cpu[0] += spent


def _unwrap_errors(graph: list, count: int) -> Iterator:
    """The epoch's `count` batches. It ends after the last one instead of asking the graph for the
    end of the stream, which torchdata finds by polling every 0.1 s: an epoch's worth of waiting."""
    try:
        for _ in range(count):
            batch = next(graph[0], _END)
            if batch is _END:  # fewer batches than the sampler said: the stream's own end
                return
            if isinstance(batch, _Failed):
                batch.wrapper.reraise()
            yield batch
    finally:
        _retire(graph)


def _retire(graph: list) -> None:
    """Drop an epoch's graph in a thread of its own: its threads take up to torchdata's 0.1 s poll to
    see the stop, and whoever ends the epoch (the runner, between epochs) should not wait for that."""
    _open.pop(id(graph), None)
    if sys.is_finalizing():  # an epoch collected at exit: no new thread can start then
        graph.clear()
        return
    retiring = threading.Thread(target=graph.clear, name="dlpipe-loader-retire", daemon=True)
    retiring.start()
    _retiring[:] = [t for t in _retiring if t.is_alive()] + [retiring]


_open: dict[int, list] = {}
"""The graphs of epochs not retired yet (an epoch still held, or left unstarted), by id."""
_retiring: list[threading.Thread] = []


def let_threads_end(timeout_s: float = 5.0) -> None:
    """Wait for the graphs of finished epochs to stop their threads (each within torchdata's 0.1 s
    poll). Worker processes start by fork: a child forked while one of those threads holds a lock
    (the allocator's, logging's) waits on it forever; `dlpipe tune` alternates thread and process
    candidates in one process."""
    for retiring in _retiring:
        retiring.join(timeout=timeout_s)
    _retiring.clear()


@atexit.register
def _stop_at_exit() -> None:
    """Stop every epoch's threads before the interpreter goes down: torch's C++ side aborts the
    process ("terminate called without an active exception") if they are still running then."""
    for graph in list(_open.values()):
        graph.clear()  # torchdata's graph stops and joins its threads as it is dropped
    _open.clear()
    for retiring in _retiring:
        retiring.join(timeout=5)


def _with_timeout(graph: list, count: int, timeout: float) -> Iterator:
    """The epoch's `count` batches from the graph, raising PyTorch's own timeout error when none
    arrives within `timeout` seconds. A relay thread consumes the graph: the graph's own next() waits
    without a deadline.
    Every hand-over gives up once the consumer has gone, so an epoch left early leaves no thread."""
    handed: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def hand_over(item) -> bool:
        while not stop.is_set():
            try:
                handed.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def relay():  # ends with the graph in hand: the last reference goes here, not in the consumer
        try:
            for _ in range(count):  # not to the end of the stream: see _unwrap_errors
                batch = next(graph[0], _END)
                if batch is _END or not hand_over(batch):
                    break
            hand_over(_END)
        except BaseException:  # noqa: BLE001 - raised again in the consuming thread
            hand_over(_Failed(ExceptionWrapper(where="in the DataLoader's thread relay")))
        finally:
            _open.pop(id(graph), None)
            graph.clear()

    thread = threading.Thread(target=relay, name="dlpipe-loader-relay", daemon=True)
    thread.start()
    try:
        while True:
            try:
                batch = handed.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
            if batch is _END:
                return
            if isinstance(batch, _Failed):
                batch.wrapper.reraise()
            yield batch
    finally:
        stop.set()
