"""Checkpoints that survive being killed mid-save, and a store that keeps the last few plus the best.

A training job on Slurm or under a preemptible scheduler can be SIGKILLed at any moment, including
in the middle of `torch.save`. Writing in place would leave a torn file and a resume that dies on it,
so every file here is written to a temp file in the same directory, fsynced and renamed over the
target: a reader sees either the old file or the new one.

Files are loaded with `weights_only=True` (the torch default): states must be plain containers,
numbers, strings and tensors -- no DictConfig, no custom classes: torch.load refuses anything else
with weights_only=True, and loading with it off would run arbitrary pickled code from the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from dlpipe.errors import DlpipeError
from dlpipe.machine.disk import write_failure

# Temp files are dot-files ending in ".<pid>.tmp" (see _temp_path); nothing else in a checkpoint
# directory matches, so clean_stale cannot delete a user's file.
_TEMP_RE = re.compile(r"\..+\.\d+\.tmp")
_EPOCH_RE = re.compile(r"epoch-(\d+)\.pt")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_MAX_REASON = 200


class CheckpointError(DlpipeError):
    """A checkpoint file cannot be read or written; the one-line message names the file."""


def _temp_path(path: Path) -> Path:
    # Same directory as the target: os.replace is only atomic within one filesystem.
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync_dir(directory: Path) -> None:
    # The rename lives in the directory entry; without this a power loss can forget it even
    # though the file's data reached the disk.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[object], None]) -> None:
    """Call write(file) on a temp file next to `path`, make it durable, then rename it onto `path`."""
    tmp = _temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Remove our half-written temp file on any failure (KeyboardInterrupt included), then
        # let the original error through; a SIGKILL skips this and clean_stale handles it.
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save_atomic(state: dict, path: Path) -> None:
    """torch.save `state` to `path` so that a crash leaves the old file or the new one, never a torn one.

    The state must be plain containers and tensors (loadable with weights_only=True).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a stop in the first epoch comes before any save
        _write_atomic(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        raise _cannot_write(path, e) from e


def _cannot_write(path: Path, exc: BaseException) -> CheckpointError:
    # Disk full, permissions, read-only mount: things a user fixes, so one line, no traceback. The
    # temp file is gone and the files already there were never touched (see _write_atomic).
    return CheckpointError(f"checkpoint {path}: cannot be written ({write_failure(exc, path)}); "
                           "the checkpoints written before are kept")


def _short_reason(exc: BaseException) -> str:
    """One short line out of torch's multi-paragraph load errors."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, EOFError):
        return "unexpected end of file"
    text = _ANSI_RE.sub("", str(exc))
    # weights_only failures bury the cause after this marker, behind advice about weights_only=False
    # that we do not want users to follow for their own checkpoints.
    marker = "WeightsUnpickler error:"
    if marker in text:
        cause = text.split(marker, 1)[1].strip().split("\n", 1)[0]
        cause = cause.split(" Please use", 1)[0].rstrip(".")
        text = f"not loadable with weights_only=True: {cause}"
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    line = line.split(". ", 1)[0].rstrip(".")
    return line if len(line) <= _MAX_REASON else line[: _MAX_REASON - 3] + "..."


def load(path: Path) -> dict:
    """Load a checkpoint on the CPU with weights_only=True; any failure is a one-line CheckpointError."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, OSError, ...
        raise CheckpointError(f"checkpoint {path}: cannot be read ({_short_reason(e)})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: cannot be read (not a dict but {type(state).__name__})")
    return state


class CheckpointStore:
    """Epoch checkpoints in one directory: epoch-0001.pt, epoch-0002.pt, ... plus best.pt.

    best.json records which epoch best.pt holds and its monitored value, so a store created on an
    existing directory (a resumed run) keeps comparing against the old best.
    """

    def __init__(self, directory: Path, keep_last: int = 2, monitor: str | None = "val_loss", mode: str = "min"):
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r}: must be an integer >= 1")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: must be 'min' or 'max'")
        # The directory is created on first save: a run that fails before its first epoch
        # should not leave empty checkpoint folders behind.
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.monitor = monitor
        self.mode = mode
        self.best_path = self.directory / "best.pt"
        self.best_json = self.directory / "best.json"
        self.best_value: float | None = self._read_best_value()

    def _read_best_value(self) -> float | None:
        if self.monitor is None or not self.best_json.exists():
            return None
        try:
            record = json.loads(self.best_json.read_text())
            value = float(record["value"])
            monitor = record["monitor"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            # Guessing would let a worse epoch overwrite best.pt; the user can delete the file.
            raise CheckpointError(f"checkpoint {self.best_json}: cannot be read ({_short_reason(e)})") from e
        # A best recorded for another metric says nothing about this one: start afresh.
        return value if monitor == self.monitor else None

    def _improves(self, value: float) -> bool:
        if math.isnan(value):  # a diverged epoch is never the best
            return False
        if self.best_value is None:
            return True
        return value < self.best_value if self.mode == "min" else value > self.best_value

    def epoch_path(self, epoch: int) -> Path:
        return self.directory / f"epoch-{epoch:04d}.pt"

    def clean_stale(self) -> list[Path]:
        """Delete temp files left by a save that was killed; return their paths so the caller can log them."""
        if not self.directory.is_dir():
            return []
        stale = sorted(p for p in self.directory.iterdir() if _TEMP_RE.fullmatch(p.name) and p.is_file())
        for p in stale:
            p.unlink(missing_ok=True)
        return stale

    def save(self, state: dict, epoch: int, metrics: dict[str, float]) -> Path:
        """Write epoch-NNNN.pt (and best.pt/best.json when the monitored metric improves), then prune."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r}: must be an integer >= 0")
        path = self.epoch_path(epoch)
        save_atomic(state, path)  # (makes the folder)
        if self.monitor is not None and self.monitor in metrics:
            value = float(metrics[self.monitor])
            if self._improves(value):
                # best.pt first, then best.json: a kill in between leaves best.json pointing at an
                # older, worse value, so the next improvement rewrites both -- never the reverse.
                save_atomic(state, self.best_path)
                record = {"epoch": epoch, "monitor": self.monitor, "value": value}
                try:
                    _write_atomic(self.best_json, lambda f: f.write(json.dumps(record).encode()))
                except OSError as e:
                    raise _cannot_write(self.best_json, e) from e
                self.best_value = value
        self._prune(keep=path)
        return path

    def _prune(self, keep: Path) -> None:
        # Never delete the file just written, even if a resumed run left higher-numbered files.
        for old in self.candidates()[self.keep_last :]:
            if old != keep:
                old.unlink(missing_ok=True)

    def candidates(self) -> list[Path]:
        """epoch-*.pt files, newest (highest epoch number) first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _EPOCH_RE.fullmatch(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found, reverse=True)]

    def load_latest(self, warn: Callable[[str], None]) -> tuple[dict, Path] | None:
        """Load the newest readable epoch checkpoint, warning about each unreadable one skipped.

        None only when there is no epoch checkpoint at all; when files exist but none can be
        read, a CheckpointError lists every file tried.
        """
        paths = self.candidates()
        if not paths:
            return None
        errors: list[CheckpointError] = []
        for i, path in enumerate(paths):
            try:
                return load(path), path
            except CheckpointError as e:
                errors.append(e)
                if i + 1 < len(paths):
                    warn(f"{e}; falling back to {paths[i + 1]}")
        tried = "; ".join(str(e) for e in errors)
        raise CheckpointError(f"no readable checkpoint in {self.directory}: tried {len(paths)} files: {tried}")
