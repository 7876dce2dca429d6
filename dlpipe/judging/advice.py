"""Advice checked against what dlpipe measured: each suggested change carries its expected gain and
the measurement behind it, and a change some measurement of this job found no faster is withheld.

The measurements, in the order they count:
- the run's own epoch: data wait, epoch time and samples give the wait and the other work per item;
  with no workers the wait *is* the main process fetching and collating items;
- the probe (loader.probe): seconds per item fetched and collated in the main process;
- the measurement journal (judging.journal): what training runs, `dlpipe bench` and `dlpipe tune`
  measured for other settings of the same job. A tune's figure counts as faster only beyond the noise
  that search measured (its threshold), so training never proposes what tune could not tell apart;
- with a config `dlpipe tune` wrote (`loader.tuned_on` names the search), that search's trials even
  where this run is another job (batch size, device, CPU budget, host or dataset changed): a change
  it found no faster is then still advised, saying what the search measured and why it may differ.
No torch here.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from dlpipe.judging.journal import MIN_GAIN, Journal

MODES = {"epoch": "a training run", "step": "dlpipe bench/tune (train mode)", "loader": "dlpipe bench/tune"}


@dataclass(frozen=True)
class Tuned:
    """The `dlpipe tune` search that wrote this run's loader config."""

    journal: Journal
    """Its trials, from the measurement journal."""
    differs: str = ""
    """How this run differs from the job the search measured ("batch_size 256, tuned at 64"); empty
    when it is the same job."""


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
    world: int = 1
    """Ranks whose epoch figures are combined (samples/s summed over ranks): the per-item figures are
    one rank's, as a single process's are."""
    tuned: Tuned | None = None
    """The search that wrote the loader config, where one did and the journal still has it."""
    previous: dict = field(default_factory=dict)
    """What the last verdict on this evidence decided (judging.steady): the next epoch keeps it until
    its figures move beyond the noise."""

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
    def of(cls, metrics: dict[str, float], world: int = 1) -> "PerItem | None":
        """One rank's split: with `world` ranks, samples/s is their sum while the epoch time is the
        slowest rank's and the data wait their mean (training.distributed), so a rank's items are the
        job's over `world`."""
        samples = metrics.get("samples_per_s", 0.0) * metrics.get("epoch_time_s", 0.0) / max(world, 1)
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


@dataclass(frozen=True)
class Finding:
    """What the journal says about a proposed change: faster, not faster, or not measured."""

    measured: bool
    faster: bool
    ratio: float | None = None
    basis: str = ""
    noisy: bool = False
    """Measured faster, but by less than the noise of the search that measured it."""


def check(change: dict, current: dict, metrics: dict[str, float], evidence: Evidence, warm: bool = True) -> Finding:
    """Compare the fastest measurement with `change` applied against the current settings, in every
    mode the journal has both for. In the epoch mode (earlier training runs) the current settings are
    also this run's own samples/s when `warm` (an epoch without start-up, like the journal's lines).
    Any comparison that found the change no faster (by MIN_GAIN, or by the noise the measuring search
    recorded) withholds it."""
    support = None
    for mode, journal in evidence.journals.items():
        proposed = journal.best(**{**_unchanged(current, change), **change})
        if proposed is None:
            continue
        figures = [(journal.median(current), "with the current settings", journal.noise(current))]
        if mode == "epoch" and warm:
            figures.append((metrics.get("samples_per_s"), "in this run", 0.0))
        for now, whose, noise in figures:
            if not now:
                continue
            ratio = proposed.samples_per_s / now
            basis = (f"{MODES.get(mode, mode)} measured {proposed.label()} at {proposed.samples_per_s:.0f} samples/s "
                     f"({proposed.source}, {proposed.when}) against {now:.0f} {whose}")
            margin = max(MIN_GAIN, proposed.noise, noise)
            if ratio < 1 + MIN_GAIN:
                return Finding(True, False, ratio, basis)
            if ratio < 1 + margin:
                return Finding(True, False, ratio, f"{basis}, within the noise of that search (a gain had to pass "
                               f"{1 + margin:.2f}x)", noisy=True)
            support = support or Finding(True, True, ratio, basis)
    return support or Finding(False, False)


def tuned_finding(change: dict, current: dict, tuned: Tuned | None) -> Finding:
    """What the search that wrote this config measured of `change` against the current settings,
    with the noise it measured; not measured when it tried neither (or there is no such search)."""
    if tuned is None:
        return Finding(False, False)
    proposed = tuned.journal.best(**{**_unchanged(current, change), **change})
    now = tuned.journal.median(current)
    if proposed is None or not now:
        return Finding(False, False)
    ratio = proposed.samples_per_s / now
    margin = max(MIN_GAIN, proposed.noise)
    basis = (f"dlpipe tune measured {proposed.label()} at {ratio:.2f}x the tuned config ({proposed.when}; a gain "
             f"had to pass {1 + margin:.2f}x)")
    return Finding(True, ratio >= 1 + margin, ratio, basis, noisy=1 + MIN_GAIN <= ratio < 1 + margin)


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
