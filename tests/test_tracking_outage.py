"""Tracking server faults for real: unreachable at start, gone mid-run and back, gone for good then synced."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR, epochs_logged, runs_of
from mlflow_server import free_port, start_server, stop_tree

from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox, connect_error, unreachable

pytestmark = pytest.mark.integration  # starts dlpipe, mlflow or torchrun: the slow tier

WARNING = "tracking server unreachable"


@pytest.fixture
def blackhole():
    """A local port whose accept queue is full: connects to it time out, like a host that drops packets."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    held = []
    while True:  # fill the queue until a connect no longer completes
        c = socket.socket()
        c.settimeout(0.3)
        try:
            c.connect(("127.0.0.1", port))
        except TimeoutError:
            c.close()
            break
        held.append(c)
    yield port
    for c in held:
        c.close()
    server.close()


def test_connect_error_names_refused_and_silent_servers(blackhole):
    assert "Connection refused" in connect_error(f"http://127.0.0.1:{free_port()}", 1.0)
    started = time.monotonic()
    assert connect_error(f"http://127.0.0.1:{blackhole}/", 0.5) == f"no answer from 127.0.0.1:{blackhole} within 0.5 s"
    assert time.monotonic() - started < 5
    assert connect_error("sqlite:///mlflow.db", 0.5) is None  # local stores have no server


def test_silent_server_fails_the_job_before_training(dlpipe, blackhole):
    """A server that never answers (dropped packets) is reported after request_timeout_s, not minutes."""
    r = dlpipe("+recipe=smoke", f"tracking.uri=http://127.0.0.1:{blackhole}", "tracking.request_timeout_s=2")
    assert r.returncode == 2, r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.startswith("dlpipe: error: ")]
    assert f"tracking.uri=http://127.0.0.1:{blackhole}: no answer from" in line and "tracking=none" in line
    assert "epoch 1/" not in r.stderr


def test_refused_request_counts_as_unreachable_but_a_rejected_one_does_not(mlflow_store):
    from mlflow.exceptions import RestException

    from dlpipe.tracking.client import client_for

    with pytest.raises(Exception) as refused:
        client_for(f"http://127.0.0.1:{free_port()}", 2, 0).get_experiment_by_name("x")
    assert unreachable(refused.value)
    rejected = RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad key"})
    assert not unreachable(rejected)


class FlakyClient:
    """An MlflowClient that stops answering after `answers` writes, as a server going away does."""

    def __init__(self, client, answers: int):
        self.client, self.answers = client, answers

    def __getattr__(self, name):
        def call(*args, **kwargs):
            if self.answers <= 0:
                raise ConnectionRefusedError(111, "Connection refused")
            self.answers -= 1
            return getattr(self.client, name)(*args, **kwargs)

        return call


def test_outbox_resends_only_what_was_not_delivered(tmp_path, mlflow_client):
    """A send cut short keeps exactly the undelivered entries (in memory and on disk); the next send
    delivers them once, and a torn last line from a kill mid-write is skipped on load."""
    from mlflow.entities import Metric

    exp = mlflow_client.create_experiment("outbox-partial")
    run_id = mlflow_client.create_run(exp).info.run_id
    path = tmp_path / OUTBOX_FILE
    box = Outbox("sqlite:///unused.db", run_id, path)
    box.metrics([Metric("loss", float(i), 0, i) for i in range(2500)])  # three MLflow batches
    box.tags({"t": "1"})
    box.end("FINISHED")
    with pytest.raises(ConnectionRefusedError):
        box.send(FlakyClient(mlflow_client, answers=2))
    assert len(mlflow_client.get_metric_history(run_id, "loss")) == 2000
    reloaded = Outbox.load(path)
    assert reloaded.counts() == {"metrics": 500, "other writes": 2}
    with path.open("a") as f:
        f.write('{"tags": {"half')  # killed while appending
    reloaded = Outbox.load(path)
    assert reloaded.send(mlflow_client) == "FINISHED"
    assert sorted(m.step for m in mlflow_client.get_metric_history(run_id, "loss")) == list(range(2500))
    assert mlflow_client.get_run(run_id).info.status == "FINISHED" and not path.exists()


def start_run(tmp_path: Path, url: str, exp: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A training run of a few seconds an epoch against `url`; its output goes to a file the test reads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_"))}
    env["PYTHONPATH"] = str(TESTS_DIR)
    env.update(NO_PHONE_HOME)
    err = tmp_path / "stderr.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlpipe", "--config-dir", str(TESTS_DIR / "conf"), "model=mlp", "model.in_features=4",
         "dataset=slow", "dataset.size=400", "dataset.delay_s=0.003", "loader.num_workers=0", "trainer.epochs=4",
         "trainer.val_fraction=0", "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}",
         f"tracking.uri={url}", f"tracking.experiment={exp}", "tracking.retry_every_s=1",
         "tracking.request_retries=0", *extra],
        cwd=tmp_path, env=env, stdout=open(err, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    return proc, err


def wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def stop_all(proc: subprocess.Popen, server: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    stop_tree(server)


def test_server_gone_mid_run_loses_nothing(tmp_path):
    """The server is stopped after the first epoch and restarted on the same port: training goes on,
    one warning is printed, and every epoch's metrics reach the run, which ends FINISHED."""
    from mlflow import MlflowClient

    root, port = tmp_path / "server", free_port()
    root.mkdir()
    url = f"http://127.0.0.1:{port}"
    server = start_server(root, port)
    proc, err = start_run(tmp_path, url, "outage")
    try:
        client = MlflowClient(tracking_uri=url)

        def first_epoch_logged():
            assert proc.poll() is None, err.read_text()
            runs = runs_of(client, "outage")
            return runs and "perf/epoch_time_s" in runs[0].data.metrics

        wait_for(first_epoch_logged, proc, "the first epoch's metrics")
        stop_tree(server)
        wait_for(lambda: WARNING in err.read_text() or proc.poll() is not None, proc, "the warning")
        server = start_server(root, port)
        assert proc.wait(timeout=180) == 0, err.read_text()
        [run] = runs_of(client, "outage")  # from the restarted server, before it stops
        assert run.info.status == "FINISHED"
        assert epochs_logged(client, run.info.run_id, "perf/epoch_time_s") == [1, 2, 3, 4]
        assert "sent late" in run.data.tags["dlpipe.tracking_outages"]
    finally:
        stop_all(proc, server)
    text = err.read_text()
    assert text.count(WARNING) == 1, text
    assert "tracking server is back" in text
    assert not (tmp_path / "run" / OUTBOX_FILE).exists()


def test_server_gone_for_good_leaves_an_outbox_that_sync_delivers(tmp_path, dlpipe):
    """The server never returns before the job ends: training finishes, everything is kept in the
    output directory, and `dlpipe sync DIR` delivers it (end status included) once the server is back."""
    from mlflow import MlflowClient

    root, port = tmp_path / "server", free_port()
    root.mkdir()
    url = f"http://127.0.0.1:{port}"
    server = start_server(root, port)
    proc, err = start_run(tmp_path, url, "gone", "tracking.offline_wait_s=1")
    client = MlflowClient(tracking_uri=url)
    try:
        wait_for(lambda: runs_of(client, "gone") and proc.poll() is None, proc, "the run to start")
        stop_tree(server)
        assert proc.wait(timeout=180) == 0, err.read_text()
    finally:
        stop_all(proc, server)
    text = err.read_text()
    assert text.count(WARNING) == 1 and f"dlpipe sync {tmp_path / 'run'}" in text, text
    outbox = tmp_path / "run" / OUTBOX_FILE
    assert outbox.exists()

    r = dlpipe("sync", str(tmp_path / "run"))
    assert r.returncode == 1 and "unreachable" in r.stderr and outbox.exists()  # still down: kept
    server = start_server(root, port)
    try:
        r = dlpipe("sync", str(tmp_path))  # a parent folder works too
        assert r.returncode == 0, r.stderr
        assert "run ended FINISHED" in r.stdout
        [run] = runs_of(client, "gone")
        assert run.info.status == "FINISHED"
        assert epochs_logged(client, run.info.run_id, "perf/epoch_time_s") == [1, 2, 3, 4]
        [given] = client.get_run(run.info.run_id).inputs.dataset_inputs  # val_fraction=0: the train split only
        assert given.tags[0].value == "train"
    finally:
        stop_tree(server)
    assert not outbox.exists()
