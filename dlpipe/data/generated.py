"""Files a built-in dataset generates once under the user cache (a synthetic stream's shards), so a
stream recipe runs on a fresh machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dlpipe.errors import DataError
from dlpipe.machine.disk import write_failure


def write_missing(root: str, folder: Path, paths: list[Path], write: Callable[[], None]) -> None:
    """`write()` (which writes the missing ones of `paths`, each whole or not at all) when any is
    missing; a file that cannot be written is one line naming the `root` key, the file and why."""
    if all(path.is_file() for path in paths):
        return
    try:
        write()
    except OSError as e:
        where = Path(e.filename) if e.filename else folder
        raise DataError(f"dataset.root={str(root)!r}: cannot write {where}: {write_failure(e, where)}") from e
