"""How much an epoch was starved of CPU: the job's run-queue wait, CPU pressure, steal time and the
CPU used by processes outside the job's tree, as per-window figures for the resource sampler.

The kernel keeps cumulative counters (machine.cpu_pressure); a window's figure is their growth over
it. Machine-wide counters (PSI, /proc/stat) only need reading at the window's ends. Per-thread
run-queue waits vanish with their thread, so every sample (each sampler tick) adds each live thread's
growth since it was last seen: a thread that exits loses at most its last tick.

Figures (absent where the kernel has no such file):
- `run_queue_s_per_s` (`_main_`, `_workers_`): seconds the job's threads were runnable but waiting for
  a CPU, summed over threads, per wall second. It can exceed 1 (two threads waiting at once) and
  counts self-contention too (the main process's torch threads against its own workers).
- `cpu_pressure_frac`: the share of the window in which some task of the job's cgroup (or of the
  system, without a cgroup PSI file) waited for a CPU.
- `cpu_steal_frac`: the share of the job's CPUs' time the hypervisor gave to other guests.
- `cpu_others_frac`: the share of the job's CPUs (its affinity) busy with processes outside its tree.
  Under torchrun the job's other ranks on this node (and their workers) are the job's (`sibling_ranks`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import psutil

from dlpipe.machine import cpu_pressure
from dlpipe.machine.cgroups import read_text

NS = 1e-9
GROUPS = ("main", "workers", "other")
"""How the sampler files the job's processes: the main process, DataLoader workers (and their
helpers), and the job's other processes (the tracking process, the other ranks on this node), which
count as the job's CPU only."""


def sibling_ranks(proc: psutil.Process, env: Mapping[str, str] = os.environ) -> list[psutil.Process]:
    """The job's other ranks on this node where torchrun started them (its agent's other children): their
    CPU is the job's, not others', or each of 2 ranks on 2 CPUs reads the other as contention from outside."""
    if "TORCHELASTIC_RUN_ID" not in env or int(env.get("LOCAL_WORLD_SIZE") or 1) <= 1:
        return []
    try:
        agent = proc.parent()
        return [p for p in agent.children() if p.pid != proc.pid] if agent is not None else []
    except psutil.Error:
        return []


@dataclass
class _Ends:
    """Machine-wide cumulative readings at one end of a window."""

    psi_us: int | None
    cpus: cpu_pressure.CpuTimes | None


@dataclass
class ContentionMeter:
    proc_root: str = "/proc"
    cgroup_root: str = "/sys/fs/cgroup"
    cpus: set[int] | None = None
    """The CPUs the job may run on; None: this process's affinity."""
    _psi: tuple[str, str] | None = None
    _start: _Ends | None = None
    _seen: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (pid, tid) -> (run, wait) ns
    _sums: dict[str, list[float]] = field(default_factory=dict)  # group -> [run s, wait s] this window
    _schedstat: bool = False  # some thread of the job had a schedstat file this window

    def start(self) -> ContentionMeter:
        if self.cpus is None and hasattr(os, "sched_getaffinity"):
            self.cpus = set(os.sched_getaffinity(0))
        self._psi = cpu_pressure.pressure_file(self.proc_root, self.cgroup_root)
        self._start = self._ends()
        self._sums = {g: [0.0, 0.0] for g in GROUPS}
        return self

    @property
    def pressure_source(self) -> str:
        """Which PSI file speaks for the job, for the log: 'cgroup PATH', 'system PATH' or 'none'."""
        return f"{self._psi[1]} {self._psi[0]}" if self._psi else "none"

    def _ends(self) -> _Ends:
        psi = cpu_pressure.psi_some_total_us(read_text(self._psi[0])) if self._psi else None
        return _Ends(psi, cpu_pressure.cpu_times(self.cpus, self.proc_root))

    def sample(self, pids: dict[str, list[int]]) -> None:
        """Add the growth of every live thread's counters since it was last seen, by group. Threads of
        processes gone since the last sample are forgotten (their pids may come back as others')."""
        live = {pid for members in pids.values() for pid in members}
        self._seen = {key: value for key, value in self._seen.items() if key[0] in live}
        for group, members in pids.items():
            run_wait = self._sums.setdefault(group, [0.0, 0.0])
            for pid in members:
                for tid, (run, wait) in cpu_pressure.thread_schedstats(pid, self.proc_root).items():
                    self._schedstat = True
                    last_run, last_wait = self._seen.get((pid, tid), (0, 0))
                    if run < last_run or wait < last_wait:  # a reused tid: a new thread from zero
                        last_run, last_wait = 0, 0
                    self._seen[(pid, tid)] = (run, wait)
                    run_wait[0] += (run - last_run) * NS
                    run_wait[1] += (wait - last_wait) * NS

    def window(self, wall_s: float, job_cpu_s: float) -> dict[str, float]:
        """The figures since the last window (or start). `job_cpu_s`: the CPU the sampler counted for
        the main process and its workers over the window; the job's other processes' is added here."""
        if self._start is None:
            return {}
        end, start = self._ends(), self._start
        sums, had_schedstat = self._sums, self._schedstat
        self._start, self._sums, self._schedstat = end, {g: [0.0, 0.0] for g in GROUPS}, False
        wall_s = max(wall_s, 1e-6)
        out: dict[str, float] = {}
        if had_schedstat:
            main, workers = sums.get("main", [0.0, 0.0])[1], sums.get("workers", [0.0, 0.0])[1]
            out["run_queue_s_per_s"] = (main + workers) / wall_s
            out["run_queue_main_s_per_s"] = main / wall_s
            out["run_queue_workers_s_per_s"] = workers / wall_s
        if end.psi_us is not None and start.psi_us is not None:
            out["cpu_pressure_frac"] = _fraction((end.psi_us - start.psi_us) * 1e-6 / wall_s)
        if end.cpus is not None and start.cpus is not None:
            total = end.cpus.total_s - start.cpus.total_s
            if total > 0:
                if end.cpus.steal_s is not None and start.cpus.steal_s is not None:
                    out["cpu_steal_frac"] = _fraction((end.cpus.steal_s - start.cpus.steal_s) / total)
                job = job_cpu_s + sums.get("other", [0.0, 0.0])[0]
                out["cpu_others_frac"] = _fraction((end.cpus.busy_s - start.cpus.busy_s - job) / total)
        return out


def _fraction(value: float) -> float:
    """Counters read a few ms apart (and ticks of 10 ms) can step just outside [0, 1]."""
    return min(max(value, 0.0), 1.0)
