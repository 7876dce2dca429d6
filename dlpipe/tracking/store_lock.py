"""One process at a time opens a SQLite tracking store, so concurrent first use cannot break it.

Opening a SQLite store runs MLflow's schema migrations (alembic) when the file is new or older
than the installed MLflow. Two jobs doing that at once (a sweep launched in parallel, a Slurm
array on a shared store) collide: `table latest_metrics already exists`, `duplicate column name`,
`Online migration expected to match one row`, and the job exits. An exclusive `flock` on a file
next to the store serialises the opening; the runs themselves write concurrently as before
(SQLite's own locking covers that).
"""

import fcntl
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

log = logging.getLogger(__name__)

SQLITE_PREFIX = "sqlite:///"


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
def store_opening(uri: str):
    """Hold the store's lock file (`<db>.lock`) exclusively for the block; other stores: no lock."""
    db = sqlite_path(uri)
    if db is None or not db.parent.is_dir():  # MLflow itself reports a missing folder
        yield
        return
    try:
        fd = os.open(lock_path(db), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only folder: nothing can migrate the store there; MLflow says why it fails
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies holding it
        except OSError as e:  # a filesystem without locks (some NFS and Lustre mounts): open it as MLflow would
            log.warning("cannot lock %s (%s): opening the store without serialising", lock_path(db), e.strerror or e)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
