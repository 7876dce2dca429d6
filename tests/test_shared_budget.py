"""Concurrent dlpipe jobs divide the CPU budget: the registry of live jobs with real processes, then
real `dlpipe` runs side by side (two at once, and a sweep through Hydra's joblib launcher).

Every test has its own XDG_CACHE_HOME (conftest), hence its own registry folder.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR
from omegaconf import OmegaConf

from dlpipe.config import decisions, sharing
from dlpipe.machine import budget_share, hardware
from dlpipe.machine.budget_share import Registry, Sharing

# A job's stand-in: registers (optionally pinned to CPUs first), prints how many jobs it saw, then
# waits for its stdin to close and exits normally (its record goes at exit).
JOB = """
import os, sys
from pathlib import Path
from dlpipe.machine import budget_share, hardware
if len(sys.argv) > 2:
    os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})
source = hardware.cpu_budget(sharing=budget_share.Sharing()).cgroup_source
me = budget_share.this_process(source, ranks=os.environ.get("RANKS") == "1")
if sys.stdin.readline() != "go\\n":
    sys.exit("no go")
print(budget_share.count(me, budget_share.Registry(Path(sys.argv[1])).join(me)).jobs, flush=True)
sys.stdin.read()
"""


class Jobs:
    """Stand-in jobs started by a test; stop() ends the ones still running, by pid."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: list[subprocess.Popen] = []

    def start(self, cpus: str | None = None, go: bool = True, rank: bool = False) -> subprocess.Popen:
        """`rank`: one of the ranks of a job whose parent is this test process (as torchrun's agent)."""
        args = [sys.executable, "-c", JOB, str(self.folder), *([cpus] if cpus else [])]
        env = {**os.environ, "RANKS": "1" if rank else "0"}
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.procs.append(proc)
        if go:
            self.go(proc)
        return proc

    def go(self, proc: subprocess.Popen) -> None:
        proc.stdin.write("go\n")
        proc.stdin.flush()

    def seen(self, proc: subprocess.Popen) -> int:
        """How many jobs `proc` saw when it registered (waits for it to have registered)."""
        line = proc.stdout.readline()
        assert line, f"job {proc.pid} ended without registering"
        return int(line)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def jobs(tmp_path):
    started = Jobs(sharing.jobs_folder())
    try:
        yield started
    finally:
        started.stop()


def records(folder: Path) -> set[int]:
    return {int(p.stem.split("-")[0]) for p in folder.glob("*.json")}  # <pid>-<node hash>.json


def peek() -> Sharing:
    """What a job starting now would share, seen from this test process (not registered)."""
    me = budget_share.this_process(hardware.cpu_budget(sharing=Sharing()).cgroup_source, ranks=False)
    return budget_share.count(me, Registry(sharing.jobs_folder()).peek(me))


def test_live_jobs_are_counted_and_killed_or_ended_ones_are_not(jobs):
    a, b, c = jobs.start(), jobs.start(go=False), jobs.start(go=False)
    assert jobs.seen(a) == 1
    jobs.go(b)
    assert jobs.seen(b) == 2
    jobs.go(c)
    assert jobs.seen(c) == 3
    d = jobs.start()
    assert jobs.seen(d) == 4
    b.kill()  # SIGKILL: no atexit, its record stays behind; not reaped yet, so a zombie for now
    deadline = time.monotonic() + 30
    while psutil.Process(b.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "SIGKILL did not end the job"
        time.sleep(0.01)
    seen = peek()
    assert seen.jobs == 4  # a, c, d and this process
    assert str(b.pid) not in seen.pids and {str(p.pid) for p in (a, c, d)} <= set(seen.pids)
    assert records(jobs.folder) == {a.pid, c.pid, d.pid}  # the dead job's record was removed
    c.stdin.close()  # c ends normally: its record goes at exit
    assert c.wait(timeout=30) == 0
    assert records(jobs.folder) == {a.pid, d.pid}


def test_the_ranks_of_one_job_count_once(jobs):
    first_rank, second_rank = jobs.start(rank=True), jobs.start(go=False, rank=True)
    assert jobs.seen(first_rank) == 1
    jobs.go(second_rank)
    assert jobs.seen(second_rank) == 1  # its own job's other rank: already divided by LOCAL_WORLD_SIZE
    other = jobs.start()
    assert jobs.seen(other) == 2
    ranks = "+".join(sorted([str(first_rank.pid), str(second_rank.pid)], key=int))
    assert set(peek().pids) == {ranks, str(other.pid), str(os.getpid())}


def test_a_record_whose_pid_was_reused_is_not_counted(jobs):
    a = jobs.start()
    assert jobs.seen(a) == 1
    [forged] = Path(jobs.folder).glob(f"{a.pid}-*.json")
    text = forged.read_text()
    started = budget_share.process_started(a.pid)
    forged.write_text(text.replace(f'"started": "{started}"', f'"started": "{int(started) - 1}"'))
    assert peek().jobs == 1  # the pid runs, but not the process that registered it
    assert not forged.exists()


def test_a_job_on_other_cpus_is_not_counted(jobs):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin two jobs apart")
    first, second = str(cpus[0]), str(cpus[1])
    on_first = jobs.start(first)
    assert jobs.seen(on_first) == 1
    on_second = jobs.start(second)
    assert jobs.seen(on_second) == 1  # disjoint CPUs: nothing shared
    everywhere = jobs.start()
    assert jobs.seen(everywhere) == 3  # overlaps both


def waiting_for_a_lock(pid: int) -> bool:
    """The kernel function `pid` sleeps in (/proc/PID/wchan) is a file lock's wait."""
    try:
        return "lock" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def test_jobs_registering_at_the_same_instant_each_see_those_before_them(jobs):
    """Six jobs released together while this test holds the registry's lock: none registers until it
    is released, then each registers and counts under the lock, so no two see the same number."""
    jobs.folder.mkdir(parents=True)
    lock = os.open(jobs.folder / budget_share.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        starting = [jobs.start() for _ in range(6)]
        deadline = time.monotonic() + 60
        while not all(waiting_for_a_lock(p.pid) for p in starting):
            assert records(jobs.folder) == set()  # registered without the lock
            if time.monotonic() > deadline:
                pytest.skip("this kernel does not say (/proc/PID/wchan) that a process waits for a lock")
            time.sleep(0.01)
        assert records(jobs.folder) == set()  # all six wait for the lock: none has registered
    finally:
        os.close(lock)
    counts = sorted(jobs.seen(p) for p in starting)
    assert counts == [1, 2, 3, 4, 5, 6]
    assert records(jobs.folder) == {p.pid for p in starting}


def test_the_decision_divides_the_budget_and_says_between_whom(jobs, monkeypatch):
    """In this process (no Hydra job: it counts itself without registering) next to a registered job."""
    other = jobs.start()
    assert jobs.seen(other) == 1
    whole = hardware.cpu_budget(sharing=Sharing()).budget
    decision = decisions.workers()
    expected = max(1, whole // 2)
    assert decision.value == hardware.recommended_workers(expected)
    assert decision.reason.startswith(f"CPU budget {expected} per rank")
    assert decision.reason.endswith(
        f" / 2 dlpipe jobs sharing these CPUs (pids {', '.join(sorted([str(other.pid), str(os.getpid())], key=int))})")
    assert decision.inputs["cpu.sharing_jobs"] == "2" and decision.inputs["cpu.budget"] == str(expected)
    monkeypatch.setenv(sharing.SHARED_BUDGET_ENV, "0")
    alone = decisions.workers()
    assert alone.value == hardware.recommended_workers(whole) and "sharing" not in alone.reason
    assert alone.inputs["cpu.sharing_jobs"] == "1"


def test_a_job_that_ended_leaves_the_registry_at_once(jobs):
    """A joblib worker runs its next job in the same process: the ended one must not count meanwhile."""
    me = budget_share.this_process(hardware.cpu_budget(sharing=Sharing()).cgroup_source, ranks=False)
    Registry(sharing.jobs_folder()).join(me)
    assert os.getpid() in records(sharing.jobs_folder())
    other = jobs.start()
    assert jobs.seen(other) == 2
    budget_share.leave()
    assert records(sharing.jobs_folder()) == {other.pid}
    second = jobs.start()
    assert jobs.seen(second) == 2  # itself and `other`: this process's ended job is gone


def test_a_registry_that_cannot_be_made_leaves_the_job_alone_with_a_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the registry would have to be a folder inside a file
    decision = decisions.workers()
    assert decision.inputs["cpu.sharing_jobs"] == "1" and "sharing" not in decision.reason
    assert "cannot keep the register of jobs sharing these CPUs" in caplog.text


def test_a_bad_opt_out_value_names_it_and_what_is_allowed(monkeypatch):
    monkeypatch.setenv(sharing.SHARED_BUDGET_ENV, "maybe")
    with pytest.raises(ValueError, match=r"^DLPIPE_SHARED_BUDGET='maybe': use 1 .* or 0 "):
        decisions.workers()


def _hydra(tmp_path: Path, sweeper: dict, task: list[str], num: int):
    """A sweep folder with the `multirun.yaml` Hydra's basic sweeper writes, and job `num`'s Hydra config."""
    sweep = tmp_path / "sweep"
    sweep.mkdir(exist_ok=True)
    OmegaConf.save(OmegaConf.create({"hydra": {"sweeper": sweeper, "overrides": {"task": task}}}),
                   sweep / "multirun.yaml")
    return OmegaConf.create({"sweep": {"dir": str(sweep)}, "job": {"num": num}})


BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@pytest.mark.parametrize("sweeper, task, num, batch", [
    ({"_target_": BASIC, "max_batch_size": None, "params": None}, ["a=1,2,3", "b=x,y", "+recipe=smoke"], 0, 6),
    ({"_target_": BASIC, "max_batch_size": 4, "params": None}, ["a=1,2,3", "b=x,y"], 5, 2),  # the last batch
    ({"_target_": BASIC, "max_batch_size": None, "params": {"c": "range(0,4)"}}, ["a=1,2"], 1, 8),
    ({"_target_": BASIC, "max_batch_size": None, "params": None}, ["a=1,2", "a=3,4,5"], 0, 3),  # the last wins
    ({"_target_": BASIC, "max_batch_size": None, "params": None}, ["model=glob(*)"], 0, None),  # cannot tell
    ({"_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"}, ["a=1,2"], 0, None),
])
def test_the_sweep_batch_is_read_from_multirun_yaml(tmp_path, sweeper, task, num, batch):
    assert sharing.sweep_batch(_hydra(tmp_path, sweeper, task, num)) == batch


def dlpipe_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "LOCAL_WORLD"))}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR))
    return env


SHARED = re.compile(r"loader\.num_workers = (\d+) \(auto: CPU budget (\d+) per rank -> \d+ workers; budget = "
                    r"min\(affinity \d+, cgroup \S+, Slurm \S+\) // 1 rank\(s\) per node / (\d+) dlpipe jobs sharing "
                    r"these CPUs \((.*)\)\)")
QUICK = ["+recipe=smoke", "tracking=none", "trainer.progress=false", "trainer.epochs=1",
         "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]


def test_a_run_started_beside_a_running_one_gets_half_the_budget(dlpipe, tmp_path):
    slow = ["--config-dir", str(TESTS_DIR / "conf"), "dataset=slow", "model=mlp", "model.in_features=4",
            "tracking=none", "trainer.progress=false", "hydra.run.dir=first"]
    first = subprocess.Popen([sys.executable, "-m", "dlpipe", *slow], cwd=tmp_path, env=dlpipe_env(),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not list(sharing.jobs_folder().glob(f"{first.pid}-*.json")):  # registered once it resolved its config
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.1)
        r = dlpipe(*QUICK)
        assert r.returncode == 0, r.stderr[-3000:]
        workers, budget, shared, pids = SHARED.search(r.stdout + r.stderr).groups()
        whole = hardware.cpu_budget(sharing=Sharing()).budget
        assert (int(budget), int(shared)) == (max(1, whole // 2), 2)
        assert int(workers) == hardware.recommended_workers(int(budget))
        assert pids.startswith(f"pids {first.pid}, ") and len(pids.split(", ")) == 2
        assert records(sharing.jobs_folder()) == {first.pid}  # the second run's record went with it
    finally:
        first.send_signal(signal.SIGTERM)  # dlpipe stops at the next step and exits: its record goes too
        first.wait(timeout=60)
    assert records(sharing.jobs_folder()) == set()


def test_a_joblib_sweep_divides_from_its_first_job(dlpipe, tmp_path):
    """n_jobs=2: even the job that registers first counts its sibling, which has not started yet."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    r = dlpipe("--multirun", *QUICK, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.sweep.dir=sweep",
               "optim.lr=0.1,0.2")
    assert r.returncode == 0, r.stderr[-3000:]
    whole = hardware.cpu_budget(sharing=Sharing()).budget
    for job in ("0", "1"):
        found = SHARED.search((tmp_path / "sweep" / job / "dlpipe.log").read_text())
        assert found is not None, f"job {job} did not divide its budget"
        assert (int(found.group(2)), int(found.group(3))) == (max(1, whole // 2), 2)
