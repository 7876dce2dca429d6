"""The training process's handle on its tracking process (tracking.sidecar): MlflowRun's interface,
carried out over a pipe.

`SidecarRun.start` launches the process, which imports mlflow and opens the store at once (the CLI
starts it before it resolves the config: resolving imports torch). `wait_prepared` waits for that
to be done: the loader is measured after it, so that our own process does not skew the timings (on
2 vCPUs that share a core, its import slowed the main process's probe by a third). `open` (after
the job is built) creates or reopens the run there and waits for its id. Every other call
is sent and not waited for: metrics are buffered here as tuples and sent at each flush, so the
training loop never waits for the store. A call that fails in the tracking process is raised here
at the next call (the run's end included), as one line.

Should the tracking process die with the run open (`kill -9` of it alone), training goes on as in a
server outage: the calls it had not answered yet, and every one after, are kept in the output
folder's outbox (tracking.outbox), under this process's name (and in `mlflow_run.json`), with one
warning; the job's last line says to run `dlpipe sync`, which delivers them and ends the run with
the status the job ended with.
"""

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import weakref
from collections import deque
from pathlib import Path

import psutil

from dlpipe.errors import DlpipeError
from dlpipe.redact import redact_text
from dlpipe.tracking.abandoned import PREVIOUS_WAIT_S, Owner, continue_outbox, keep_call, write_marker
from dlpipe.tracking.metric_names import metric_rows
from dlpipe.tracking.run import MAX_PENDING_METRICS, end_status
from dlpipe.tracking.sidecar import ASKED, MODULE, Channel
from dlpipe.tracking.store_lock import absolute_uri

log = logging.getLogger(__name__)

EXIT_WAIT_S = 30.0  # for the process to exit once its run ended (it ended the run first: nothing is lost)


class SidecarRun:
    """One MLflow run kept by a tracking process; a context manager that ends it with an honest status."""

    run_id: str | None = None
    status: str | None = None
    resumed = False

    def __init__(self, process: subprocess.Popen, channel: Channel, uri: str):
        self._process, self._channel, self._uri = process, channel, uri
        self._answers: queue.Queue = queue.Queue()
        self._failures: list[str] = []  # failures of calls not waited for (appended by _read), raised at the next call
        self._rows: list[tuple[str, float, int, int]] = []
        self._done = False
        self._prepared = False
        self._exit_wait_s = EXIT_WAIT_S
        self._run_args: dict = {}
        self._unanswered: deque = deque()  # calls sent, not yet answered: lost if the process dies
        self._gone_seen = threading.Event()  # the pipe closed: the process died (or was closed)
        self._kept = None  # an Outbox, once the process died with the run open: its writes, for sync
        threading.Thread(target=self._read, name="dlpipe-tracking-pipe", daemon=True).start()

    @classmethod
    def start(cls, uri: str, timeout_s: float, retries: int) -> "SidecarRun":
        """Launch the tracking process: it imports mlflow and opens the store while the job is built."""
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-m", MODULE, str(to_child), str(from_child)], pass_fds=(to_child, from_child),
            stdin=subprocess.DEVNULL, start_new_session=True)  # a terminal's Ctrl-C is the training process's
        os.close(to_child)
        os.close(from_child)
        channel = Channel(to_parent, from_parent)
        os.register_at_fork(after_in_child=_dropper(weakref.ref(channel)))
        run = cls(process, channel, uri)
        run._send("prepare", (uri, timeout_s, retries))
        return run

    def wait_prepared(self) -> None:
        """Return once the process has imported mlflow and opened the store (or failed to: open says why)."""
        if not self._prepared:
            self._answer("prepare")
            self._prepared = True

    def open(self, **run_args) -> "SidecarRun":
        """Create (or reopen) the run with MlflowRun's arguments; waits for it, raises its refusal."""
        # Opening may wait for an earlier job's tracking process, and an interrupted opening ends
        # its run only after it: close() waits that long before it kills the process.
        self._exit_wait_s = EXIT_WAIT_S + PREVIOUS_WAIT_S + run_args.get("offline_wait_s", 30.0)
        self._run_args = run_args = {**run_args, "tags": {**run_args.get("tags", {}), **self._owner_tag()}}
        try:
            self.wait_prepared()
            self.run_id, self.resumed = self._ask("open", (run_args,))
        except _Failed as f:
            self.close()
            if f.user:
                raise DlpipeError(f.text) from None
            raise DlpipeError(f"tracking.uri={redact_text(self._uri)}: cannot start an MLflow run "
                              f"({f.kind}: {f.text}); use tracking=none to train without tracking") from None
        return self

    def _owner_tag(self) -> dict[str, str]:
        """The tracking process as the run's owner (tracking.abandoned.OWNER_TAG), set as the run opens."""
        try:
            started = psutil.Process(self._process.pid).create_time()
        except psutil.NoSuchProcess:
            return {}  # it died already: opening the run says so
        return Owner(socket.gethostname(), self._process.pid, started).tag()

    # What the job writes: sent, not waited for.
    def log_params(self, params: dict[str, object], compared: dict[str, list[str]] | None = None) -> None:
        self._send("log_params", (params, compared))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._send("set_tags", (tags,))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._send("log_text", (text, artifact_file))

    def log_inputs(self, described: dict) -> None:
        self._send("log_inputs", (described,))

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self._send("log_artifact", (str(Path(path).absolute()), artifact_path))

    def log_pytorch_model(self, path: Path, step: int) -> None:
        """The model tasks.logged_model wrote, logged as an MLflow PyTorch model (tracking.pytorch_model)."""
        self._send("log_pytorch_model", (str(path), step))

    def watch_system(self) -> None:
        self._send("watch_system", ())

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics here (tuples: cheap inside the loop); flush() sends them."""
        self._rows.extend(metric_rows(metrics, step))
        if len(self._rows) >= MAX_PENDING_METRICS:
            self.flush()

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        if rows:
            self._send("write_rows", (rows,))

    def end(self, status: str, reason: str | None = None) -> None:
        """Send what is buffered, end the run (the tracking process waits for an away server as
        MlflowRun.end does), then let the process exit. Failures of earlier calls are logged here,
        not raised: the run has ended either way, and the job's own outcome is what the CLI reports.
        With the process dead, the end is kept with the run's other writes for `dlpipe sync`."""
        try:
            rows, self._rows = self._rows, []
            if rows:
                self._send("write_rows", (rows,), check=False)
            self.status = self._ask("end", (status, reason), check=False)
        except _Failed as f:
            log.error("MLflow run %s: ending it failed: %s", self.run_id, f.text)
        finally:
            for text in self._take_failures():
                log.error("MLflow run %s: %s", self.run_id, text)
            self.close()
        if self._kept is not None:
            self.status = f"{status}, not sent"
            log.error("MLflow run %s: its tracking process died during the run: %s", self.run_id,
                      self._kept.kept_for_sync(status))

    def close(self) -> None:
        """Stop the process; a run it opened that end() did not end, it ends KILLED first. Idempotent."""
        if self._done:
            return
        self._done = True
        if self._process.poll() is None:
            if self.run_id is None:  # no run opened: nothing to lose (it ignores this while opening the store)
                self._process.terminate()
            try:
                self._channel.send(("quit", ()))  # unread after an end: the process is leaving anyway
            except OSError as e:  # it exited between poll() and send(): wait() below reaps it
                log.debug("the tracking process left first: %s", e)
            try:
                self._process.wait(self._exit_wait_s)
            except subprocess.TimeoutExpired:
                log.warning("the tracking process (pid %d) did not exit: killing it", self._process.pid)
                self._process.kill()
                self._process.wait()
        self._channel.close()

    def __enter__(self) -> "SidecarRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.end(*end_status(exc_type, exc))
        except DlpipeError as e:  # the process died: said, without hiding why the job itself ended
            if exc_type is None:
                raise
            log.error("%s", e)
        return False

    def _send(self, call: str, args: tuple, check: bool = True) -> None:
        """Send a call; with `check`, first raise what an earlier call's failure says. Once the
        process has died with the run open, keep the call for `dlpipe sync` instead (_take_over)."""
        if self._kept is None and self.run_id is not None and self._gone_seen.is_set():
            self._take_over()
        if self._kept is not None:
            keep_call(self._kept, call, args, self.resumed)
            return
        if check:
            self._raise_failures()
        self._unanswered.append((call, args))  # before sending: its answer may come at once
        try:
            self._channel.send((call, args))
        except OSError as e:
            if self.run_id is None:
                raise self._gone(call) from e
            self._take_over()  # it holds this call, unanswered

    def _ask(self, call: str, args: tuple, check: bool = True):
        """Send a call and wait for its answer (_answer)."""
        self._send(call, args, check)
        return self._answer(call)

    def _answer(self, call: str):
        """The answer to `call` (one of sidecar.ASKED); its failure raised as _Failed. The run's end,
        when the process died first, is kept with the run's writes (None)."""
        while self._kept is None:
            message = self._answers.get()
            if message[0] == "gone":
                self._answers.put(message)  # for any later call that waits too
                if call != "end" or self.run_id is None:
                    raise self._gone(call)
                self._take_over()
            elif message[1] == call:
                if message[0] == "failed":
                    raise _Failed(*message[2:])
                return message[2]
        return None

    def _take_over(self) -> None:
        """The tracking process died with the run open (kill -9 of it alone): training goes on as in
        a server outage. The calls it had not answered, and every call from now on, are kept in the
        outbox (after what it kept there itself), and the folder's run record names this process."""
        args = self._run_args
        uri = absolute_uri(args["uri"])
        self._kept = continue_outbox(args.get("outbox_path"), uri, self.run_id)
        unanswered, self._unanswered = list(self._unanswered), deque()
        for call, call_args in unanswered:
            keep_call(self._kept, call, call_args, self.resumed)
        if args.get("marker_dir") is not None:
            write_marker(args["marker_dir"], self.run_id, uri)
        try:
            code = self._process.wait(5)
        except subprocess.TimeoutExpired:  # its pipe broke, yet it runs: it may not touch the run again
            self._process.kill()
            code = f"killed by dlpipe; {self._process.wait()}"
        log.warning("tracking: the tracking process (pid %d) exited (code %s) with MLflow run %s open: training "
                    "continues; the run's writes are kept in %s for `dlpipe sync`", self._process.pid, code,
                    self.run_id, self._kept.path or "memory")

    def _take_failures(self) -> list[str]:
        """The lines of the failures of calls not waited for, received so far (each taken once)."""
        taken = self._failures[:len(self._failures)]
        del self._failures[:len(taken)]
        return taken

    def _raise_failures(self) -> None:
        """Raise the first failure of an earlier call not waited for; log any others."""
        failures = self._take_failures()
        for text in failures[1:]:
            log.error("MLflow run %s: %s", self.run_id, text)
        if failures:
            raise DlpipeError(failures[0])

    def _read(self) -> None:
        """The tracking process's messages: its log records logged here, answers to the caller."""
        while True:
            try:
                message = self._channel.receive()
            except Exception:  # EOF, a closed pipe or a message cut short: the process is gone
                self._gone_seen.set()
                self._answers.put(("gone",))
                return
            if message[0] == "log":
                _, level, name, text = message
                logging.getLogger(name).log(level, "%s", text)
                continue
            if self._unanswered:  # calls are carried out, and answered, in the order they were sent
                self._unanswered.popleft()
            if message[0] == "failed" and message[1] not in ASKED:  # raised at the next call
                self._failures.append(_Failed(*message[2:]).line(message[1]))
            elif message[0] != "ack":
                self._answers.put(message)

    def _gone(self, call: str) -> DlpipeError:
        try:
            code = self._process.wait(5)
        except subprocess.TimeoutExpired:  # its pipe broke, yet it runs: say so rather than wait
            code = "none yet"
        return DlpipeError(f"tracking: the tracking process exited (code {code}) before {call}: MLflow run "
                           f"{self.run_id or '(not opened)'} is ended by `dlpipe sync` of its output folder, or "
                           "the next job there")


def _dropper(channel_ref):
    """The fork hook of one channel (hooks cannot be removed: once the channel is gone it does nothing)."""

    def drop() -> None:
        channel = channel_ref()
        if channel is not None:
            channel.drop_in_fork()

    return drop


class _Failed(Exception):
    """A call the tracking process could not carry out."""

    def __init__(self, kind: str, text: str, user: bool):
        super().__init__(text)
        self.kind, self.text, self.user = kind, redact_text(text), user

    def line(self, call: str) -> str:
        return self.text if self.user else f"tracking: {call} failed in the tracking process ({self.kind}: {self.text})"
