"""Which job of a sweep won, only where its lead over the runner-up exceeds the noise of that sweep.

On a shared machine one setting measured twice ran at 87.2 and 29.3 samples/s: the fastest job by
less than that is no finding. The noise of a sweep's samples/s is the largest of
- the epoch-to-epoch spread within any finished job: max/min - 1 over its epochs after the first
  (the first pays for worker start-up and warm-up);
- the spread between finished jobs that ran the same settings (sweeps.jobs.same_settings), max/min - 1;
- contention: the speed-up 1/(1 - share) - 1 that the largest share of a job's runnable time lost to
  other processes in one of its epochs after the first could explain (contention_share);
- MIN_GAIN, below which dlpipe calls no setting faster anywhere (judging.journal).
A job is the fastest when it beats the runner-up by more than that, and no other job was contended.
A contended job (a third or more of its runnable time lost to other processes in an epoch, the
verdict's threshold, judging.contention) measured only a floor of its speed: beside other work its
intra-op threads also spin while they wait, so the loss is more than the CPU time taken (a regression
sweep's job lost 68% of its time and ran 12x slower than the same job alone). No lead over a floor is
a finding. Otherwise the jobs within the noise of the top, and the contended ones, are named and
none is the fastest.

The objective (a loss, an R2...), and the chart's panels of data wait, GPU utilisation and memory,
are judged the same way with an absolute noise: the largest change
of the objective in the last epoch of any finished job (a loss still moving that much per epoch
could change places with one more), and the spread between jobs that ran the same settings. Contention
slows a job; it does not change what it learns.

Pure: the inputs are sweeps.jobs.Job objects with the metric histories the callback fetched.
"""

from dataclasses import dataclass, field

from dlpipe.judging.contention import RUN_QUEUE_SHARE
from dlpipe.judging.journal import MIN_GAIN
from dlpipe.sweeps.jobs import Job, numbers, same_settings

SPEED = "samples_per_s"
CONTENTION = ("run_queue_s_per_s", "cpu_main_pct", "cpu_workers_pct", "cpu_pressure_frac", "cpu_steal_frac",
              "cpu_others_frac")
"""The per-epoch figures contention_share reads (dlpipe's names; dlpipe.telemetry.contention logs them)."""
LAST_EPOCHS = 2
"""The objective's spread is read over this many last epochs: its last epoch-to-epoch change."""


def _most(values) -> float | None:
    """The largest of the values that are not None, or None."""
    return max((v for v in values if v is not None), default=None)


def _values(series: dict[int, float]) -> list[float]:
    return [v for _, v in sorted(series.items())]


def epoch_spread(series: dict[int, float]) -> float | None:
    """max/min - 1 of a positive metric over its epochs after the first; None with fewer than two such."""
    values = _values(series)[1:]
    if len(values) < 2 or min(values) <= 0:
        return None
    return max(values) / min(values) - 1


def last_spread(series: dict[int, float]) -> float | None:
    """max - min of a metric over its last LAST_EPOCHS epochs; None with fewer than two epochs."""
    values = _values(series)[-LAST_EPOCHS:]
    return max(values) - min(values) if len(values) >= 2 else None


def epoch_contention(figures: dict[str, float]) -> float | None:
    """The share of the job's runnable time that other processes cost it in one epoch, or None unmeasured.

    The job's threads waited `run_queue_s_per_s` for each `(cpu_main_pct + cpu_workers_pct) / 100`
    seconds they ran: that share of their runnable time was lost (without schedstat, CPU pressure
    stands in). Only as much as others took counts (the share of the job's CPUs other processes or
    the hypervisor used): a job whose own threads outnumber its CPUs waits by its own setting, and
    that wait is its cost, not noise."""
    queue, main = figures.get("run_queue_s_per_s"), figures.get("cpu_main_pct")
    ran = None if main is None else (main + figures.get("cpu_workers_pct", 0.0)) / 100
    if queue is not None and ran is not None and queue + ran > 0:
        waited = queue / (queue + ran)
    else:
        waited = figures.get("cpu_pressure_frac")
    outside = [figures[k] for k in ("cpu_others_frac", "cpu_steal_frac") if k in figures]
    taken = max(outside) if outside else None
    if waited is None or taken is None:
        return waited if taken is None else taken
    return min(waited, taken)


def contention_share(job: Job) -> tuple[float | None, float | None]:
    """(the largest epoch_contention, the largest CPU pressure) over the job's epochs after the first."""
    series = {k: job.history[k] for k in CONTENTION if job.history.get(k)}
    epochs = sorted({e for values in series.values() for e in values})
    epochs = epochs[1:] if len(epochs) > 1 else epochs
    shares = [epoch_contention({k: v[e] for k, v in series.items() if e in v}) for e in epochs]
    pressure = [series["cpu_pressure_frac"][e] for e in epochs if e in series.get("cpu_pressure_frac", {})]
    return _most(shares), _most(pressure)


@dataclass
class Ranking:
    """A sweep's jobs ranked by one metric, and whether the top one won beyond the sweep's noise."""

    what: str
    """`fastest` or `best val_r2`: what the winner is called."""
    metric: str
    unit: str
    higher: bool
    relative: bool
    """Noise and leads as shares (samples/s) or in the metric's own units (an objective)."""
    ranked: list[Job]
    """The FINISHED jobs with the metric, best first."""
    noise: float
    measured: list[str]
    """What the noise was measured from, for the sentence (`epoch-to-epoch spread up to 38%`)."""
    floors: list[Job] = field(default_factory=list)
    """Jobs whose value is only a floor (contended): no job is ahead of them beyond noise."""

    def _value(self, job: Job) -> float:
        return job.metrics[self.metric]

    def gap(self, a: Job, b: Job) -> float:
        """How far `a` is ahead of `b` (a share where relative)."""
        x, y = self._value(a), self._value(b)
        if not self.relative:
            return x - y if self.higher else y - x
        return (x / y if self.higher else y / x) - 1 if min(x, y) > 0 else float("inf")

    @property
    def winner(self) -> Job | None:
        """The top job where its lead exceeds the noise (or it is the only one), else None."""
        if not self.ranked or any(j is not self.ranked[0] for j in self.floors):
            return self.ranked[0] if len(self.ranked) == 1 else None
        if len(self.ranked) == 1 or self.gap(self.ranked[0], self.ranked[1]) > self.noise:
            return self.ranked[0]
        return None

    @property
    def within(self) -> list[Job]:
        """The jobs within the noise of the top one, in job order (the winner alone where there is one)."""
        if not self.ranked or self.winner is not None:
            return self.ranked[:1]
        near = [j for j in self.ranked if j in self.floors or self.gap(self.ranked[0], j) <= self.noise]
        return sorted(near, key=lambda j: j.number)

    def shown(self, value: float) -> str:
        return f"{value:.1f}" if self.relative else f"{value:.4g}"

    def _amount(self, value: float) -> str:
        return f"{value:.0%}" if self.relative else f"{value:.4g}"

    def headline(self) -> str:
        """`fastest: job #0 loader.num_workers=0 (87.2 samples/s)`, or
        `fastest: indistinguishable (jobs #0-#3 within noise)`."""
        top = self.winner
        if top is not None:
            unit = f" {self.unit}" if self.unit else ""
            return f"{self.what}: job #{top.number} {top.name} ({self.shown(self._value(top))}{unit})"
        return f"{self.what}: indistinguishable (jobs {numbers(self.within)} within noise)"

    def noise_text(self) -> str:
        return ", ".join(self.measured) or f"no spread measured; floor {self._amount(self.noise)}"

    def sentence(self) -> str:
        """The verdict with its evidence, for the notes, the chart and the parent's tags."""
        top = self.winner
        if top is None:
            nobody = "no fastest job" if self.relative else f"no best job by {self.metric}"
            return f"jobs {numbers(self.within)} are within the noise of this sweep ({self.noise_text()}): {nobody}"
        if len(self.ranked) == 1:
            return f"{self.headline()}: the only finished job with {self.metric}"
        second = self.ranked[1]
        return (f"{self.headline()}: {self._amount(self.gap(top, second))} ahead of #{second.number} "
                f"({self.shown(self._value(second))}), beyond the noise of this sweep "
                f"({self._amount(self.noise)}: {self.noise_text()})")


def _ranked(jobs: list[Job], metric: str, higher: bool) -> list[Job]:
    finished = [j for j in jobs if j.finished and metric in j.metrics]
    return sorted(finished, key=lambda j: -j.metrics[metric] if higher else j.metrics[metric])


def _repeat_spread(jobs: list[Job], metric: str, relative: bool) -> float | None:
    """The largest spread of `metric` between finished jobs that ran the same settings."""
    spreads = []
    for group in same_settings(jobs):
        values = [j.metrics[metric] for j in group if j.finished and metric in j.metrics]
        if len(values) >= 2 and (not relative or min(values) > 0):
            spreads.append(max(values) / min(values) - 1 if relative else max(values) - min(values))
    return max(spreads, default=None)


def fastest(jobs: list[Job]) -> Ranking | None:
    """The jobs ranked by samples/s (the last epoch's, as the table shows) against the sweep's noise."""
    ranked = _ranked(jobs, SPEED, higher=True)
    if not ranked:
        return None
    spread = _most(epoch_spread(j.history.get(SPEED, {})) for j in ranked)
    repeat = _repeat_spread(jobs, SPEED, relative=True)
    shares, pressures = zip(*(contention_share(j) for j in ranked))
    floors = contended(ranked)
    below = _most(s for s in shares if s is not None and s < RUN_QUEUE_SHARE)
    explained = None if below is None else 1 / (1 - below) - 1
    pressure = _most(pressures)
    measured = []
    if spread is not None:
        measured.append(f"epoch-to-epoch spread up to {spread:.0%}")
    if repeat is not None:
        measured.append(f"same settings up to {repeat:.0%} apart")
    if floors:
        lost = _most(share for j, share in zip(ranked, shares) if j in floors)
        measured.append(f"{'job' if len(floors) == 1 else 'jobs'} {numbers(floors)} contended, up to {lost:.0%} of "
                        "the time lost to other processes, so samples/s only a floor")
    elif below is not None:
        measured.append(f"up to {below:.0%} of a job's time lost to other processes")
    if pressure is not None:
        measured.append(f"CPU pressure {pressure:.2g}")
    noise = max(MIN_GAIN, _most([spread, repeat, explained]) or 0.0)
    return Ranking("fastest", SPEED, "samples/s", True, True, ranked, noise, measured, floors)


def best_by(jobs: list[Job], metric: str, higher: bool) -> Ranking | None:
    """The jobs ranked by the objective against the sweep's noise of it (absolute)."""
    ranked = _ranked(jobs, metric, higher)
    if not ranked:
        return None
    spread = _most(last_spread(j.history.get(metric, {})) for j in ranked)
    repeat = _repeat_spread(jobs, metric, relative=False)
    measured = []
    if spread is not None:
        measured.append(f"{metric} moved up to {spread:.4g} in a job's last epoch")
    if repeat is not None:
        measured.append(f"same settings up to {repeat:.4g} apart")
    noise = _most([spread, repeat]) or 0.0
    return Ranking(f"best {metric}", metric, "", higher, False, ranked, noise, measured)


def contended(jobs: list[Job]) -> list[Job]:
    """The jobs that lost a third or more of their runnable time to other processes in an epoch."""
    return [j for j in jobs if (contention_share(j)[0] or 0.0) >= RUN_QUEUE_SHARE]


def panel_ranking(jobs: list[Job], metric: str, higher: bool, timed: bool) -> Ranking | None:
    """A chart panel's own ranking (data wait, GPU utilisation, memory): judged as the objective is, by
    the metric's last epoch-to-epoch change and the spread of repeated settings; a `timed` metric (a
    share of the epoch's time) of a contended job is no finding either, as for samples/s."""
    ranking = best_by(jobs, metric, higher)
    if ranking is not None and timed:
        ranking.floors = contended(ranking.ranked)
    return ranking
