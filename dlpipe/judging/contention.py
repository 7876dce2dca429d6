"""Whether an epoch was starved of CPU, and by whom, from telemetry.contention's figures: the verdict
says "contended" with it and qualifies its speed verdicts.

Thresholds (documented in docs/telemetry.md, measured on a 2-CPU machine, 2026-12-06):
- contended: the job's threads spent at least a third of their runnable time waiting for a CPU,
  `run_queue_s_per_s / (run_queue_s_per_s + CPU used) >= 0.33`, and waited at least 0.1 s per second
  per CPU of the budget (less costs the epoch little). A share of the job's own runnable time, not of
  the budget: it holds for a job that needs little CPU (one feeding an accelerator) and does not swing
  with how busy the job happened to be. On that machine the smoke recipe's threads waited 0.7-1.4 s
  per second beside two other engineers' test runs and 1.0-1.5 with two busy loops added, 38-80% of
  their runnable time, 37-73% in a second series; with the machine quiet the same job's threads
  waited 5-27% of theirs (47% in a first epoch of thread workers starting). Against the budget alone
  (0.25 x 2 CPUs) an epoch at 0.43 s per second (38%) fell through to "I/O or locks" between two
  contended ones. Three runnable threads on 2 CPUs and nothing else give a third. Without schedstat
  files, CPU pressure (PSI "some") over 50% of the epoch stands in for it.
- from outside: other processes used >= 25% of the job's CPUs (`cpu_others_frac`), or the hypervisor
  took >= 10% (`cpu_steal_frac`).
- from inside: the job's threads wanted clearly more CPUs than its budget: CPU used plus run-queue
  wait, per second, at least 1.25x the budget (the main process's intra-op threads against its own
  workers). At exactly the budget it is not the job's doing: the tabular recipe's 2 intra-op threads
  on 2 CPUs read 1.99-2.2 beside other work, flipping from epoch to epoch at a bare "above". Also
  from inside when nothing outside took the CPUs: on the quiet machine thread workers waited 0.9 s
  per second while the job used 1.0 CPU of 2 and others 1% (threads woken onto a CPU that another
  of the job's threads holds, the GIL handed between them).
Every rule reads one epoch's figures, and whether the previous verdict of the same job was contended:
near the threshold the previous answer holds until the share moves beyond a band (judging.steady).
"""

from dataclasses import dataclass

from dlpipe.judging.steady import OVER_BAND, SHARE_BAND, above

RUN_QUEUE_SHARE = 0.33
"""The share of the job's runnable time spent waiting for a CPU from which an epoch is contended."""
RUN_QUEUE_FLOOR = 0.10
"""...provided the wait is at least this many seconds per second per CPU of the budget."""
PRESSURE_CONTENDED = 0.50
OTHERS_BUSY = 0.25
STEAL_BUSY = 0.10
OVER_BUDGET = 1.25
"""The job's CPU demand (used + waiting, per second) over its budget from which the wait is its own."""


@dataclass(frozen=True)
class Contention:
    """An epoch starved of CPU: the figures that say so, and where the wait came from."""

    text: str
    outside: bool
    inside: bool

    def advice(self) -> str:
        """What helps when items wait for a CPU rather than for I/O: neither workers nor prefetch."""
        fixes = []
        if self.inside:
            fixes.append("fewer threads than the budget: one intra-op thread in the main process "
                         "(trainer.torch_threads=1) or one worker fewer")
        if self.outside or not self.inside:
            fixes.append("CPUs of the job's own (fewer jobs on these CPUs, a cgroup or taskset of its own)")
        return (f"more workers or prefetch cannot help while the job's threads wait for a CPU: {'; or '.join(fixes)}; "
                "compare runs by cpu_s_per_sample, which contention moves far less than samples/s")


def contention(metrics: dict[str, float], cpu_budget: int, previous: dict | None = None) -> Contention | None:
    """The epoch's contention, or None when its figures do not reach the thresholds (or are absent).
    `previous`: the last verdict's answers on this job (judging.steady), None for the bare thresholds."""
    budget = max(cpu_budget, 1)
    queue = metrics.get("run_queue_s_per_s")
    pressure = metrics.get("cpu_pressure_frac")
    steal = metrics.get("cpu_steal_frac") or 0.0
    others = metrics.get("cpu_others_frac")
    used = metrics.get("cpu_util", 0.0) / 100 * budget
    share = queue / (queue + used) if queue else 0.0
    if queue is not None:
        starved = above(previous, "contended", share, RUN_QUEUE_SHARE, SHARE_BAND) and queue >= RUN_QUEUE_FLOOR * budget
    else:
        starved = pressure is not None and above(previous, "contended", pressure, PRESSURE_CONTENDED, SHARE_BAND)
    if not (starved or steal >= STEAL_BUSY):
        return None
    parts = []
    if queue is not None:
        split = [f"{who} {metrics[key]:.2f}" for who, key in (("workers", "run_queue_workers_s_per_s"),
                                                               ("main process", "run_queue_main_s_per_s"))
                 if metrics.get(key)]
        parts.append(f"the job's threads waited for a CPU {queue:.2f} s per second"
                     + (f" ({', '.join(split)})" if len(split) > 1 else "")
                     + f", {share:.0%} of their runnable time, on a {budget}-CPU budget")
    if pressure is not None:
        parts.append(f"CPU pressure {pressure:.0%} of the time")
    outside = (others is not None and others >= OTHERS_BUSY) or steal >= STEAL_BUSY
    wanted = used + (queue or 0.0)
    over = queue is not None and above(previous, "over_budget", wanted / budget, OVER_BUDGET, OVER_BAND)
    inside = over or (queue is not None and others is not None and not outside)
    sources = []
    if outside:
        took = [f"other processes used {others:.0%} of its CPUs" if others is not None and others >= OTHERS_BUSY
                else "", f"the hypervisor took {steal:.0%} (steal)" if steal >= STEAL_BUSY else ""]
        sources.append("from outside the job: " + " and ".join(t for t in took if t))
    if inside:
        sources.append(f"from inside the job: its threads wanted {wanted:.1f} CPUs ({used:.1f} used + {queue:.1f} "
                       f"waiting) of its {budget}" + ("" if over else f", others used {others:.0%} of them"))
    return Contention("; ".join(parts + sources), outside, inside)
