"""Data-parallel dlpipe on the real one-node Slurm cluster (tests/slurm_cluster.py), launched the ways a
cluster user launches it: a batch script running `srun dlpipe ...` (no torchrun, no submitit),
submitit's `slurm_node` preset (a task per rank), and the shipped multi-node torchrun template.

Each is held to the same config under `torchrun --nproc_per_node=2` on this host (tests/ddp_reference.py):
one MLflow run, 2 ranks, every logged number equal. Each job takes the whole 2-CPU node (two 1-CPU tasks).
"""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR, runs_of
from ddp_reference import ARGS, two_ranks_on_one_node  # noqa: F401 (a fixture)
from test_resume import logged
from test_slurm import attempts, finish, job_logs, sweep  # noqa: F401 (sweep: a fixture)
from test_submitit import children_of

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

TEMPLATE = TESTS_DIR.parent / "docs" / "slurm" / "torchrun-multinode.sbatch"


@pytest.fixture
def batch(slurm, tmp_path):
    """`sbatch --wait` from tmp_path with a clean environment (no MLflow, dlpipe or Slurm variables of
    this process; the venv's python first on PATH); returns (exit code, job id, the job's output).
    Every job submitted is cancelled at the end, by its name, finished or not."""
    name = f"dlpipe-test-{tmp_path.name}"
    env = {k: v for k, v in slurm.env.items()
           if not k.startswith(("MLFLOW_", "DLPIPE_", "SUBMITIT_", "LOCAL_WORLD", "TORCHELASTIC_"))
           and (not k.startswith("SLURM_") or k == "SLURM_CONF")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")

    def submit(*args: str, extra_env: dict | None = None, timeout: float = 240) -> tuple[int, str, str]:
        out = tmp_path / "job.out"
        r = subprocess.run(
            ["sbatch", "--wait", "--parsable", f"--job-name={name}", f"--output={out}", f"--chdir={tmp_path}",
             "--mem=1G", *args],
            env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        job = r.stdout.strip().split(";")[0]
        return r.returncode, job, out.read_text() if out.exists() else r.stderr

    yield submit
    slurm.run("scancel", f"--name={name}", check=False)


def same_numbers(mlflow_client, run, reference) -> None:
    a, b = logged(mlflow_client, reference), logged(mlflow_client, run)
    assert {"train_loss", "val_loss", "val_accuracy"} <= set(a)
    assert a == b


def test_srun_tasks_train_as_ranks_of_one_job(slurm, batch, tmp_path, mlflow_store, mlflow_client,
                                               two_ranks_on_one_node):  # noqa: F811
    """`sbatch --ntasks=2 --cpus-per-task=1` of a script running `srun dlpipe ...`: the two tasks are
    ranks 0 and 1 of one job (not two runs), each with its own 1-CPU worker budget."""
    script = tmp_path / "job.sh"
    dlpipe = shlex.join([sys.executable, "-m", "dlpipe", *ARGS, "hydra.run.dir=run", f"tracking.uri={mlflow_store}",
                         "tracking.experiment=srun-ranks"])
    script.write_text(f"#!/bin/bash\nsrun --kill-on-bad-exit=1 {dlpipe}\n")
    code, job, out = batch("--ntasks=2", "--cpus-per-task=1", str(script))
    assert code == 0, out[-3000:]
    assert attempts(slurm, job) == ["COMPLETED"]
    [run] = runs_of(mlflow_client, "srun-ranks")  # rank 0 tracks; rank 1 made no run of its own
    assert run.info.status == "FINISHED"
    params = run.data.params
    dist = (params["dist.world_size"], params["dist.local_world_size"], params["dist.global_batch"])
    assert dist == ("2", "2", "128")
    # a rank per Slurm task: SLURM_CPUS_PER_TASK is each rank's own, not divided again
    assert (params["cpu.slurm_cpus"], params["cpu.rank_per_slurm_task"], params["cpu.budget"]) == ("1", "True", "1")
    assert run.data.tags["slurm.job_id"] == job
    # which launcher gave the ranks, in the log (rank 1 logs warnings only)
    assert "rank 0 of 2 (local 0 of 2), gloo on cpu; ranks from srun, rendezvous at " in out
    # rank 0's run folder and its artifacts (the store's default artifact root): rank 1 wrote nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.out", "job.sh", "mlruns", "run"]
    same_numbers(mlflow_client, run, two_ranks_on_one_node)


def test_srun_refuses_a_sweep_in_every_task(slurm, batch, tmp_path):
    """--multirun in a step of 2 tasks would run the whole sweep twice: refused in one line, nothing trained."""
    script = tmp_path / "job.sh"
    dlpipe = shlex.join([sys.executable, "-m", "dlpipe", "--multirun", *ARGS, "loader.batch_size=16,32",
                         "tracking=none", "hydra.sweep.dir=sweep"])
    script.write_text(f"#!/bin/bash\nsrun {dlpipe}\n")
    code, job, out = batch("--ntasks=2", "--cpus-per-task=1", str(script))
    assert code != 0
    line = ("dlpipe: error: --multirun in an srun step of 2 tasks: every rank would run the whole sweep; sweep with "
            "hydra/launcher=slurm_node (tasks_per_node=N), or start one srun per job")
    assert out.count(line) == 2, out[-3000:]  # each task, before Hydra opened the sweep
    assert not (tmp_path / "sweep").exists() and "epoch 1" not in out and not list(tmp_path.rglob("*.pt"))


def test_slurm_node_trains_two_ranks_through_submitit(sweep, tmp_path, mlflow_store, mlflow_client,  # noqa: F811
                                                      two_ranks_on_one_node):  # noqa: F811
    """The slurm_node preset (a task per rank, ranks from submitit's job environment), sized for the test node."""
    # ARGS but its --config-dir, which the fixture gives
    proc = sweep(*ARGS[2:], "hydra/launcher=slurm_node", "hydra.launcher.tasks_per_node=2",
                 "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
                 f"tracking.uri={mlflow_store}", "tracking.experiment=slurm-node")
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    parent, [child] = children_of(runs_of(mlflow_client, "slurm-node"))  # rank 0's run only
    assert parent.info.status == child.info.status == "FINISHED"
    assert (child.data.params["dist.world_size"], child.data.params["cpu.budget"]) == ("2", "1")
    logs = job_logs(tmp_path)
    assert "rank 0 of 2 (local 0 of 2), gloo on cpu; ranks from submitit" in logs
    same_numbers(mlflow_client, child, two_ranks_on_one_node)


def test_the_shipped_multinode_template_runs_as_shipped_on_one_node(slurm, batch, tmp_path, mlflow_store,
                                                                     mlflow_client, two_ranks_on_one_node):  # noqa: F811
    """docs/slurm/torchrun-multinode.sbatch with its #SBATCH lines sized for the test node on sbatch's
    command line (which wins over them), the venv, output folder and tracking store in its variables,
    and the dlpipe arguments as the script's arguments."""
    code, job, out = batch(
        "--nodes=1", "--cpus-per-task=2", "--gres=none", "--time=10", str(TEMPLATE), *ARGS,
        extra_env={"VENV": sys.prefix, "RANKS_PER_NODE": "2", "OUTPUT_ROOT": str(tmp_path / "runs"),
                   "MLFLOW_TRACKING_URI": mlflow_store, "MLFLOW_EXPERIMENT_NAME": "template"})
    assert code == 0, out[-3000:]
    assert attempts(slurm, job) == ["COMPLETED"]
    [run] = runs_of(mlflow_client, "template")
    assert run.info.status == "FINISHED" and run.data.params["dist.world_size"] == "2"
    assert "ranks from torchrun" in out
    assert (tmp_path / "runs" / f"dlpipe-test-{tmp_path.name}-{job}" / "checkpoints" / "epoch-0002.pt").is_file()
    same_numbers(mlflow_client, run, two_ranks_on_one_node)
