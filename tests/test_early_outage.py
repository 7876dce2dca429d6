"""A tracking server that dies in the first seconds of a run: right after the run is created, before
or while its params are logged. Nothing is lost: the params are kept with every other write, and
`dlpipe sync` delivers them all (a reopened run's comparison with its first attempt included)."""

import os
import signal
import socket
import threading

import pytest
from conftest import runs_of
from mlflow_server import free_port, start_server, stop_tree
from test_tracking_faults import Proxy

from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox
from dlpipe.tracking.run import MlflowRun

WARNING = "tracking server unreachable"
HTTP_METHODS = (b"GET ", b"POST ", b"PATCH ", b"DELETE ", b"PUT ")


@pytest.fixture
def server(tmp_path):
    """(process, url, restart) of a real `mlflow server` on 127.0.0.1; stopped by PID at the end."""
    root, port = tmp_path / "server", free_port()
    root.mkdir()
    procs = [start_server(root, port)]

    def restart():
        procs.append(start_server(root, port))

    try:
        yield procs[0], f"http://127.0.0.1:{port}", restart
    finally:
        for proc in procs:
            stop_tree(proc)


def kill_server(proc) -> None:
    """SIGKILL the server's process group (its uvicorn worker too), as the OOM killer would."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


class KilledBetweenParamBatches:
    """The run's MlflowClient, with the server killed right after the first batch of params reached it."""

    def __init__(self, client, server):
        self.client, self.server, self.killed = client, server, False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.client.log_batch(run_id, metrics=metrics, params=params, tags=tags)
        if params and not self.killed:
            self.killed = True
            kill_server(self.server)


PARAMS = {f"group.key_{i:03d}": i for i in range(250)}  # three of MLflow's batches of 100


@pytest.mark.parametrize("when", ["before params", "between param batches"])
def test_params_of_a_run_whose_server_dies_at_its_start_are_kept_and_synced(tmp_path, server, dlpipe, when):
    """The server is SIGKILLed right after the run is created (before its params), or after the first
    of its three params batches: nothing raises, the params not delivered are kept in the outbox with
    the run's other writes and its end, and `dlpipe sync` delivers every one of the 250."""
    from mlflow import MlflowClient

    proc, url, restart = server
    outbox = tmp_path / "run" / OUTBOX_FILE
    run = MlflowRun(url, "early", "early", {}, timeout_s=2, retries=1, outbox_path=outbox, offline_wait_s=0)
    if when == "before params":
        kill_server(proc)
    else:
        run.client = KilledBetweenParamBatches(run.client, proc)
    run.log_params(PARAMS)
    run.log_text("a: 1\n", "config/resolved.yaml")
    run.log_metrics({"loss": 0.5}, step=1)
    run.end("FINISHED")
    assert run.status == "FINISHED, not sent"
    kept = Outbox.load(outbox)
    [params] = [e["params"] for e in kept.entries if "params" in e]
    assert len(params) == (250 if when == "before params" else 150)
    assert kept.entries[-1] == {"end": "FINISHED"}

    restart()
    r = dlpipe("sync", str(tmp_path / "run"))
    assert r.returncode == 0 and "run ended FINISHED" in r.stdout, r.stderr
    synced = MlflowClient(tracking_uri=url).get_run(run.run_id)
    assert synced.data.params == {k: str(v) for k, v in PARAMS.items()}
    assert synced.data.metrics == {"loss": 0.5} and synced.info.status == "FINISHED"
    assert not outbox.exists()


def test_a_reopened_run_whose_server_dies_is_compared_when_its_params_are_delivered(tmp_path, server, dlpipe):
    """A run reopened by a resume, then the server is SIGKILLed: its params are kept whole, and sync
    compares them with the first attempt's then: only new ones are logged, a changed one is tagged
    (MLflow params cannot change: sent blind, it would be refused and stop the delivery)."""
    from mlflow import MlflowClient

    proc, url, restart = server
    first = MlflowRun(url, "resumed", "first", {}, timeout_s=2, retries=1)
    first.log_params({"optim.lr": 0.1, "trainer.epochs": 2})
    first.end("KILLED", "terminated")
    again = MlflowRun(url, "resumed", "first", {}, timeout_s=2, retries=1, resume_run_id=first.run_id,
                      outbox_path=tmp_path / "run" / OUTBOX_FILE, offline_wait_s=0)
    assert again.resumed
    kill_server(proc)
    again.log_params({"optim.lr": 0.1, "trainer.epochs": 4, "loader.num_workers": 2},
                     compared={"dlpipe.resumed_changed_params": ["optim.lr", "trainer.epochs"]})
    again.end("FINISHED")
    [kept] = [e for e in Outbox.load(tmp_path / "run" / OUTBOX_FILE).entries if "params" in e]
    assert kept["compared"] == {"dlpipe.resumed_changed_params": ["optim.lr", "trainer.epochs"]}

    restart()
    r = dlpipe("sync", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    synced = MlflowClient(tracking_uri=url).get_run(first.run_id)
    assert synced.data.params == {"optim.lr": "0.1", "trainer.epochs": "2", "loader.num_workers": "2"}
    assert synced.data.tags["dlpipe.resumed_changed_params"] == "trainer.epochs"
    assert synced.info.status == "FINISHED"


class KillAfterRunCreated(Proxy):
    """A forwarder to the server that SIGKILLs it when the first request after the run's creation
    comes (the run's params, in a training job), and closes: that request is never answered, and
    every later connect is refused, as from a dead server."""

    def __init__(self, target_url: str, server):
        super().__init__(target_url)
        self.server, self.created, self.killed = server, False, threading.Event()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: the server is dead
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # killed meanwhile: this connect is refused too
                client.close()
                return
            self.sockets += [client, upstream]
            creating = threading.Event()
            threading.Thread(target=self._requests, args=(client, upstream, creating), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client, creating), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, creating: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                if self.created and data.startswith(HTTP_METHODS):
                    kill_server(self.server)
                    self.killed.set()
                    self.stop()
                    return
                if b"/runs/create" in data:
                    creating.set()
                upstream.sendall(data)
        except OSError:
            return  # stop() closed it

    def _answers(self, upstream: socket.socket, client: socket.socket, creating: threading.Event) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
                if creating.is_set():
                    self.created = True  # the run exists: the next request finds the server dead
            client.shutdown(socket.SHUT_WR)
        except OSError:
            return


JOB = ["+recipe=smoke", "trainer.progress=false", "trainer.epochs=2", "tracking.experiment=early-cli"]


def test_a_job_whose_server_dies_right_after_its_run_is_created_trains_and_sync_delivers_every_param(
        tmp_path, server, dlpipe):
    """A real job whose server is SIGKILLed at its first request after the run's creation (its params):
    it trains on and exits 0, says so in one warning and no urllib3 "Retrying" line (stderr and its
    dlpipe.log), keeps everything, and `dlpipe sync` delivers every param a job logs (counted against
    the same job against a SQLite store) with every epoch and its end."""
    from mlflow import MlflowClient

    proc, url, restart = server
    proxy = KillAfterRunCreated(url, proc)
    proxy.start()
    try:
        r = dlpipe(*JOB, f"tracking.uri=http://{proxy.url}", "tracking.offline_wait_s=1", "hydra.run.dir=run")
    finally:
        proxy.stop()
    assert proxy.killed.is_set()
    assert r.returncode == 0, r.stderr
    printed, log = r.stdout + r.stderr, (tmp_path / "run" / "dlpipe.log").read_text()
    for text in (printed, log):
        assert text.count(WARNING) == 1 and "Retrying" not in text and "Traceback" not in text, text
    assert f"dlpipe sync {tmp_path / 'run'}" in printed
    kept = Outbox.load(tmp_path / "run" / OUTBOX_FILE)
    assert kept.entries[-1] == {"end": "FINISHED"}

    control = dlpipe(*JOB, f"tracking.uri=sqlite:///{tmp_path / 'control.db'}", "hydra.run.dir=control")
    assert control.returncode == 0, control.stderr
    [expected] = runs_of(MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'control.db'}"), "early-cli")

    restart()
    r = dlpipe("sync", str(tmp_path / "run"), "--uri", url)
    assert r.returncode == 0 and "run ended FINISHED" in r.stdout, r.stderr
    client = MlflowClient(tracking_uri=url)
    [run] = runs_of(client, "early-cli")
    assert run.info.status == "FINISHED"
    assert sorted(run.data.params) == sorted(expected.data.params) and len(run.data.params) > 50
    [sent] = [e["params"] for e in kept.entries if "params" in e]
    assert {k: run.data.params[k] for k in sent} == sent  # every kept value, as it was kept
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "epoch")) == \
        sorted(m.step for m in MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'control.db'}")
               .get_metric_history(expected.info.run_id, "epoch"))
    assert not (tmp_path / "run" / OUTBOX_FILE).exists()
