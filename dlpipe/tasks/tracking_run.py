"""The job's tracking run: its tags, the tracking process started early, and the run opened in it
(or in this process, or a NullRun with tracking=none) as a context manager that always ends it.
"""

import logging
import os
import socket

from dlpipe.config.objective import SweepObjective
from dlpipe.config.tracking_checks import env_tags
from dlpipe.errors import DlpipeError, first_line
from dlpipe.machine import slurm
from dlpipe.redact import redact_overrides, redact_text
from dlpipe.schema import TrackingConfig
from dlpipe.stop import Unbroken
from dlpipe.sweeps.jobs import JOB_NUM_TAG
from dlpipe.sweeps.objective import DIRECTION_TAG, OBJECTIVE_TAG
from dlpipe.tasks.preflight import JobContext
from dlpipe.tracking.context_tags import context_tags
from dlpipe.tracking.metric_names import mlflow_name
from dlpipe.tracking.null_run import NullRun
from dlpipe.tracking.outbox import OUTBOX_FILE
from dlpipe.tracking.run import PARENT_RUN_ENV, MlflowRun
from dlpipe.tracking.run_names import job_name, swept_keys_of_parent
from dlpipe.tracking.sidecar_run import SidecarRun
from dlpipe.tracking.where_to_look import where_to_look

log = logging.getLogger("dlpipe")


def run_tags(ctx: JobContext, **extra: str) -> dict[str, str]:
    """Tags every dlpipe run carries (overrides redacted: they may hold a tracking password)."""
    return {
        **env_tags(),  # MLFLOW_TAGS: the user's, under dlpipe's own
        "dlpipe.recipe": ctx.recipe or "none",
        "dlpipe.overrides": " ".join(redact_overrides(ctx.overrides)) or "none",
        "dlpipe.host": socket.gethostname(),
        "dlpipe.output_dir": str(ctx.output_dir),
        # a sweep's summary numbers its rows by it (sweeps.jobs.JOB_NUM_TAG), as Hydra numbers the jobs
        **({JOB_NUM_TAG: str(ctx.job_num)} if ctx.job_num is not None else {}),
        **context_tags(),  # MLflow's own run context: who ran what, from where
        **slurm.job_tags(),  # under Slurm: the job id, array task, partition, nodes (sacct and squeue find it)
        **extra,
    }


def print_where_to_look(ctx: JobContext, tracking: TrackingConfig, run_id: str | None) -> None:
    """The MLflow UI line at a tracked run's end. A sweep's job leaves it to the sweep's parent
    (sweeps.callback), which prints it once after the summary rather than once a job."""
    if run_id and not (ctx.multirun and os.environ.get(PARENT_RUN_ENV)):
        print(where_to_look(tracking.uri, tracking.experiment), flush=True)


def objective_tags(objective: SweepObjective | None) -> dict[str, str]:
    """What a sweep's summary ranks a training run by (sweep.objective): the metric as MLflow names it
    (`val/r2`) and `min` or `max`; none for a run without an objective."""
    if objective is None:
        return {}
    return {OBJECTIVE_TAG: mlflow_name(objective.metric), DIRECTION_TAG: str(objective.direction)}


def start_tracking(tracking: TrackingConfig):
    """The tracking process (tracking.sidecar), started before the job is built so that importing
    mlflow and opening the store overlap the build; None with tracking off. open_run opens the
    run in it; close() it if the job ends before."""
    if not tracking.enabled:
        return None
    return SidecarRun.start(tracking.uri, tracking.request_timeout_s, tracking.request_retries)


def open_run(ctx: JobContext, tracking: TrackingConfig, tags: dict[str, str], resume_run_id: str | None = None,
             sidecar=None, params: dict[str, str] | None = None) -> Unbroken:
    """The job's tracking run (tracking.protocols.JobRun; a NullRun with tracking=none), as a context
    manager that ends it: kept in `sidecar` (start_tracking) when given, else in this process."""
    if not tracking.enabled:
        return NullRun()
    # Named by what distinguishes it (tracking.run_names): in a sweep, its swept values
    swept = swept_keys_of_parent() if ctx.multirun else None
    name = redact_text(tracking.run_name) if tracking.run_name else job_name(ctx.recipe, ctx.overrides, swept, params)
    args = dict(uri=tracking.uri, experiment=tracking.experiment, run_name=name, tags=tags,
                parent_run_id=os.environ.get(PARENT_RUN_ENV) if ctx.multirun else None,
                timeout_s=tracking.request_timeout_s, retries=tracking.request_retries,
                resume_run_id=resume_run_id, outbox_path=ctx.output_dir / OUTBOX_FILE,
                retry_every_s=tracking.retry_every_s, offline_wait_s=tracking.offline_wait_s,
                marker_dir=ctx.output_dir)
    if sidecar is not None:
        return Unbroken(lambda: sidecar.open(**args))

    def start():
        try:
            return MlflowRun(**args)
        except DlpipeError:
            raise
        except Exception as e:  # MLflow raises many types for a bad URI or an unreachable server
            raise DlpipeError(f"tracking.uri={redact_text(tracking.uri)}: cannot start an MLflow run "
                              f"({redact_text(first_line(e))}); use tracking=none to train without tracking") from e

    return Unbroken(start)  # a stop signal while it opens or ends leaves no run RUNNING
