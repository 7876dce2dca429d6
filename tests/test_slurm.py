"""dlpipe on a real one-node Slurm cluster (tests/slurm_cluster.py), through the CLI as a cluster user
runs it: `--multirun hydra/launcher=slurm`, then Slurm's own signals: `scancel --signal=USR2`,
preemption by a job of a higher-priority partition (Slurm's default SIGTERM, with and without a
grace period) and a plain `scancel`.

Each job is tiny and takes 1 CPU, so the jobs of a sweep run side by side on a 2-CPU node; a
requeued job starts again ~11 s after its requeue (the cluster's cred_expire).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR, runs_of
from slurm_cluster import SlurmCluster
from test_resume import SIGNALLED, logged
from test_submitit import children_of

# xdist_group: the Slurm tests in one test process, one cluster. pytest 9.2 with pytest-xdist 3.8
# ignores it (pytest-xdist#1386): then each test process that gets one starts a cluster of its own.
pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

# Each job 1 CPU and 1 GB: the presets' 8 CPUs and 32 GB would never start on the test node.
SMALL_JOBS = ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
              "hydra.launcher.timeout_min=10"]
# test_resume's interrupted run (120 items, 4 optimizer steps an epoch, a cosine schedule with
# warm-up, train_loss_step windows across the stop) on a dataset that waits at its 150th item
# (in epoch 2) for the signal the test sends; one intra-op thread, as the 1-CPU job has.
WAITING = [a for a in SIGNALLED if "=" in a and not a.startswith("dataset=")] + [  # --config-dir goes first
    "dataset=waits_for_a_stop", "trainer.torch_threads=1"]


@pytest.fixture
def sweep(slurm, tmp_path):
    """Start `dlpipe --multirun` submitting to the test cluster, from tmp_path, into tmp_path/sweep.
    At the end the submitters still running are killed and every job left is cancelled: the next
    test gets an empty node even when this one failed halfway."""
    env = {k: v for k, v in slurm.env.items()
           if not k.startswith(("MLFLOW_", "DLPIPE_", "SUBMITIT_", "LOCAL_WORLD"))
           and (not k.startswith("SLURM_") or k == "SLURM_CONF")}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR))  # sbatch hands this environment to the jobs
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        started.append(subprocess.Popen(
            [sys.executable, "-m", "dlpipe", "--config-dir", str(TESTS_DIR / "conf"), "--multirun", *SMALL_JOBS,
             *args, "hydra.sweep.dir=sweep"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, start_new_session=True))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    slurm.run("scancel", "--user", "root", check=False)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    """The submitter's exit code and stderr."""
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def slurm_job(tmp_path: Path, proc: subprocess.Popen, timeout: float = 180) -> str:
    """The Slurm job id of a one-job sweep, once its job waits for the test's signal (the marker)."""
    deadline = time.monotonic() + timeout
    while not (tmp_path / "waiting").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)[1][-3000:]
        time.sleep(0.2)
    [job] = [p.name for p in (tmp_path / "sweep" / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name)]
    return job


def attempts(cluster: SlurmCluster, job: str) -> list[str]:
    """The job's states in Slurm's accounting, one per start: ['REQUEUED', 'COMPLETED'] for a requeue.
    Once the job has ended: submitit's submitter is done when the result file is written, a moment
    before the job's process exits and Slurm records its end."""

    def ended():
        out = cluster.run("sacct", "-n", "-X", "-P", "--duplicates", "-j", job, "-o", "State")
        states = [line.split()[0] for line in out.splitlines() if line.strip()]
        return states if states and states[-1] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED") else None

    return cluster.wait(f"job {job} ended in sacct", ended, timeout=60)


def job_logs(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*_log.*"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, mlflow_store, mlflow_client):
    """The uninterrupted run of WAITING, here outside Slurm (every logged number is the same: the job's
    CPU budget changes only speed settings, and torch_threads is pinned): its MLflow run."""
    out = tmp_path_factory.mktemp("straight")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "SUBMITIT_"))}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR))
    r = subprocess.run([sys.executable, "-m", "dlpipe", "--config-dir", str(TESTS_DIR / "conf"), *WAITING,
                        "dataset.at=-1", f"hydra.run.dir={out / 'run'}", f"tracking.uri={mlflow_store}",
                        f"tracking.experiment=slurm-straight-{out.name}"],
                       cwd=out, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = runs_of(mlflow_client, f"slurm-straight-{out.name}")
    return run


def interrupted(sweep, tmp_path, mlflow_store, exp: str, *args: str) -> subprocess.Popen:
    """A one-job sweep of WAITING whose job waits at its 150th item for the test's signal."""
    return sweep(*WAITING, "dataset.at=150", f"dataset.marker={tmp_path / 'waiting'}",
                 f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}", *args)


def resumed_exactly(mlflow_client, exp: str, straight, tmp_path: Path):
    """The sweep's one job continued its own MLflow run from the mid-epoch checkpoint and logged every
    number the straight run logged; returns that run."""
    parent, [child] = children_of(runs_of(mlflow_client, exp))  # one run: the requeued job reopened it
    assert child.info.status == "FINISHED" and parent.info.status == "FINISHED"
    assert child.data.tags["dlpipe.resumed_from"] == f"{tmp_path / 'sweep' / '0' / 'checkpoints' / 'epoch-0002.pt'}" \
        " (epoch 1)"
    a, b = logged(mlflow_client, straight), logged(mlflow_client, child)
    assert {"train_loss", "train_loss_step", "val_loss", "lr", "epoch_lr"} <= set(a)
    assert a == b
    return child


def test_a_two_job_sweep_runs_as_slurm_jobs_under_one_parent_run(slurm, sweep, tmp_path, mlflow_store, mlflow_client):
    proc = sweep("+recipe=tabular", "dataset.size=512", "trainer.epochs=1", "trainer.progress=false",
                 "loader.batch_size=64,128", f"tracking.uri={mlflow_store}", "tracking.experiment=slurm-sweep")
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    parent, children = children_of(runs_of(mlflow_client, "slurm-sweep"))
    assert parent.info.status == "FINISHED" and parent.data.tags["dlpipe.jobs"] == "2"
    assert sorted(c.data.params["loader.batch_size"] for c in children) == ["128", "64"]
    assert all(c.info.status == "FINISHED" for c in children)
    [array] = [p.name for p in (tmp_path / "sweep" / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name)]
    assert attempts(slurm, f"{array}_0") == attempts(slurm, f"{array}_1") == ["COMPLETED"]  # through Slurm, once
    # each run names its place in Slurm: the array's task, the partition it ran in, its node
    keys = ("slurm.array_job_id", "slurm.array_task_id", "slurm.partition")
    tags = sorted(tuple(c.data.tags[k] for k in keys) for c in children)
    assert tags == [(array, "0", "debug"), (array, "1", "debug")]
    assert all(c.data.tags["slurm.job_id"] and c.data.tags["slurm.nodelist"] for c in children)


def test_scancel_usr2_checkpoints_requeues_and_resumes_exactly(slurm, sweep, tmp_path, mlflow_store, mlflow_client,
                                                                straight):
    """submitit's signal (what Slurm sends before a time limit), sent by hand mid-epoch: the job
    checkpoints, submitit requeues it, and the new start resumes it exactly in the same MLflow run."""
    proc = interrupted(sweep, tmp_path, mlflow_store, "slurm-usr2")
    job = slurm_job(tmp_path, proc)
    slurm.run("scancel", "--signal=USR2", job)
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "handing the job back to submitit to requeue it" in job_logs(tmp_path)
    assert attempts(slurm, job) == ["REQUEUED", "COMPLETED"]
    resumed_exactly(mlflow_client, "slurm-usr2", straight, tmp_path)


def preempt(cluster: SlurmCluster) -> None:
    """Submit a job to `urgent` that needs the whole node: Slurm preempts what runs in the lower partitions."""
    cluster.run("sbatch", "-p", "urgent", "-c", str(cluster.cpus), "--mem=100M", "-o", "/dev/null", "--wrap", "true")


@pytest.mark.parametrize("partition, first_attempt", [("debug", "REQUEUED"), ("nograce", "PREEMPTED")],
                         ids=["grace-period", "no-grace"])
def test_preemption_by_slurms_sigterm_checkpoints_requeues_and_resumes_exactly(
        slurm, sweep, tmp_path, mlflow_store, mlflow_client, straight, partition, first_attempt):
    """Preemption with Slurm's default signal. With the partition's grace period, Slurm sends SIGTERM
    and requeues the job at the end of the grace period only if it still runs: the job checkpoints and
    requeues itself at once (REQUEUED; Slurm's own requeue at the end of grace would read PREEMPTED).
    Without grace, Slurm has already requeued it (PREEMPTED) and sends SIGTERM, SIGCONT, SIGTERM
    within milliseconds: one stop request, so the mid-epoch checkpoint is still written. Either way
    the job resumes from that checkpoint, exactly, in its MLflow run."""
    exp = f"slurm-preempt-{partition}"
    proc = interrupted(sweep, tmp_path, mlflow_store, exp, f"hydra.launcher.partition={partition}")
    job = slurm_job(tmp_path, proc)
    preempt(slurm)
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    assert attempts(slurm, job) == [first_attempt, "COMPLETED"]
    logs = job_logs(tmp_path)
    assert "stopped by SIGTERM in epoch 2" in logs  # the mid-epoch checkpoint, not a stop at once
    assert ("Slurm is preempting job" in logs) == (partition == "debug")  # requeued itself only within grace
    resumed_exactly(mlflow_client, exp, straight, tmp_path)


def test_a_deliberate_scancel_ends_the_run_killed_and_is_not_requeued(slurm, sweep, tmp_path, mlflow_store,
                                                                       mlflow_client):
    """`scancel` sends the same SIGTERM as a preemption; slurmctld's record tells them apart (the job is
    COMPLETING, with no PreemptTime): the job checkpoints, its run ends KILLED, nothing is requeued."""
    proc = interrupted(sweep, tmp_path, mlflow_store, "slurm-scancel")
    job = slurm_job(tmp_path, proc)
    slurm.run("scancel", job)
    code, err = finish(proc)
    assert code != 0  # the sweep's job was cancelled
    assert attempts(slurm, job) == ["CANCELLED"]
    assert "Slurm is preempting job" not in job_logs(tmp_path)
    parent, [child] = children_of(runs_of(mlflow_client, "slurm-scancel"))
    assert child.info.status == "KILLED" and child.data.tags["dlpipe.end_reason"] == "terminated (SIGTERM)"
    assert (tmp_path / "sweep" / "0" / "checkpoints" / "epoch-0002.pt").is_file()  # resumable by hand
