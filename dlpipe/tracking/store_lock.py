"""One process at a time opens a SQLite tracking store, and a new store appears whole or not at all.

Opening a SQLite store runs MLflow's schema migrations (alembic) when the file is new or older
than the installed MLflow. Two jobs doing that at once (a sweep launched in parallel, a Slurm
array on a shared store) collide: `table latest_metrics already exists`, `duplicate column name`,
`Online migration expected to match one row`, and the job exits. An exclusive `flock` on a file
next to the store serialises the opening; the runs themselves write concurrently as before
(SQLite's own locking covers that). The holder records itself in the lock file (machine.lock_file),
so a job that waits can say for whom, and gives up after LOCK_GIVE_UP_S.

The migration is not atomic either: a job killed while it creates a store (kill -9, the OOM
killer) would leave a half-made file that every later job fails on. So a new store is created
and migrated in a temporary file beside it (same folder: the rename is atomic) and renamed into
place under the lock; a temporary file a killed creator left is removed by the next opener.
"""

import logging
import os
import secrets
import sqlite3
import time
from contextlib import closing, contextmanager
from functools import partial
from pathlib import Path
from urllib.parse import unquote

from dlpipe.errors import DlpipeError, causes
from dlpipe.machine.lock_file import LockFile
from dlpipe.redact import redact_text

log = logging.getLogger(__name__)

SQLITE_PREFIX = "sqlite:///"
NEW_INFIX = ".new-"  # <db>.new-<pid>-<random>: a store being created (and its -journal)
LOCK_NOTE_AFTER_S = 5.0  # a wait this long is said, once: a migration takes a few seconds
LOCK_GIVE_UP_S = 600.0  # migrating a large store takes minutes, a hung holder forever
LOCK_POLL_S = 0.2


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (relative to the working directory, like
    MLflow's), or None for any other store (a server, an in-memory database)."""
    if not uri.startswith(SQLITE_PREFIX):
        return None
    path = unquote(uri[len(SQLITE_PREFIX):].split("?", 1)[0])
    return Path(path) if path and path != ":memory:" else None


def absolute_uri(uri: str) -> str:
    """A `sqlite:///relative.db` URI made absolute (what the job's folder records must not depend
    on where `dlpipe sync` runs); any other URI as it is."""
    db = sqlite_path(uri)
    if db is None or db.is_absolute():
        return uri
    _, question, query = uri.partition("?")
    return f"{SQLITE_PREFIX}{db.resolve()}{question}{query}"


def lock_path(db: Path) -> Path:
    return db.with_name(db.name + ".lock")


@contextmanager
def store_opening(uri: str, give_up_s: float = LOCK_GIVE_UP_S):
    """Hold the store's lock file (`<db>.lock`) exclusively for the block and yield the database
    file (temporary files a killed creator left are removed first); other stores: no lock, None."""
    db = sqlite_path(uri)
    if db is None or not db.parent.is_dir():  # MLflow itself reports a missing folder
        yield None
        return
    try:
        lock = LockFile(lock_path(db))
    except OSError:  # a read-only folder: nothing can create or migrate the store there; MLflow says why it fails
        yield None
        return
    try:
        try:
            lock.take(partial(_while_waiting, lock, uri, give_up_s, noted=[]), LOCK_POLL_S)
            lock.record()  # released by the kernel if this process dies holding it
        except OSError as e:  # a filesystem without locks (some NFS and Lustre mounts): open it as MLflow would
            log.warning("cannot lock %s (%s): opening the store without serialising", lock.path, e.strerror or e)
        else:
            _remove_leftovers(db)
        yield db
    finally:
        lock.close()  # clears its record: a later holder that records nothing must not be taken for us


def _while_waiting(lock: LockFile, uri: str, give_up_s: float, waited: float, noted: list) -> None:
    """Each poll of a wait for the lock: say once (`noted` is empty until then), after
    LOCK_NOTE_AFTER_S, who holds it, and give up in one line once it has been held `give_up_s` (by
    this wait, or by the holder's own record of when it took it)."""
    holder, held_s = _holder(lock)
    if not noted and waited >= LOCK_NOTE_AFTER_S:  # before giving up: a stalled poll still says it
        log.warning("waiting for %s, held by %s (another job opening the store: creating or migrating it); "
                    "giving up after %.0f s", lock.path, holder, give_up_s)
        noted.append(True)
    if max(waited, held_s) >= give_up_s:
        raise DlpipeError(f"tracking.uri={redact_text(uri)}: {lock.path} has been held for {max(waited, held_s):.0f} s "
                          f"by {holder} (another job opening the store); stop that process if it hangs, "
                          "then run again")


def _holder(lock: LockFile) -> tuple[str, float]:
    """(who holds the lock, for how long in seconds, 0 if unknown) from what the holder wrote in the
    file; a holder on another host has another clock, and an older dlpipe wrote nothing."""
    holder = lock.holder()
    if holder is None:
        return "another process (its pid is not recorded)", 0.0
    if holder.running() is None:
        return f"pid {holder.pid} on host {holder.host}", 0.0
    return f"pid {holder.pid}", max(time.time() - holder.since, 0.0)


def _remove_leftovers(db: Path) -> None:
    """Delete what a creator killed mid-way left (its temporary store and journal): under the lock,
    no creator is at work."""
    for left in db.parent.glob(db.name + NEW_INFIX + "*"):
        try:
            left.unlink(missing_ok=True)
        except OSError as e:  # another user's, in a shared folder: it costs only its space
            log.warning("cannot remove %s, left by a job killed while it created the store (%s)", left,
                        e.strerror or e)
            continue
        log.info("removed %s, left by a job killed while it created the store", left)


def is_new(db: Path) -> bool:
    """Nothing in the store yet: no file, or an empty one (SQLite makes a database of it)."""
    return not db.exists() or db.stat().st_size == 0


def create_whole(uri: str, db: Path, create) -> None:
    """Make the new store `db` (of `uri`) with `create(temporary URI)` in a temporary file beside it,
    then rename it into place: killed at any point, no half-made `db` remains. Call under the lock."""
    tmp = db.with_name(f"{db.name}{NEW_INFIX}{os.getpid()}-{secrets.token_hex(4)}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask's mode, as SQLite's own
    path, question, query = uri.partition("?")
    try:
        create(f"{path}{tmp.name[len(db.name):]}{question}{query}")
        _put_in_place(tmp, db)
    finally:
        for left in (tmp, tmp.with_name(tmp.name + "-journal")):
            left.unlink(missing_ok=True)


def _put_in_place(tmp: Path, db: Path) -> None:
    """Rename the made store to `db`, but never over a store another job made meanwhile (possible
    only on a filesystem without locks): a link fails if `db` exists; an empty `db` is replaced."""
    try:
        os.link(tmp, db)
    except FileExistsError:
        if db.stat().st_size == 0:
            os.replace(tmp, db)
    except OSError:  # a filesystem without hard links
        os.replace(tmp, db)


def half_made(db: Path, error: BaseException) -> str | None:
    """Why the store `db` that failed to open with `error` is half-made (a schema migration cut
    short), or None when it is not that."""
    try:
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    except sqlite3.Error:
        return None  # not a database at all: MLflow's own words say so
    left = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if left:
        return f"table {left[0]} is left from an interrupted schema migration"
    refused = next((e for e in causes(error) if isinstance(e, sqlite3.OperationalError)), None)
    if refused is not None and any(s in str(refused) for s in ("duplicate column name", "already exists")):
        return f"MLflow's schema migration stops at: {refused}"
    return None
