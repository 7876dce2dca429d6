"""Every kill ends its runs: what `kill -9` leaves RUNNING is ended by `dlpipe sync` or by the next
sweep or job in that folder, through the real CLI, real SIGKILLs and a real SQLite store.

A sweep's parent killed with its sweep process; a job killed with its tracking process, its run
found by its folder's record or, with that record torn, by its own tags; a tracking process killed
alone, while training goes on; torn and damaged outboxes; the sweep parent's end reason."""

import json
import os
from dataclasses import asdict
from pathlib import Path

from conftest import TESTS_DIR, epochs_logged, runs_of
from test_tracking_faults import gone_owner, kill, spawn, tracking_process
from test_tracking_outage import wait_for

from dlpipe.tracking.abandoned import MARKER_FILE, OWNER_TAG, Owner, keep_call
from dlpipe.tracking.client import client_for
from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox
from dlpipe.tracking.sidecar import ORPHANED

SLOW = ["--config-dir", str(TESTS_DIR / "conf"), "dataset=slow", "dataset.size=400", "dataset.delay_s=0.005",
        "model=mlp", "model.in_features=4", "loader.num_workers=0", "trainer.val_fraction=0", "trainer.progress=false"]


def tracked(store: str, experiment: str) -> list[str]:
    return [f"tracking.uri={store}", f"tracking.experiment={experiment}"]


def owner_pid(run) -> int:
    return json.loads(run.data.tags[OWNER_TAG])["pid"]


def wait_for_epoch(job, folder: Path, epoch: int = 1) -> None:
    checkpoint = folder / "checkpoints" / f"epoch-{epoch:04d}.pt"
    wait_for(lambda: checkpoint.exists() or job.poll() is not None, job, f"epoch {epoch} in {folder}")
    assert job.poll() is None, f"the job ended before epoch {epoch}"


def test_a_sweep_killed_outright_is_ended_by_sync_and_continued_by_a_rerun(tmp_path, dlpipe):
    """kill -9 of a sweep's process during job 0: job 0's tracking process ends job 0 KILLED, the
    parent stays RUNNING, recorded in the sweep's folder. `dlpipe sync` of that folder ends it KILLED
    as found abandoned (a second sync finds nothing to do). The same sweep run again in that folder
    continues the parent: job 0 resumes its own run under it, job 1 joins it, and it ends FINISHED
    with one row per job."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = ["--multirun", *SLOW, "trainer.epochs=3", "hydra.sweep.dir=sweep", *tracked(store, "killed-sweep"),
             "optim.lr=0.1,0.2"]
    first = spawn(tmp_path, tmp_path / "first.txt", *sweep)
    try:
        wait_for_epoch(first, tmp_path / "sweep" / "0")
        tracker = tracking_process(first)
    finally:
        kill(first)
    tracker.wait(timeout=120)  # it ended job 0's run when the pipe closed
    client = client_for(store, 10, 0)
    marker = json.loads((tmp_path / "sweep" / MARKER_FILE).read_text())
    parent_id = marker["run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "RUNNING" and marker["pid"] == owner_pid(parent) == first.pid
    [job0] = [r for r in runs_of(client, "killed-sweep") if r.info.run_id != parent_id]
    assert job0.info.status == "KILLED" and job0.data.tags["dlpipe.end_reason"] == ORPHANED
    assert job0.data.tags["mlflow.parentRunId"] == parent_id

    synced = dlpipe("sync", "sweep")
    assert synced.returncode == 0, synced.stderr
    assert f"run {parent_id} ended KILLED (found abandoned: its process {first.pid} on " in synced.stdout
    parent = client.get_run(parent_id)
    assert parent.info.status == "KILLED"
    assert parent.data.tags["dlpipe.end_reason"].startswith(f"found abandoned: its process {first.pid} on ")
    again = dlpipe("sync", "sweep")
    assert again.returncode == 0 and "ended" not in again.stdout
    assert again.stdout.endswith(f"2 runs recorded there ({MARKER_FILE}) checked\n"), again.stdout
    assert not list((tmp_path / "sweep").rglob(OUTBOX_FILE))

    rerun = dlpipe(*sweep, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    runs = runs_of(client, "killed-sweep")
    assert len(runs) == 3  # the parent and one run per job: job 0 resumed its own
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and "dlpipe.end_reason" not in parent.data.tags
    assert parent.data.tags["dlpipe.jobs"] == "2" and parent.data.tags["dlpipe.failed_jobs"] == "0"
    children = [r for r in runs if r.info.run_id != parent_id]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent_id}
    assert {r.info.status for r in children} == {"FINISHED"}
    assert job0.info.run_id in {r.info.run_id for r in children}
    assert epochs_logged(client, job0.info.run_id, "perf/epoch_time_s") == [1, 2, 3]
    assert f"sweep parent MLflow run {parent_id} (continued)" in rerun.stdout + rerun.stderr
    assert "sweep summary (2 runs" in rerun.stdout
    assert json.loads((tmp_path / "sweep" / MARKER_FILE).read_text())["run_id"] == parent_id
    printed = (tmp_path / "first.txt").read_text() + synced.stdout + synced.stderr + rerun.stdout + rerun.stderr
    assert "Traceback" not in printed


def test_sync_ends_jobs_killed_with_their_tracking_process_by_their_record_or_their_tags(tmp_path, dlpipe):
    """Two jobs, each SIGKILLed with its tracking process after epoch 1 while the store is up: no
    outbox, runs RUNNING. Job b's record is then torn. `dlpipe sync b` alone knows no store to look
    in: one line, exit 1. `dlpipe sync a b` ends a's run from its record and finds b's in a's store
    by its tags (the folder and the tracking process that owned it): both KILLED as found abandoned."""
    (tmp_path / "store").mkdir()
    store = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"  # not ./mlflow.db: sync must not find it by default
    jobs = {name: spawn(tmp_path, tmp_path / f"{name}.txt", *SLOW, "trainer.epochs=50", f"hydra.run.dir={name}",
                        *tracked(store, "killed-both")) for name in ("a", "b")}
    trackers = {}
    try:
        for name, job in jobs.items():
            trackers[name] = tracking_process(job)
            wait_for_epoch(job, tmp_path / name)
    finally:
        for name, job in jobs.items():
            kill(job, trackers.get(name))
    client = client_for(store, 10, 0)
    runs = {Path(r.data.tags["dlpipe.output_dir"]).name: r for r in runs_of(client, "killed-both")}
    assert {r.info.status for r in runs.values()} == {"RUNNING"}
    assert {name: owner_pid(r) for name, r in runs.items()} == {name: t.pid for name, t in trackers.items()}
    assert not list(tmp_path.rglob(OUTBOX_FILE))
    record = tmp_path / "b" / MARKER_FILE
    torn = record.read_text()[:20]
    record.write_text(torn)  # as a damaged disk leaves it

    alone = dlpipe("sync", "b")
    assert alone.returncode == 1 and alone.stdout == ""
    [line, total] = alone.stderr.splitlines()
    assert line.startswith(f"dlpipe sync: error: b/{MARKER_FILE} is unreadable (") and "pass --uri" in line
    assert total == "dlpipe sync: error: 1 of 1 run records not done (see above)"
    assert client.get_run(runs["b"].info.run_id).info.status == "RUNNING"

    both = dlpipe("sync", "a", "b")
    assert both.returncode == 0, both.stderr
    a_id, b_id = runs["a"].info.run_id, runs["b"].info.run_id
    assert f"a: run {a_id} ended KILLED (found abandoned: its process {trackers['a'].pid} on " in both.stdout
    [line] = both.stderr.splitlines()
    assert line.startswith(f"dlpipe sync: b/{MARKER_FILE} is unreadable (")
    assert f"found by its tags in {store}: " in line
    assert f"run {b_id} ended KILLED (found abandoned: its process {trackers['b'].pid} on " in line
    for name, run_id in (("a", a_id), ("b", b_id)):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert run.data.tags["dlpipe.end_reason"].startswith(f"found abandoned: its process {trackers[name].pid} ")
        assert 1 in epochs_logged(client, run_id, "perf/epoch_time_s")
    assert record.read_text() == torn  # left as it is
    assert not list(tmp_path.rglob(OUTBOX_FILE))


def test_a_job_whose_tracking_process_is_killed_trains_on_and_sync_delivers_its_run(tmp_path, dlpipe):
    """kill -9 of the tracking process alone after epoch 1: training goes on as in an outage (one
    warning, every epoch's checkpoint, exit 0, a last line naming `dlpipe sync`), keeping the run's
    writes in the outbox under its own name (and in mlflow_run.json); sync delivers every epoch and
    ends the run FINISHED, as the job ended."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = tmp_path / "job.txt"
    job = spawn(tmp_path, log, *SLOW, "trainer.epochs=4", "hydra.run.dir=out", *tracked(store, "tracker-killed"))
    try:
        tracker = tracking_process(job)
        wait_for_epoch(job, tmp_path / "out")
        tracker.kill()
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        kill(job)
    printed = log.read_text()
    assert printed.count(f"tracking: the tracking process (pid {tracker.pid}) exited (code -9)") == 1, printed
    assert f"send them with: dlpipe sync {tmp_path / 'out'}\n" in printed
    assert "(FINISHED, not sent)" in printed and "Traceback" not in printed
    assert (tmp_path / "out" / "checkpoints" / "epoch-0004.pt").exists()
    outbox = tmp_path / "out" / OUTBOX_FILE
    assert Outbox.load(outbox).owner["pid"] == job.pid
    assert json.loads((tmp_path / "out" / MARKER_FILE).read_text())["pid"] == job.pid
    client = client_for(store, 10, 0)
    [run] = runs_of(client, "tracker-killed")
    assert run.info.status == "RUNNING" and owner_pid(run) == tracker.pid

    synced = dlpipe("sync", "out")
    assert synced.returncode == 0, synced.stderr
    assert f"to run {run.info.run_id} at {store}, run ended FINISHED" in synced.stdout
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and "dlpipe.end_reason" not in run.data.tags
    assert owner_pid(run) == job.pid  # the run's own record names the process that kept it last
    assert epochs_logged(client, run.info.run_id, "perf/epoch_time_s") == [1, 2, 3, 4]
    assert not outbox.exists()


def test_sync_drops_a_torn_last_line_and_keeps_an_outbox_damaged_before_it(tmp_path, mlflow_store, mlflow_client,
                                                                           dlpipe):
    """A last line cut short (what a kill mid-write leaves) is dropped with a note naming it, the rest
    delivered and the file removed, exit 0; a bad line before the last is damage: the file is kept as
    it is, nothing of it sent, one line names the line, exit 1."""
    exp = mlflow_client.create_experiment("torn-outboxes")
    torn_id, damaged_id = (mlflow_client.create_run(exp).info.run_id for _ in range(2))
    torn, damaged = tmp_path / "torn" / OUTBOX_FILE, tmp_path / "damaged" / OUTBOX_FILE
    for path, run_id in ((torn, torn_id), (damaged, damaged_id)):
        path.parent.mkdir()
        box = Outbox(mlflow_store, run_id, path, owner=gone_owner())
        box.tags({"first": "1"})
        box.tags({"second": "2"})
    lines = torn.read_text().splitlines(keepends=True)
    torn.write_text("".join(lines[:-1]) + lines[-1][:12])
    lines = damaged.read_text().splitlines(keepends=True)
    damaged.write_text(lines[0] + lines[1][:12] + "\n" + lines[2])
    kept = damaged.read_bytes()

    r = dlpipe("sync", "torn")
    assert r.returncode == 0, r.stderr
    note = "is incomplete (the process was killed while writing it): skipped"
    assert r.stderr == f"[WARNING] torn/{OUTBOX_FILE}:3 {note}\n"
    assert "sent 0 metrics and 1 other writes" in r.stdout and not torn.exists()
    run = mlflow_client.get_run(torn_id)
    assert run.data.tags["first"] == "1" and "second" not in run.data.tags and run.info.status == "KILLED"

    r = dlpipe("sync", "damaged")
    assert r.returncode == 1 and r.stdout == ""
    [line, total] = r.stderr.splitlines()
    assert line.startswith(f"dlpipe sync: error: damaged/{OUTBOX_FILE}:2 is damaged (") and "kept as it is" in line
    assert total == "dlpipe sync: error: 1 of 1 outboxes not done (see above)"
    assert damaged.read_bytes() == kept
    run = mlflow_client.get_run(damaged_id)
    assert run.info.status == "RUNNING" and "first" not in run.data.tags


def test_a_failed_sweeps_parent_says_how_many_jobs_ran_and_failed(tmp_path, mlflow_store, mlflow_client, dlpipe):
    """Every job runs though one fails: the parent's reason counts them, and says nothing stopped
    early. With one job a batch, Hydra launches nothing after the failed batch, and the reason says so."""
    fast = ["--multirun", "+recipe=smoke", "trainer.progress=false", "trainer.epochs=1", "loader.num_workers=-1,0"]
    r = dlpipe(*fast, *tracked(mlflow_store, "all-ran"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    [parent] = [x for x in runs_of(mlflow_client, "all-ran") if x.data.tags.get("dlpipe.role") == "sweep"]
    assert parent.info.status == "FAILED"
    assert parent.data.tags["dlpipe.end_reason"] == "1 of 2 jobs failed (dlpipe.failed_overrides names them)"

    r = dlpipe(*fast, "hydra.sweeper.max_batch_size=1", *tracked(mlflow_store, "stopped"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    runs = runs_of(mlflow_client, "stopped")
    [parent] = runs
    assert parent.info.status == "FAILED"
    assert parent.data.tags["dlpipe.end_reason"] == ("1 of 1 jobs failed (dlpipe.failed_overrides names them); "
                                                     "the sweep launched no job after the failed one")


def test_sync_leaves_an_outbox_its_live_job_still_writes(tmp_path, mlflow_store, mlflow_client, dlpipe):
    """Sending rewrites the file: lines the job appended meanwhile would be lost. An outbox whose
    writer (here this test's own process) still runs on this host is left to it, named, exit 1."""
    run_id = mlflow_client.create_run(mlflow_client.create_experiment("live-writer")).info.run_id
    path = tmp_path / "live" / OUTBOX_FILE
    path.parent.mkdir()
    Outbox(mlflow_store, run_id, path, owner=asdict(Owner.this_process())).tags({"kept": "1"})
    before = path.read_bytes()
    r = dlpipe("sync", "live")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"dlpipe sync: error: live/{OUTBOX_FILE}: its job's process {os.getpid()} still writes it and sends it "
        "itself once the store is back; left to it (sync again once it has ended)",
        "dlpipe sync: error: 1 of 1 outboxes not done (see above)"]
    assert path.read_bytes() == before
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "RUNNING" and "kept" not in run.data.tags


def test_params_of_a_process_whose_tracking_process_died_are_kept_and_delivered(tmp_path, mlflow_store,
                                                                               mlflow_client):
    """keep_call keeps a dead tracking process's log_params as MlflowRun would have sent them: values
    as text, cut to MLflow's limit; on a reopened run compared with the first attempt's on delivery."""
    exp = mlflow_client.create_experiment("kept-params")
    fresh, reopened = (mlflow_client.create_run(exp).info.run_id for _ in range(2))
    mlflow_client.log_param(reopened, "optim.lr", "0.1")
    for run_id, resumed, params in ((fresh, False, {"optim.lr": 0.1, "long": "x" * 7000}),
                                    (reopened, True, {"optim.lr": 0.2, "new": 3})):
        box = Outbox(mlflow_store, run_id, tmp_path / f"{run_id}.jsonl", owner=gone_owner())
        keep_call(box, "log_params", (params, None), resumed)
        Outbox.load(box.path).send(client_for(mlflow_store, 10, 0))
    assert mlflow_client.get_run(fresh).data.params == {"optim.lr": "0.1", "long": "x" * 5997 + "..."}
    run = mlflow_client.get_run(reopened).data
    assert run.params == {"optim.lr": "0.1", "new": "3"}  # MLflow params cannot change: the first stays
    assert run.tags["dlpipe.resumed_changed_params"] == "optim.lr"
