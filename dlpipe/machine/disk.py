"""Whether a folder can be written, and the words for a write that failed: which disk, how full.

Pre-flight asks `unwritable(folder)` for every place a job will write, so a read-only mount, a
path under /proc or a file where a folder should be fails in a second instead of after an epoch.
A write that fails later (a disk that filled up mid-run) is described by `write_failure`, with the
free space: "No space left on device" alone says neither which disk nor how little was left.
"""

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from dlpipe.errors import causes, first_line

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `text` to `path` whole or not at all (atomic_file)."""
    with atomic_file(path, mode) as f:
        f.write(text)


@contextmanager
def atomic_file(path: Path, mode: int = 0o644, binary: bool = False):
    """A file to write `path` through, whole or not at all: a temp file of its own in the same folder
    (two writers never share one), synced to disk when the block ends (renamed before its data
    reached the disk, a crash could leave an empty file), then renamed over `path`; a reader sees
    the old file or the new one, and of two writers the last one's, whole. The temp file goes on any
    failure."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            os.fchmod(f.fileno(), mode)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def nearest_existing(path: Path) -> Path:
    """`path` (made absolute) or its closest ancestor that exists: where `mkdir -p` would start."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in _UNITS[:-1]:
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} {_UNITS[-1]}"


def free_space(path: Path) -> str:
    """'12.0 KiB free of 1.0 MiB' on the filesystem that holds `path` (or would hold it)."""
    try:
        usage = shutil.disk_usage(nearest_existing(path))
    except OSError as e:
        return f"free space unknown: {e.strerror or e}"
    return f"{size(usage.free)} free of {size(usage.total)}"


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The OSError behind `exc`, if any: torch.save turns a failed write into a RuntimeError
    ("enforce fail at inline_container.cc") and keeps the OSError only as its context."""
    return next((e for e in causes(exc) if isinstance(e, OSError)), None)


def write_failure(exc: BaseException, path: Path) -> str:
    """Why writing `path` failed, in a few words; a full disk (or an unknown cause) with its free space."""
    found = os_error_in(exc)
    if found is None:
        return f"{first_line(exc)}; {free_space(path)}"
    reason = found.strerror or first_line(found)
    if found.errno in DISK_FULL:
        return f"{reason}: {free_space(path)}"
    return reason


def unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (None when they can), found without leaving anything
    behind: a folder that does not exist yet is judged by the nearest one above it, where it would
    be created, and the probe file is removed at once."""
    folder = Path(os.path.abspath(folder))
    base = nearest_existing(folder)
    if not base.is_dir():
        return "it exists and is not a folder" if base == folder else f"{base} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".dlpipe-write-probe-", dir=base)
    except OSError as e:
        where = "" if base == folder else f"{base}: "
        return f"{where}{_virtual(base) or e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    if shutil.disk_usage(base).free == 0:
        return f"{base}: no space left ({free_space(base)})"
    return None


def _virtual(path: Path) -> str | None:
    # /proc and /sys refuse new files with "No such file or directory": say what they are instead.
    try:
        return "a virtual file system without storage" if shutil.disk_usage(path).total == 0 else None
    except OSError:
        return None
