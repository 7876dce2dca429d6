"""MLflow runs: params, tags, metrics, artifacts, and the parent/child link of sweeps.

mlflow is imported only when a run starts (it costs 1-2 s); a training job keeps its run in a
process of its own (tracking.sidecar), which pays that while the job is built. Metrics are buffered in memory, as
plain tuples (0.35 us a metric), and written in batches when the runner calls `flush()` at the end
of each epoch. Measured on 2 CPUs: a synchronous write to SQLite costs 2.5-16 ms per call, and
MLflow's own asynchronous queue (`synchronous=False`) cost far more than it saves, because its
writer thread competes with the training loop for the GIL (0.14x the steps/s with a metric every
step, 0.87x every 50 steps; benchmarks/telemetry_overhead.py). Writing is what costs: MLflow's SQL
store spends 75-200 us of CPU per metric row in log_batch (an ORM object, validation, the latest
value), about 10% of a 1 ms step logged every step, paid at the epoch's flush; against a tracking
server that work is the server's. Writing rows into MLflow's tables directly would be ~8 us a row,
but ties dlpipe to MLflow's private store classes and schema: not done.
Runs always end FINISHED, FAILED or KILLED.

When the server goes away mid-run, training goes on: one warning, and every write from then on
is kept in an Outbox (memory plus a file in the output directory) and delivered, in order, when a
connect succeeds again (tried at most every `retry_every_s`, at metric flushes) or at the end,
which waits up to `offline_wait_s` for the server before leaving the file to `dlpipe sync`.
"""

# Imported inside functions: mlflow (1-2 s) and torch, which a training process using sidecar_run never loads.
import logging
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

from dlpipe.errors import first_line, user_message
from dlpipe.redact import redact_text
from dlpipe.stop import Terminated
from dlpipe.tracking.abandoned import END_REASON_TAG, Owner, close_previous, write_marker
from dlpipe.tracking.client import client_for, experiment_id
from dlpipe.tracking.dataset_input import log_inputs
from dlpipe.tracking.metric_names import metric_rows
from dlpipe.tracking.outbox import (
    MAX_METRICS_PER_BATCH,
    Outbox,
    clipped,
    compared_params,
    connect_error,
    described,
    outage_reason,
    send_params,
    set_aside,
    set_aside_for,
    unreachable,
)
from dlpipe.tracking.store_lock import absolute_uri
from dlpipe.tracking.system_metrics import start_system_monitor, stop_system_monitor

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # a connect attempt while the server is away: bounds the stall of a flush
MAX_PENDING_METRICS = 20000  # flush mid-epoch beyond this, so a very long epoch holds bounded memory
PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs under
PARENT_RUN_ENV = "DLPIPE_PARENT_RUN_ID"  # the sweep parent's run id, set by sweeps.callback for its jobs


class MlflowRun:
    """One MLflow run, used as a context manager that always ends it with an honest status."""

    def __init__(self, uri: str, experiment: str, run_name: str | None, tags: dict[str, str],
                 parent_run_id: str | None = None, timeout_s: float = 10.0, retries: int = 2,
                 resume_run_id: str | None = None, outbox_path: Path | None = None,
                 retry_every_s: float = 30.0, offline_wait_s: float = 30.0, marker_dir: Path | None = None,
                 client=None):
        """A new run, or with `resume_run_id` the run a checkpoint was written by, reopened.

        `outbox_path` is where writes the server could not take are kept while it is away.
        `marker_dir` (a job's output folder) records which run this process opened; a run an
        earlier job there left RUNNING is ended first (tracking.abandoned). `client`: one already
        opened on `uri` (tracking.run_process opens it while the job is being built).
        """
        self.uri = uri
        self.client = client if client is not None else client_for(uri, timeout_s, retries)
        self.experiment_id = experiment_id(self.client, experiment)
        self.status: str | None = None
        self._pending: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self.resumed = False
        self._system_monitor = None  # MLflow's, with tracking.system_metrics (watch_system)
        self.retry_every_s, self.offline_wait_s = retry_every_s, offline_wait_s
        self.probe_timeout_s = min(PROBE_TIMEOUT_S, timeout_s)
        self.offline_since: float | None = None  # monotonic time the current outage began
        self.outages: list[str] = []
        self._last_attempt = 0.0
        tags = dict(tags)
        if parent_run_id:
            tags[PARENT_TAG] = parent_run_id
        where = absolute_uri(uri)  # what files in the output folder record: valid from any working directory
        self.run_id = self._open(resume_run_id, run_name, tags, marker_dir, where)
        try:
            if marker_dir is not None:
                write_marker(marker_dir, self.run_id, where)
            self.outbox = Outbox(where, self.run_id, outbox_path, owner=asdict(Owner.this_process()))
            if outbox_path is not None and outbox_path.exists():
                self._take_over(outbox_path)
            # (key, step) already in a reopened run: a resume from an older checkpoint repeats epochs
            self._logged_steps = self._latest_steps() if self.resumed else {}
            if self.resumed:
                self.set_tags(tags)
        except BaseException as e:
            self._fail_opening(e)
            raise

    def _open(self, resume_run_id: str | None, run_name: str | None, tags: dict[str, str], marker_dir: Path | None,
              where: str) -> str:
        """The checkpoint's run reopened, or a new one; a run an earlier job in `marker_dir` left
        RUNNING is ended first (unless it is the one reopened)."""
        if marker_dir is not None:
            close_previous(self.client, marker_dir, where, resume_run_id)
        if resume_run_id and self._reopen(resume_run_id):
            self.resumed = True
            return resume_run_id
        if resume_run_id and marker_dir is not None:  # not reopened after all: not spared either
            close_previous(self.client, marker_dir, where, None)
        return self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id

    def _fail_opening(self, error: BaseException) -> None:
        """The run exists but opening it failed part-way (the constructor raises, so no `with` ends
        it): end it FAILED rather than leave it RUNNING."""
        try:
            self.client.set_tag(self.run_id, END_REASON_TAG, f"opening the run failed: {type(error).__name__}")
            self.client.set_terminated(self.run_id, "FAILED")
        except Exception as e:  # the store is away too: a later job in this folder ends it (tracking.abandoned)
            log.warning("MLflow run %s could not be ended after a failed start (%s)", self.run_id,
                        redact_text(outage_reason(e)))

    def _take_over(self, path: Path) -> None:
        """The outbox an earlier attempt left in this folder. This run's writes are sent first (or,
        with the store still away, kept ahead of the new ones); another run's file is moved aside for
        `dlpipe sync`, so two runs' writes never share a file; an unreadable one is moved aside too."""
        try:
            left = Outbox.load(path)
        except (OSError, ValueError, KeyError) as e:
            aside = set_aside(path)
            log.warning("%s is unreadable (%s): moved to %s; nothing in it can be sent", path, first_line(e), aside)
            return
        if left.run_id != self.run_id:
            aside = set_aside_for(path, left.run_id)
            log.warning("%s holds writes for MLflow run %s, not this one: moved to %s for `dlpipe sync`",
                        path, left.run_id, aside)
            return
        left.entries = [e for e in left.entries if "end" not in e]  # this run goes on: no old end
        counts = left.counts()  # before sending: send() drops what it delivers
        try:
            left.send(self.client)
        except Exception as e:
            if not unreachable(e):
                raise
            self.outbox.entries = left.entries  # the file holds them already: new writes go after them
            self._went_away(e)
            return
        log.info("sent %s kept by the previous attempt", described(counts))

    def _reopen(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:
            if unreachable(e):  # whether the run exists is unknown: the job cannot open its run (one line)
                raise
            log.warning("the checkpoint's MLflow run %s is not in this store: starting a new run", run_id)
            return False
        if run.info.experiment_id != self.experiment_id:
            log.warning("the checkpoint's MLflow run %s belongs to another experiment: starting a new run", run_id)
            return False
        self.client.update_run(run_id, status="RUNNING")
        if END_REASON_TAG in run.data.tags:  # why the attempt before ended; this one has not
            self.client.delete_tag(run_id, END_REASON_TAG)
        return True

    def _latest_steps(self) -> dict[str, int]:
        """The newest step of each metric the run holds (MLflow keeps each key's latest Metric)."""
        run = self.client.get_run(self.run_id)
        return {m.key: m.step for m in run.data._metric_objs}  # no public accessor for the steps

    def log_params(self, params: dict[str, object], compared: dict[str, list[str]] | None = None) -> None:
        """Log params; on a reopened run, only new ones (MLflow params cannot change), and for each tag of
        `compared` (tag -> keys; default: every key under dlpipe.resumed_changed_params) tag those of its
        keys whose values differ from the run's first (host facts such as free memory say nothing).
        Kept, like every write, while the server is away; a reopened run is compared on delivery."""
        values = clipped(params)
        compared = compared_params(values, self.resumed, compared)
        pending = dict(values)  # what a failure part-way leaves unsent (send_params removes what it sent)
        self._write(lambda: send_params(self.client, self.run_id, pending, compared),
                    lambda: self.outbox.params(pending, compared))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        tags = clipped(tags)
        self._write(lambda: self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()]),
                    lambda: self.outbox.tags(tags))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics (with their step and wall-clock time); they are written by flush(). Called
        inside the training loop, so it only appends tuples; MLflow's Metric entities are built when
        the rows are written. Names are MLflow's (metric_names: `val_loss` is logged as `val/loss`)."""
        self.write_rows(metric_rows(metrics, step), flush=False)

    def write_rows(self, rows: list[tuple[str, float, int, int]], flush: bool = True) -> None:
        """Rows made by `metric_rows`, buffered, then written (a flush) if `flush` or the buffer is full."""
        self._pending.extend(rows)
        if flush or len(self._pending) >= MAX_PENDING_METRICS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered metrics, in MLflow-sized batches (the runner calls this per epoch)."""
        from mlflow.entities import Metric

        pending, self._pending = self._pending, []
        # One value per (name, step), the last: `epoch` comes with an epoch's row and with the step
        # log of its last step, and a store may refuse a batch that repeats a key at one step.
        pending = list({(row[0], row[3]): row for row in pending}.values())
        if self._logged_steps:
            logged = self._logged_steps
            pending = [row for row in pending if row[3] > logged.get(row[0], row[3] - 1)]
        for i in range(0, len(pending), MAX_METRICS_PER_BATCH):
            batch = [Metric(*row) for row in pending[i : i + MAX_METRICS_PER_BATCH]]
            # _write calls one of the two now, so binding `batch` per iteration is only for clarity
            self._write(partial(self.client.log_batch, self.run_id, metrics=batch), partial(self.outbox.metrics, batch))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._write(lambda: self.client.log_text(self.run_id, text, artifact_file),
                    lambda: self.outbox.text(text, artifact_file))

    def log_inputs(self, described: dict) -> None:
        """The dataset as the run's input, once per split it fed (tracking.dataset_input.describe)."""
        self._write(lambda: log_inputs(self.client, self.run_id, described),
                    lambda: self.outbox.inputs(described))

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self._write(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path),
                    lambda: self.outbox.artifact(path, artifact_path))

    def _write(self, send, keep) -> None:
        """Send now; or, while the server is away, keep the write (after those already kept)."""
        if self.offline_since is None:
            try:
                send()
                return
            except Exception as e:
                if not unreachable(e):
                    raise
                self._went_away(e)
        keep()
        self._reconnect()

    def _went_away(self, error: Exception) -> None:
        self.offline_since = self._last_attempt = time.monotonic()
        log.warning("%s (%s): training continues; metrics are kept in %s and sent when it is back", self._outage(),
                    redact_text(outage_reason(error))[:200], self.outbox.path or "memory")

    def _outage(self, still: str = "") -> str:
        if self.uri.startswith("http"):
            return f"tracking server {still}unreachable"
        return f"tracking store {still}cannot take writes"  # a local store: full, locked or read-only

    def _reconnect(self, force: bool = False) -> bool:
        """Deliver the kept writes if the server answers again (tried at most every retry_every_s)."""
        now = time.monotonic()
        if not force and now - self._last_attempt < self.retry_every_s:
            return False
        self._last_attempt = now
        if connect_error(self.uri, self.probe_timeout_s) is not None:
            return False
        counts = self.outbox.counts()
        try:
            self.outbox.send(self.client)
        except Exception as e:
            if unreachable(e):
                return False  # it answered a connect but not the requests: try again later
            raise
        outage = f"unreachable for {time.monotonic() - self.offline_since:.0f} s; sent late: {described(counts)}"
        self.outages.append(outage)
        log.warning("tracking server is back (%s)", outage)
        self.offline_since = None
        return True

    def log_pytorch_model(self, path, step: int) -> None:
        """The model file at `path` as an MLflow PyTorch model (tracking.pytorch_model: imports torch)."""
        from dlpipe.tracking.pytorch_model import log_pytorch_model

        log_pytorch_model(self, str(path), step)

    def watch_system(self) -> None:
        """Start MLflow's own system-metrics monitor on this run, until the run ends."""
        self._system_monitor = start_system_monitor(self.run_id, self.resumed, absolute_uri(self.uri))

    def end(self, status: str, reason: str | None = None) -> None:
        """Write what is buffered and mark the run ended; if the server is away, wait for it up to
        offline_wait_s, then leave everything in the outbox file for `dlpipe sync`."""
        monitor, self._system_monitor = self._system_monitor, None
        if monitor is not None:
            stop_system_monitor(monitor)  # its last samples go in while the run is still RUNNING
        try:
            self.flush()  # a failed or killed run keeps the metrics it measured
            if reason:
                self.set_tags({END_REASON_TAG: reason})
        finally:
            deadline = time.monotonic() + self.offline_wait_s
            while self.offline_since is not None and time.monotonic() < deadline:
                time.sleep(min(2.0, max(deadline - time.monotonic(), 0)))
                self._reconnect(force=True)
            if self.offline_since is not None:
                self.outages.append("unreachable at the end")
            if self.outages:
                self.set_tags({"dlpipe.tracking_outages": "; ".join(self.outages)})
            # the status matters more than the reason: never leave the run RUNNING
            self._write(lambda: self.client.set_terminated(self.run_id, status), lambda: self.outbox.end(status))
            self.status = status
            if self.offline_since is not None:
                self.status = f"{status}, not sent"
                log.error("%s after %g s: %s", self._outage("still "), self.offline_wait_s,
                          self.outbox.kept_for_sync(status))

    def __enter__(self) -> "MlflowRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.end(*end_status(exc_type, exc))
        return False  # never swallow the exception


def end_status(exc_type, exc) -> tuple[str, str | None]:
    """(status, reason) of a run whose block ended with this exception (None: it did not raise)."""
    if exc_type is None:
        return "FINISHED", None
    if issubclass(exc_type, KeyboardInterrupt):
        return "KILLED", "interrupted (Ctrl-C)"
    if issubclass(exc_type, Terminated):
        return "KILLED", f"terminated ({exc})"
    return "FAILED", f"{exc_type.__name__}: {' '.join(user_message(exc))}"

