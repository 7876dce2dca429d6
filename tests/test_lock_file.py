"""machine.lock_file on real flocks and real processes: taking, waiting and giving up, the holder's
record and whether it is believed, removal races, and forked children that must not keep a lock."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dlpipe.machine.lock_file import Holder, LockFile, ProcessId

# Another process holding the lock file argv[1], recording itself; with argv[2] == "fork", a child
# it forked lives on (as a DataLoader worker would). The child's pid (0: none) is printed, then it
# sleeps. The forked child prints its own pid: once fork() has returned in the child, the at-fork
# hooks have run there (the parent could print before the child was scheduled at all, and a kill -9
# of the parent would then race the child's hook on a loaded machine).
HOLDING = """
    import os, sys, time
    from pathlib import Path
    from dlpipe.machine.lock_file import LockFile
    lock = LockFile(Path(sys.argv[1]))
    assert lock.take_if_free()
    lock.record()
    child = os.fork() if sys.argv[2] == "fork" else 0
    if child == 0 and sys.argv[2] == "fork":
        print(os.getpid(), flush=True)
        time.sleep(120)
        os._exit(0)
    if child == 0:
        print(0, flush=True)
    time.sleep(120)
"""


def holding(path: Path, fork: bool = False) -> tuple[subprocess.Popen, int]:
    """A process holding `path` (and the pid of the child it forked, or 0), once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDING), str(path), "fork" if fork else "-"],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "the holding process ended before it held the lock"
    return proc, int(line)


def killed(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def test_a_lock_is_one_holders_at_a_time_and_says_who_holds_it(tmp_path):
    """Two descriptors of one file (as two processes have): the second finds the lock held, and the
    record names this process; let go, the record is cleared and the second takes it."""
    path = tmp_path / "x.lock"
    first, second = LockFile(path), LockFile(path)
    assert first.take_if_free()
    first.record()
    assert not second.take_if_free()
    holder = second.holder()
    assert ProcessId(holder.host, holder.pid, holder.started) == ProcessId.this_process()
    assert holder.since == pytest.approx(time.time(), abs=60)
    assert holder.described().startswith(f"pid {os.getpid()} on {os.uname().nodename}, since ")
    first.close()
    assert path.read_text() == ""  # cleared: a later holder that records nothing is not taken for this one
    assert second.take_if_free() and second.holder() is None
    second.close(remove=True)
    assert not path.exists()


def test_another_processs_lock_holds_until_it_is_killed_and_its_record_is_then_not_believed(tmp_path):
    """A holder in another process is named by its pid; killed outright, the kernel lets go of its
    lock at once, and the record it left names a process that is gone: no holder."""
    path = tmp_path / "x.lock"
    proc, _ = holding(path)
    lock = LockFile(path)
    try:
        assert not lock.take_if_free()
        assert lock.holder().pid == proc.pid
    finally:
        killed(proc)
    assert path.read_text().split()[0] == str(proc.pid)  # its record stays in the file
    assert lock.holder() is None
    assert lock.take_if_free()
    lock.close()


def test_a_killed_holders_forked_children_do_not_keep_its_lock(tmp_path):
    """The holder forks a child that lives on: the child closed its copy of the lock at once, so
    the lock is the holder's alone, held while it runs and free as soon as it is killed."""
    path = tmp_path / "x.lock"
    proc, child = holding(path, fork=True)
    lock = LockFile(path)
    try:
        assert child > 0 and not lock.take_if_free()
        killed(proc)
        assert psutil.pid_exists(child)
        assert lock.take_if_free()  # the child would still hold it had it kept its copy
    finally:
        if proc.poll() is None:
            killed(proc)
        os.kill(child, signal.SIGKILL)
    lock.close()


def test_a_wait_polls_until_the_lock_is_let_go_and_gives_up_when_a_poll_raises(tmp_path):
    """`take` waits (in a thread blocked in flock), calling `meanwhile` with the seconds waited; an
    exception from it gives up; a holder letting go ends the wait with the lock taken."""
    path = tmp_path / "x.lock"
    holder, waiter = LockFile(path), LockFile(path)
    assert holder.take_if_free()
    waited = []

    def give_up(seconds: float) -> None:
        waited.append(seconds)
        if len(waited) == 3:
            raise TimeoutError("given up")

    with pytest.raises(TimeoutError):
        waiter.take(give_up, 0.01)
    assert waited == sorted(waited) and not waiter.held
    waiter.close()

    again = LockFile(path)
    again.take(lambda seconds: holder.close(), 0.01)  # the first poll lets the holder go (closing twice is harmless)
    assert again.held and again.take_if_free()
    again.close()


def test_a_lock_file_removed_as_it_is_opened_is_not_the_lock(tmp_path):
    """A holder that removes its file as it lets go: a process that opened the old file takes the one
    made in its place, and a holder never removes a file that is no longer its own."""
    path = tmp_path / "x.lock"
    late, first = LockFile(path), LockFile(path)
    assert first.take_if_free()
    first.close(remove=True)
    assert late.take_if_free()  # the old file's lock was free, but it is no longer the file
    assert path.exists() and os.fstat(late.fd).st_ino == path.stat().st_ino
    path.unlink()
    path.write_text("someone else's\n")
    late.close(remove=True)
    assert path.read_text() == "someone else's\n"


def test_a_process_runs_until_it_ends_and_a_reused_pid_or_a_zombie_is_not_it(tmp_path):
    """running(): this process runs; a zombie and an exited process do not; a record with another
    start time names another process; one on another host cannot be checked (None)."""
    me = ProcessId.this_process()
    assert me.running() is True
    assert ProcessId(me.host, me.pid, me.started - 100).running() is False
    assert ProcessId("elsewhere", me.pid, me.started).running() is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ended = ProcessId(me.host, child.pid, psutil.Process(child.pid).create_time())
    deadline = time.monotonic() + 60
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not yet reaped
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    assert ended.running() is False
    child.wait()
    assert ended.running() is False


@pytest.mark.parametrize("text", ["", "123\n", "12 host 1.0\n", "pid host since started\n", "\xff\n"])
def test_a_record_that_names_no_holder_is_none(tmp_path, text):
    """Nothing, half a line, an older three-field record, words: no holder."""
    path = tmp_path / "x.lock"
    path.write_text(text, encoding="latin-1")
    assert LockFile(path).holder() is None


def test_a_holder_on_another_host_is_believed_as_recorded(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text(Holder("elsewhere", 4242, 1.0, 2.0).line())
    holder = LockFile(path).holder()
    assert holder == Holder("elsewhere", 4242, 1.0, 2.0) and holder.running() is None
