"""The tracking process (tracking.sidecar) driven through its handle (tracking.sidecar_run), against
a real SQLite store: what it records, how a failure reaches the training process, that a job
refused before its run opened leaves no store and no process, its log records, DataLoader-style
forks, and the resource sampler leaving it out of the workers."""

import json
import logging
import os
import signal
import time

import pytest
from conftest import runs_of
from test_tracking_outage import wait_for

from dlpipe.errors import DlpipeError
from dlpipe.telemetry.sampler import TRACKING_MARK, ResourceSampler
from dlpipe.tracking.abandoned import MARKER_FILE, SIDECAR_MODULE
from dlpipe.tracking.client import client_for
from dlpipe.tracking.outbox import Outbox
from dlpipe.tracking.sidecar import MODULE, STOPPED
from dlpipe.tracking.sidecar_run import SidecarRun

pytestmark = pytest.mark.integration  # starts dlpipe, mlflow or torchrun: the slow tier


def opened(store: str, experiment: str, tmp_path, **extra) -> SidecarRun:
    run = SidecarRun.start(store, 10.0, 0)
    return run.open(uri=store, experiment=experiment, run_name="side", tags={"t": "1"}, marker_dir=tmp_path,
                    outbox_path=tmp_path / "outbox.jsonl", **extra)


def test_it_records_what_an_in_process_run_records_and_exits(mlflow_store, tmp_path):
    """Params, tags, metrics under MLflow's names at their steps, text, an artifact and the end,
    written by the tracking process; it exits once the run has ended."""
    (tmp_path / "model.pt").write_bytes(b"weights")
    with opened(mlflow_store, "side-records", tmp_path) as run:
        run.log_params({"optim.lr": 0.1, "loader.num_workers": 2})
        for step in (1, 2, 3):
            run.log_metrics({"train_loss": 1.0 / step, "val_loss": 2.0 / step}, step=step)
        run.flush()
        run.log_metrics({"samples_per_s": 100.0}, step=3)  # left buffered: end() sends it
        run.log_text("a: 1\n", "config/resolved.yaml")
        run.log_artifact(tmp_path / "model.pt", "model")
        run.set_tags({"dlpipe.verdict": "compute-bound"})
    assert run.status == "FINISHED" and run._process.returncode == 0
    client = client_for(mlflow_store, 10, 0)
    stored = client.get_run(run.run_id)
    assert stored.info.status == "FINISHED" and stored.info.run_name == "side"
    assert stored.data.params == {"optim.lr": "0.1", "loader.num_workers": "2"}
    assert stored.data.tags["t"] == "1" and stored.data.tags["dlpipe.verdict"] == "compute-bound"
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "val/loss")] == [
        (1, 2.0), (2, 1.0), (3, 2.0 / 3)]
    assert client.get_metric_history(run.run_id, "perf/samples_per_s")[0].value == 100.0
    assert {a.path for a in client.list_artifacts(run.run_id)} == {"config", "model"}


def test_a_failed_write_is_raised_at_the_next_call_and_the_run_still_ends(mlflow_store, tmp_path):
    """A write the store refuses (not an outage) fails in the tracking process; the training process
    raises it, as one line naming the call, at its next call; the run ends FAILED with that reason."""
    with pytest.raises(DlpipeError) as err:
        with opened(mlflow_store, "side-fails", tmp_path) as run:
            run.log_params({"bad?key": 1})  # MLflow refuses the name
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the refusal arrives while the job goes on
                run.set_tags({"still": "going"})
                time.sleep(0.1)
    assert str(err.value).startswith("tracking: log_params failed in the tracking process (MlflowException: ")
    stored = client_for(mlflow_store, 10, 0).get_run(run.run_id)
    assert stored.info.status == "FAILED"
    assert stored.data.tags["dlpipe.end_reason"].startswith("DlpipeError: tracking: log_params failed")


def test_a_failure_not_yet_raised_at_the_end_is_logged_and_the_run_still_ends(mlflow_store, tmp_path, caplog):
    """A refused write whose failure arrives after the job's last call: end() sends the run's end all
    the same (it never raises an earlier call's failure) and logs the failure."""
    with opened(mlflow_store, "side-late", tmp_path) as run:
        run.log_params({"bad?key": 1})
        deadline = time.monotonic() + 60
        while not run._failures and time.monotonic() < deadline:  # arrived, not yet raised
            time.sleep(0.05)
        assert run._failures
    assert run.status == "FINISHED"
    assert client_for(mlflow_store, 10, 0).get_run(run.run_id).info.status == "FINISHED"
    assert "tracking: log_params failed in the tracking process (MlflowException: " in caplog.text


def test_a_run_its_job_stopped_without_ending_is_ended_killed(mlflow_store, tmp_path):
    """close() without end() (the job interrupted right after the run opened): the tracking process
    ends the run KILLED, with the reason, before it exits."""
    run = opened(mlflow_store, "side-stopped", tmp_path)
    run.close()
    stored = client_for(mlflow_store, 10, 0).get_run(run.run_id)
    assert stored.info.status == "KILLED" and stored.data.tags["dlpipe.end_reason"] == STOPPED


def test_a_killed_tracking_process_leaves_its_run_to_the_outbox_and_sync(mlflow_store, tmp_path, dlpipe, caplog):
    """SIGKILL of the tracking process, stopped (SIGSTOP) with a flush unread in its pipe: that flush,
    never answered, and every call after it are kept in the outbox under this process's name (and its
    record), with one warning; the end says `not sent`; `dlpipe sync` delivers every step and ends
    the run FINISHED."""
    run = opened(mlflow_store, "side-killed", tmp_path)
    run.log_metrics({"train_loss": 1.0}, step=1)
    run.flush()
    wait_for(lambda: not run._unanswered, None, "the first flush to be answered")
    os.kill(run._process.pid, signal.SIGSTOP)
    run.log_metrics({"train_loss": 0.5}, step=2)
    run.flush()  # lies in the pipe, unread
    os.kill(run._process.pid, signal.SIGKILL)
    run._process.wait()
    with caplog.at_level(logging.WARNING):
        run.log_metrics({"train_loss": 0.25}, step=3)
        run.set_tags({"dlpipe.verdict": "input-bound"})
        run.end("FINISHED")
    assert run.status == "FINISHED, not sent"
    warned = [r.getMessage() for r in caplog.records if "the tracking process" in r.getMessage()]
    assert len(warned) == 1 and "exited (code -9)" in warned[0], warned
    outbox = tmp_path / "outbox.jsonl"
    assert Outbox.load(outbox).owner["pid"] == os.getpid()
    assert json.loads((tmp_path / MARKER_FILE).read_text())["pid"] == os.getpid()
    client = client_for(mlflow_store, 10, 0)
    assert client.get_run(run.run_id).info.status == "RUNNING"

    r = dlpipe("sync", str(outbox))
    assert r.returncode == 0, r.stderr
    stored = client.get_run(run.run_id)
    assert stored.info.status == "FINISHED" and stored.data.tags["dlpipe.verdict"] == "input-bound"
    assert [m.step for m in client.get_metric_history(run.run_id, "train/loss")] == [1, 2, 3]
    assert not outbox.exists()


def test_a_job_refused_before_its_run_opens_leaves_no_store_and_no_process(tmp_path):
    """Started on a store that does not exist yet, then closed without a run (the job was refused
    while it was built): the store is never made and the process is gone at once."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = SidecarRun.start(store, 10.0, 0)
    run.wait_prepared()
    run.close()
    assert run._process.returncode is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_closing_it_mid_import_does_not_wait_for_the_import(tmp_path):
    """Closed before it is prepared (a refusal in validation): ended by SIGTERM, not waited for."""
    run = SidecarRun.start(f"sqlite:///{tmp_path / 'mlflow.db'}", 10.0, 0)
    run.close()
    assert run._process.returncode == -15
    assert not (tmp_path / "mlflow.db").exists()


def test_its_refusal_to_open_is_one_line_and_ends_it(mlflow_store, mlflow_client, tmp_path):
    """A deleted experiment: open() raises dlpipe's own line, and the process has exited."""
    mlflow_client.delete_experiment(mlflow_client.create_experiment("side-deleted"))
    run = SidecarRun.start(mlflow_store, 10.0, 0)
    with pytest.raises(DlpipeError, match="tracking.experiment=side-deleted: this experiment is deleted"):
        run.open(uri=mlflow_store, experiment="side-deleted", run_name="x", tags={})
    assert run._process.returncode is not None
    assert runs_of(mlflow_client, "side-deleted") == []


def test_its_log_records_are_logged_by_the_training_process(mlflow_store, tmp_path, caplog):
    """A warning of the tracking process (a checkpoint's run that is not in this store) reaches the
    training process's logging, under the logger that said it."""
    caplog.set_level(logging.INFO)
    with opened(mlflow_store, "side-logs", tmp_path, resume_run_id="0" * 32):
        pass
    records = [r for r in caplog.records if r.name == "dlpipe.tracking.run"]
    assert any("is not in this store: starting a new run" in r.getMessage() for r in records), caplog.text


def test_a_forked_child_holds_no_end_of_its_pipe(mlflow_store, tmp_path):
    """A forked child (a DataLoader worker) has the pipe's descriptors pointed at /dev/null, so the
    tracking process sees the training process die even while its workers live on."""
    with opened(mlflow_store, "side-fork", tmp_path) as run:
        fds = run._channel.fds
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report where its copies of the descriptors point
            os.write(write_end, ",".join(os.readlink(f"/proc/self/fd/{fd}") for fd in fds).encode())
            os._exit(0)
        os.close(write_end)
        seen = os.read(read_end, 4096).decode().split(",")
        os.close(read_end)
        os.waitpid(pid, 0)
        assert all(os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:") for fd in fds)  # ours are intact
    assert seen == ["/dev/null", "/dev/null"]


def test_every_copy_of_its_module_name_is_the_module():
    """Its `python -m` name is written out where an import would break the layering (the sampler) or
    close a circle (abandoned, read by the run the tracking process runs): all name the real module."""
    import importlib.util

    assert SIDECAR_MODULE == TRACKING_MARK == MODULE
    assert importlib.util.find_spec(MODULE).origin.endswith("tracking/sidecar.py")


def test_the_sampler_leaves_it_out_of_the_workers(mlflow_store, tmp_path):
    """The tracking process is a child of the training process, but neither its CPU nor its memory
    is the loader's: no worker counted while it is the only child."""
    assert TRACKING_MARK == MODULE
    # under xdist a session fixture of another test (the Slurm cluster's daemons) may have children here too
    before = ResourceSampler(interval_s=60.0, cpu_budget=2).start()
    try:
        others = int(before.window()["workers_alive"])
    finally:
        before.stop()
    with opened(mlflow_store, "side-sampler", tmp_path):
        sampler = ResourceSampler(interval_s=0.05, cpu_budget=2).start()
        try:
            time.sleep(0.3)
            window = sampler.window()
        finally:
            sampler.stop()
    assert window["workers_alive"] == others
    assert others or window["workers_rss_mb"] == 0
