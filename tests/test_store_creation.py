"""A SQLite store's first creation under real faults: the creating process SIGKILLed at points of the
schema migration, a store half-made by a killed MLflow, and the lock of the store held by another
process (said, then given up)."""

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR, runs_of
from test_tracking_faults import spawn
from test_tracking_outage import wait_for

from dlpipe.errors import DlpipeError
from dlpipe.tracking import store_lock
from dlpipe.tracking.client import client_for
from dlpipe.tracking.store_lock import NEW_INFIX, store_opening

FAST = ["+recipe=smoke", "trainer.progress=false"]


def python(code: str, cwd: Path, log: Path) -> subprocess.Popen:
    """`code` in a Python process of its own (dlpipe importable, no phoning home), its output in `log`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_"))}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def temporary_stores(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"mlflow.db{NEW_INFIX}*"))


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dlpipe: error: ")]


# What the temporary store has reached when the creator is killed: just made (empty), its first
# tables, half its migrations (the whole store is about 0.9 MB).
@pytest.mark.parametrize("kill_at_bytes", [0, 64 * 1024, 480 * 1024])
def test_a_store_creation_killed_at_any_point_leaves_no_half_made_store(tmp_path, dlpipe, kill_at_bytes):
    """SIGKILL of a process creating a new store while its temporary file exists: the store's own
    path never holds a half-made file; the next job on the same URI removes the leftover (under
    the lock), creates the store whole, trains, and leaves no temporary file."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    creator = python(f"from dlpipe.tracking.client import client_for; client_for({uri!r}, 10, 0)", tmp_path,
                     tmp_path / "creator.txt")

    def reached() -> bool:
        made = temporary_stores(tmp_path)
        return creator.poll() is not None or (made != [] and made[0].stat().st_size >= kill_at_bytes)

    try:
        wait_for(reached, creator, "the temporary store to grow")
        assert creator.poll() is None, (tmp_path / "creator.txt").read_text()
    finally:
        stop(creator)
    assert not db.exists() and temporary_stores(tmp_path)  # killed before the rename: only the leftover

    r = dlpipe(*FAST, "trainer.epochs=1", f"tracking.uri={uri}", "tracking.experiment=after-kill")
    assert r.returncode == 0, r.stderr
    assert temporary_stores(tmp_path) == []
    client = client_for(uri, 10, 0)
    [run] = runs_of(client, "after-kill")
    assert run.info.status == "FINISHED"
    made = client.create_run(run.info.experiment_id).info.run_id  # the store is whole: it takes a new run
    assert client.get_run(made).info.status == "RUNNING"


def test_a_new_store_is_made_whole_and_leaves_only_itself_and_its_lock(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri, 10, 0)
    client.create_run(client.create_experiment("whole"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]
    assert oct((tmp_path / "mlflow.db").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def half_make(db: Path, leftover_table: bool) -> None:
    """A whole store turned into what a killed migration leaves: a later table missing, the schema
    version of an earlier migration (so MLflow runs the migrations again and fails on what exists),
    with or without alembic's temporary table of a migration cut short."""
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE webhooks")
        conn.execute("UPDATE alembic_version SET version_num = '7f2a7d5fae7d'")
        if leftover_table:
            conn.execute("CREATE TABLE _alembic_tmp_experiments (experiment_id INTEGER)")


@pytest.mark.parametrize("leftover_table, why", [
    (True, "table _alembic_tmp_experiments is left from an interrupted schema migration"),
    (False, "MLflow's schema migration stops at: duplicate column name: storage_location"),
])
def test_a_half_made_store_is_named_in_one_line(tmp_path, dlpipe, leftover_table, why):
    """A store half-made by an older dlpipe or another tool: one line naming the file, saying it is
    half-made and how to fix it, exit 2 before training; moved aside, the same command trains."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    made = python(f"from dlpipe.tracking.client import client_for; client_for({uri!r}, 10, 0)", tmp_path,
                  tmp_path / "made.txt")
    assert made.wait(timeout=300) == 0, (tmp_path / "made.txt").read_text()
    half_make(db, leftover_table)
    r = dlpipe(*FAST, "trainer.epochs=1", f"tracking.uri={uri}", "tracking.experiment=half")
    assert r.returncode == 2, r.stderr
    assert errors(r.stderr) == [f"dlpipe: error: tracking.uri={uri}: {db} is half-made ({why}; a job was killed "
                                f"while it created the store, or another tool was); move it aside (mv {db} "
                                f"{db}.broken) and run again to start a new store"], r.stderr
    assert "Traceback" not in r.stderr and "epoch 1:" not in r.stderr + r.stdout
    (tmp_path / "job").mkdir()  # a folder whose record names the half-made store: sync says so, in one line
    (tmp_path / "job" / "mlflow_run.json").write_text(
        f'{{"run_id": "0123abcd", "uri": "{uri}", "host": "{os.uname().nodename}", "pid": 1, "started": 0}}\n')
    r = dlpipe("sync", "job")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"store {uri}: tracking.uri={uri}: {db} is half-made" in r.stderr
    db.rename(db.with_name("mlflow.db.broken"))
    r = dlpipe(*FAST, "trainer.epochs=1", f"tracking.uri={uri}", "tracking.experiment=half")
    assert r.returncode == 0, r.stderr
    assert [run.info.status for run in runs_of(client_for(uri, 10, 0), "half")] == ["FINISHED"]


HOLD = """
    import sys, time
    from dlpipe.tracking.store_lock import store_opening
    with store_opening({uri!r}):
        print("held", flush=True)
        time.sleep(3600)
"""


@pytest.fixture
def holder(tmp_path):
    """A second process holding the store's lock (as a job creating the store does), stopped by PID."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = tmp_path / "holder.txt"
    proc = python(HOLD.format(uri=uri), tmp_path, log)
    try:
        wait_for(lambda: "held" in log.read_text() or proc.poll() is not None, proc, "the lock to be held")
        assert proc.poll() is None, log.read_text()
        yield proc, uri
    finally:
        stop(proc)


def held_for_s(lock) -> float:
    """How long the holder has held `lock`, by its own record (pid host time)."""
    return time.time() - float(lock.read_text().split()[2])


def test_a_held_lock_is_said_once_with_its_holder_and_given_up_in_one_line(holder, tmp_path, caplog, monkeypatch):
    """Waiting on the lock says once which file and which process hold it, and gives up after the
    bound; a second wait gives up at once, since the holder's record says how long it has held it.
    The bounds follow the holder's own record, so a slow start of the test changes nothing."""
    proc, uri = holder
    lock = tmp_path / "mlflow.db.lock"
    caplog.set_level(logging.INFO, logger="dlpipe.tracking.store_lock")
    monkeypatch.setattr(store_lock, "LOCK_NOTE_AFTER_S", 0.5)
    with pytest.raises(DlpipeError) as waited, store_opening(uri, give_up_s=held_for_s(lock) + 4):
        pytest.fail("the lock was taken while another process held it")
    [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said.startswith(f"waiting for {lock}, held by pid {proc.pid} (another job opening the store")
    assert str(waited.value).startswith(f"tracking.uri={uri}: {lock} has been held for ")
    assert f"s by pid {proc.pid} (another job opening the store); stop that process if it hangs" in str(waited.value)
    caplog.clear()
    monkeypatch.setattr(store_lock, "LOCK_NOTE_AFTER_S", 5.0)
    with pytest.raises(DlpipeError), store_opening(uri, give_up_s=held_for_s(lock) - 0.5):
        pytest.fail("the lock was taken while another process held it")
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []  # gave up before the note
    stop(proc)  # SIGKILL: its record stays in the file
    with store_opening(uri, give_up_s=7):
        assert lock.read_text().split()[0] == str(os.getpid())
    assert lock.read_text() == ""  # cleared when let go


def test_a_holder_that_records_nothing_is_not_taken_for_a_dead_one(tmp_path, caplog, monkeypatch):
    """A dlpipe holder SIGKILLed leaves its record; the lock then held by a process that writes none
    (flock(1), an older dlpipe) is said to be another process's, never the dead one's."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    dead = python(HOLD.format(uri=uri), tmp_path, tmp_path / "dead.txt")
    wait_for(lambda: "held" in (tmp_path / "dead.txt").read_text() or dead.poll() is not None, dead, "the lock")
    stop(dead)
    assert (tmp_path / "mlflow.db.lock").read_text().split()[0] == str(dead.pid)
    log = tmp_path / "bare.txt"
    bare = python(f"""
        import fcntl, os, time
        fd = os.open({str(tmp_path / 'mlflow.db.lock')!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(3600)
    """, tmp_path, log)
    caplog.set_level(logging.WARNING, logger="dlpipe.tracking.store_lock")
    try:
        wait_for(lambda: "held" in log.read_text() or bare.poll() is not None, bare, "the lock")
        monkeypatch.setattr(store_lock, "LOCK_NOTE_AFTER_S", 0.5)  # said before the bound, however slow the poll
        with pytest.raises(DlpipeError) as waited, store_opening(uri, give_up_s=6):
            pytest.fail("the lock was taken while another process held it")
    finally:
        stop(bare)
    [said] = [r.getMessage() for r in caplog.records]
    assert "held by another process (its pid is not recorded)" in said and str(dead.pid) not in said
    assert "by another process (its pid is not recorded)" in str(waited.value)


@pytest.mark.integration
def test_a_job_waiting_for_a_held_lock_says_so_and_trains_once_it_is_free(holder, tmp_path):
    """The real CLI on a store whose lock another process holds: one line naming the lock file and
    the holder's pid, no training meanwhile; once the holder is gone, the job runs and finishes."""
    proc, uri = holder
    log = tmp_path / "job.txt"
    job = spawn(tmp_path, log, *FAST, "trainer.epochs=1", f"tracking.uri={uri}", "tracking.experiment=held",
                "hydra.run.dir=out")
    try:
        line = f"waiting for {tmp_path / 'mlflow.db.lock'}, held by pid {proc.pid}"
        wait_for(lambda: line in log.read_text() or job.poll() is not None, job, "the waiting line")
        assert job.poll() is None and "epoch 1:" not in log.read_text(), log.read_text()
        stop(proc)
        assert job.wait(timeout=300) == 0, log.read_text()
    finally:
        stop(job)
    text = log.read_text()
    assert text.count("waiting for ") == 1 and "Traceback" not in text, text
    assert line in (tmp_path / "out" / "dlpipe.log").read_text()
    assert [run.info.status for run in runs_of(client_for(uri, 10, 0), "held")] == ["FINISHED"]
