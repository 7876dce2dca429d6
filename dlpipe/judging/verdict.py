"""What limits an epoch, from the numbers telemetry measured: the bottleneck verdict and worker leaks.

Thresholds (documented in docs/telemetry.md):
- input-bound: the step waits on the loader for >= 20% of the epoch. If the process tree already
  uses >= 85% of its CPU budget, more workers cannot help: CPU-budget-bound instead.
- host-to-device-bound (CUDA only): >= 15% of the epoch is spent blocked in host-to-device copies.
- compute-bound: neither; the loader keeps up.
Each is qualified "contended" when the job's threads waited for a CPU a lot (judging.contention); an
input-bound epoch whose threads waited for a CPU is then not put down to I/O or locks, and never told
to add workers (they would wait for the same CPUs).
Under DDP the rules are a single process's, per rank: the CPU budget is the rank's, and an item's cost
one rank's (judging.advice.PerItem). Near a threshold the previous epoch's answer holds until the
figure moves beyond a band (judging.steady), so the same evidence gives the same verdict every epoch.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import fmean

from dlpipe.judging.advice import (
    Evidence,
    Finding,
    PerItem,
    check,
    fewer_workers_gain,
    gain_text,
    item_cost,
    more_workers_gain,
    tuned_finding,
    wait_bound,
)
from dlpipe.judging.contention import Contention, contention
from dlpipe.judging.journal import MIN_GAIN, effective
from dlpipe.judging.steady import COST_BAND, CPU_BAND, WAIT_BAND, above
from dlpipe.loader import policy
from dlpipe.machine.hardware import recommended_workers

INPUT_BOUND = 0.20
CPU_SATURATED = 85.0
H2D_BOUND = 0.15
LEAK_MIN_EPOCHS = 3
LEAK_MB_PER_EPOCH = 5.0  # and at least 5% of the first epoch's worker RSS per epoch


@dataclass(frozen=True)
class Verdict:
    kind: str
    """input-bound, cpu-budget-bound, host-to-device-bound or compute-bound."""
    evidence: str
    """The measured numbers behind it."""
    advice: str
    """The change to try, as an override where there is one."""
    gain: float | None = None
    """The advice's expected samples/s ratio: measured (`measured`), else an upper bound."""
    basis: str = ""
    """The measurement the gain comes from."""
    measured: bool = False
    change: str | None = None
    """The advice as one override (`loader.num_workers=2`), for the sweep to check against its jobs."""
    rough: bool = False
    """The gain is a model's estimate ("about"), not measured and not a hard bound ("up to")."""
    contended: str = ""
    """How the job was starved of CPU, when it was (judging.contention): the speed figures understate it."""

    def line(self) -> str:
        text = f"{self.kind}: {self.evidence}" + (f"; contended: {self.contended}" if self.contended else "")
        text += f"; {self.advice}" if self.advice else ""
        if self.gain is not None:
            how = "" if self.measured else "about " if self.rough else "up to "
            text += f" (expected {how}{gain_text(self.gain)}: {self.basis})"
        return text


@dataclass(frozen=True)
class LoaderState:
    """The settings the training loader really runs with (after normalisation) and its CPU budget."""

    num_workers: int
    cpu_budget: int
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    fetch: str = "item"
    worker_method: str = "process"

    def settings(self) -> dict:
        """As the journal files them: a measurement of thread workers or whole-batch fetching is looked
        up as such, not as the process/item one."""
        return effective({"num_workers": self.num_workers, "prefetch_factor": self.prefetch_factor,
                          "persistent_workers": self.persistent_workers, "pin_memory": self.pin_memory,
                          "fetch": self.fetch, "worker_method": self.worker_method})


def more_workers(num_workers: int, cpu_budget: int) -> int:
    """The next worker count worth trying, within the CPU budget (num_workers when there is none)."""
    target = max(recommended_workers(cpu_budget), 2 * num_workers, 1)
    return max(num_workers, min(target, cpu_budget))


def diagnose(metrics: dict[str, float], *, num_workers: int, cpu_budget: int, pin_memory: bool,
             device_type: str, prefetch_factor: int | None = None, persistent_workers: bool = False,
             fetch: str = "item", worker_method: str = "process", evidence: Evidence | None = None,
             warm: bool = True) -> Verdict:
    """The bottleneck of one epoch (or of a run, given epoch means), with advice that no measurement
    in `evidence` (the probe, the measurement journal) contradicts. `warm`: the metrics leave out the
    first epoch's start-up, so they compare with earlier runs' (judging.journal files such runs)."""
    evidence = evidence or Evidence()
    starved = contention(metrics, cpu_budget, evidence.previous)
    job = Judged(metrics, LoaderState(num_workers, cpu_budget, pin_memory, prefetch_factor, persistent_workers,
                                      fetch, worker_method), evidence, warm, starved)
    verdict = _judge(job, device_type)
    return replace(verdict, contended=starved.text) if starved is not None else verdict


def _judge(job: "Judged", device_type: str) -> Verdict:
    metrics, pin_memory, previous = job.metrics, job.loader.pin_memory, job.evidence.previous
    wait, h2d = metrics.get("data_wait_frac", 0.0), metrics.get("h2d_frac", 0.0)
    if above(previous, "input_bound", wait, INPUT_BOUND, WAIT_BAND):
        return _input_bound(job)
    if device_type == "cuda" and above(previous, "h2d_bound", h2d, H2D_BOUND, WAIT_BAND):
        seen = f"{h2d:.0%} of the epoch blocked in host-to-device copies"
        free = (wait_bound(h2d), "if the copies cost nothing (this epoch's h2d_frac)")
        smaller = Verdict("host-to-device-bound", seen, "send less data per step (uint8 images, normalise on the GPU)",
                          *free)
        if pin_memory:
            return smaller
        return job.advise("host-to-device-bound", seen, {"pin_memory": True}, "loader.pin_memory=true", free,
                          lambda f: replace(smaller, evidence=f"{seen}; pinning is no answer here ({f.basis})"))
    keeps_up = f"the loader keeps up (data wait {wait:.1%})"
    if job.starved is not None and "cpu_s_per_sample" in metrics:  # samples/s fall with contention, this does not
        keeps_up += (f"; samples/s understate the job here: it spent {metrics['cpu_s_per_sample'] * 1e3:.3g} ms "
                     "of CPU a sample")
    return Verdict("compute-bound", keeps_up, "")


@dataclass(frozen=True)
class Judged:
    """One verdict's inputs, and the one way advice is given: checked against the evidence first."""

    metrics: dict[str, float]
    loader: LoaderState
    evidence: Evidence
    warm: bool = True
    starved: Contention | None = None

    def advise(self, kind: str, seen: str, change: dict, override: str, estimate: tuple,
               otherwise: Callable[[Finding], Verdict]) -> Verdict:
        """Advise `override`, with the measured gain where the journal has one and the estimate
        otherwise: (gain, basis), or (gain, basis, True) for a model's rough figure rather than a bound;
        `otherwise(finding)` when a measurement found the change no faster."""
        current = self.loader.settings()
        finding = check(change, current, self.metrics, self.evidence, self.warm)
        advice = f"try {override}"
        if not finding.measured:  # the search that wrote this config, when this run is another job
            tuned = tuned_finding(change, current, self.evidence.tuned)
            if tuned.measured and not tuned.faster:
                differs = self.evidence.tuned.differs
                if not differs:  # the same job: what the search found stands
                    return otherwise(tuned)
                wait = self.metrics.get("data_wait_frac", 0.0)
                advice += (f" ({tuned.basis}; this run differs: {differs}, and waits {wait:.1%} of its epoch for "
                           "data, so measure it here)")
        if finding.measured and not finding.faster:
            return otherwise(finding)
        if finding.measured:
            return Verdict(kind, seen, advice, finding.ratio, finding.basis, True, override)
        gain, basis, *rough = estimate
        return Verdict(kind, seen, advice, gain, basis, change=override, rough=bool(rough and rough[0]))


def _input_bound(job: Judged) -> Verdict:
    metrics, workers, budget = job.metrics, job.loader.num_workers, job.loader.cpu_budget
    wait, previous, world = metrics.get("data_wait_frac", 0.0), job.evidence.previous, job.evidence.world
    per_item = PerItem.of(metrics, world)
    cost, source = item_cost(per_item, workers, job.evidence)
    seen = f"data wait {wait:.1%} of the epoch"
    if cost is not None and not above(previous, "costly_items", cost, policy.CHEAP_ITEM_S, COST_BAND, relative=True):
        rank = f" on each of {world} ranks" if world > 1 else ""
        return _cheap_items(job, f"{seen}; items take {cost * 1e6:.1f} us each to fetch in the main process{rank} "
                                 f"({source})", per_item, cost)
    cpu = metrics.get("cpu_util")
    if cpu is not None and workers > 0 and above(previous, "cpu_saturated", cpu, CPU_SATURATED, CPU_BAND):
        return Verdict(
            "cpu-budget-bound",
            f"data wait {wait:.1%} with {cpu:.0f}% of the {budget}-CPU budget in use ({workers} workers)",
            "more workers cannot help: make per-item transforms cheaper or give the job more CPUs",
            wait_bound(wait), FREE_DATA,
        )
    target = more_workers(workers, budget)
    # Starved of CPU, more workers would wait for the same CPUs: advised only where measured faster.
    if job.starved is not None and target > workers and not _measured_faster(job, {"num_workers": target}):
        return Verdict("input-bound", f"data wait {wait:.1%} while the job's threads waited for a CPU ({workers} "
                       f"workers on a {budget}-CPU budget, CPU at {cpu or 0:.0f}% of it): items wait for a CPU, "
                       "not for more workers", job.starved.advice(), wait_bound(wait), FREE_DATA)
    if target > workers:
        gain = more_workers_gain(per_item, cost, workers, target, wait)
        basis = ("if the loader's rate grew with the workers while the epoch's other work stays (this epoch)"
                 if workers or cost is not None else FREE_DATA)
        return job.advise("input-bound", seen, {"num_workers": target}, f"loader.num_workers={target}",
                          (gain, basis, workers > 0 or cost is not None),
                          lambda f: _no_answer(seen, f"loader.num_workers={target}", f, wait))
    if job.starved is not None:  # not I/O or locks: the workers were runnable, waiting for a CPU
        return Verdict("input-bound", f"data wait {wait:.1%} with workers at the {budget}-CPU budget and the job's "
                       f"CPU at {cpu or 0:.0f}% of it: items wait for a CPU, not for I/O or locks",
                       job.starved.advice(), wait_bound(wait), FREE_DATA)
    prefetch = 2 * policy.prefetch_in_effect(workers, job.loader.prefetch_factor)
    seen = (f"data wait {wait:.1%} with workers at the {budget}-CPU budget but CPU not saturated: items wait on "
            "I/O or locks (read faster storage, or keep more batches in flight)")
    return job.advise("input-bound", seen, {"prefetch_factor": prefetch}, f"loader.prefetch_factor={prefetch}",
                      (wait_bound(wait), FREE_DATA),
                      lambda f: _no_answer(seen, f"loader.prefetch_factor={prefetch}", f, wait))


FREE_DATA = "if the wait for data went away (this epoch's data wait)"


def _measured_faster(job: Judged, change: dict) -> bool:
    return check(change, job.loader.settings(), job.metrics, job.evidence, job.warm).faster

def cheap_items_advice(fetch: str) -> str:
    """What helps when items are cheap; letting the dataset gather only where it does not already."""
    gather = ("" if fetch == "batch" else "let the dataset take a list of indices (or a __getitems__ returning the "
              "batch) so loader.fetch gathers whole batches, ")
    return ("fetch fewer, larger pieces: raise loader.batch_size (each batch's fixed costs spread over more items; "
            f"scale optim.lr with it), {gather}or move per-item work out of __getitem__ (into the model, on the "
            "device)")


def _cheap_items(job: Judged, seen: str, per_item: PerItem | None, cost: float) -> Verdict:
    """Items in memory: workers cannot help (with workers, the main process fetches them faster)."""
    wait = job.metrics.get("data_wait_frac", 0.0)
    cheap = Verdict("input-bound", f"{seen}, under the {policy.CHEAP_ITEM_S * 1e6:.0f} us where workers start to "
                     "pay: more workers cannot help", cheap_items_advice(job.loader.fetch), wait_bound(wait), FREE_DATA)
    gain = fewer_workers_gain(per_item, cost, wait)
    if job.loader.num_workers == 0 or gain < 1 + MIN_GAIN:
        return cheap
    handover = (f"{seen}: {job.loader.num_workers} workers hand them over slower than the main process fetches "
                "them")
    return job.advise("input-bound", handover, {"num_workers": 0}, "loader.num_workers=0",
                      (gain, "if the main process fetches as fast as the probe, beside the epoch's other work", True),
                      lambda finding: replace(cheap, evidence=f"{cheap.evidence}; loader.num_workers=0 is no answer "
                                                                f"either ({finding.basis})"))


def _no_answer(seen: str, override: str, finding: Finding, wait: float) -> Verdict:
    """Input-bound, but the change the rules would suggest was measured no faster (or not beyond the
    noise of the search that measured it): say so instead."""
    said = "was measured no faster beyond the noise" if finding.noisy else "is no answer here"
    return Verdict("input-bound", seen, f"{override} {said} ({finding.basis}): make per-item work cheaper "
                   "(decode or resize ahead of time, cache) or give the job more CPUs",
                   wait_bound(wait), FREE_DATA)


def run_metrics(history: list[dict[str, float]]) -> dict[str, float]:
    """Epoch means for the run verdict, leaving out the first epoch when there are more (warm-up)."""
    rows = history[1:] if len(history) > 1 else history
    keys = {k for r in rows for k in r}
    return {k: fmean(r[k] for r in rows if k in r) for k in keys}


def rss_slope(values: list[float]) -> float:
    """Least-squares slope of values over epochs (MB per epoch); 0 for fewer than 2 points."""
    n = len(values)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, fmean(values)
    num = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    return num / sum((i - x_mean) ** 2 for i in range(n))


def worker_leak(history: list[dict[str, float]], persistent_workers: bool) -> str | None:
    """A warning when persistent workers grow steadily across epochs, else None.

    Only persistent workers can carry memory from one epoch to the next; without them every
    epoch starts fresh workers, so growth there is not theirs to explain.
    """
    values = [r["worker_rss_max_mb"] for r in history if r.get("worker_rss_max_mb")]
    if not persistent_workers or len(values) < LEAK_MIN_EPOCHS:
        return None
    slope = rss_slope(values)
    steady = all(b >= a - 0.5 * slope for a, b in zip(values, values[1:]))  # no big drops
    if slope < max(LEAK_MB_PER_EPOCH, 0.05 * values[0]) or not steady:
        return None
    return (
        f"DataLoader worker memory grows {slope:.1f} MB per epoch ({values[0]:.0f} -> {values[-1]:.0f} MB per worker): "
        "persistent workers keep whatever the dataset accumulates (try loader.persistent_workers=false), "
        "and Python lists/dicts in a dataset are copied page by page into each forked worker as their "
        "reference counts change (copy-on-write): keep dataset state in NumPy arrays or tensors"
    )
