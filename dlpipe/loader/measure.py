"""Measure what a DataLoader delivers: samples/s after warm-up, first-batch latency, CPU and memory.

Used by `dlpipe bench` (one measurement) and `dlpipe tune` (many). The measured batches run across
epoch boundaries like training does, so worker start-up at each epoch (without persistent workers)
is part of the figure. With a `step` (bench.mode=train) each batch also goes through the training
step, because the best worker count depends on how many cores the step itself takes.
"""

import time
from dataclasses import dataclass

from torch.utils.data import IterableDataset

from dlpipe.training.batches import batch_samples


class _Batches:
    """Batches of `loader` across epochs, calling the sampler's (or the stream's) set_epoch like the
    trainer does."""

    def __init__(self, loader):
        self.loader, self.epoch, self._it = loader, 0, None

    def next(self):
        while True:
            if self._it is None:
                self.epoch += 1
                if hasattr(self.loader.sampler, "set_epoch"):
                    self.loader.sampler.set_epoch(self.epoch)
                elif isinstance(getattr(self.loader, "dataset", None), IterableDataset) and \
                        hasattr(self.loader.dataset, "set_epoch"):
                    self.loader.dataset.set_epoch(self.epoch)  # a stream orders itself by the epoch
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None

    def close(self) -> None:
        """Shut this pass's non-persistent workers down now. Dropping the iterator is not enough when an
        error or a stop signal left next(): its traceback holds the iterator (until the interpreter exits,
        for Ctrl-C). Persistent workers stay for the next pass; their loader's shutdown() ends them."""
        it, self._it = self._it, None
        if it is not None and not getattr(self.loader, "persistent_workers", False):
            shutdown = getattr(it, "_shutdown_workers", None)  # PyTorch's worker-process iterators
            if shutdown is not None:
                shutdown()


@dataclass(frozen=True)
class Measurement:
    samples_per_s: float
    first_batch_s: float
    batches: int
    samples: int
    seconds: float
    resources: dict[str, float]

    def metrics(self) -> dict[str, float]:
        return {"samples_per_s": self.samples_per_s, "first_batch_s": self.first_batch_s,
                "bench_seconds": self.seconds, **self.resources}


def measure(loader, batches: int, warmup: int, sampler=None, step=None) -> Measurement:
    """Time `batches` batches after `warmup` (the first batch, worker start-up, counts as warm-up
    and is reported on its own as first_batch_s)."""
    source = _Batches(loader)
    try:
        started = time.perf_counter()
        batch = source.next()
        first = time.perf_counter() - started
        if step is not None:
            step(batch)
        for _ in range(max(warmup - 1, 0)):
            batch = source.next()
            if step is not None:
                step(batch)
        if sampler is not None:
            sampler.window()  # the resource window starts with the measured batches
        samples = 0
        started = time.perf_counter()
        for _ in range(batches):
            batch = source.next()
            if step is not None:
                step(batch)
            samples += batch_samples(batch)
        seconds = time.perf_counter() - started
        resources = sampler.window() if sampler is not None else {}
    finally:
        source.close()
    return Measurement(samples / max(seconds, 1e-9), first, batches, samples, seconds, resources)


def describe(metrics: dict[str, float]) -> str:
    parts = [f"{metrics['samples_per_s']:.1f} samples/s", f"first batch {metrics['first_batch_s']:.2f} s"]
    if "cpu_util" in metrics:
        parts.append(f"cpu {metrics['cpu_util']:.0f}% of budget")
    if "cpu_per_worker_pct" in metrics:
        parts.append(f"{metrics['cpu_per_worker_pct']:.0f}% cpu and {metrics['worker_rss_mean_mb']:.0f} MB per worker")
    if "tree_rss_peak_mb" in metrics:
        parts.append(f"peak {metrics['tree_rss_peak_mb']:.0f} MB in all")
    return ", ".join(parts)
