"""The loader search behind `dlpipe tune`: candidates, trials, the memory guard and the climb.

The search starts at the automatic values and measures rather than guesses, with far fewer
trials than the full grid:
1. the automatic config, `bench.repeats` times: the standard deviation of its repeats over their
   median is the noise; a candidate has to beat the best by max(bench.min_gain, 6 x noise /
   sqrt(repeats)) to win (at 3 repeats about twice the spread of the repeats, as expected of a normal
   noise; four times the repeats halve it, so more repeats can decide what fewer could not);
2. num_workers=0, always: for data already in memory the main process beats any worker count,
   and a climb from the automatic value through 1 worker (often the slowest choice) would stop
   before reaching 0;
3. unless 0 won, a climb over the worker ladder (0 1 2 3 4 6 8 12 16 ...) up from the automatic
   value while it improves, else down towards 1; at most bench.max_workers (default: the CPU
   budget plus half of it). A start with no workers (loader=pytorch) first tries the automatic
   worker count and climbs from there if it wins;
4. where the dataset gathers whole batches, loader.fetch=batch at the best worker count and at 0;
5. with workers, the other worker method at the best count: threads win when faster, or when as
   fast within the noise at a lower peak RSS of the whole process tree; then more threads while
   they gain (a dataset waiting on I/O may use more threads than CPUs);
6. with the best worker count: prefetch_factor doubled, persistent_workers flipped (only when the
   measurement crosses an epoch boundary, where it matters, and only for processes), pin_memory
   flipped (only with CUDA).
Before each trial a memory guard estimates workers x prefetch_factor x batch bytes against free
/dev/shm and the RAM the workers would take against available memory, and skips what does not fit.

What the search may claim (Search.outcome): its choice is the best only when no other candidate
measured faster; one that did, by less than the noise, is a tie: the search is inconclusive, keeps
its choice (the automatic config, unless a candidate beat it beyond the noise) and says how many
repeats would tell them apart.
"""

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dlpipe.loader import policy
from dlpipe.loader.build import build_loader
from dlpipe.loader.measure import measure

LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class Candidate:
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    fetch: str = "item"
    """item or batch (loader.fetch): decided, never auto."""
    worker_method: str = "process"
    """process or thread (loader.worker_method); process without workers."""

    def __post_init__(self):  # one candidate per effective loader: what means nothing is normalised away
        if self.num_workers == 0 and (self.worker_method != "process" or self.persistent_workers):
            object.__setattr__(self, "worker_method", "process")
            object.__setattr__(self, "persistent_workers", False)
        if self.worker_method == "thread" and self.persistent_workers:
            object.__setattr__(self, "persistent_workers", False)

    def label(self) -> str:
        tail = (" fetch=batch" if self.fetch == "batch" else "") + (" pin_memory=true" if self.pin_memory else "")
        if self.num_workers == 0:
            return "num_workers=0" + tail
        if self.worker_method == "thread":
            return f"num_workers={self.num_workers} worker_method=thread prefetch_factor={self.prefetch_factor}" + tail
        return (f"num_workers={self.num_workers} prefetch_factor={self.prefetch_factor} "
                f"persistent_workers={str(self.persistent_workers).lower()}" + tail)

    def settings(self) -> dict:
        return {"num_workers": self.num_workers, "prefetch_factor": self.prefetch_factor if self.num_workers else None,
                "persistent_workers": self.persistent_workers and self.num_workers > 0, "pin_memory": self.pin_memory,
                "fetch": self.fetch, "worker_method": self.worker_method}

    def with_workers(self, n: int) -> "Candidate":
        if n == 0:
            return replace(self, num_workers=0, prefetch_factor=None, persistent_workers=False)
        return replace(self, num_workers=n, prefetch_factor=self.prefetch_factor or policy.PREFETCH_DEFAULT)


@dataclass
class Trial:
    candidate: Candidate
    runs: list[float] = field(default_factory=list)  # samples/s of each measurement
    metrics: dict[str, float] = field(default_factory=dict)  # of the median measurement
    skipped: str | None = None

    @property
    def samples_per_s(self) -> float:
        return statistics.median(self.runs) if self.runs else 0.0


def memory_guard(c: Candidate, batch_bytes: int, shm_free: int | None, ram_available: int,
                 worker_rss_bytes: float) -> str | None:
    """Why `c` would not fit in memory here, or None."""
    if c.num_workers == 0:
        return None
    inflight = policy.inflight_bytes(c.num_workers, c.prefetch_factor, batch_bytes)
    if c.worker_method == "thread":  # no /dev/shm, no process of their own: only the batches in flight
        worker_rss_bytes = 0.0
    elif policy.shm_overflow(inflight, shm_free):
        prefetch = policy.prefetch_in_effect(c.num_workers, c.prefetch_factor)
        return (f"{c.num_workers} workers x prefetch {prefetch} x {batch_bytes / 2**20:.1f} MB = "
                f"{inflight / 2**20:.0f} MB in flight, over half the {shm_free / 2**20:.0f} MB free in /dev/shm")
    if policy.ram_overflow(c.num_workers * worker_rss_bytes, inflight, ram_available):
        ram = c.num_workers * worker_rss_bytes + inflight
        return (f"{c.num_workers} workers would take about {ram / 2**20:.0f} MB, over {policy.RAM_SHARE:.0%} of the "
                f"{ram_available / 2**20:.0f} MB available")
    return None


NOISE_Z = 6.0
"""A gain must pass NOISE_Z x noise / sqrt(repeats): 3.5 standard deviations of one run at 3 repeats,
about twice the range three normal repeats span (the rule's earlier form, twice the range)."""


def noise_of(runs: list[float]) -> float:
    """The spread of repeated measurements of one config: their standard deviation over their median."""
    if len(runs) < 2 or statistics.median(runs) <= 0:
        return 0.0
    return statistics.stdev(runs) / statistics.median(runs)


def threshold_for(noise: float, repeats: int, min_gain: float) -> float:
    """The gain a candidate must show over the best to win."""
    return max(min_gain, NOISE_Z * noise / math.sqrt(max(repeats, 1)))


@dataclass(frozen=True)
class Outcome:
    """What a finished search may claim: its choice, and the candidates it cannot tell from it."""

    chosen: Candidate
    ties: tuple[Candidate, ...]
    """Measured faster than `chosen`, by less than the threshold (fastest first)."""
    noise: float
    threshold: float
    repeats: int

    @property
    def conclusive(self) -> bool:
        return not self.ties

    def repeats_to_decide(self, gap: float) -> int:
        """Repeats at which a relative gap `gap` would pass the threshold, the noise staying as measured."""
        if gap <= 0 or self.noise <= 0:
            return self.repeats
        return max(self.repeats + 1, math.ceil((NOISE_Z * self.noise / gap) ** 2))


class Search:
    """The search of the module docstring over an `evaluate(candidate) -> Trial` function."""

    def __init__(self, evaluate, min_gain: float, max_workers: int, tune_persistent: bool, tune_pin: bool,
                 seed_workers: int = 2, persist: Callable[[int], bool] | None = None, gathers: bool = False,
                 tune_threads: bool = False):
        """`seed_workers`: where to start climbing when the start config has no workers. `persist`:
        persistent_workers for a worker count (policy.persist_workers) when it is automatic, so a
        candidate carries the value the job would get with that many workers; None keeps the start's.
        `gathers`: the dataset gathers whole batches (loader.fetch=batch is possible). `tune_threads`:
        thread workers are a candidate (not for a dataset that draws from the global RNGs)."""
        self.evaluate, self.min_gain, self.max_workers = evaluate, min_gain, max_workers
        self.seed_workers, self.persist = seed_workers, persist
        self.tune_persistent, self.tune_pin = tune_persistent, tune_pin
        self.gathers, self.tune_threads = gathers, tune_threads
        self.trials: dict[Candidate, Trial] = {}
        self.threshold, self.noise = min_gain, 0.0

    def outcome(self, chosen: Candidate) -> Outcome:
        """`chosen` (what run() returned) with the candidates measured faster than it: the climb only
        moves beyond the threshold, so each of those is faster by less, a tie it cannot decide."""
        kept = self.trials[chosen].samples_per_s
        faster = sorted((t for c, t in self.trials.items() if c != chosen and not t.skipped and t.samples_per_s > kept),
                        key=lambda t: -t.samples_per_s)
        return Outcome(chosen, tuple(t.candidate for t in faster), self.noise, self.threshold,
                       len(self.trials[chosen].runs))

    def _with_workers(self, c: Candidate, n: int) -> Candidate:
        moved = c.with_workers(n)
        if self.persist is None or n == 0:
            return moved
        return replace(moved, persistent_workers=self.persist(n))

    def _score(self, c: Candidate) -> float:
        if c not in self.trials:
            self.trials[c] = self.evaluate(c)
        trial = self.trials[c]
        return 0.0 if trial.skipped else trial.samples_per_s

    def _better(self, c: Candidate, best: Candidate) -> bool:
        return self._score(c) > self._score(best) * (1 + self.threshold)

    def run(self, start: Candidate) -> Candidate:
        self._score(start)
        runs = self.trials[start].runs
        self.noise = noise_of(runs)
        self.threshold = threshold_for(self.noise, len(runs), self.min_gain)
        best = start
        if start.num_workers != 0:
            if self._better(self._with_workers(start, 0), best):
                best = self._with_workers(start, 0)
            else:
                best = self._climb_workers(best)
        else:  # a start without workers (loader=pytorch, in_memory): see whether workers help at all
            seed = self._with_workers(start, max(1, min(self.seed_workers, self.max_workers)))
            if self.max_workers and self._better(seed, best):
                best = self._climb_workers(seed)
        best = self._fetch(best)
        best = self._method(best)
        if best.num_workers:
            prefetch = policy.prefetch_in_effect(best.num_workers, best.prefetch_factor)
            doubled = replace(best, prefetch_factor=2 * prefetch)
            if self._better(doubled, best):
                best = doubled
            if self.tune_persistent and best.worker_method == "process":
                flipped = replace(best, persistent_workers=not best.persistent_workers)
                if self._better(flipped, best):
                    best = flipped
        if self.tune_pin:
            flipped = replace(best, pin_memory=not best.pin_memory)
            if self._better(flipped, best):
                best = flipped
        return best

    def _fetch(self, best: Candidate) -> Candidate:
        """One gather per batch, where the dataset can: at the best worker count, and without workers
        (a gather is cheap enough that workers rarely pay for their hand-over)."""
        if not self.gathers or best.fetch == "batch":
            return best
        for batched in (replace(best, fetch="batch"), replace(self._with_workers(best, 0), fetch="batch")):
            if self._better(batched, best):
                best = batched
        return best

    def _method(self, best: Candidate) -> Candidate:
        """The other worker method at the best worker count: taken when faster, or, for threads, when
        as fast within the noise with less memory (the whole process tree's peak RSS); then more
        threads while they gain (a dataset waiting on I/O may use more threads than CPUs)."""
        if not best.num_workers or not self.tune_threads:
            return best
        other = replace(best, worker_method="thread" if best.worker_method == "process" else "process",
                        persistent_workers=False if best.worker_method == "process" else
                        (self.persist(best.num_workers) if self.persist else best.persistent_workers))
        if self._better(other, best):
            best = other
        elif other.worker_method == "thread" and self._as_fast_lighter(other, best):
            best = other
        if best.worker_method == "thread":
            best = self._climb_up(best)
        return best

    def _as_fast_lighter(self, c: Candidate, best: Candidate) -> bool:
        """`c` as fast as `best` (slower by at most the noise threshold, and never by more than twice
        min_gain: a noisy start must not let a much slower candidate in) with a lower process-tree peak."""
        self._score(c)
        rss = lambda x: self.trials[x].metrics.get("tree_rss_peak_mb")  # noqa: E731
        tolerance = min(self.threshold, 2 * self.min_gain)
        return (not self.trials[c].skipped and self._score(c) * (1 + tolerance) >= self._score(best)
                and rss(c) is not None and rss(best) is not None and rss(c) < rss(best))

    def _climb_up(self, best: Candidate) -> Candidate:
        for n in (n for n in LADDER if best.num_workers < n <= self.max_workers):
            if not self._better(self._with_workers(best, n), best):
                break
            best = self._with_workers(best, n)
        return best

    def _climb_workers(self, best: Candidate) -> Candidate:
        ladder = sorted({n for n in LADDER if n <= self.max_workers} | {best.num_workers})
        i = ladder.index(best.num_workers)
        improved = False
        for n in ladder[i + 1:]:
            if not self._better(self._with_workers(best, n), best):
                break
            best, improved = self._with_workers(best, n), True
        if not improved:
            for n in reversed(ladder[1:i]):  # down, never to 0 (tried on its own)
                if not self._better(self._with_workers(best, n), best):
                    break
                best = self._with_workers(best, n)
        return best


def measure_candidate(c: Candidate, dataset, loader_settings: dict, batches: int, warmup: int, repeats: int,
                      seed: int, cuda: bool, sampler=None, step=None) -> Trial:
    """`repeats` measurements of one candidate's loader (built fresh, its workers stopped after)."""
    settings = {**loader_settings, **c.settings()}
    loader = build_loader(dataset, **settings, seed=seed, cuda=cuda, role="tune").loader
    try:
        results = [measure(loader, batches, warmup, sampler, step) for _ in range(repeats)]
    finally:
        loader.shutdown()  # persistent workers end here, before the next candidate starts its own
    median = sorted(results, key=lambda r: r.samples_per_s)[len(results) // 2]
    return Trial(c, runs=[r.samples_per_s for r in results], metrics=median.metrics())
