"""What the kernel says about waiting for a CPU: pressure-stall information (PSI), steal time, and the
run-queue wait of single threads. Cumulative counters only: telemetry.contention turns their deltas
into per-epoch figures.

- PSI `some ... total=N` (microseconds during which at least one runnable task waited for a CPU): the
  job's own cgroup v2 `cpu.pressure` where it has one (it counts only that cgroup's tasks), else the
  system's `/proc/pressure/cpu`. Kernels without PSI (before 4.20, or booted with psi=0) have neither.
- `/proc/stat` per-CPU lines: busy and steal time (the hypervisor running someone else on our vCPU),
  summed over the CPUs this process may run on.
- `/proc/PID/task/TID/schedstat`: "<ns on a CPU> <ns runnable but waiting for one> <slices>".

A missing or malformed file reads as None (the figure is then absent), never as zero. Nothing is read
at import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dlpipe.machine.cgroups import hierarchy, read_text

# PSI lives in cgroup v2 only: a name no v1 line of /proc/self/cgroup carries makes `hierarchy`
# return the v2 tree (the unified mount on a hybrid host).
_V2_ONLY = "pressure"


def psi_some_total_us(text: str | None) -> int | None:
    """The `total=` of the `some` line of a PSI file, in microseconds; None when there is none."""
    for line in (text or "").splitlines():
        kind, _, fields = line.partition(" ")
        if kind != "some":
            continue
        for field in fields.split():
            key, _, value = field.partition("=")
            if key == "total" and value.isdigit():
                return int(value)
    return None


def pressure_file(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> tuple[str, str] | None:
    """(path, "cgroup" or "system") of the CPU pressure file that speaks for this job: its own cgroup
    v2 `cpu.pressure` when readable, else `/proc/pressure/cpu`; None without PSI. In a container, whose
    /proc/self/cgroup names a host path, the cgroup mount's root is the container's own cgroup."""
    found = hierarchy(_V2_ONLY, (), proc_root, cgroup_root)
    if found is not None and found[2]:
        mount, rel, _ = found
        leaf = os.path.normpath(os.path.join(mount, rel.lstrip("/")))
        for directory in (leaf, os.path.normpath(mount)):
            path = os.path.join(directory, "cpu.pressure")
            if psi_some_total_us(read_text(path)) is not None:
                return path, "cgroup"
    path = os.path.join(proc_root, "pressure", "cpu")
    return (path, "system") if psi_some_total_us(read_text(path)) is not None else None


@dataclass(frozen=True)
class CpuTimes:
    """Seconds summed over a set of CPUs since boot (from /proc/stat)."""

    total_s: float
    busy_s: float
    """Run by this machine's kernel for some process: everything but idle, iowait and steal."""
    steal_s: float | None
    """None where the kernel's lines have no steal column."""


def cpu_times(cpus: set[int] | None = None, proc_root: str = "/proc") -> CpuTimes | None:
    """The per-CPU lines of /proc/stat summed over `cpus` (None: all); None when unreadable."""
    text = read_text(os.path.join(proc_root, "stat"))
    if text is None:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = busy = steal = 0
    has_steal, seen = True, False
    for line in text.splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        try:
            ticks = [int(v) for v in values[:8]]  # guest time is already inside user/nice
        except ValueError:
            return None
        if len(ticks) < 4:
            return None
        seen = True
        total += sum(ticks)
        has_steal = has_steal and len(ticks) >= 8
        stolen = ticks[7] if len(ticks) >= 8 else 0
        busy += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0) - stolen  # idle, iowait, steal
        steal += stolen
    if not seen:
        return None
    return CpuTimes(total / tick, busy / tick, steal / tick if has_steal else None)


def thread_schedstats(pid: int, proc_root: str = "/proc") -> dict[int, tuple[int, int]]:
    """tid -> (ns on a CPU, ns runnable but waiting for a CPU) for every thread of `pid` now; empty
    when the process is gone or the kernel has no schedstat (CONFIG_SCHED_INFO off)."""
    task_dir = os.path.join(proc_root, str(pid), "task")
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return {}
    out = {}
    for tid in tids:
        fields = (read_text(os.path.join(task_dir, tid, "schedstat")) or "").split()
        if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit() and tid.isdigit():
            out[int(tid)] = (int(fields[0]), int(fields[1]))
    return out
