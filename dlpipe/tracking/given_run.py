"""MLFLOW_RUN_ID: log a training job into a run that already exists (HF Trainer's convention).

Checked before anything is built: a sweep, bench, tune or eval cannot all log into one run, and a
run id the store does not hold (or one in another experiment) is refused in one line, instead of
training first and then starting a new run with a warning, as a checkpoint's stale run id does.
"""

import logging
import os
from collections.abc import Mapping

from dlpipe.errors import ConfigError, first_line
from dlpipe.redact import redact_text

log = logging.getLogger("dlpipe")

RUN_ID_ENV = "MLFLOW_RUN_ID"


def refuse_outside_training(task: str, multirun: bool, environ: Mapping[str, str] = os.environ) -> None:
    """MLFLOW_RUN_ID names one run: a sweep's jobs, bench, tune and eval cannot all continue it."""
    run_id = environ.get(RUN_ID_ENV, "").strip()
    if run_id and (multirun or task != "train"):
        what = "--multirun" if multirun else f"dlpipe {task}"
        raise ConfigError([f"{RUN_ID_ENV}={run_id} (environment variable): continues one training run; "
                           f"unset it for {what}"])


def given_run_id(tracking, environ: Mapping[str, str] = os.environ) -> str | None:
    """The run MLFLOW_RUN_ID names, checked against the store; None when unset or without tracking.
    `tracking`: the validated TrackingConfig."""
    run_id = environ.get(RUN_ID_ENV, "").strip()
    if not run_id or not tracking.enabled:
        return None
    from mlflow.exceptions import MlflowException

    from dlpipe.tracking.client import client_for

    said = f"{RUN_ID_ENV}={run_id} (environment variable)"
    store = f"tracking.uri={redact_text(tracking.uri)}"
    client = client_for(tracking.uri, tracking.request_timeout_s, tracking.request_retries)
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise ConfigError([f"{said}: no such run in {store}"]) from None
        raise ConfigError([f"{said}: cannot read the run from {store} ({redact_text(first_line(e))})"]) from None
    if run.info.lifecycle_stage == "deleted":
        raise ConfigError([f"{said}: the run is deleted in {store}; restore it (mlflow runs restore) or unset "
                           f"{RUN_ID_ENV}"])
    if run.info.status == "RUNNING":  # maybe a live job's: both would write into it
        log.warning("%s: the run is RUNNING: if another job still logs to it, both write into one run", said)
    experiment = client.get_experiment(run.info.experiment_id).name
    if experiment != tracking.experiment:
        raise ConfigError([f"{said}: the run is in experiment {experiment!r}, not tracking.experiment="
                           f"{tracking.experiment}; set tracking.experiment={experiment}"])
    return run_id
