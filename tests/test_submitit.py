"""Sweeps through Hydra's submitit launcher, for real, with submitit's local executor (the same
job runner, pickling and requeue path as on Slurm, minus sbatch)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR, epochs_logged, runs_of

pytestmark = pytest.mark.integration  # starts dlpipe, mlflow or torchrun: the slow tier

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

SLOW = ["--config-dir", str(TESTS_DIR / "conf"), "dataset=slow", "dataset.size=480", "dataset.delay_s=0.004",
        "model=mlp", "model.in_features=4", "loader.num_workers=0", "loader.batch_size=16",
        "trainer.val_fraction=0", "trainer.progress=false"]


def sweep(tmp_path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "SUBMITIT_", "LOCAL_WORLD"))}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR))
    return subprocess.Popen(
        [sys.executable, "-m", "dlpipe", "--multirun", *args, "hydra/launcher=submitit_local", "hydra.sweep.dir=sweep"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        start_new_session=True,  # so a failed test can end the whole tree: controller and tasks too
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def children_of(runs):
    [parent] = [r for r in runs if r.data.tags.get("dlpipe.role") == "sweep"]
    return parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


def test_a_two_job_sweep_runs_as_submitit_jobs_under_one_parent_run(tmp_path, mlflow_store, mlflow_client):
    code, out, err = finish(sweep(tmp_path, "+recipe=tabular", "dataset.size=512", "trainer.epochs=1",
                                  "trainer.progress=false", "loader.batch_size=64,128",
                                  f"tracking.uri={mlflow_store}", "tracking.experiment=submitit-sweep"))
    assert code == 0, err[-3000:]
    parent, children = children_of(runs_of(mlflow_client, "submitit-sweep"))
    assert parent.info.status == "FINISHED" and parent.data.tags["dlpipe.jobs"] == "2"
    assert sorted(c.data.params["loader.batch_size"] for c in children) == ["128", "64"]
    assert all(c.info.status == "FINISHED" for c in children)
    for job in ("0", "1"):  # Hydra's job dirs, written by the submitit worker processes
        assert (tmp_path / "sweep" / job / "resolved_config.yaml").is_file()
    assert list((tmp_path / "sweep" / ".submitit").iterdir())  # the jobs really went through submitit


def submitit_task(proc: subprocess.Popen) -> psutil.Process | None:
    """The process running the job (submitit.core._submit), below the sweep and submitit's controller."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "submitit.core._submit" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def test_a_preempted_job_is_requeued_and_resumes_in_the_same_dir_and_run(tmp_path, mlflow_store, mlflow_client):
    exp = "submitit-requeue"
    proc = sweep(tmp_path, *SLOW, "trainer.epochs=3", f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}")
    first_epoch = tmp_path / "sweep" / "0" / "checkpoints" / "epoch-0001.pt"
    try:
        deadline = time.monotonic() + 180
        while not first_epoch.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
            time.sleep(0.2)
        task = submitit_task(proc)
        assert task is not None
        task.send_signal(signal.SIGUSR2)  # what submitit (Slurm or local) sends on preemption or time-out
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]

    job_dir = tmp_path / "sweep" / "0"
    logs = "".join(p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*_log.*"))
    assert "handing the job back to submitit to requeue it" in logs
    assert "Requeued job" in logs  # submitit's own record of the requeue
    parent, [child] = children_of(runs_of(mlflow_client, exp))  # one run: the requeued job continued it
    assert child.info.status == "FINISHED" and parent.info.status == "FINISHED"
    assert child.data.tags["dlpipe.resumed_from"].startswith(str(job_dir / "checkpoints"))
    # each epoch once, across the two processes
    assert epochs_logged(mlflow_client, child.info.run_id, "train/loss") == [1, 2, 3]
    assert (job_dir / "checkpoints" / "epoch-0003.pt").is_file()


def test_a_job_of_two_tasks_trains_data_parallel_with_the_environment_from_submitit(tmp_path, mlflow_store,
                                                                                     mlflow_client):
    """hydra/launcher=slurm_node's layout (a task per GPU, no torchrun), here as 2 local tasks with gloo."""
    code, out, err = finish(sweep(tmp_path, "+recipe=tabular", "dataset.size=1024", "trainer.epochs=2",
                                  "trainer.progress=false", "loader.num_workers=0", "loader.batch_size=32",
                                  "hydra.launcher.tasks_per_node=2", f"tracking.uri={mlflow_store}",
                                  "tracking.experiment=submitit-ddp"))
    assert code == 0, err[-3000:]
    parent, [child] = children_of(runs_of(mlflow_client, "submitit-ddp"))  # rank 0's run only
    assert child.info.status == "FINISHED"
    assert (child.data.params["dist.world_size"], child.data.params["dist.global_batch"]) == ("2", "64")
    logs = "".join(p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*_log.*"))
    assert "rank 0 of 2 (local 0 of 2), gloo on cpu" in logs
    assert (tmp_path / "sweep" / "0" / "checkpoints" / "epoch-0002.pt").is_file()
