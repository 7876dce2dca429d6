"""The automatic loader values that depend only on numbers (workers, prefetch, persistence), each as
a Decision: the value with the reason said in the log and recorded as the run's `auto.*` param.

The config resolvers (config.decisions) and the fit to the built data (loader.fitting) both take
them from here. No torch and nothing read at import: config resolvers import this module.
"""

from dataclasses import dataclass, field

from dlpipe.loader import policy
from dlpipe.machine import hardware


@dataclass(frozen=True)
class Decision:
    value: object
    reason: str
    inputs: dict = field(default_factory=dict)


def workers_for_data(cpu_workers: int, item_fetch_s: float | None) -> Decision:
    """The CPU-based worker count, or 0 when items are so cheap to fetch in this process that
    workers can only slow it down (data already in memory). `item_fetch_s` None: not measured."""
    if cpu_workers and item_fetch_s is not None and item_fetch_s < policy.CHEAP_ITEM_S:
        return Decision(0, f"items take {item_fetch_s * 1e6:.1f} us each to fetch in this process (data in memory), "
                           f"under the {policy.CHEAP_ITEM_S * 1e6:.0f} us where workers start to pay for their "
                           "hand-over; "
                           f"the CPU budget alone would give {cpu_workers}")
    return Decision(cpu_workers, "")


def prefetch(num_workers: int) -> Decision:
    if int(num_workers) == 0:
        return Decision(None, "no workers: PyTorch rejects prefetch_factor without them")
    n = policy.PREFETCH_DEFAULT
    return Decision(n, f"{num_workers} workers x {n} batches in flight")


def persistent(num_workers: int, epochs: int, dataset_size, batch_size=None, val_fraction=0.0,
               drop_last=False) -> Decision:
    """policy.persist_workers on the batches this config gives each rank per epoch; without a known
    dataset size (or batch size) the batches are unknown here, and tasks.build decides again once
    the dataset is built."""
    num_workers, epochs, size = int(num_workers), int(epochs), int(dataset_size or 0)
    batches = None
    if size > 0 and batch_size:
        train = policy.train_samples(size, float(val_fraction or 0.0))
        batches = policy.batches_per_epoch(train, int(batch_size), hardware.world_size(), bool(drop_last))
    value, why = policy.persist_workers(num_workers, epochs, batches)
    inputs = {"num_workers": str(num_workers), "epochs": str(epochs), "dataset_size": str(size or "unknown"),
              "batches_per_epoch": "unknown" if batches is None else str(batches)}
    return Decision(value, why, inputs)
