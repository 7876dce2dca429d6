"""The tracking process: a training job's MLflow run (tracking.run.MlflowRun), kept in a process of
its own and driven over a pipe by tracking.sidecar_run.

Why a process: importing mlflow and opening the store cost a launch 2.5-3 s of CPU (1.7 s import,
0.8 s opening SQLite). Started first thing, this process pays them on another core while the
training process builds the data and the model; a thread would not, since both halves are Python
holding one GIL. Writes are done here too, so the store's CPU per metric row (75-200 us on SQLite)
leaves the training process.

It ignores the stop signals (and runs in a session of its own, so a terminal's Ctrl-C does not
reach it): the training process ends the run with the status it knows (KILLED after Ctrl-C or
SIGTERM, FAILED with the reason). When that process dies without ending the run (SIGKILL, the OOM
killer) the pipe closes, and the run is ended here, KILLED, with the metrics it was sent. Every call
is answered once carried out (`done`, `failed` or `ack`): should this process die instead, the
training process keeps the calls not yet answered, and those after, for `dlpipe sync`. Until it
opens a run it has nothing to lose, and SIGTERM ends it (a job refused before its run opens does
not wait for mlflow's import), except while it opens the store: a schema migration is not cut short.

    python -m dlpipe.tracking.sidecar READ_FD WRITE_FD
"""

import logging
import os
import pickle
import signal
import sys
import threading

from dlpipe.errors import DlpipeError, first_line

# Imported inside functions: mlflow (1.7 s) and the run's modules, in the tracking process only, once main()
# has set the stop signals aside (what loads before that stays small); the training process imports this
# module too (Channel, through sidecar_run) and leaves mlflow to this one.

MODULE = "dlpipe.tracking.sidecar"  # what its command line holds: the resource sampler leaves it out
IGNORED_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)  # SIGTERM: see above
ASKED = ("prepare", "open", "end")  # calls answered ("done"); the others are sent and not waited for
STOPPED = "the training process stopped before it ended its run (interrupted while the run opened?)"
ORPHANED = ("the training process ended without ending its run (killed by SIGKILL or the out-of-memory "
            "killer?): ended by dlpipe's tracking process")


class Channel:
    """Pickled messages over a pair of pipes; sends from several threads do not interleave."""

    def __init__(self, read_fd: int, write_fd: int):
        self.fds = (read_fd, write_fd)
        self._in = os.fdopen(read_fd, "rb")
        self._out = os.fdopen(write_fd, "wb")
        self._lock = threading.Lock()

    def drop_in_fork(self) -> None:
        """In a forked child (a DataLoader worker): point this pipe's descriptors at /dev/null. A
        worker holding the training process's end open would keep the tracking process from seeing
        that process die (SIGKILL) until the worker exits too. (dup2, not close: the child's copies
        of the file objects may still close them.)"""
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in self.fds:
            os.dup2(devnull, fd)
        os.close(devnull)

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._out.write(data)
            self._out.flush()

    def receive(self) -> tuple:
        """The next message. EOFError (or OSError, or UnpicklingError for a message cut short) when
        the other side closed its end or died."""
        return pickle.load(self._in)

    def close(self) -> None:
        failed = []
        with self._lock:
            self.fds = ()  # their numbers may be reused from here on: a later fork must not touch them
            for f in (self._out, self._in):
                try:
                    f.close()
                except OSError as e:  # the other side is gone: nothing is left to flush to it
                    failed.append(e)
        for e in failed:  # logged outside the lock: in the tracking process, logging sends through it
            logging.getLogger(__name__).debug("closing the tracking pipe: %s", e)


class _Forward(logging.Handler):
    """This process's log records, sent to the training process, which logs them as its own (its
    console, its job log file); printed here if that process is gone."""

    def __init__(self, channel: Channel):
        super().__init__(logging.INFO)
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        try:
            self.channel.send(("log", record.levelno, record.name, message))
        except (OSError, ValueError):  # the pipe is closed: stderr is what is left
            print(f"dlpipe: {record.levelname.lower()}: {message}", file=sys.stderr, flush=True)


class Host:
    """The run this process keeps, and the calls it takes."""

    def __init__(self, uri: str, timeout_s: float, retries: int):
        self.client = _client_if_store_exists(uri, timeout_s, retries)
        self.run = None

    def handle(self, call: str, args: tuple):
        if call == "open":
            from dlpipe.tracking.run import MlflowRun

            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on there is a run to end
            self.run = MlflowRun(**args[0], client=self.client)
            return self.run.run_id, self.run.resumed
        if call == "end":
            self.run.end(*args)
            return self.run.status
        return getattr(self.run, call)(*args)  # tracking.protocols.JobRun's calls, and write_rows

    def orphaned(self, reason: str) -> None:
        """The training process is gone or done without ending its run: end it, if it is still going."""
        if self.run is not None and self.run.status is None:
            self.run.end("KILLED", reason)


def _client_if_store_exists(uri: str, timeout_s: float, retries: int):
    """An MlflowClient opened now, or None when the store would be made by opening it: the job may
    still be refused, and a refused job leaves nothing behind (the run's opening makes it then)."""
    import mlflow.entities  # noqa: F401  (the import is most of the cost this process takes off the launch)

    from dlpipe.tracking.client import client_for
    from dlpipe.tracking.store_lock import sqlite_path

    db = sqlite_path(uri)
    if db is not None and not db.exists():
        return None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # opening may migrate the store's schema: not cut short
    try:
        return client_for(uri, timeout_s, retries)
    except Exception as e:  # opening it again when the run opens raises this for the job to report
        logging.getLogger(__name__).debug("opening %s ahead of the run failed: %s", uri, e)
        return None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def serve(channel: Channel) -> None:
    """Take calls until the run ends, the training process says it is done, or it is gone. Whatever
    ends this loop (a broken pipe while answering, a message cut short), a run still going is ended."""
    try:
        _, settings = channel.receive()  # ("prepare", (uri, timeout_s, retries)): sent at once
    except Exception:  # EOF, a closed pipe, a message cut short: the training process is gone
        return
    host = Host(*settings)
    reason = ORPHANED
    try:
        channel.send(("done", "prepare", None))  # the training process measures its loader only after this
        while True:
            try:
                call, args = channel.receive()
            except Exception:  # EOF, a closed pipe, a message cut short: the training process is gone
                return
            if call == "quit":  # the job ended without ending a run it opened (interrupted while it opened)
                reason = STOPPED
                return
            try:
                result = host.handle(call, args)
            except Exception as e:  # the training process raises it, as the call's own or at its next call
                user = isinstance(e, DlpipeError)
                channel.send(("failed", call, type(e).__name__, str(e) if user else first_line(e), user))
            else:
                # every call is answered, also those not waited for: the training process keeps what
                # it sent until then, and keeps it for `dlpipe sync` if this process dies first
                channel.send(("done", call, result) if call in ASKED else ("ack", call))
            if call == "end":
                return
    except OSError as e:  # the pipe broke while answering: the training process is gone (kill -9)
        logging.getLogger(__name__).debug("answering the training process: %s", e)
    finally:
        host.orphaned(reason)


def main(argv: list[str]) -> int:
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    fds = (int(argv[0]), int(argv[1]))
    for fd in fds:  # pass_fds made them inheritable: a process started from here must not hold the pipe
        os.set_inheritable(fd, False)
    channel = Channel(*fds)
    root = logging.getLogger()
    root.addHandler(_Forward(channel))
    root.setLevel(logging.INFO)
    try:
        serve(channel)
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Without the interpreter's teardown (0.5-0.7 s of unloading mlflow, SQLAlchemy and their atexit
    # hooks), which the training process would wait for: the run has ended, its writes are committed.
    os._exit(code)
