"""Which dlpipe jobs share this machine's CPUs: a folder with one small record per live job.

Jobs started side by side (a sweep's joblib or submitit_local jobs, two shells, one cgroup) would
each size their DataLoader workers from the whole CPU budget and oversubscribe the CPUs together.
A job that sizes its workers from the budget writes `<pid>.json` into the registry folder and counts
the others whose CPUs overlap its own; `hardware.cpu_budget` divides the budget between them.

Failure model: a record counts only while its process runs with the start time it recorded, so a
job killed with SIGKILL (no atexit) or a reused pid counts for nothing, and the next job that looks
removes its file. Registering and counting happen under an flock on `.lock` in the folder: jobs that
start at the same instant each see those registered before them (the k-th sees k jobs). Records from
another boot or pid namespace (a home folder shared by nodes or containers) are neither counted nor
removed. A folder that cannot be written leaves the job alone with the whole budget, with a warning.

torch-free and Hydra-free: the config layer (`config/sharing.py`) decides when a job registers.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


@dataclass(frozen=True)
class Sharing:
    """The dlpipe jobs a job's CPU budget is divided between (this one included)."""

    jobs: int = 1
    pids: tuple[str, ...] = ()
    """Each job's pids (a multi-rank job's as "11+12"), this one's too."""
    launcher: str = ""
    """Set when the sweep's launcher, not the registry, gave the count: what it runs at once."""

    def describe(self) -> str:
        """The reason's tail: '' for a job alone, else ' / N dlpipe jobs sharing these CPUs (...)'."""
        if self.jobs <= 1:
            return ""
        started = f"pids {', '.join(self.pids)}"
        detail = f"{self.launcher}; {started} started" if self.launcher else started
        return f" / {self.jobs} dlpipe jobs sharing these CPUs ({detail})"


@dataclass(frozen=True)
class JobRecord:
    """What one registered job writes: enough to tell whether it still runs and shares our CPUs."""

    pid: int
    started: str
    """The kernel's start time of `pid`: a later process reusing the pid has another."""
    group: str
    """The ranks of one job (torchrun, srun tasks) share it and count as one job."""
    cpus: tuple[int, ...]
    scope: str
    """The cgroup whose CPU quota limits the job ("none": no quota); jobs under different quotas do not share one."""
    node: str
    """Boot and pid namespace: pids compare only within one."""
    sweep: str = ""
    """The sweep folder of a `--multirun` job (its siblings are counted with the launcher's number)."""

    def shares_cpus_with(self, other: JobRecord) -> bool:
        return self.node == other.node and self.scope == other.scope and bool(set(self.cpus) & set(other.cpus))


def process_started(pid: int) -> str | None:
    """A token for when `pid` started, None when it is not running (gone, or a zombie).

    Linux: the start time in clock ticks since boot from /proc/PID/stat, exact and untouched by
    clock steps (psutil's create_time adds the wall-clock boot time, which moves with them)."""
    if not os.path.exists("/proc/self/stat"):
        return _psutil_started(pid)  # no /proc: macOS
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):  # killed but not yet reaped: it runs nothing
        return None
    return fields[19].decode()  # field 22 of proc(5), counted from the state (field 3)


def _psutil_started(pid: int) -> str | None:
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"{process.create_time():.2f}"
    except psutil.Error:
        return None


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def node_identity() -> str:
    """This boot and pid namespace: where a record's pid means the same process as ours."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{_read('/proc/sys/kernel/random/boot_id') or socket.gethostname()} {namespace}"


def limit_scope(cgroup_source: str | None) -> str:
    """The cgroup folder holding our tightest CPU quota, as device:inode (one identity however the
    folder's path reads, e.g. from inside a container); "none" without a quota: unlimited jobs share
    the machine whatever cgroups (terminal sessions, services) they sit in."""
    if cgroup_source is None:
        return "none"
    try:
        st = os.stat(os.path.dirname(cgroup_source))
    except OSError:
        return cgroup_source
    return f"{st.st_dev}:{st.st_ino}"


def this_process(cgroup_source: str | None, *, ranks: bool, sweep: str = "") -> JobRecord:
    """This process's record. `ranks`: it is one of several ranks of a job, started by one parent
    (torchrun's agent, slurmstepd, submitit's controller), which the group then names."""
    pid = os.getpid()
    owner = os.getppid() if ranks else pid
    prefix = "ranks of " if ranks else ""
    if hasattr(os, "sched_getaffinity"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    else:  # macOS/Windows: no affinity API
        cpus = tuple(range(os.cpu_count() or 1))
    return JobRecord(pid=pid, started=process_started(pid) or "", group=f"{prefix}{owner}@{process_started(owner)}",
                     cpus=cpus, scope=limit_scope(cgroup_source), node=node_identity(), sweep=sweep)


def record_name(record: JobRecord) -> str:
    """`<pid>-<node hash>.json`: two containers with one hostname and one cache folder (a shared
    home) have their own pids; the node part keeps their records from overwriting each other."""
    node = hashlib.sha256(record.node.encode()).hexdigest()[:12]
    return f"{record.pid}-{node}.json"


class Registry:
    """The registry folder: `join` registers this process and lists the live jobs, `peek` only lists."""

    def __init__(self, folder: Path):
        self.folder = folder

    def join(self, me: JobRecord) -> list[JobRecord]:
        """Write (or rewrite) `me` and return every live record, `me` included, in one locked step.
        The record goes at this process's exit."""
        with self._locked() as usable:
            if not usable:
                return [me]
            path = self.folder / record_name(me)
            temporary = path.with_name(path.name + ".tmp")  # readers never see half a record
            try:
                temporary.write_text(json.dumps(asdict(me)), encoding="utf-8")
                os.replace(temporary, path)
            except OSError as e:
                log.warning("cannot register this job in %s (%s): jobs starting later will not count it",
                            self.folder, e.strerror or e)
                return [me]
            _remove_at_exit(path, me.pid)
            return self._live(me)

    def peek(self, me: JobRecord) -> list[JobRecord]:
        """The live records, without registering `me` (a plan, a printed config)."""
        with self._locked() as usable:
            return self._live(me) if usable else []

    @contextmanager
    def _locked(self) -> Iterator[bool]:
        """Hold `.lock` exclusively; yields False where the folder cannot be made or opened."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            log.warning("cannot keep the register of jobs sharing these CPUs in %s (%s): other dlpipe jobs "
                        "are not counted", self.folder, e.strerror or e)
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel releases it if this process dies holding it
            except OSError as e:  # a filesystem without locks (some NFS mounts): count without serialising
                log.warning("cannot lock %s (%s): jobs starting this instant may not see each other",
                            self.folder / LOCK_NAME, e.strerror or e)
            yield True
        finally:
            os.close(fd)

    def _live(self, me: JobRecord) -> list[JobRecord]:
        """Every record of a running job on this node; those of ended jobs on this node are removed."""
        live = []
        for path in sorted(self.folder.glob("*.json")):
            record = _load(path)
            if record is None or record.node != me.node:
                continue  # unreadable, or another node's: its pid means nothing here
            if process_started(record.pid) != record.started:
                path.unlink(missing_ok=True)  # ended (or killed) and its pid maybe reused
                continue
            live.append(record)
        return live


def _load(path: Path) -> JobRecord | None:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        fields["cpus"] = tuple(fields["cpus"])
        return JobRecord(**fields)
    except (OSError, ValueError, TypeError, KeyError):
        return None  # removed meanwhile, or written by another dlpipe version: not ours to judge


_registered: set[Path] = set()


def _remove_at_exit(path: Path, pid: int) -> None:
    if path in _registered:
        return
    _registered.add(path)

    def remove() -> None:
        if os.getpid() == pid:  # never from a forked child (DataLoader workers exit without atexit anyway)
            path.unlink(missing_ok=True)

    atexit.register(remove)


def leave() -> None:
    """Unregister the job this process ran, now that it ended. The joblib launcher and the basic
    sweeper run the next job in the same process, which registers afresh; until then nothing here
    uses these CPUs. The removal at exit stays registered for a job that never gets here."""
    global _settled
    for path in _registered:
        path.unlink(missing_ok=True)
    _settled = None  # the next job in this process settles its own share (or none, with its own workers)


def count(me: JobRecord, records: list[JobRecord], declared: tuple[int, str] | None = None) -> Sharing:
    """The jobs sharing `me`'s CPUs among `records` (`me`'s own ranks as one job, `me` counted even when
    not registered). `declared`: (jobs the sweep's launcher runs at once, what says so); `me`'s
    sweep counts at least that many, since its siblings may not have registered yet."""
    members: dict[str, set[int]] = {me.group: {me.pid}}
    sweeps: dict[str, str] = {me.group: me.sweep}
    for record in records:
        if record.shares_cpus_with(me):
            members.setdefault(record.group, set()).add(record.pid)
            sweeps.setdefault(record.group, record.sweep)
    jobs, launcher = len(members), ""
    if declared is not None and me.sweep:
        at_once, said = declared
        siblings = sum(1 for sweep in sweeps.values() if sweep == me.sweep)
        if at_once > siblings:
            jobs, launcher = jobs + at_once - siblings, said
    pids = tuple("+".join(map(str, sorted(p))) for p in sorted(members.values(), key=min))
    return Sharing(jobs, pids, launcher)


# The share each job settled on when it sized its workers, so that its resolver, its logged reason
# and its later `cpu_budget()` calls agree even while other jobs come and go. One entry: the job
# this process runs now (a sequential sweep runs its jobs one after another in one process).
_settled: tuple[str, Sharing] | None = None


def settled(job: str) -> Sharing | None:
    """What job `job` (a key naming the registry and the job) settled on in this process, if it did."""
    return _settled[1] if _settled is not None and _settled[0] == job else None


def settle(job: str, sharing: Sharing) -> None:
    global _settled
    _settled = (job, sharing)


def current_sharing() -> Sharing:
    """The share of the job this process runs now; alone (no division) before any job settled one."""
    return _settled[1] if _settled is not None else Sharing()
