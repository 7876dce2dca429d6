"""MLflow runs: params, tags, metrics, artifacts, and the parent/child link of sweeps.

mlflow is imported only when a run starts (it costs 1-2 s). Metrics are buffered in memory and
written in batches when the runner calls `flush()` at the end of each epoch. Measured on 2 CPUs:
a synchronous write to SQLite costs 2.5-16 ms per call, and MLflow's own asynchronous queue
(`synchronous=False`) cost far more than it saves, because its writer thread competes with the
training loop for the GIL (0.14x the steps/s with a metric every step, 0.87x every 50 steps;
benchmarks/telemetry_overhead.py). A list append per metric costs nothing measurable.
Runs always end FINISHED, FAILED or KILLED.
"""

import logging
import os
import time

from dlpipe.errors import DlpipeError, user_message

log = logging.getLogger(__name__)

MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limits
MAX_METRICS_PER_BATCH = 1000
MAX_PENDING_METRICS = 20000  # flush mid-epoch beyond this, so a very long epoch holds bounded memory
MAX_PARAM_CHARS = 6000  # MLflow 3's param value limit
PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs under


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM so the run ends KILLED (BaseException: never swallowed)."""


def client_for(uri: str, timeout_s: float, retries: int):
    """An MlflowClient whose HTTP calls fail in seconds, not MLflow's default of minutes."""
    # MLflow reads these when it builds each request session. The config keys decide (each job of
    # a sweep sets its own), rather than whatever an earlier job or the shell left behind.
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(max(timeout_s, 1)))
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(retries)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # schema migrations of a new SQLite store
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            raise DlpipeError(f"tracking.experiment={name}: this experiment is deleted; restore it or pick another name")
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # another sweep job created it between our lookup and create
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _clip(value) -> str:
    text = str(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."


class MlflowRun:
    """One MLflow run, used as a context manager that always ends it with an honest status."""

    def __init__(self, uri: str, experiment: str, run_name: str | None, tags: dict[str, str],
                 parent_run_id: str | None = None, timeout_s: float = 10.0, retries: int = 2,
                 resume_run_id: str | None = None):
        """A new run, or with `resume_run_id` the run a checkpoint was written by, reopened."""
        self.uri = uri
        self.client = client_for(uri, timeout_s, retries)
        self.experiment_id = experiment_id(self.client, experiment)
        self.status: str | None = None
        self._pending: list = []
        self.resumed = False
        tags = dict(tags)
        if parent_run_id:
            tags[PARENT_TAG] = parent_run_id
        if resume_run_id and self._reopen(resume_run_id):
            self.run_id = resume_run_id
            self.resumed = True
            self.set_tags(tags)
            return
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id

    def _reopen(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            log.warning("the checkpoint's MLflow run %s is not in this store: starting a new run", run_id)
            return False
        if run.info.experiment_id != self.experiment_id:
            log.warning("the checkpoint's MLflow run %s belongs to another experiment: starting a new run", run_id)
            return False
        self.client.update_run(run_id, status="RUNNING")
        return True

    def log_params(self, params: dict[str, object]) -> None:
        """Log params; on a reopened run, only new ones (MLflow params cannot change) and tag the
        keys whose values differ from what the run recorded first."""
        from mlflow.entities import Param

        values = {k: _clip(v) for k, v in params.items()}
        if self.resumed:
            logged = self.client.get_run(self.run_id).data.params
            changed = sorted(k for k, v in values.items() if k in logged and logged[k] != v)
            if changed:
                self.set_tags({"dlpipe.resumed_changed_params": ", ".join(changed)})
            values = {k: v for k, v in values.items() if k not in logged}
        items = [Param(k, v) for k, v in sorted(values.items())]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, _clip(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics (with their step and wall-clock time); they are written by flush()."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())
        if len(self._pending) >= MAX_PENDING_METRICS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered metrics, in MLflow-sized batches (the runner calls this per epoch)."""
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[i : i + MAX_METRICS_PER_BATCH])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def end(self, status: str, reason: str | None = None) -> None:
        """Write what is buffered and mark the run ended."""
        try:
            self.flush()  # a failed or killed run keeps the metrics it measured
            if reason:
                self.set_tags({"dlpipe.end_reason": reason})
        finally:
            # the status matters more than the reason: never leave the run RUNNING
            self.client.set_terminated(self.run_id, status)
            self.status = status

    def __enter__(self) -> "MlflowRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.end("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.end("KILLED", "interrupted (Ctrl-C)")
        elif issubclass(exc_type, Terminated):
            self.end("KILLED", f"terminated ({exc})")
        else:
            self.end("FAILED", f"{exc_type.__name__}: {' '.join(user_message(exc))}")
        return False  # never swallow the exception


class NullRun:
    """tracking=none: the same interface, recording nothing."""

    run_id = None
    status = None

    def log_params(self, params): ...
    def set_tags(self, tags): ...
    def log_metrics(self, metrics, step): ...
    def flush(self): ...
    def log_text(self, text, artifact_file): ...
    def log_artifact(self, path, artifact_path=None): ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
