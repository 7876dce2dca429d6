"""What a job writes to its tracking run, declared once, whoever keeps the run.

Three classes implement `JobRun`: `MlflowRun` writes in this process (tune, bench, eval and
`dlpipe sync`), `SidecarRun` carries each call over a pipe to the tracking process, where an
`MlflowRun` carries it out (training), and `NullRun` records nothing (tracking=none). The tasks are
written against this Protocol; the tracking process forwards exactly these calls by name, so a
method added here and to MlflowRun is all it takes to send a new kind of write
(tests/test_tracking_protocol.py holds the three to the same signatures).
"""

from pathlib import Path
from typing import Protocol


class JobRun(Protocol):
    """One tracking run of one job; a context manager that ends it with an honest status (FINISHED,
    FAILED or KILLED from the exception that left the block), never leaving it RUNNING."""

    run_id: str | None  # None until opened, and with tracking=none
    status: str | None  # how it ended (", not sent" appended while its end waits in the outbox)

    def log_params(self, params: dict[str, object], compared: dict[str, list[str]] | None = None) -> None:
        """Params; `compared` names those a resumed run may find changed (tracking.outbox)."""

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffered: cheap inside the training loop; sent by flush()."""

    def flush(self) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def log_inputs(self, described: dict) -> None:
        """The training data as an MLflow dataset input (tracking.dataset_input)."""

    def log_artifact(self, path, artifact_path: str | None = None) -> None: ...

    def log_pytorch_model(self, path: Path, step: int) -> None:
        """A model file written by tasks.logged_model, logged as an MLflow PyTorch model and removed."""

    def watch_system(self) -> None:
        """MLflow's own system-metrics monitor on this run, until it ends (tracking.system_metrics)."""

    def end(self, status: str, reason: str | None = None) -> None: ...

    def __enter__(self) -> "JobRun": ...

    def __exit__(self, exc_type, exc, tb) -> bool: ...
