"""MLFLOW_RUN_ID: log a training job into a run that already exists (HF Trainer's convention).

Checked before anything is built: a sweep, bench, tune or eval cannot all log into one run, and a
run id the store does not hold (or one in another experiment) is refused in one line, instead of
training first and then starting a new run with a warning, as a checkpoint's stale run id does.

A run that already holds a dlpipe job's training metrics is continued only by a job that resumes
from a checkpoint: a job starting at step 0 would log every metric at a (key, step) the run holds,
and dlpipe never logs one twice (a resumed job repeats epochs), so all its metrics would be dropped
while its params and tags mixed with the first job's. A run made empty by the user
(`mlflow.start_run()`, then dlpipe), or holding only the user's own metrics, is continued as given.
"""

import logging
import os
from collections.abc import Mapping

from dlpipe.errors import ConfigError, first_line
from dlpipe.redact import redact_text
from dlpipe.tracking.client import client_for
from dlpipe.tracking.metric_names import SECTIONS

# Imported inside functions: mlflow (seconds), only when MLFLOW_RUN_ID names a run to check: the CLI imports
# this module, and `dlpipe --help` must not load mlflow.

log = logging.getLogger("dlpipe")

RUN_ID_ENV = "MLFLOW_RUN_ID"
# What a dlpipe training job logs (tracking.metric_names): `epoch` and its sections, but `system/`,
# which MLflow's own system metrics share; `val/` holds the validation metrics.
TRAINING_PREFIXES = tuple(f"{section}/" for section in SECTIONS if section != "system") + ("val/",)


def refuse_outside_training(task: str, multirun: bool, environ: Mapping[str, str] = os.environ) -> None:
    """MLFLOW_RUN_ID names one run: a sweep's jobs, bench, tune and eval cannot all continue it."""
    run_id = environ.get(RUN_ID_ENV, "").strip()
    if run_id and (multirun or task != "train"):
        what = "--multirun" if multirun else f"dlpipe {task}"
        raise ConfigError([f"{RUN_ID_ENV}={run_id} (environment variable): continues one training run; "
                           f"unset it for {what}"])


def given_run_id(tracking, resumes: bool = False, environ: Mapping[str, str] = os.environ) -> str | None:
    """The run MLFLOW_RUN_ID names, checked against the store; None when unset or without tracking.
    `tracking`: the validated TrackingConfig; `resumes`: the job resumes from a checkpoint if one is
    readable (checkpoint.resume is not never, and its folder holds one)."""
    run_id = environ.get(RUN_ID_ENV, "").strip()
    if not run_id or not tracking.enabled:
        return None
    from mlflow.exceptions import MlflowException

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
    if not resumes and _trained(run.data.metrics):
        raise ConfigError([f"{said}: {_trained(run.data.metrics)}; this job starts at step 0, and a metric "
                           "is never logged twice at one step, so all of its metrics would be dropped; "
                           f"{_what_to_do(run.data.tags.get('dlpipe.output_dir'))}, or unset {RUN_ID_ENV} for a "
                           "new run"])
    return run_id


def _trained(metrics: dict[str, float]) -> str | None:
    """What says the run holds a dlpipe job's training metrics, or None (an empty run, the user's own metrics)."""
    if "epoch" in metrics:
        return f"the run already holds the training metrics of {int(metrics['epoch'])} epoch(s)"
    ours = sorted(k for k in metrics if k.startswith(TRAINING_PREFIXES))
    return f"the run already holds training metrics ({', '.join(ours[:3])})" if ours else None


def _what_to_do(folder: str | None) -> str:
    where = f"hydra.run.dir={folder}" if folder else "hydra.run.dir=<its output folder>"
    return f"to continue it, resume the job that trained it (checkpoint.resume=must {where})"
