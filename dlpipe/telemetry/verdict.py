"""What limits an epoch, from the numbers telemetry measured: the bottleneck verdict and worker leaks.

Thresholds (documented in the README):
- input-bound: the step waits on the loader for >= 20% of the epoch. If the process tree already
  uses >= 85% of its CPU budget, more workers cannot help: CPU-budget-bound instead.
- host-to-device-bound (CUDA only): >= 15% of the epoch is spent blocked in host-to-device copies.
- compute-bound: neither; the loader keeps up.
"""

from dataclasses import dataclass
from statistics import fmean

from dlpipe.hardware import recommended_workers

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

    def line(self) -> str:
        return f"{self.kind}: {self.evidence}" + (f"; {self.advice}" if self.advice else "")


def more_workers(num_workers: int, cpu_budget: int) -> int:
    """The next worker count worth trying, within the CPU budget (num_workers when there is none)."""
    target = max(recommended_workers(cpu_budget), 2 * num_workers, 1)
    return max(num_workers, min(target, cpu_budget))


def diagnose(metrics: dict[str, float], *, num_workers: int, cpu_budget: int, pin_memory: bool,
             device_type: str) -> Verdict:
    """The bottleneck of one epoch (or of a run, given epoch means)."""
    wait = metrics.get("data_wait_frac", 0.0)
    cpu = metrics.get("cpu_util")
    h2d = metrics.get("h2d_frac", 0.0)
    if wait >= INPUT_BOUND:
        if cpu is not None and cpu >= CPU_SATURATED and num_workers > 0:
            return Verdict(
                "cpu-budget-bound",
                f"data wait {wait:.0%} with {cpu:.0f}% of the {cpu_budget}-CPU budget in use ({num_workers} workers)",
                "more workers cannot help: make per-item transforms cheaper or give the job more CPUs",
            )
        target = more_workers(num_workers, cpu_budget)
        if target > num_workers:
            return Verdict("input-bound", f"data wait {wait:.0%} of the epoch", f"try loader.num_workers={target}")
        return Verdict(
            "input-bound",
            f"data wait {wait:.0%} with workers at the {cpu_budget}-CPU budget but CPU not saturated",
            "items wait on I/O or locks: raise loader.prefetch_factor or read faster storage",
        )
    if device_type == "cuda" and h2d >= H2D_BOUND:
        advice = ("set loader.pin_memory=true" if not pin_memory
                  else "send less data per step (uint8 images, normalise on the GPU)")
        return Verdict("host-to-device-bound", f"{h2d:.0%} of the epoch blocked in host-to-device copies", advice)
    return Verdict("compute-bound", f"the loader keeps up (data wait {wait:.0%})", "")


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
