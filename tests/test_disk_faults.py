"""Full and unwritable disks for real: read-only tmpfs mounts, /proc, a file where a folder should
be, and small tmpfs mounts that fill up mid-run under the checkpoints and under the SQLite store.

`FillDisk` is a user callback (the real `callbacks` mechanism) that fills a disk at the end of an
epoch, so the next write to it fails as a disk that filled up during training does.
"""

import errno
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from conftest import epochs_logged, runs_of

from dlpipe.errors import ConfigError
from dlpipe.machine import disk
from dlpipe.tasks.writable import check_writable, hydra_output_error
from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox, unreachable
from dlpipe.tracking.store_lock import sqlite_path
from dlpipe.training.checkpoint import CheckpointError, CheckpointStore, load, save_atomic

FILLER = "filler.bin"
TABULAR = ("+recipe=tabular", "dataset.size=256", "loader.num_workers=0")


def fill(folder: Path) -> Path:
    """Write zeros into folder/filler.bin until the disk is full; return the file."""
    path = Path(folder) / FILLER
    chunk = b"\0" * 65536
    with open(path, "ab", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as e:
                if e.errno not in disk.DISK_FULL:
                    raise
                if len(chunk) == 1:
                    return path
                chunk = chunk[: len(chunk) // 2]  # the last pages, down to the last byte


class FillDisk:
    """A training callback that fills the disk holding `path` at the end of epoch `after`."""

    def __init__(self, path: str, after: int = 1):
        self.path, self.after = Path(path), after

    def on_epoch_end(self, trainer, epoch: int, metrics: dict) -> None:
        if epoch == self.after:
            fill(self.path)


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, *options) -> a fresh tmpfs folder of that size; every mount is undone at the end.
    Only the tests that mount need root: the others run anywhere."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def mount(size: str, *options: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(target)],
                       check=True)
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", str(target)], check=True)


def callback(path: Path, after: int = 1) -> list[str]:
    return [f"+callbacks.fill._target_={__name__}.FillDisk", f"+callbacks.fill.path={path}",
            f"+callbacks.fill.after={after}"]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dlpipe: error: ")]


# --- pre-flight: every folder a job writes, probed before anything is built ----------------------


def test_unwritable_names_why_and_leaves_nothing_behind(tmpfs, tmp_path):
    ro = tmpfs("1m", "ro")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    full = tmpfs("64k")
    fill(full)
    assert disk.unwritable(ro) == "Read-only file system"
    assert disk.unwritable(ro / "new" / "checkpoints") == f"{ro}: Read-only file system"
    assert disk.unwritable(Path("/proc/dlpipe")) == "/proc: a virtual file system without storage"
    assert disk.unwritable(a_file) == "it exists and is not a folder"
    assert disk.unwritable(a_file / "sub") == f"{a_file} is not a folder"
    assert disk.unwritable(full).startswith(f"{full}: no space left (0 B free of 64.0 KiB)")
    before = sorted(tmp_path.rglob("*"))
    assert disk.unwritable(tmp_path / "new" / "deeper") is None
    assert sorted(tmp_path.rglob("*")) == before  # no probe file, no folder made


class Ctx:
    """What check_writable reads of a tasks.preflight.JobContext."""

    def __init__(self, output_dir: Path, multirun: bool = False):
        self.output_dir, self.multirun = output_dir, multirun


def resolved(task: str = "train", checkpoint_dir=None, enabled: bool = True, uri: str = "http://127.0.0.1:5000"):
    return {"task": task, "checkpoint": {"enabled": enabled, "dir": checkpoint_dir and str(checkpoint_dir)},
            "bench": {"output_dir": "tuned"}, "tracking": {"enabled": True, "uri": uri}}


def test_check_writable_names_each_key_once(tmpfs, tmp_path):
    ro = tmpfs("1m", "ro")
    check_writable(Ctx(tmp_path / "out"), resolved())  # all writable: no error
    with pytest.raises(ConfigError) as err:
        check_writable(Ctx(tmp_path / "out"), resolved(checkpoint_dir=ro / "ck", uri=f"sqlite:///{ro}/m.db"))
    assert err.value.problems == [
        f"checkpoint.dir={ro}/ck: cannot write there ({ro}: Read-only file system); point checkpoint.dir at a "
        "writable folder, or set checkpoint.enabled=false",
        f"tracking.uri=sqlite:///{ro}/m.db: cannot write there (Read-only file system); point tracking.uri at a "
        "writable place, or use tracking=none",
    ]
    # the default checkpoint folder lies inside the output folder: named once, under the output's key
    with pytest.raises(ConfigError) as err:
        check_writable(Ctx(ro / "out", multirun=True), resolved())
    [line] = err.value.problems
    assert line.startswith(f"hydra.sweep.dir={ro}/out: cannot write there ({ro}: Read-only file system)")
    # checkpoints only when a training job writes them
    check_writable(Ctx(tmp_path / "out"), resolved(checkpoint_dir=ro, enabled=False))
    check_writable(Ctx(tmp_path / "out"), resolved(task="bench", checkpoint_dir=ro))


def test_sqlite_path_of_a_tracking_uri():
    assert sqlite_path("sqlite:///mlflow.db") == Path("mlflow.db")
    assert sqlite_path("sqlite:////abs/m.db?timeout=5") == Path("/abs/m.db")
    assert sqlite_path("http://127.0.0.1:5000") is None
    assert sqlite_path("sqlite://") is None


def test_hydra_output_error_only_for_hydras_own_writes(tmpfs, tmp_path):
    from hydra.core.utils import _save_config
    from omegaconf import OmegaConf

    ro = tmpfs("1m", "ro")
    with pytest.raises(OSError) as hydras:
        _save_config(OmegaConf.create({}), "config.yaml", ro / "run" / ".hydra")  # before dlpipe's code runs
    assert hydra_output_error(hydras.value, ["hydra.run.dir=x/run"]) == (
        f"hydra.run.dir=x/run: cannot write there ({ro}: Read-only file system); pick a writable folder with "
        "hydra.run.dir=DIR")
    with pytest.raises(OSError) as inside:
        Outbox.load(tmp_path / "missing.jsonl")  # raised by dlpipe's own code: not Hydra's set-up
    assert hydra_output_error(inside.value, []) is None
    assert hydra_output_error(ValueError("x"), []) is None


@pytest.mark.parametrize("where", ["checkpoint.dir", "hydra.run.dir", "hydra.sweep.dir"])
def test_cli_refuses_an_unwritable_folder_before_building_anything(dlpipe, tmpfs, tmp_path, mlflow_store,
                                                                   mlflow_client, where):
    """A sweep's folder too: Hydra stops before any job, and no parent run is left behind."""
    ro = tmpfs("1m", "ro")
    sweep = ["--multirun"] if where == "hydra.sweep.dir" else []
    r = dlpipe(*sweep, *TABULAR, f"{where}={ro}/job", f"tracking.uri={mlflow_store}",
               "tracking.experiment=disk-preflight")
    assert r.returncode == 2, r.stderr
    assert errors(r.stderr) == [f"dlpipe: error: {where}={ro}/job: cannot write there ({ro}: Read-only file system); "
                                + ("point checkpoint.dir at a writable folder, or set checkpoint.enabled=false"
                                   if where == "checkpoint.dir" else f"pick a writable folder with {where}=DIR")]
    assert "Traceback" not in r.stderr and "epoch 1/" not in r.stderr
    assert not (tmp_path / "outputs").exists()  # Hydra's half-made output folder is removed
    assert runs_of(mlflow_client, "disk-preflight") == []


# --- a checkpoint disk that fills up mid-run ------------------------------------------------------


def test_full_disk_keeps_the_last_good_checkpoint(tmpfs):
    import torch

    folder = tmpfs("1m")
    store = CheckpointStore(folder, keep_last=2, monitor="val_loss")
    first = {"w": torch.arange(20000.0), "epoch": 1}  # 80 KB: a few fit, then the disk is filled
    store.save(first, 1, {"val_loss": 1.0})
    fill(folder)
    with pytest.raises(CheckpointError) as err:
        store.save({"w": torch.zeros(20000), "epoch": 2}, 2, {"val_loss": 0.5})
    assert str(err.value) == (f"checkpoint {folder}/epoch-0002.pt: cannot be written (No space left on device: "
                              "0 B free of 1.0 MiB); the checkpoints written before are kept")
    with pytest.raises(CheckpointError):  # over an existing file: the old one stays whole
        save_atomic({"w": torch.zeros(20000)}, folder / "best.pt")
    assert sorted(p.name for p in folder.iterdir()) == ["best.json", "best.pt", "epoch-0001.pt", FILLER]
    for name in ("epoch-0001.pt", "best.pt"):
        assert torch.equal(load(folder / name)["w"], first["w"])
    assert json.loads((folder / "best.json").read_text())["value"] == 1.0


def test_cli_disk_full_mid_run_fails_with_one_line(dlpipe, tmpfs, mlflow_store, mlflow_client):
    folder = tmpfs("2m")
    r = dlpipe(*TABULAR, "trainer.epochs=2", f"checkpoint.dir={folder}", *callback(folder),
               f"tracking.uri={mlflow_store}", "tracking.experiment=disk-full-checkpoint")
    assert r.returncode == 2, r.stderr
    line = (f"checkpoint {folder}/epoch-0002.pt: cannot be written (No space left on device: 0 B free of 2.0 MiB); "
            "the checkpoints written before are kept")
    assert errors(r.stderr) == [f"dlpipe: error: {line}"]
    assert "Traceback" not in r.stderr and "inline_container" not in r.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["best.json", "best.pt", "epoch-0001.pt", FILLER]
    assert load(folder / "epoch-0001.pt")["epoch"] == load(folder / "best.pt")["epoch"] == 1
    [run] = runs_of(mlflow_client, "disk-full-checkpoint")
    assert run.info.status == "FAILED"
    assert run.data.tags["dlpipe.end_reason"] == f"CheckpointError: {line}"
    assert epochs_logged(mlflow_client, run.info.run_id, "train/loss") == [1, 2]


# --- a tracking store that cannot take writes mid-run ---------------------------------------------


def test_outbox_file_on_a_full_disk_keeps_writes_in_memory(tmpfs, caplog):
    folder = tmpfs("256k")
    box = Outbox("sqlite:///m.db", "run1", folder / OUTBOX_FILE)
    box.add({"tags": {"a": "1"}})
    fill(folder)
    big = {"metrics": [["loss", 0.5, 1, step] for step in range(1000)]}  # more than the page left
    box.add(big)  # no exception: training goes on
    box.add({"end": "FINISHED"})
    [warning] = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert "No space left on device: 0 B free of 256.0 KiB" in warning
    assert box.kept_for_sync("FINISHED").startswith(
        "1000 metrics, 2 other writes and the run's end (FINISHED) are kept in memory only, lost at exit "
        f"({folder / OUTBOX_FILE} cannot be written: [Errno 28] No space left on device")
    (folder / FILLER).unlink()
    box.add({"tags": {"b": "2"}})  # the file is written afresh: every entry, none torn
    assert box.kept_for_sync("FAILED") == ("1000 metrics, 3 other writes and the run's end (FAILED) are kept in "
                                           f"{folder / OUTBOX_FILE}; send them with: dlpipe sync {folder}")
    assert Outbox.load(folder / OUTBOX_FILE).entries == [{"tags": {"a": "1"}}, big, {"end": "FINISHED"},
                                                        {"tags": {"b": "2"}}]
    assert sorted(p.name for p in folder.iterdir()) == [OUTBOX_FILE]


def test_an_outbox_without_a_file_says_its_writes_are_lost_at_exit():
    box = Outbox("sqlite:///m.db", "run1")
    box.metrics([])
    box.tags({"a": "1"})
    assert box.kept_for_sync("KILLED") == ("0 metrics, 1 other writes and the run's end (KILLED) are kept in memory "
                                           "(lost at exit); send them with: dlpipe sync ")


def test_full_store_mid_run_is_an_outage_that_ends(tmpfs, tmp_path, caplog, capfd):
    from mlflow import MlflowClient

    from dlpipe.tracking.run import MlflowRun

    folder = tmpfs("8m")
    uri = f"sqlite:///{folder}/mlflow.db"
    outbox = tmp_path / OUTBOX_FILE
    run = MlflowRun(uri, "store-faults", "store fault", {}, outbox_path=outbox, retry_every_s=0, offline_wait_s=0)
    client = MlflowClient(uri)
    store = client._tracking_client.store  # one per URI, shared with the run's client
    try:
        run.log_metrics({"loss": 1.0}, step=1)
        run.flush()
        filler = fill(folder)
        run.log_metrics({"loss": 0.5}, step=2)
        with caplog.at_level(logging.WARNING, logger="dlpipe.tracking.run"):
            run.flush()  # "database or disk is full": kept, training goes on
        assert run.offline_since is not None
        # One line in SQLite's words, not MLflow's paragraph about autoflush, nor its traceback.
        [said] = [r.getMessage() for r in caplog.records if r.name == "dlpipe.tracking.run"]
        assert said.startswith("tracking store cannot take writes (OperationalError: database or disk is full)")
        assert "Traceback" not in capfd.readouterr().err
        assert Outbox.load(outbox).counts()["metrics"] == 1
        filler.unlink()
        run.log_metrics({"loss": 0.25}, step=3)
        run.flush()  # a retry (connect_error has nothing to probe for SQLite) delivers what was kept
        assert run.offline_since is None and not outbox.exists()
        run.end("FINISHED")
        assert [m.value for m in client.get_metric_history(run.run_id, "loss")] == [1.0, 0.5, 0.25]
        assert client.get_run(run.run_id).info.status == "FINISHED"
    finally:
        store.engine.dispose()  # its open connections would keep the tmpfs busy


def test_read_only_store_mid_run_keeps_writes_for_sync(tmpfs, tmp_path):
    """A store remounted read-only: training goes on and every write is kept. The run's pooled
    SQLite connection stays read-only after the mount is writable again (SQLite opened it so), so
    the writes are delivered by `dlpipe sync`, a new process, not by a retry in this one."""
    from mlflow import MlflowClient

    from dlpipe.tracking.run import MlflowRun

    folder = tmpfs("8m")
    uri = f"sqlite:///{folder}/mlflow.db"
    outbox = tmp_path / OUTBOX_FILE
    run = MlflowRun(uri, "store-faults", "read-only", {}, outbox_path=outbox, retry_every_s=0, offline_wait_s=0)
    store = MlflowClient(uri)._tracking_client.store  # one per URI, shared with the run's client
    try:
        run.log_metrics({"loss": 1.0}, step=1)
        run.flush()
        # Linux refuses to remount read-only while a file on it is open for writing: close MLflow's
        # pooled connections first; its next write opens the database on the read-only mount.
        store.engine.dispose()
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        try:
            run.log_metrics({"loss": 0.5}, step=2)
            run.flush()  # refused: "attempt to write a readonly database"; kept, training goes on
            run.end("FINISHED")
        finally:
            store.engine.dispose()
            subprocess.run(["mount", "-o", "remount,rw", str(folder)], check=True)
        assert run.status == "FINISHED, not sent"
        kept = Outbox.load(outbox)
        assert kept.counts()["metrics"] == 1 and kept.entries[-1] == {"end": "FINISHED"}
        assert kept.send(MlflowClient(uri)) == "FINISHED"  # what `dlpipe sync` does, connections opened afresh
        client = MlflowClient(uri)
        assert [m.value for m in client.get_metric_history(run.run_id, "loss")] == [1.0, 0.5]
        assert client.get_run(run.run_id).info.status == "FINISHED"
    finally:
        store.engine.dispose()  # its open connections would keep the tmpfs busy


def test_unreachable_counts_a_locked_store_but_not_a_broken_one(tmp_path):
    """Real SQLite errors, chained as MLflow's session raises them. (A locked store through MLflow
    itself waits its 20 s busy timeout per write before failing: too slow to test that way.)"""
    import sqlite3

    from mlflow.exceptions import MlflowException

    def error_of(sql: str) -> MlflowException:
        with pytest.raises(sqlite3.OperationalError) as err:
            sqlite3.connect(tmp_path / "m.db", timeout=0, isolation_level=None).execute(sql)
        try:
            raise MlflowException(f"(sqlite3.OperationalError) {err.value}") from err.value
        except MlflowException as e:
            return e

    holder = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    holder.execute("CREATE TABLE metrics (value REAL)")
    holder.execute("BEGIN EXCLUSIVE")  # another process in the middle of a long write
    try:
        assert unreachable(error_of("INSERT INTO metrics VALUES (1)"))  # database is locked
    finally:
        holder.close()
    assert not unreachable(error_of("SELECT * FROM runs"))  # no such table: a broken store, not an outage
    assert unreachable(OSError(errno.ENOSPC, "No space left on device"))


def test_cli_store_full_mid_run_trains_on_and_sync_delivers(dlpipe, tmpfs, tmp_path):
    from mlflow import MlflowClient

    folder = tmpfs("8m")
    uri = f"sqlite:///{folder}/mlflow.db"
    r = dlpipe(*TABULAR, "trainer.epochs=2", "hydra.run.dir=job", *callback(folder), f"tracking.uri={uri}",
               "tracking.offline_wait_s=0")
    assert r.returncode == 0, r.stderr
    assert "tracking store cannot take writes (OperationalError: database or disk is full)" in r.stdout
    assert "epoch 2/2" in r.stderr and "Traceback" not in r.stderr
    box = Outbox.load(tmp_path / "job" / OUTBOX_FILE)
    epochs = {row[1] for e in box.entries if "metrics" in e for row in e["metrics"] if row[0] == "epoch"}
    # The tracking process writes epoch 1 when it gets to it: before the callback fills the disk, or
    # after (then it is kept too). Epoch 2 came after the disk was full, and nothing else is kept.
    assert 2.0 in epochs and epochs <= {1.0, 2.0} and box.entries[-1] == {"end": "FINISHED"}
    (folder / FILLER).unlink()
    synced = dlpipe("sync", "job")
    assert synced.returncode == 0, synced.stderr
    assert not (tmp_path / "job" / OUTBOX_FILE).exists()
    client = MlflowClient(uri)
    try:
        assert client.get_run(box.run_id).info.status == "FINISHED"
        assert epochs_logged(client, box.run_id, "train/loss") == [1, 2]
    finally:
        client._tracking_client.store.engine.dispose()  # its open connections would keep the tmpfs busy
