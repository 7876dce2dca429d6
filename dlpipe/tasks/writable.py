"""Pre-flight: every folder the job will write can be written, checked before anything is built.

A checkpoint folder on a read-only mount was found at the end of the first epoch, with a
traceback. Here each place a job writes is probed (a file created and removed at once, in the
folder or, when it does not exist yet, in the nearest folder above it where it would be made), so
the job fails in a second with one line per folder and leaves nothing behind.

Hydra creates the job's output folder and writes .hydra/ in it before dlpipe's code runs: a folder
Hydra cannot create stops Hydra itself, and `hydra_output_error` turns that into the same line.
"""

import importlib.util
import os
import traceback
from pathlib import Path
from typing import NamedTuple

from dlpipe.errors import ConfigError
from dlpipe.machine import disk
from dlpipe.tracking.store_lock import sqlite_path
from dlpipe.training.distributed import ranks_from_env

HYDRA_READS = ("config_loader", "config_source", "config_repository")  # Hydra's modules that read config files


class Target(NamedTuple):
    key: str
    value: str  # as the user set it (or its default), for the message
    folder: Path
    fix: str


def written_folders(output_dir: Path, multirun: bool, resolved: dict) -> list[Target]:
    """Where this job writes: its output folder (logs, resolved config, outbox, profiles), the
    checkpoint folder when a training job checkpoints, tune's config folder and a SQLite store."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    targets = [Target(key, str(output_dir), output_dir, _pick_another(key))]
    task, ck = resolved.get("task", "train"), resolved["checkpoint"]
    if task == "train" and ck["enabled"]:
        folder = Path(ck["dir"]) if ck["dir"] else output_dir / "checkpoints"
        targets.append(Target("checkpoint.dir", str(ck["dir"] or folder), folder,
                              "point checkpoint.dir at a writable folder, or set checkpoint.enabled=false"))
    if task == "tune":
        folder = Path(resolved["bench"]["output_dir"])
        targets.append(Target("bench.output_dir", str(folder), folder, "point bench.output_dir at a writable folder"))
    tracking = resolved["tracking"]
    store = sqlite_path(tracking["uri"]) if tracking["enabled"] else None
    if store is not None:  # SQLite writes its journal next to the database file
        targets.append(Target("tracking.uri", tracking["uri"], store.parent,
                              "point tracking.uri at a writable place, or use tracking=none"))
    return targets


def check_writable(ctx, resolved: dict) -> None:
    """Raise a ConfigError with one line per folder the job (`ctx`: a tasks.preflight.JobContext) would
    fail to write; a folder inside one already named is not named again."""
    if ranks_from_env().rank > 0:
        return  # torchrun's other ranks write nothing of their own: rank 0 checks
    problems, bad = [], []
    for target in written_folders(ctx.output_dir, ctx.multirun, resolved):
        folder = Path(os.path.abspath(target.folder))
        if any(folder.is_relative_to(b) for b in bad):
            continue
        why = disk.unwritable(folder)
        if why:
            bad.append(folder)
            problems.append(f"{target.key}={target.value}: cannot write there ({why}); {target.fix}")
    if problems:
        raise ConfigError(problems)


def hydra_output_error(exc: BaseException, argv: list[str]) -> str | None:
    """The one line for Hydra failing to create the job's output folder or to write .hydra/ in it,
    before any dlpipe code ran; None for any other error."""
    found = disk.os_error_in(exc)
    if found is None or not _hydra_was_writing(exc):
        return None
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
    typed = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+~").startswith(f"{key}=")]
    if found.filename is not None:
        path = Path(os.path.abspath(os.fsdecode(found.filename)))
        # the folder Hydra made, or the one it wrote a file (.hydra/config.yaml, dlpipe.log) or .hydra/ in
        folder = path.parent if path.suffix or path.name == ".hydra" else path
        folder = folder.parent if folder.name == ".hydra" else folder
    elif typed:  # a write that failed (a full disk) names no file
        folder = path = Path(os.path.abspath(typed[-1]))
    else:
        return f"{key}: cannot write the job's output folder ({found.strerror or found}); {_pick_another(key)}"
    why = disk.unwritable(folder) or disk.write_failure(found, path)
    return f"{key}={typed[-1] if typed else folder}: cannot write there ({why}); {_pick_another(key)}"


def _pick_another(key: str) -> str:
    return f"pick a writable folder with {key}=DIR"


def _hydra_was_writing(exc: BaseException) -> bool:
    # The innermost Hydra or dlpipe frame must be Hydra's: not the job's own code (which Hydra
    # calls), and not Hydra reading a config file (its config loader and sources), which leaves
    # Hydra making the output folders and writing .hydra/ and the job's log file in them.
    hydra = Path(importlib.util.find_spec("hydra").origin).parent  # located, not imported
    dlpipe = Path(__file__).resolve().parents[1]
    ours = [Path(frame.filename).resolve() for frame in traceback.extract_tb(exc.__traceback__)]
    ours = [path for path in ours if path.is_relative_to(hydra) or path.is_relative_to(dlpipe)]
    reading = any(part in path.stem for path in ours for part in HYDRA_READS)
    return bool(ours) and ours[-1].is_relative_to(hydra) and not reading
