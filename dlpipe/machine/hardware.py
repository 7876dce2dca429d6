"""Facts about the machine a run actually gets: CPU budget, shared memory and RAM (GPUs: `dlpipe.machine.gpu`).

Nothing is read or initialised at import time and torch is never imported, so config resolvers
can import this module cheaply.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields

import psutil

from dlpipe.machine import cgroups
from dlpipe.machine.budget_share import Sharing, current_sharing
from dlpipe.machine.gpu import gpu_summary

log = logging.getLogger(__name__)

# The cpu controller's v1 mount directory name depends on the distro / container runtime.
_V1_CPU_MOUNTS = ("cpu,cpuacct", "cpuacct,cpu", "cpu")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs one rank may really use, and every input that limited it."""

    affinity: int
    """CPUs this process may be scheduled on (`taskset`, Slurm binding), not `os.cpu_count()`."""
    cgroup_cpus: float | None
    """quota/period of the tightest cgroup CPU limit on our path; None when unlimited or absent."""
    cgroup_source: str | None
    """The file that set `cgroup_cpus` (e.g. `/sys/fs/cgroup/a/b/cpu.max`)."""
    slurm_cpus: int | None
    """SLURM_CPUS_PER_TASK when set to an integer >= 1."""
    local_world_size: int
    """Ranks sharing this node's CPUs (torchrun's LOCAL_WORLD_SIZE), default 1."""
    rank_per_slurm_task: bool
    """Each rank is a Slurm task of its own (srun with one task per GPU, as submitit launches them):
    SLURM_CPUS_PER_TASK is then already per rank and only the node-wide limits are divided."""
    sharing_jobs: int
    """dlpipe jobs on these CPUs the budget is divided between, this one included (`dlpipe.machine.budget_share`:
    the live jobs it found, or the sweep launcher's jobs at once); 1 when it was not divided."""
    budget: int
    """Per-rank CPUs: max(1, min(affinity, ceil(cgroup_cpus), slurm_cpus) // local_world_size // sharing_jobs);
    with a Slurm task per rank, max(1, min(affinity, slurm_cpus, ceil(cgroup_cpus) // local_world_size)
    // sharing_jobs)."""

    def as_params(self) -> dict[str, str]:
        """Flat str->str mapping for MLflow params; absent limits read "none", never 0."""
        values = {f"cpu.{f.name}": getattr(self, f.name) for f in fields(self)}
        return {
            key: "none" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
            for key, v in values.items()
        }


def _ratio(quota: str, period: str, source: str) -> tuple[float, str] | None:
    try:
        q, p = int(quota), int(period)  # int() tolerates the trailing newline
    except ValueError:
        return None  # malformed content: better no limit than a crash or an invented one
    return (q / p, source) if q > 0 and p > 0 else None  # v1 quota -1 means unlimited


def _read_v2_limit(directory: str) -> tuple[float, str] | None:
    """CPUs allowed by `<directory>/cpu.max` ("max 100000" = unlimited, "200000 100000" = 2.0)."""
    path = os.path.join(directory, "cpu.max")
    fields = (cgroups.read_text(path) or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1], path)


def _read_v1_limit(directory: str) -> tuple[float, str] | None:
    """CPUs allowed by `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1 = unlimited)."""
    quota_path = os.path.join(directory, "cpu.cfs_quota_us")
    quota = cgroups.read_text(quota_path)
    period = cgroups.read_text(os.path.join(directory, "cpu.cfs_period_us"))
    if quota is None or period is None:
        return None
    return _ratio(quota, period, quota_path)


def _cgroup_limit(proc_root: str, cgroup_root: str) -> tuple[float, str] | None:
    """CPUs allowed by the tightest quota on this process's cgroup path (cgroups.hierarchy)."""
    found = cgroups.hierarchy("cpu", _V1_CPU_MOUNTS, proc_root, cgroup_root)
    if found is None:
        return None
    mount, rel, v2 = found
    return cgroups.tightest_on_path(mount, rel, _read_v2_limit if v2 else _read_v1_limit)


def _positive_int(value: str | None) -> int | None:
    try:
        number = int(value or "")
    except ValueError:
        return None  # unset, "" or e.g. "4(x2)": ignore rather than guess
    return number if number >= 1 else None


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """Processes in this job (torchrun's WORLD_SIZE), 1 when not set."""
    return _positive_int((os.environ if environ is None else environ).get("WORLD_SIZE")) or 1


def cpu_budget(
    *,
    proc_root: str = "/proc",
    cgroup_root: str = "/sys/fs/cgroup",
    environ: Mapping[str, str] | None = None,
    affinity: int | None = None,
    sharing: Sharing | None = None,
) -> CpuBudget:
    """Per-rank CPUs: min(affinity, ceil(cgroup quota), SLURM_CPUS_PER_TASK) // LOCAL_WORLD_SIZE,
    divided between the dlpipe jobs sharing these CPUs.

    `os.cpu_count()` and psutil ignore affinity and cgroup quotas and torch reads affinity only, so
    a 2-CPU container on a 64-core host would otherwise get 64-core settings. The cgroup limit
    follows /proc/self/cgroup and is the minimum over every ancestor (v2 `cpu.max`, v1 CFS quota);
    missing or malformed files count as "no limit"; fractional quotas round up. `sharing` None means
    the share this process's job settled on when it sized its workers (`budget_share.current_sharing`;
    alone when it did not); `Sharing()` gives the undivided budget. Roots, environment, affinity and
    sharing are injectable for tests.
    """
    env = os.environ if environ is None else environ
    if affinity is None:
        if hasattr(os, "sched_getaffinity"):
            affinity = len(os.sched_getaffinity(0))
        else:  # macOS/Windows: no affinity API, the logical count is the best we have
            affinity = os.cpu_count() or 1
    limit = _cgroup_limit(proc_root, cgroup_root)
    cgroup_cpus, cgroup_source = limit if limit is not None else (None, None)
    slurm_cpus = _positive_int(env.get("SLURM_CPUS_PER_TASK"))
    local_world_size = _positive_int(env.get("LOCAL_WORLD_SIZE")) or 1
    step_tasks = _positive_int(env.get("SLURM_STEP_NUM_TASKS"))
    world = world_size(env)
    # torchrun inside one Slurm task: its ranks share the task's CPUs. One srun task per rank: each
    # has its own SLURM_CPUS_PER_TASK (and, with task binding, its own affinity); only the job's
    # cgroup on this node is shared by the node's ranks.
    per_task = world > 1 and step_tasks == world
    cgroup_ceil = None if cgroup_cpus is None else math.ceil(cgroup_cpus)
    if per_task:
        # Without SLURM_CPUS_PER_TASK the tasks may not be bound apart: then affinity is shared too.
        own_cpus = affinity if slurm_cpus is not None else affinity // local_world_size
        limits = [own_cpus, slurm_cpus, None if cgroup_ceil is None else cgroup_ceil // local_world_size]
        budget = min(n for n in limits if n is not None)
    else:
        budget = min(n for n in (affinity, slurm_cpus, cgroup_ceil) if n is not None) // local_world_size
    if sharing is None:
        sharing = current_sharing()
    return CpuBudget(
        affinity=affinity,
        cgroup_cpus=cgroup_cpus,
        cgroup_source=cgroup_source,
        slurm_cpus=slurm_cpus,
        local_world_size=local_world_size,
        rank_per_slurm_task=per_task,
        sharing_jobs=sharing.jobs,
        # Never 0: even an oversubscribed rank has the main process to run on.
        budget=max(1, budget // sharing.jobs),
    )


def recommended_workers(budget: int) -> int:
    """DataLoader `num_workers` for a per-rank CPU budget.

    ======  ============================  ==================
    budget  workers                       examples
    ======  ============================  ==================
    <= 1    0 (load in the main process)  1 -> 0
    2       2                             2 -> 2
    3-4     budget - 1                    3 -> 2, 4 -> 3
    5-8     budget - 2                    5 -> 3, 8 -> 6
    9+      min(8, max(6, budget // 2))   12 -> 6, 16+ -> 8
    ======  ============================  ==================

    Measured on 2 CPUs with a JPEG decode pipeline: 2 workers were best and 1 worker was the
    *worst* choice (0.56x of best). Larger budgets keep CPUs for the main process and pin-memory
    thread; the cap of 8 is deliberate, since every worker costs startup time and RAM (8 workers
    lost 14% on 2 CPUs): the answer is never "as many as possible".
    """
    if budget <= 1:
        return 0
    if budget == 2:
        return 2
    if budget <= 4:
        return budget - 1
    if budget <= 8:
        return budget - 2
    return min(8, max(6, budget // 2))


def _statvfs(path: str, attr: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None  # no /dev/shm (macOS, some sandboxes): callers report "none", not 0
    return getattr(st, attr) * st.f_frsize


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """Total size of the shm mount (DataLoader workers pass batches through it), or None."""
    return _statvfs(path, "f_blocks")


def shm_free_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes on the shared-memory mount available to us, or None when it is missing."""
    return _statvfs(path, "f_bavail")


def memory_available_bytes(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """RAM this process can still take without swapping or the OOM killer: the host's available
    memory (psutil), or less where a cgroup memory limit on this process's path leaves less
    (a container's --memory, Slurm's --mem; cgroups.memory_headroom)."""
    available = psutil.virtual_memory().available
    headroom = cgroups.memory_headroom(proc_root, cgroup_root)
    return available if headroom is None else min(available, int(headroom[0]))


def memory_total_bytes() -> int:
    """Total physical RAM (psutil)."""
    return psutil.virtual_memory().total


def host_facts(*, cpu: CpuBudget | None = None) -> dict[str, str]:
    """Flat str->str facts for MLflow params: host, CPU budget, memory (GiB), shm (MiB), GPUs.

    "host.logical_cpus" is `os.cpu_count()`, kept next to "cpu.budget" to show the difference.
    Without GPUs this reports "gpu.status": "not available: <reason>", never a fake count of 0.
    Pass `cpu` to reuse an already computed budget.
    """
    gib, mib = 1024**3, 1024**2
    facts = {
        "host.name": socket.gethostname(),
        "host.python": platform.python_version(),
        "host.logical_cpus": str(os.cpu_count()),
    }
    facts.update((cpu or cpu_budget()).as_params())
    facts["mem.total_gb"] = f"{memory_total_bytes() / gib:.1f}"
    facts["mem.available_gb"] = f"{memory_available_bytes() / gib:.1f}"
    shm = shm_bytes()
    facts["shm.total_mb"] = "none" if shm is None else str(shm // mib)
    devices, reason = gpu_summary()
    if devices:
        facts["gpu.count"] = str(len(devices))
        facts["gpu.names"] = ",".join(d.name for d in devices)
    else:
        facts["gpu.status"] = f"not available: {reason}"
    return facts
