"""Advice checked against what dlpipe measured: each suggested change carries its expected gain and
the measurement behind it, and a change some measurement of this job found no faster is withheld.

The measurements, in the order they count:
- the run's own epoch: data wait, epoch time and samples give the wait and the other work per item;
  with no workers the wait *is* the main process fetching and collating items;
- the probe (loader.probe): seconds per item fetched and collated in the main process;
- the measurement journal (judging.journal): what training runs, `dlpipe bench` and `dlpipe tune`
  measured for other settings of the same job.
No torch here.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from dlpipe.judging.journal import MIN_GAIN, Journal
from dlpipe.loader import policy

MODES = {"epoch": "a training run", "step": "dlpipe bench/tune (train mode)", "loader": "dlpipe bench/tune"}


@dataclass
class Evidence:
    """What is known about this job's loader besides the epoch's own numbers."""

    item_fetch_s: float | None = None
    """Seconds per item fetched and collated in the main process, by the probe (None: not probed)."""
    journals: dict[str, Journal] = field(default_factory=dict)
    """mode -> this job's earlier measurements in that mode (judging.journal)."""
    probe: Callable[[], float | None] | None = None
    """Measures item_fetch_s the first time an advice depends on it: the probe fetches items in the
    main process, which only an input-bound epoch with workers needs."""

    def fetch_cost(self) -> float | None:
        if self.item_fetch_s is None and self.probe is not None:
            self.item_fetch_s, self.probe = self.probe(), None
        return self.item_fetch_s


@dataclass(frozen=True)
class PerItem:
    """One epoch's time per sample, split into the wait for data and everything else."""

    total_s: float
    wait_s: float

    @property
    def other_s(self) -> float:
        return max(self.total_s - self.wait_s, 0.0)

    @classmethod
    def of(cls, metrics: dict[str, float]) -> "PerItem | None":
        samples = metrics.get("samples_per_s", 0.0) * metrics.get("epoch_time_s", 0.0)
        if samples <= 0 or "data_wait_s" not in metrics:
            return None
        return cls(metrics["epoch_time_s"] / samples, metrics["data_wait_s"] / samples)


def item_cost(per_item: PerItem | None, num_workers: int, evidence: Evidence) -> tuple[float | None, str]:
    """(seconds to fetch one item in the main process, which measurement says so). Without workers
    the epoch measured it directly: the step waited exactly while the main process fetched."""
    if num_workers == 0 and per_item is not None:
        return per_item.wait_s, "this epoch's data wait per sample, fetched in the main process"
    if num_workers > 0 and evidence.fetch_cost() is not None:
        return evidence.item_fetch_s, "the probe: fetch and collate in the main process"
    return None, ""


def is_cheap(cost_s: float | None) -> bool:
    """Items this cheap are in memory: a worker's hand-over costs more than the fetch (loader.policy)."""
    return cost_s is not None and cost_s < policy.CHEAP_ITEM_S


@dataclass(frozen=True)
class Finding:
    """What the journal says about a proposed change: faster, not faster, or not measured."""

    measured: bool
    faster: bool
    ratio: float | None = None
    basis: str = ""


def check(change: dict, current: dict, metrics: dict[str, float], evidence: Evidence, warm: bool = True) -> Finding:
    """Compare the fastest measurement with `change` applied against the current settings, in every
    mode the journal has both for. In the epoch mode (earlier training runs) the current settings are
    also this run's own samples/s when `warm` (an epoch without start-up, like the journal's lines).
    Any comparison that found the change no faster (by MIN_GAIN) withholds it."""
    support = None
    for mode, journal in evidence.journals.items():
        proposed = journal.best(**{**_unchanged(current, change), **change})
        if proposed is None:
            continue
        figures = [(journal.median(current), "with the current settings")]
        if mode == "epoch" and warm:
            figures.append((metrics.get("samples_per_s"), "in this run"))
        for now, whose in figures:
            if not now:
                continue
            ratio = proposed.samples_per_s / now
            basis = (f"{MODES.get(mode, mode)} measured {proposed.label()} at {proposed.samples_per_s:.0f} samples/s "
                     f"({proposed.source}, {proposed.when}) against {now:.0f} {whose}")
            if ratio < 1 + MIN_GAIN:
                return Finding(True, False, ratio, basis)
            support = support or Finding(True, True, ratio, basis)
    return support or Finding(False, False)


def _unchanged(current: dict, change: dict) -> dict:
    """The current settings a measurement of `change` must share: all of them, except that a changed
    worker count brings its own prefetch and persistence (and none without workers)."""
    if "num_workers" in change:
        return {"pin_memory": current["pin_memory"]}
    return {k: v for k, v in current.items() if k not in change}


def gain_text(ratio: float) -> str:
    return f"{ratio:.2f}x samples/s"


def wait_bound(wait_frac: float) -> float:
    """The most an epoch can speed up if the wait for data went away entirely."""
    return 1.0 / max(1.0 - wait_frac, 1e-3)


def more_workers_gain(per_item: PerItem | None, cost_s: float | None, workers: int, target: int,
                      wait_frac: float) -> float:
    """Expected samples/s ratio from `target` workers instead of `workers`: the loader's rate scales
    with the worker count at best, and the epoch cannot get faster than its other work allows."""
    bound = wait_bound(wait_frac)
    if workers == 0:
        if per_item is None or cost_s is None:
            return bound
        return min(bound, per_item.total_s / max(per_item.other_s, cost_s / target, 1e-12))
    return min(bound, target / workers)


def fewer_workers_gain(per_item: PerItem | None, cost_s: float, wait_frac: float) -> float:
    """Expected ratio from fetching in the main process: each item then costs its fetch plus the
    other work, instead of waiting on the workers' hand-over."""
    if per_item is None:
        return wait_bound(wait_frac)
    return min(wait_bound(wait_frac), per_item.total_s / max(per_item.other_s + cost_s, 1e-12))
