"""Jobs never share an output folder: a clock-named folder is claimed fresh (NAME, NAME_1, ...) even
for jobs started in the same second, and a folder a live job holds refuses a second job in one line;
a job killed outright holds nothing."""

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import runs_of
from test_tracking_faults import spawn
from test_tracking_outage import wait_for

from dlpipe.config.output_folder import LOCK_FILE, claim, override
from dlpipe.tracking.abandoned import MARKER_FILE

pytestmark = pytest.mark.integration  # real dlpipe jobs side by side

SMALL = ["+recipe=tabular", "dataset.size=512", "trainer.epochs=1"]


def tracked(store: str, experiment: str) -> list[str]:
    return [f"tracking.uri={store}", f"tracking.experiment={experiment}"]


def run_id_in(folder: Path) -> str:
    return json.loads((folder / MARKER_FILE).read_text())["run_id"]


def test_claim_takes_the_first_free_name(tmp_path):
    base = tmp_path / "outputs" / "12-00-00"
    assert [claim(base) for _ in range(3)] == [base, base.with_name("12-00-00_1"), base.with_name("12-00-00_2")]
    assert all(p.is_dir() for p in base.parent.iterdir())


def test_a_claimed_sweep_folder_is_an_override_hydra_can_parse():
    plain = "multirun/2026-12-06/07-08-13_1"
    assert override("hydra.sweep.dir", plain) == f"hydra.sweep.dir={plain}"
    assert override("hydra.sweep.dir", "/data/it's here") == "hydra.sweep.dir='/data/it\\'s here'"


def test_jobs_started_together_each_get_a_folder_and_a_run(tmp_path, mlflow_store, mlflow_client):
    """Three jobs at once whose folder is named by the clock (`${now:%Y}`: the same name for all of
    them, as Hydra's default is for jobs started in the same second): three folders, three runs, each
    folder's checkpoint its own run's, nobody resumed anybody."""
    args = [*SMALL, *tracked(mlflow_store, "same-second"), "hydra.run.dir=outputs/${now:%Y}"]
    procs = [spawn(tmp_path, tmp_path / f"job{i}.log", *args) for i in range(3)]
    codes = [p.wait(timeout=300) for p in procs]
    logs = [(tmp_path / f"job{i}.log").read_text() for i in range(3)]
    assert codes == [0, 0, 0], logs
    assert not any("resuming from" in log for log in logs)
    folders = sorted((tmp_path / "outputs").iterdir())
    year = folders[0].name
    assert [f.name for f in folders] == [year, f"{year}_1", f"{year}_2"]
    runs = {run.info.run_id: run for run in runs_of(mlflow_client, "same-second")}
    assert {run.info.status for run in runs.values()} == {"FINISHED"} and len(runs) == 3
    assert {run_id_in(f) for f in folders} == set(runs)
    for folder in folders:
        assert [p.name for p in (folder / "checkpoints").glob("epoch-*.pt")] == ["epoch-0001.pt"]
        assert not (folder / LOCK_FILE).exists()  # released at the end


def test_sweeps_started_together_each_get_a_folder_and_a_parent(tmp_path, mlflow_store, mlflow_client):
    args = ["--multirun", *SMALL, *tracked(mlflow_store, "same-second-sweeps"), "hydra.sweep.dir=multirun/${now:%Y}",
            "optim.lr=0.01,0.02"]
    procs = [spawn(tmp_path, tmp_path / f"sweep{i}.log", *args) for i in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0], [(tmp_path / f"sweep{i}.log").read_text() for i in range(2)]
    sweeps = sorted((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 2 and sweeps[1].name == f"{sweeps[0].name}_1"
    runs = runs_of(mlflow_client, "same-second-sweeps")
    parents = {r.info.run_id: r.data.tags["dlpipe.sweep_dir"]
               for r in runs if r.data.tags.get("dlpipe.role") == "sweep"}
    assert sorted(Path(d).name for d in parents.values()) == [s.name for s in sweeps]
    for sweep in sweeps:  # each sweep's jobs ran in its folder and nest under its parent
        parent = next(p for p, d in parents.items() if Path(d).name == sweep.name)
        children = {run_id_in(sweep / str(job)) for job in (0, 1)}
        assert {r.info.run_id for r in runs if r.data.tags.get("mlflow.parentRunId") == parent} == children


def test_a_folder_in_use_refuses_a_second_job_and_a_kill_frees_it(tmp_path, mlflow_store, mlflow_client, dlpipe):
    """A job given the folder of a live job stops in one line before writing anything (the first's
    Hydra record, log and run untouched); once the first is killed with SIGKILL the folder is free."""
    experiment = "folder-in-use"
    folder = tmp_path / "outputs" / "mine"
    first = spawn(tmp_path, tmp_path / "first.log", "+recipe=tabular", "dataset.size=512", "trainer.epochs=100000",
                  *tracked(mlflow_store, experiment), "hydra.run.dir=outputs/mine")
    try:
        wait_for(lambda: (folder / MARKER_FILE).exists() or first.poll() is not None, first, "the first job's run")
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        record = (folder / ".hydra" / "overrides.yaml").read_text()
        log_before = (folder / "dlpipe.log").read_text()

        second = dlpipe("+recipe=tabular", "optim.lr=0.5", *tracked(mlflow_store, experiment),
                        "hydra.run.dir=outputs/mine")
        assert second.returncode == 2
        assert second.stdout == ""
        assert second.stderr.splitlines() == [
            f"dlpipe: error: hydra.run.dir={folder.relative_to(tmp_path)}: another dlpipe job uses this folder "
            f"(pid {first.pid} on {os.uname().nodename}, since {second.stderr.split('since ')[1].split(')')[0]}); "
            "wait for it to end, or give this job a folder of its own (hydra.run.dir=...)"]
        assert (folder / ".hydra" / "overrides.yaml").read_text() == record
        assert "optim.lr=0.5" not in (folder / "dlpipe.log").read_text()[len(log_before):]
        assert [r.info.run_id for r in runs_of(mlflow_client, experiment)] == [run_id_in(folder)]
    finally:
        first.send_signal(signal.SIGKILL)  # as the OOM killer would; its tracking process ends its run
        first.wait(timeout=60)

    third = dlpipe(*SMALL, "checkpoint.resume=never", *tracked(mlflow_store, experiment), "hydra.run.dir=outputs/mine")
    assert third.returncode == 0, third.stderr
    assert not (folder / LOCK_FILE).exists()
    statuses = sorted(r.info.status for r in runs_of(mlflow_client, experiment))
    assert statuses == ["FINISHED", "KILLED"]  # the killed job's run ended by the next job there


FORKING_HOLDER = """
import os, sys, time
from pathlib import Path
from dlpipe.config.output_folder import hold
hold(Path(sys.argv[1]), "hydra.run.dir")
child = os.fork()  # as a DataLoader worker or a user's multiprocessing Manager is made
if child == 0:
    # said by the child, not the parent: once fork() returns here, the at-fork hooks have run (the
    # parent may print before the child was ever scheduled, and then kill -9 would race the hook)
    print(os.getpid(), flush=True)
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def test_a_killed_jobs_forked_children_do_not_keep_its_folder(tmp_path):
    """The job is SIGKILLed while a child it forked lives on: the folder is free at once."""
    import subprocess
    import sys

    from dlpipe.config.output_folder import hold, release

    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        lock = hold(tmp_path, "hydra.run.dir")  # FolderInUse if the child still held it
        assert lock is not None
        release(lock)
    finally:
        os.kill(child, signal.SIGKILL)
