"""Tracking under real faults: jobs opening a new SQLite store at once, jobs killed with SIGKILL
(before their first checkpoint; during a server outage, then `dlpipe sync` over broken outboxes),
reopened runs, and credentials given on the command line, in a config file and in the environment."""

import fcntl
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR, epochs_logged, runs_of
from mlflow_server import free_port, start_server, stop_tree
from test_tracking_outage import wait_for

from dlpipe.tracking.abandoned import MARKER_FILE, Owner
from dlpipe.tracking.client import client_for
from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox
from dlpipe.tracking.run import MlflowRun
from dlpipe.tracking.sidecar import MODULE as SIDECAR_MODULE
from dlpipe.tracking.sidecar import ORPHANED
from dlpipe.tracking.store_lock import store_opening

pytestmark = pytest.mark.integration  # starts dlpipe, mlflow or torchrun: the slow tier

WARNING = "tracking server unreachable"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, store folder) of a real `mlflow server` on 127.0.0.1, stopped when the module ends."""
    root = tmp_path_factory.mktemp("server")
    try:
        proc = start_server(root, port := free_port())
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield f"http://127.0.0.1:{port}", root
    finally:
        stop_tree(proc)


class Proxy:
    """A TCP forwarder from 127.0.0.1:port to the server: stop() closes it and every connection
    through it (to a client, the server went away: refused connects, reset requests); start()
    opens it again on the same port (the server is back)."""

    def __init__(self, target_url: str):
        self.target = int(target_url.rsplit(":", 1)[1])
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.sockets: list[socket.socket] = []

    def start(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self.sockets.append(listener)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked in accept/recv on it
            except OSError:
                continue  # the peer closed it already; nothing left to wake
            finally:
                s.close()
        self.sockets = []

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stop() closed the listener
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # pass the end of the stream on
        except OSError:
            return  # stop() closed one side: the connection is gone, as intended


def spawn(cwd: Path, log: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """The real CLI in the background, its output in `log`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_"))}
    full_env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "dlpipe", *args], cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def kill(proc: subprocess.Popen, tracker: psutil.Process | None = None) -> None:
    """SIGKILL a dlpipe process; with `tracker` (tracking_process) both at once, as the OOM killer
    or a torn-down cgroup does: the job is frozen first, so it cannot see its tracking process die
    and start an outbox (it did, 1 run in ~40 on a loaded CI machine), then the tracker, then the job."""
    if tracker is not None and proc.poll() is None:
        proc.send_signal(signal.SIGSTOP)
    if tracker is not None and tracker.is_running():
        tracker.kill()
        # Dead is enough: a zombie is reaped by the training process only when it next talks to it
        # (psutil's wait would wait for that, an epoch later).
        wait_for(lambda: _dead(tracker), None, "the tracking process to die")
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def _dead(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def tracking_process(proc: subprocess.Popen) -> psutil.Process:
    """The tracking process (tracking.sidecar) of a running dlpipe job, once it has started it."""
    found: list[psutil.Process] = []

    def started() -> bool:
        found[:] = [c for c in psutil.Process(proc.pid).children() if SIDECAR_MODULE in c.cmdline()]
        return bool(found) or proc.poll() is not None

    wait_for(started, proc, "the tracking process")
    assert found, "the job ended before it started a tracking process"
    return found[0]


# -- 1. concurrent first use of a SQLite store ------------------------------------------------


def test_store_lock_is_held_while_a_client_opens_the_store(tmp_path):
    """client_for waits for `<db>.lock`: while the test holds it, a thread opening the store is
    blocked in flock (the kernel lists it as waiting) and the database is not created; released,
    the thread creates it. Other stores take no lock."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    fd = os.open(tmp_path / "mlflow.db.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    opened = []
    thread = threading.Thread(target=lambda: opened.append(client_for(uri, 5, 0)), daemon=True)
    try:
        thread.start()
        inode = os.fstat(fd).st_ino
        wait_for(lambda: _waiting_on(inode), None, "the thread to wait for the lock")
        assert not db.exists() and not opened
    finally:
        os.close(fd)  # releases the lock
    thread.join(timeout=120)
    assert opened and db.exists()
    with store_opening(uri):  # the lock is taken only inside the block
        probe = os.open(tmp_path / "mlflow.db.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(probe)
    with store_opening("http://127.0.0.1:1"):
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]


def _waiting_on(inode: int) -> bool:
    """True when /proc/locks shows a process blocked on a flock of `inode` (a '->' line)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return any("->" in line and "FLOCK" in line and line.split()[-3].endswith(f":{inode}") for line in lines)


def test_jobs_started_at_once_on_a_new_store_all_run(tmp_path):
    """Three real jobs started together in an empty folder share the default SQLite store: every
    one starts (no schema-migration race) and ends FINISHED."""
    procs = [spawn(tmp_path, tmp_path / f"r{i}.txt", "+recipe=tabular", "dataset.size=256", "trainer.epochs=1",
                   "loader.num_workers=0", "trainer.progress=false", f"hydra.run.dir=r{i}") for i in range(3)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            kill(p)
    assert codes == [0, 0, 0], [(tmp_path / f"r{i}.txt").read_text()[-2000:] for i in range(3)]
    client = client_for(f"sqlite:///{tmp_path / 'mlflow.db'}", 10, 0)
    assert sorted(r.info.status for r in runs_of(client, "dlpipe")) == ["FINISHED"] * 3


# -- 4. runs whose process was killed --------------------------------------------------------


def test_owner_gone_or_alive():
    """A reaped process is gone; this one is alive; a reused pid (other start time) is not the
    owner; another host cannot be checked and is said to be."""
    me = Owner.this_process()
    assert "is gone" in Owner(**gone_owner()).gone()
    assert me.gone() is None
    assert "is gone" in Owner(me.host, me.pid, me.started - 100).gone()
    assert "ran on host elsewhere, which cannot be checked" in Owner("elsewhere", me.pid, me.started).gone()


def test_a_training_process_killed_outright_has_its_run_ended_by_its_tracking_process(tmp_path):
    """SIGKILL of the training process after its first epoch (with DataLoader workers, which inherit
    the pipe): its tracking process sees the pipe close, ends the run KILLED with the reason, keeps
    the epoch it was sent, and exits. Nothing is left RUNNING, nothing waits for a later job."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = spawn(tmp_path, tmp_path / "job.txt", "--config-dir", str(TESTS_DIR / "conf"), "dataset=slow",
                "dataset.size=400", "dataset.delay_s=0.005", "model=mlp", "model.in_features=4",
                "loader.num_workers=1", "loader.persistent_workers=true", "trainer.progress=false",
                "trainer.epochs=50", "trainer.val_fraction=0", f"tracking.uri={store}", "tracking.experiment=k",
                "hydra.run.dir=out")
    try:
        tracker = tracking_process(job)
        wait_for(lambda: (tmp_path / "out" / "checkpoints" / "epoch-0001.pt").exists() or job.poll() is not None,
                 job, "epoch 1")
        assert job.poll() is None, (tmp_path / "job.txt").read_text()
    finally:
        kill(job)
    tracker.wait(timeout=60)  # it ended the run and exited by itself
    [run] = runs_of(client_for(store, 10, 0), "k")
    assert run.info.status == "KILLED"
    assert run.data.tags["dlpipe.end_reason"] == ORPHANED
    assert 1 in epochs_logged(client_for(store, 10, 0), run.info.run_id, "perf/epoch_time_s")
    assert json.loads((tmp_path / "out" / MARKER_FILE).read_text())["pid"] == tracker.pid


def test_rerun_ends_the_run_a_killed_job_left_running(tmp_path):
    """A job whose training and tracking processes are both SIGKILLed before its first checkpoint
    (the OOM killer, a node's cgroup torn down) leaves its run RUNNING; the next job in the same
    output folder ends it KILLED (tagged as found abandoned) and trains in a new run."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["--config-dir", str(TESTS_DIR / "conf"), "dataset=slow", "model=mlp", "model.in_features=4",
              "loader.num_workers=0", "trainer.progress=false", "trainer.epochs=1", "trainer.val_fraction=0",
              f"tracking.uri={store}", "tracking.experiment=abandoned", "hydra.run.dir=out"]
    first = spawn(tmp_path, tmp_path / "first.txt", *common, "dataset.size=4000", "dataset.delay_s=0.01")
    try:
        tracker = tracking_process(first)
        wait_for(lambda: (tmp_path / "out" / MARKER_FILE).exists() or first.poll() is not None, first, "the run")
        assert first.poll() is None, (tmp_path / "first.txt").read_text()
    finally:
        kill(first, tracker)
    assert not list((tmp_path / "out").glob("checkpoints/*.pt"))  # killed before its first checkpoint
    again = spawn(tmp_path, tmp_path / "again.txt", *common, "dataset.size=40", "dataset.delay_s=0")
    try:
        assert again.wait(timeout=300) == 0, (tmp_path / "again.txt").read_text()
    finally:
        kill(again)
    assert "was left RUNNING" in (tmp_path / "again.txt").read_text()
    runs = {r.info.status: r for r in runs_of(client_for(store, 10, 0), "abandoned")}
    assert sorted(runs) == ["FINISHED", "KILLED"]
    # the marker names the process that kept the run: the tracking process
    assert runs["KILLED"].data.tags["dlpipe.end_reason"].startswith(f"found abandoned: its process {tracker.pid} ")
    assert json.loads((tmp_path / "out" / MARKER_FILE).read_text())["run_id"] == runs["FINISHED"].info.run_id


def test_sync_ends_a_run_killed_during_an_outage_and_survives_broken_outboxes(tmp_path, server, dlpipe):
    """A job with a password in tracking.uri loses its server (a proxy that closes) and is SIGKILLed
    with its writes in the outbox. `dlpipe sync` of the sweep folder (an empty outbox, a torn one,
    one of a deleted run, one whose process still runs, then the killed job's) reports each broken
    one in one line, delivers the job's metrics, ends its run KILLED as found abandoned and exits
    1. The password is never printed, logged or written outside Hydra's record of the command."""
    url, _ = server
    client = client_for(url, 10, 0)
    proxy = Proxy(url)
    proxy.start()
    job_dir, log = tmp_path / "sweep" / "9", tmp_path / "job.txt"
    job = spawn(tmp_path, log, "--config-dir", str(TESTS_DIR / "conf"), "dataset=slow", "dataset.size=400",
                "dataset.delay_s=0.005", "model=mlp", "model.in_features=4", "loader.num_workers=0",
                "trainer.epochs=20", "trainer.val_fraction=0", "trainer.progress=false", f"hydra.run.dir={job_dir}",
                f"tracking.uri=http://carol:OUTAGEPW@{proxy.url}", "tracking.experiment=killed-offline",
                "tracking.request_retries=0", "tracking.retry_every_s=1")
    outbox = job_dir / OUTBOX_FILE
    try:
        wait_for(lambda: (job_dir / "checkpoints" / "epoch-0001.pt").exists() or job.poll() is not None, job, "epoch 1")
        proxy.stop()
        # An epoch's end reached the outbox (epoch 1's too may have, if it was in flight at the stop)
        wait_for(lambda: _kept_steps(outbox, "perf/epoch_time_s") or job.poll() is not None, job,
                 "an epoch's metrics kept in the outbox")
        assert job.poll() is None, log.read_text()
        tracker = tracking_process(job)
    finally:
        kill(job, tracker)  # both: a training process killed alone has its run ended by the other
    kept_epochs = _kept_steps(outbox, "perf/epoch_time_s")
    assert "end" not in outbox.read_text() and stat.S_IMODE(outbox.stat().st_mode) == 0o600
    broken = _broken_outboxes(tmp_path / "sweep", client, f"http://{proxy.url}")

    down = dlpipe("sync", str(job_dir))  # the server is still away: kept, and the missing password named
    assert down.returncode == 1 and "unreachable" in down.stderr and "MLFLOW_TRACKING_PASSWORD" in down.stderr
    proxy.start()
    try:
        r = dlpipe("sync", str(tmp_path / "sweep"), env={"MLFLOW_TRACKING_PASSWORD": "OUTAGEPW"})
    finally:
        proxy.stop()
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe sync: error: ")]
    assert len(errors) == 5 and errors[-1].endswith("4 of 5 outboxes not done (see above)"), r.stderr
    assert "1/mlflow_outbox.jsonl: unreadable" in errors[0] and "2/mlflow_outbox.jsonl: unreadable" in errors[1]
    assert broken["deleted"] in errors[2] and f"process {os.getpid()} still writes it" in errors[3]
    [run] = runs_of(client, "killed-offline")
    assert run.info.status == "KILLED", r.stdout
    assert run.data.tags["dlpipe.end_reason"].startswith(f"found abandoned: its process {tracker.pid} ")
    # every epoch end the outbox kept is delivered, beside epoch 1's, sent before or kept
    assert kept_epochs <= {m.step for m in client.get_metric_history(run.info.run_id, "perf/epoch_time_s")}
    assert 1 in epochs_logged(client, run.info.run_id, "perf/epoch_time_s")
    assert not outbox.exists() and all((tmp_path / "sweep" / str(i) / OUTBOX_FILE).exists() for i in range(1, 5))
    alive = client.get_run(broken["alive"])  # left to the process that still writes it: sending would race it
    assert alive.info.status == "RUNNING" and "t" not in alive.data.tags
    printed = log.read_text() + down.stdout + down.stderr + r.stdout + r.stderr
    assert WARNING in log.read_text() and "carol:***@" in log.read_text()
    assert "OUTAGEPW" not in printed + _files_text(job_dir)


def test_a_training_process_killed_alone_during_an_outage_has_its_end_kept_for_sync(tmp_path, server, dlpipe):
    """The server goes away after epoch 1, then the training process alone is SIGKILLed: its tracking
    process waits tracking.offline_wait_s, leaves the run's end (KILLED, with the reason) in the outbox
    after the metrics it was sent, and exits; `dlpipe sync` delivers both, and the run ends as the
    tracking process said, not as found abandoned."""
    url, _ = server
    client = client_for(url, 10, 0)
    proxy = Proxy(url)
    proxy.start()
    job_dir, log = tmp_path / "job", tmp_path / "job.txt"
    job = spawn(tmp_path, log, "--config-dir", str(TESTS_DIR / "conf"), "dataset=slow", "dataset.size=400",
                "dataset.delay_s=0.005", "model=mlp", "model.in_features=4", "loader.num_workers=0",
                "trainer.epochs=20", "trainer.val_fraction=0", "trainer.progress=false", f"hydra.run.dir={job_dir}",
                f"tracking.uri=http://{proxy.url}", "tracking.experiment=killed-alone-offline",
                "tracking.request_retries=0", "tracking.retry_every_s=1", "tracking.offline_wait_s=1")
    outbox = job_dir / OUTBOX_FILE
    try:
        tracker = tracking_process(job)
        wait_for(lambda: (job_dir / "checkpoints" / "epoch-0001.pt").exists() or job.poll() is not None, job, "epoch 1")
        proxy.stop()
        # the tracking process keeps the metrics and then relays its warning, which training logs:
        # killed before the relay arrives, training never logs it (it did, once in CI)
        wait_for(lambda: (_kept_metrics(outbox) and "tracking server unreachable" in log.read_text())
                 or job.poll() is not None, job, "metrics kept in the outbox and the warning logged")
        assert job.poll() is None, log.read_text()
    finally:
        kill(job)
    tracker.wait(timeout=120)  # it waited for the server, then left the end in the outbox
    kept = [json.loads(line) for line in outbox.read_text().splitlines()[1:]]
    assert kept[-1]["end"] == "KILLED" and any(ORPHANED in json.dumps(e) for e in kept), kept
    proxy.start()
    try:
        r = dlpipe("sync", str(job_dir))
    finally:
        proxy.stop()
    assert r.returncode == 0, r.stderr
    [run] = runs_of(client, "killed-alone-offline")
    assert run.info.status == "KILLED" and run.data.tags["dlpipe.end_reason"] == ORPHANED
    assert 1 in epochs_logged(client, run.info.run_id, "perf/epoch_time_s")
    assert not outbox.exists()
    assert "tracking server unreachable" in log.read_text()  # the tracking process's warning, logged by training


def _kept_metrics(outbox: Path) -> bool:
    return outbox.exists() and '"metrics"' in outbox.read_text()


def _kept_steps(outbox: Path, key: str) -> set[int]:
    """The steps of `key` that the outbox holds, read as `dlpipe sync` reads it (Outbox.load skips
    a last line the job is still writing)."""
    if not outbox.exists() or not outbox.stat().st_size:
        return set()
    return {step for entry in Outbox.load(outbox).entries for name, _, _, step in entry.get("metrics", [])
            if name == key}


def _broken_outboxes(sweep: Path, client, url: str) -> dict[str, str]:
    """sweep/1 empty, sweep/2 a torn first line, sweep/3 a deleted run's, sweep/4 a run whose
    process (this one) still runs; returns the run ids of the last two."""
    for i in range(1, 5):
        (sweep / str(i)).mkdir(parents=True)
    (sweep / "1" / OUTBOX_FILE).write_text("")
    (sweep / "2" / OUTBOX_FILE).write_text('{"uri": "http://127.0.0.1:1", "run_')
    exp = client.create_experiment("broken-outboxes")
    deleted, alive = (client.create_run(exp).info.run_id for _ in range(2))
    client.delete_run(deleted)
    Outbox(url, deleted, sweep / "3" / OUTBOX_FILE).tags({"t": "1"})
    Outbox(url, alive, sweep / "4" / OUTBOX_FILE, owner=asdict(Owner.this_process())).tags({"t": "1"})
    return {"deleted": deleted, "alive": alive}


def _files_text(folder: Path, skip: str = ".hydra") -> str:
    """Every file under `folder` (but `skip`, Hydra's record of the command line), as text."""
    return "".join(p.read_bytes().decode(errors="replace") for p in folder.rglob("*")
                   if p.is_file() and skip not in p.relative_to(folder).parts)


# -- 5 and 8: reopened runs ------------------------------------------------------------------


def test_reopened_run_logs_no_step_twice_and_forgets_its_end_reason(mlflow_store, mlflow_client):
    """Reopening a run (a resume from an older checkpoint) keeps the values already logged for each
    (metric, step), clears the previous attempt's end reason, and compares only the given keys."""
    with pytest.raises(KeyboardInterrupt):
        with MlflowRun(mlflow_store, "reopened", "r", {}) as first:
            first.log_params({"optim.lr": "0.1", "loader.num_workers": "2", "mem.available_gb": "3.0"})
            for step in (1, 2, 3):
                first.log_metrics({"loss": float(step), "acc": 0.5}, step=step)
            raise KeyboardInterrupt
    run_id = first.run_id
    assert "Ctrl-C" in mlflow_client.get_run(run_id).data.tags["dlpipe.end_reason"]
    with MlflowRun(mlflow_store, "reopened", "r", {}, resume_run_id=run_id) as again:
        assert again.resumed
        assert "dlpipe.end_reason" not in mlflow_client.get_run(run_id).data.tags
        again.log_params({"optim.lr": "0.2", "loader.num_workers": "1", "mem.available_gb": "5.0"},
                         compared={"dlpipe.resumed_changed_params": ["optim.lr"],
                                   "dlpipe.resumed_loader_changes": ["loader.num_workers"]})
        for step in (2, 3, 4):  # resumed from the checkpoint of step 1
            again.log_metrics({"loss": 10.0 * step, "acc": 0.9}, step=step)
    stored = mlflow_client.get_run(run_id)
    assert stored.info.status == "FINISHED" and "dlpipe.end_reason" not in stored.data.tags
    assert stored.data.tags["dlpipe.resumed_changed_params"] == "optim.lr"
    assert stored.data.tags["dlpipe.resumed_loader_changes"] == "loader.num_workers"
    loss = sorted((m.step, m.value) for m in mlflow_client.get_metric_history(run_id, "loss"))
    assert loss == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert sorted(m.step for m in mlflow_client.get_metric_history(run_id, "acc")) == [1, 2, 3, 4]


def gone_owner() -> dict:
    """The record of a process on this host that has exited."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return asdict(Owner(socket.gethostname(), int(done.stdout), Owner.this_process().started))


def test_an_earlier_runs_or_unreadable_outbox_is_moved_aside_never_mixed(tmp_path, mlflow_store, mlflow_client):
    """A job in a folder whose outbox holds another run's writes moves it aside for `dlpipe sync`
    (mlflow_outbox.<run id>.jsonl) instead of appending its own under that run's head; an empty one
    (its write failed on a full disk) is moved aside too, and the run still opens and ends."""
    from dlpipe.tasks.sync import outboxes

    earlier = Outbox(mlflow_store, "0123abcd", tmp_path / OUTBOX_FILE)
    earlier.tags({"k": "v"})
    earlier.end("FINISHED")
    with MlflowRun(mlflow_store, "aside", "r", {}, outbox_path=tmp_path / OUTBOX_FILE) as run:
        assert not (tmp_path / OUTBOX_FILE).exists() and run.outbox.entries == []
        run.outbox.tags({"mine": "1"})  # what an outage would keep
    aside = tmp_path / "mlflow_outbox.0123abcd.jsonl"
    assert Outbox.load(aside).run_id == "0123abcd" and Outbox.load(aside).entries[-1] == {"end": "FINISHED"}
    assert Outbox.load(tmp_path / OUTBOX_FILE).run_id == run.run_id
    assert outboxes([tmp_path]) == sorted([aside, tmp_path / OUTBOX_FILE])  # sync delivers both

    (tmp_path / OUTBOX_FILE).write_text("")
    with MlflowRun(mlflow_store, "aside", "r2", {}, outbox_path=tmp_path / OUTBOX_FILE) as second:
        pass
    assert tmp_path / "mlflow_outbox.unreadable-1.jsonl" in outboxes([tmp_path])  # sync still finds and names it
    assert mlflow_client.get_run(second.run_id).info.status == "FINISHED"


def test_a_resume_whose_run_cannot_be_reopened_still_ends_it(tmp_path, mlflow_store, mlflow_client):
    """The checkpoint names a run of another experiment, left RUNNING by a killed job: a new run
    starts, and the old one is ended as found abandoned rather than spared as the one resumed."""
    old = MlflowRun(mlflow_store, "reopen-elsewhere", "old", {})
    (tmp_path / MARKER_FILE).write_text(json.dumps({"run_id": old.run_id, "uri": old.outbox.uri, **gone_owner()}))
    with MlflowRun(mlflow_store, "reopen-here", "new", {}, resume_run_id=old.run_id, marker_dir=tmp_path) as new:
        assert not new.resumed and new.run_id != old.run_id
    ended = mlflow_client.get_run(old.run_id)
    assert ended.info.status == "KILLED" and ended.data.tags["dlpipe.end_reason"].startswith("found abandoned")


def test_sync_leaves_a_run_of_another_host_running(mlflow_store, mlflow_client):
    """`dlpipe sync` on a login node must not end the runs of jobs still running on compute nodes."""
    from dlpipe.tracking.abandoned import end_if_abandoned

    run = MlflowRun(mlflow_store, "other-host", "r", {})
    owner = Owner("compute-node-7", 4242, 0.0)
    status, found = end_if_abandoned(run.client, run.run_id, owner, other_hosts=False)
    assert status == "RUNNING" and "host compute-node-7: run `dlpipe sync` there" in found
    assert mlflow_client.get_run(run.run_id).info.status == "RUNNING"
    assert end_if_abandoned(run.client, run.run_id, owner)[0] == "KILLED"  # a rerun in its folder ends it


def test_files_in_the_output_folder_name_the_store_absolutely(tmp_path, monkeypatch):
    """A relative sqlite:///mlflow.db is recorded as an absolute path: `dlpipe sync` from any folder finds it."""
    from dlpipe.tracking.store_lock import absolute_uri

    monkeypatch.chdir(tmp_path)
    assert absolute_uri("sqlite:///mlflow.db?timeout=5") == f"sqlite:///{tmp_path}/mlflow.db?timeout=5"
    assert absolute_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert absolute_uri("http://u:p@h:5000") == "http://u:p@h:5000"
    with MlflowRun("sqlite:///mlflow.db", "absolute", "r", {}, marker_dir=tmp_path) as run:
        pass
    assert json.loads((tmp_path / MARKER_FILE).read_text())["uri"] == f"sqlite:///{tmp_path}/mlflow.db"
    assert run.outbox.head()["uri"] == f"sqlite:///{tmp_path}/mlflow.db"


# -- 2. secrets ------------------------------------------------------------------------------


def test_credentials_from_every_source_stay_out_of_everything_recorded(tmp_path, server, dlpipe):
    """A token on the command line, a URI password in a config file, a password in a run name and
    one in MLFLOW_TRACKING_URI: none reaches the server's store or artifacts, the output folder
    (Hydra's .hydra record aside: it keeps the command line, see docs/configuration.md) or the printed output."""
    url, root = server
    conf = tmp_path / "conf" / "dataset"
    conf.mkdir(parents=True)
    (conf / "remote.yaml").write_text("_target_: faulty_data.TokenizedDataset\nsize: 32\n"
                                      "mirror: https://me:FILEPW77@data.example/x\n")
    env_uri = url.replace("http://", "http://alice:ENVPW999@")
    r = dlpipe("--config-dir", str(tmp_path / "conf"), "dataset=remote", "model=mlp", "model.in_features=4",
               "+dataset.api_token=SECRET123", "tracking.run_name=http://bob:hunter2@x", "trainer.epochs=1",
               "trainer.progress=false", "tracking.experiment=credentials", "hydra.run.dir=out",
               env={"MLFLOW_TRACKING_URI": env_uri})
    assert r.returncode == 0, r.stderr
    [run] = runs_of(client_for(url, 10, 0), "credentials")
    assert run.info.run_name == "http://bob:***@x"
    assert "+dataset.api_token=***" in run.data.tags["dlpipe.overrides"]
    secrets = ("SECRET123", "FILEPW77", "hunter2", "ENVPW999")
    recorded = _files_text(root) + _files_text(tmp_path / "out") + r.stdout + r.stderr
    assert (tmp_path / "out" / "dlpipe.log").exists()
    assert [s for s in secrets if s in recorded] == []
    # an environment variable reaches Hydra's record as the ${oc.env:...} it was composed from
    assert "ENVPW999" not in _files_text(tmp_path / "out", skip="no folder is called this")
