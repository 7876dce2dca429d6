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
  (a sweep's folder for the sweep's; machine.lock_file): a second job that finds it held stops with
  one line naming the holder before Hydra writes its record there. The kernel releases the lock when
  the process dies, and the children it forked close it, so a job killed outright never blocks the
  next one (its resume).

Hydra turns an exception in a callback into a warning and goes on, so a held folder ends the process
here, with the same line and exit status as any other bad input.
"""

import errno
import re
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dlpipe.errors import ConfigError
from dlpipe.machine.lock_file import LockFile

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


def hold(folder: Path, key: str) -> LockFile | None:
    """Lock `folder` for this process (None where the filesystem has no locks or the folder cannot
    be written: Hydra's own write then says why). FolderInUse if another holds it."""
    try:
        lock = LockFile(folder / LOCK_FILE)
    except OSError:
        return None
    try:
        taken = lock.take_if_free()
    except OSError:  # no locks on this filesystem (some NFS, Lustre mounts): as before, unguarded
        lock.close()
        return None
    if not taken:
        holder = lock.holder()
        lock.close()
        raise FolderInUse([f"{key}={folder}: another dlpipe job uses this folder "
                           f"({holder.described() if holder else 'a job that is starting'}); wait for it "
                           f"to end, or give this job a folder of its own ({key}=...)"])
    lock.record()
    return lock


def release(lock: LockFile | None) -> None:
    """Remove the lock file and let go of it (its forked children closed their copies already)."""
    if lock is not None:
        lock.close(remove=True)


def remove_empty_parents(folder: Path, within: Path) -> None:
    """After `folder` was removed: its parents that are now empty, up to (not including) `within`,
    the working directory (outputs/DATE of a run or sweep that left nothing). Both paths normalized
    alike (absolute or resolved)."""
    parent = folder.parent
    while within in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def override(key: str, value: str) -> str:
    """`key=value` in Hydra's override grammar (quoted unless the value is plain)."""
    if SAFE_OVERRIDE_VALUE.fullmatch(value):
        return f"{key}={value}"
    return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class OutputFolders(Callback):
    """Claims a fresh folder for a job (or a sweep) named by the clock, and holds it while it runs."""

    def __init__(self) -> None:
        self._held: LockFile | None = None

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
            self._held = hold(folder, key)
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
        release(held)


def _raw(config: DictConfig, mode: str):
    """The folder's name as configured, before interpolation."""
    return OmegaConf.to_container(config.hydra[mode], resolve=False).get("dir")
