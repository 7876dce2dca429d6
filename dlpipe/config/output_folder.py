"""The job's output folder: a fresh one for every job, and never two live jobs in one.

Hydra names a job's folder after the second it started (`outputs/DATE/HH-MM-SS`, `multirun/...`),
so jobs started in the same second shared one: their logs interleaved, the later ones "resumed" the
first's live checkpoint, and one MLflow run took three jobs' metrics. Two measures, both taken by a
Hydra callback before Hydra writes anything into the folder:

- A folder whose configured name comes from the clock (`${now:...}` in `hydra.run.dir` or
  `hydra.sweep.dir`) is claimed with an atomic `mkdir`: a job that finds its name taken takes
  `NAME_1`, `NAME_2`, ... instead. A name without `${now:` is the user's deliberate choice (that is
  how a run is resumed), so it is used as given.
- The folder is then held with an exclusive `flock` on `.dlpipe.lock` inside it for the job's life
  (a sweep's folder for the sweep's): a second job that finds it held stops with one line naming the
  holder before Hydra writes its record there. The kernel releases the lock when the process dies,
  so a job killed outright never blocks the next one (its resume).

Hydra turns an exception in a callback into a warning and goes on, so a held folder ends the process
here, with the same line and exit status as any other bad input.
"""

import errno
import fcntl
import functools
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dlpipe.errors import ConfigError

LOCK_FILE = ".dlpipe.lock"
MAX_SUFFIX = 10_000  # a folder with this many same-second siblings is a runaway loop, not a sweep
SAFE_OVERRIDE_VALUE = re.compile(r"[\w./-]+")


def claim(path: Path) -> Path:
    """`path`, or the first free `path_N`, created here: two processes never get the same one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in range(MAX_SUFFIX):
        candidate = path if n == 0 else path.with_name(f"{path.name}_{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"{MAX_SUFFIX} folders of this name exist", str(path))


class FolderInUse(ConfigError):
    """Another live process holds the output folder's lock."""


def hold(folder: Path, key: str) -> int | None:
    """Lock `folder` for this process (the descriptor; None where the filesystem has no locks or
    the folder cannot be written: Hydra's own write then says why). FolderInUse if another holds it."""
    path = folder / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise FolderInUse([f"{key}={folder}: another dlpipe job uses this folder ({holder}); wait for it "
                               f"to end, or give this job a folder of its own ({key}=...)"]) from None
        except OSError:  # no locks on this filesystem (some NFS, Lustre mounts): as before, unguarded
            os.close(fd)
            return None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed the file as we opened it: lock the one that is there now
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(record) + "\n").encode())
    _not_in_forks(fd)
    return fd


_HELD_FDS: set[int] = set()  # this process's folder locks, which its forked children must not keep


def _not_in_forks(fd: int) -> None:
    """A forked child (a DataLoader worker, a user's multiprocessing Manager) shares the lock's open
    file: were the job killed outright, its orphans would hold the folder until they exit. Each
    child closes its copy at once, which leaves the parent's lock as it is."""
    _register_fork_hook()
    _HELD_FDS.add(fd)


@functools.cache
def _register_fork_hook() -> None:
    os.register_at_fork(after_in_child=_close_held)  # once per process: _HELD_FDS says what to close


def _close_held() -> None:
    for fd in _HELD_FDS:
        try:
            os.close(fd)
        except OSError:  # closed already in this child
            continue
    _HELD_FDS.clear()


def release(folder: Path, fd: int | None) -> None:
    """Remove the lock file, then let go of it (in this order: a process that opened the old file
    meanwhile sees it is gone and retries on a new one, so it cannot hold a lock nobody checks)."""
    if fd is None:
        return
    _HELD_FDS.discard(fd)
    try:
        if _same_file(fd, folder / LOCK_FILE):
            (folder / LOCK_FILE).unlink()
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _describe_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["started"])))
        return f"pid {int(record['pid'])} on {record['host']}, since {started}"
    except (OSError, ValueError, KeyError, TypeError):  # written by a job that is starting right now
        return "a job that is starting"


def override(key: str, value: str) -> str:
    """`key=value` in Hydra's override grammar (quoted unless the value is plain)."""
    if SAFE_OVERRIDE_VALUE.fullmatch(value):
        return f"{key}={value}"
    return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class OutputFolders(Callback):
    """Claims a fresh folder for a job (or a sweep) named by the clock, and holds it while it runs."""

    def __init__(self) -> None:
        self._held: tuple[Path, int | None] | None = None

    def __getstate__(self):
        # launchers that run jobs elsewhere (submitit) pickle the callbacks: the lock stays here
        return {**self.__dict__, "_held": None}

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.output_subdir is None and str(config.hydra.run.dir) == ".":
            return  # a plan, or a rank other than 0: it writes no folder of its own
        self._take(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._take(config, "sweep")

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        self._let_go()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._let_go()

    def _take(self, config: DictConfig, mode: str) -> None:
        key = f"hydra.{mode}.dir"
        try:
            clock_named = "${now:" in str(_raw(config, mode))
            folder = self._fresh(config, mode) if clock_named else Path(str(config.hydra[mode].dir))
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return  # Hydra makes the folder next and says in one line why it cannot (tasks.writable)
        try:
            self._held = (folder, hold(folder, key))
        except FolderInUse as e:
            print(f"dlpipe: error: {e}", file=sys.stderr)
            sys.exit(2)  # an exception here would be only a warning (Hydra's callbacks)

    @staticmethod
    def _fresh(config: DictConfig, mode: str) -> Path:
        """Claim the clock-named folder (or a sibling) and make the config name it from now on."""
        folder = claim(Path(str(config.hydra[mode].dir)))
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra[mode].dir = str(folder)
            if mode == "sweep":
                # each job's config is composed again from these overrides (Hydra's load_sweep_config):
                # without this one, the jobs would go back to the unclaimed name
                kept = [o for o in config.hydra.overrides.hydra if not o.lstrip("+~").startswith("hydra.sweep.dir=")]
                config.hydra.overrides.hydra = [*kept, override("hydra.sweep.dir", str(folder))]
        return folder

    def _let_go(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            release(*held)


def _raw(config: DictConfig, mode: str):
    """The folder's name as configured, before interpolation."""
    return OmegaConf.to_container(config.hydra[mode], resolve=False).get("dir")
