"""A lock file: an exclusive `flock` on a file, and a record in it of the process that holds it.

The kernel releases a flock when the last descriptor of its open file is closed, so a holder killed
outright (kill -9, the OOM killer) never blocks the next one. This process's descriptors of lock
files are closed in every child it forks (a DataLoader worker, a user's multiprocessing Manager),
which would otherwise keep the lock after the holder is killed, until they exit.

The holder writes one line into the file, `PID HOST SINCE STARTED` (when it took the lock; when the
process started, so that a later process given the same pid is not taken for it), so that a process
that finds the lock held can say by whom. A record is a claim, not the lock: a holder killed before
it cleared its record leaves it behind, and the process holding the lock now may write none (flock(1),
an older dlpipe) or be writing its own right now; a record whose process is gone is not believed.
A process on another host cannot be checked from here.

Held by the job's output folder (config.output_folder) and by a SQLite store while it is opened
(tracking.store_lock); the owner of a run (tracking.abandoned.Owner) is a ProcessId.
"""

import fcntl
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart by its start time from a later one given the same pid."""

    host: str
    pid: int
    started: float  # the process's start time

    @classmethod
    def this_process(cls, **more) -> Self:
        """This process (`more`: a subclass's other fields)."""
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), **more)

    def running(self) -> bool | None:
        """Whether the process runs: not ended, not a zombie, not a later process with its pid (one
        that cannot be looked at, another user's, is taken to run); None on another host, which
        cannot be checked from here."""
        if self.host != socket.gethostname():
            return None
        try:
            proc = psutil.Process(self.pid)
            return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - self.started) < 1
        except psutil.NoSuchProcess:  # a zombie psutil cannot read is one too
            return False
        except psutil.AccessDenied:
            return True


@dataclass(frozen=True)
class Holder(ProcessId):
    """The process that holds a lock file, as its record says."""

    since: float  # when it took the lock, by its host's clock

    def line(self) -> str:
        return f"{self.pid} {self.host} {self.since:.3f} {self.started!r}\n"

    @classmethod
    def parse(cls, line: str) -> "Holder":
        """The holder a record names; ValueError for anything else (nothing, half a line)."""
        pid, host, since, started = line.split()
        return cls(host, int(pid), float(started), float(since))

    def described(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host}, since {since}"


class LockFile:
    """This process's descriptor of the lock file `path`, made if missing (OSError where it cannot
    be: a read-only folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.held = False
        self.fd = _open(path)

    def take_if_free(self) -> bool:
        """Take the lock (True) unless another process holds it (False); OSError where the
        filesystem has no locks (some NFS and Lustre mounts). A file that its holder removed as
        this one opened it is not the lock: the file there now is taken instead."""
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if self._on_file():
                self.held = True
                return True
            self._reopen()

    def take(self, meanwhile: Callable[[float], None], poll_s: float) -> None:
        """Wait for the lock, blocked in flock in a thread (the kernel queues the waiters), calling
        `meanwhile(seconds waited)` every `poll_s`; an exception from it gives up (raised here)."""
        started = time.monotonic()
        while not self.take_if_free():
            self._wait(lambda: meanwhile(time.monotonic() - started), poll_s)

    def _wait(self, poll: Callable[[], None], poll_s: float) -> None:
        mine = _open_dup(self.fd)  # the thread's own descriptor of the same open file: its lock is `fd`'s too
        taken, failed = threading.Event(), []

        def take() -> None:
            try:
                fcntl.flock(mine, fcntl.LOCK_EX)
            except OSError as e:
                failed.append(e)
            finally:
                # given up meanwhile, `fd` is closed and this was the file's last descriptor: the lock goes with it
                _close(mine)
                taken.set()

        threading.Thread(target=take, name=f"dlpipe-lock-{self.path.name}", daemon=True).start()
        while not taken.wait(poll_s):
            poll()
        if failed:
            raise failed[0]

    def record(self) -> None:
        """Write this process into the file as the lock's holder."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, Holder.this_process(since=time.time()).line().encode(), 0)

    def holder(self) -> Holder | None:
        """The holder the file's record names; None when it names none (a holder that records
        nothing, one writing its record right now) or one that is gone (killed before it cleared it)."""
        try:
            holder = Holder.parse(os.pread(self.fd, 512, 0).decode())
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        return None if holder.running() is False else holder

    def close(self, remove: bool = False) -> None:
        """Let go of the lock and close the file. A lock held has its record cleared, so that a later
        holder that records nothing is not taken for this process; with `remove`, its file is removed
        instead, before the lock is let go (so a process that opened it meanwhile sees it is gone and
        tries a new one: it cannot hold a lock nobody checks). Closed already: nothing."""
        if self.fd < 0:
            return
        try:
            if self.held and remove:
                if self._on_file():
                    self.path.unlink()
            elif self.held:
                os.ftruncate(self.fd, 0)
        finally:
            self.held = False
            fd, self.fd = self.fd, -1
            _close(fd)  # never twice: its number may be another file's by then

    def _on_file(self) -> bool:
        try:
            return os.fstat(self.fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _reopen(self) -> None:
        fd = _open(self.path)  # may raise: `self.fd` is still the one to close
        _close(self.fd)
        self.fd = fd


_OPEN_FDS: set[int] = set()  # this process's descriptors of lock files, which its forked children must not keep


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _not_in_forks(fd)
    return fd


def _open_dup(fd: int) -> int:
    mine = os.dup(fd)
    _not_in_forks(mine)
    return mine


def _close(fd: int) -> None:
    _OPEN_FDS.discard(fd)  # before its number can be given to another file
    os.close(fd)


def _not_in_forks(fd: int) -> None:
    """A forked child shares the lock's open file: each child closes its copy at once, which leaves
    the parent's lock as it is."""
    _register_fork_hook()
    _OPEN_FDS.add(fd)


@functools.cache
def _register_fork_hook() -> None:
    os.register_at_fork(after_in_child=_close_in_child)  # once per process: _OPEN_FDS says what to close


def _close_in_child() -> None:
    for fd in _OPEN_FDS:
        try:
            os.close(fd)
        except OSError:  # closed already in this child
            continue
    _OPEN_FDS.clear()
