"""Hydra callback: a `--multirun` sweep becomes one parent MLflow run with a child run per job.

The parent's id reaches the jobs through an environment variable, which every launcher passes on:
the basic launcher runs jobs in this process, submitit's local and Slurm executors inherit the
submitting environment. At the end the parent gets the sweep's summary (sweeps.summary): a comparison
table (sweep_summary.md), the same numbers as bar charts (sweep_summary.png), and the best job by the
objective and the fastest job, each named only beyond the sweep's noise (sweeps.verdict).

The parent is recorded in the sweep's folder (`mlflow_run.json`, tracking.abandoned), so a sweep
process killed outright leaves a trace: `dlpipe sync` or a later sweep there ends the parent KILLED.
A sweep run again in the same folder (an explicit hydra.sweep.dir) continues that parent, as each job
resumes its own run from its folder's checkpoint: the jobs stay its children and the summary counts
each job folder's latest run once. With checkpoint.resume=never the jobs start over, and so does the
sweep: a new parent.

Hydra turns exceptions in callbacks into warnings, so a failure here never stops the sweep; the
tests check the parent/child link in a real store to catch a silently broken callback.
"""

import atexit
import json
import logging
import os
import signal
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dlpipe.machine.disk import unwritable
from dlpipe.redact import redact_overrides, without_password
from dlpipe.stop import STOP_SIGNALS, hold_or_raise, stop_error
from dlpipe.sweeps.jobs import JOB_NUM_TAG
from dlpipe.sweeps.summary import summarise, tag_value
from dlpipe.sweeps.verdict import VERDICT_TAGS
from dlpipe.tracking.abandoned import END_REASON_TAG, FOLDER_TAGS, Owner, close_previous, read_marker, write_marker
from dlpipe.tracking.client import client_for, experiment_id
from dlpipe.tracking.context_tags import context_tags
from dlpipe.tracking.run import PARENT_RUN_ENV, PARENT_TAG, end_status
from dlpipe.tracking.run_names import SWEPT_KEYS_ENV, override_key, sweep_name
from dlpipe.tracking.store_lock import absolute_uri
from dlpipe.tracking.where_to_look import where_to_look

# Imported inside functions: mlflow (seconds), only in a --multirun sweep that tracks: Hydra loads this
# callback for every job (conf/config.yaml's hydra.callbacks), `dlpipe plan` and untracked runs too.

log = logging.getLogger("dlpipe")

FAILED_TAG_PREFIX = "dlpipe.failed_job."  # + Hydra job number -> that job's overrides


NOTE_TAG = "mlflow.note.content"
"""A run's description in the MLflow UI (markdown)."""
SUMMARY_TAGS = (END_REASON_TAG, "dlpipe.jobs", "dlpipe.failed_jobs", "dlpipe.failed_overrides", *VERDICT_TAGS,
                NOTE_TAG)
"""What the end of a sweep writes on its parent: a continued parent drops the last attempt's."""


def swept_keys(overrides: list[str]) -> list[str]:
    """The keys a sweep's overrides sweep (`a=1,2`, `range(...)`, `choice(...)`...), by Hydra's own parser."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [override_key(o.input_line) for o in parsed if o.is_sweep_override()]


class SweepTracking(Callback):
    """Creates the sweep's parent run, records failed jobs on it, and ends it with a summary."""

    def __init__(self) -> None:
        self.client = None
        self.parent_id: str | None = None
        self.interrupted: str | None = None
        self.ended: tuple[str, str] | None = None  # (status, reason) the launcher gave (ended_by)
        self.every_job_runs = True  # whether Hydra runs every job even when one fails (_every_job_runs)
        self._previous_handlers: dict = {}
        self.look: tuple[str, str, str] | None = None  # the parent's tracking URI, experiment name and id

    def __getstate__(self):
        # Launchers that run jobs elsewhere (submitit) pickle the callbacks with the task;
        # the client is rebuilt from the job's own config there.
        return {**self.__dict__, "client": None, "_previous_handlers": {}}

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        tracking = OmegaConf.to_container(config.tracking, resolve=True)
        if not tracking["enabled"]:
            return
        folder = Path(config.hydra.sweep.dir).absolute()
        if unwritable(folder):
            return  # Hydra cannot make the sweep's folder and stops before any job: no parent run to end
        self.client = client_for(tracking["uri"], tracking["request_timeout_s"], tracking["request_retries"])
        exp = experiment_id(self.client, tracking["experiment"])
        where = absolute_uri(tracking["uri"])
        given = list(config.hydra.overrides.task)
        recipe = config.hydra.runtime.choices.get("recipe") or "dlpipe"
        swept = swept_keys(given)
        tags = {"dlpipe.role": "sweep", "dlpipe.overrides": " ".join(redact_overrides(given)) or "none",
                "dlpipe.recipe": recipe, "dlpipe.sweep_dir": str(folder), **context_tags(),
                **Owner.this_process().tag()}
        resumes = OmegaConf.select(config, "checkpoint.resume", default="auto") != "never"
        earlier = self._earlier_parent(folder, where, exp) if resumes else None
        close_previous(self.client, folder, where, earlier)  # a killed sweep's parent, not continued: KILLED
        if earlier:
            self.parent_id = self._continue(earlier, tags)
        else:
            run = self.client.create_run(exp, run_name=sweep_name(recipe, given, swept), tags=tags)
            self.parent_id = run.info.run_id
        write_marker(folder, self.parent_id, where)
        self.look = (tracking["uri"], tracking["experiment"], exp)  # where_to_look's, printed at the end
        self.every_job_runs = _every_job_runs(config)
        os.environ[PARENT_RUN_ENV] = self.parent_id
        os.environ[SWEPT_KEYS_ENV] = json.dumps(swept)  # each job is named by its values of these
        # Hydra's sweeper raises a failed job's error before on_multirun_end, and a signal would
        # end the process without it: atexit plus these handlers end the parent in every case.
        atexit.register(self._finish)
        for sig in STOP_SIGNALS:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        log.info("sweep parent MLflow run %s%s", self.parent_id, " (continued)" if earlier else "")

    def _earlier_parent(self, folder: Path, where: str, exp: str) -> str | None:
        """The parent an earlier sweep in this folder recorded, if this sweep continues it: in this
        store and experiment, and not kept by a sweep process still running."""
        from mlflow.exceptions import MlflowException

        marker = read_marker(folder)
        if marker is None or marker.get("uri") != without_password(where):
            return None
        try:
            run = self.client.get_run(marker["run_id"])
        except MlflowException:
            return None  # deleted since
        owner = Owner.from_dict(marker)
        kept = run.info.status == "RUNNING" and (owner is None or owner.gone() is None)
        if run.info.experiment_id != exp or run.data.tags.get("dlpipe.role") != "sweep" or kept:
            return None
        return run.info.run_id

    def _continue(self, parent: str, tags: dict[str, str]) -> str:
        """Reopen the earlier attempt's parent: RUNNING again, its summary and failed jobs dropped
        (this attempt's end writes them anew), this attempt's tags."""
        from mlflow.entities import RunTag

        old = self.client.get_run(parent).data.tags
        for key in [k for k in old if k in SUMMARY_TAGS or k.startswith(FAILED_TAG_PREFIX)]:
            self.client.delete_tag(parent, key)
        self.client.log_batch(parent, tags=[RunTag(k, tag_value(v)) for k, v in tags.items()])
        self.client.update_run(parent, status="RUNNING")
        return parent

    def ended_by(self, status: str, reason: str) -> None:
        """The launcher ended the sweep (hydra_plugins/dlpipe_submitit_launcher.py): the parent ends `status`
        with `reason`, which says what happened (a job cancelled, sbatch's refusal) better than the children can."""
        self.ended = (status, reason)

    def _on_signal(self, signum, frame) -> None:
        self.interrupted = signal.Signals(signum).name
        hold_or_raise(self.interrupted)  # not inside a job's tracking call: it would leave that run RUNNING

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        # Runs in the job's process (this one for the basic launcher, a submitit worker otherwise),
        # so a failure is written to the parent run where every process can see it. Jobs that
        # fail on bad values never create a run of their own: this is their only trace.
        parent = os.environ.get(PARENT_RUN_ENV)
        if job_return.status != JobStatus.FAILED or not parent:
            return
        tracking = OmegaConf.to_container(config.tracking, resolve=True)
        client = self.client or client_for(tracking["uri"], tracking["request_timeout_s"], tracking["request_retries"])
        job_num = config.hydra.job.get("num", 0)
        overrides = " ".join(redact_overrides(job_return.overrides or []))
        client.set_tag(parent, f"{FAILED_TAG_PREFIX}{job_num}", tag_value(overrides))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._finish(ended_cleanly=True)

    def _finish(self, ended_cleanly: bool = False) -> None:
        """Summarise the children into the parent and end it FINISHED, FAILED or KILLED."""
        if self.parent_id is None:
            return
        atexit.unregister(self._finish)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        os.environ.pop(PARENT_RUN_ENV, None)
        os.environ.pop(SWEPT_KEYS_ENV, None)
        parent, self.parent_id = self.parent_id, None
        parent_run = self.client.get_run(parent)
        children = latest_per_folder(self.client.search_runs(
            [parent_run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent}'", max_results=10000
        ))
        failed_jobs = {int(k.removeprefix(FAILED_TAG_PREFIX)): v
                       for k, v in parent_run.data.tags.items() if k.startswith(FAILED_TAG_PREFIX)}
        summary = summarise(self.client, parent, children, failed_jobs)

        # A job that failed inside its run is both a non-FINISHED child and a failed-job tag:
        # count jobs by their overrides so it is counted once.
        failed = {v for k, v in parent_run.data.tags.items() if k.startswith(FAILED_TAG_PREFIX)}
        without_run = failed - {r.data.tags.get("dlpipe.overrides") for r in children}
        failed |= {r.data.tags.get("dlpipe.overrides", r.info.run_id) for r in children if r.info.status != "FINISHED"}
        tags = {"dlpipe.jobs": str(len(children)), "dlpipe.failed_jobs": str(len(failed))}
        if failed:
            tags["dlpipe.failed_overrides"] = " | ".join(sorted(failed))
        killed_child = next((r for r in children if r.info.status == "KILLED"), None)
        if self.ended:
            status, tags[END_REASON_TAG] = self.ended
        elif self.interrupted:  # this process got the signal: its reason as a run's (terminated (SIGTERM))
            stop = stop_error(self.interrupted)
            status, tags[END_REASON_TAG] = end_status(type(stop), stop)
        elif killed_child:  # only a job was stopped, not this process: say whose stop it was
            num = killed_child.data.tags.get(JOB_NUM_TAG, "?")
            status = "KILLED"
            tags[END_REASON_TAG] = f"job #{num} was stopped: {killed_child.data.tags.get(END_REASON_TAG, 'KILLED')}"
        elif failed or not ended_cleanly:
            status = "FAILED"
            tags[END_REASON_TAG] = self._failed_reason(len(failed), len(children) + len(without_run))
        else:
            status = "FINISHED"
        if summary is not None:
            tags.update(summary.verdict.tags())
            tags[NOTE_TAG] = summary.text  # the description the UI shows on the parent's page
            for key, value in summary.verdict.metrics().items():
                self.client.log_metric(parent, key, value)
        for k, v in tags.items():
            self.client.set_tag(parent, k, tag_value(v))
        self.client.set_terminated(parent, status)
        if self.look is not None:  # once a sweep: its jobs leave it to here
            (uri, name, exp), self.look = self.look, None
            print(where_to_look(uri, name, experiment_id=exp), flush=True)

    def _failed_reason(self, failed: int, jobs: int) -> str:
        """What ended the sweep FAILED, as it happened: Hydra's basic sweeper runs every job of a
        batch before it raises the first failure, then launches no further batch."""
        if not failed:
            return f"the sweep stopped before its end after {jobs} jobs, none of which failed"
        counted = f"{failed} of {jobs} jobs failed (dlpipe.failed_overrides names them)"
        return counted if self.every_job_runs else f"{counted}; the sweep launched no job after the failed one"


def _every_job_runs(config: DictConfig) -> bool:
    """Whether the sweep runs every job even when one fails: Hydra's basic sweeper in one batch
    (no hydra.sweeper.max_batch_size) does; after a failed batch it launches no other."""
    sweeper = OmegaConf.select(config, "hydra.sweeper._target_", default="") or ""
    return sweeper.endswith("BasicSweeper") and OmegaConf.select(config, "hydra.sweeper.max_batch_size") is None


def latest_per_folder(children: list) -> list:
    """One child per job: the latest run of each job folder (dlpipe.output_dir). A job run again in
    its folder without resuming (killed before its first checkpoint) leaves an earlier run there
    that its new run supersedes; children without the tag are kept as they are."""
    latest: dict[str, object] = {}
    rest = []
    for run in sorted(children, key=lambda r: r.info.start_time):
        folder = run.data.tags.get(FOLDER_TAGS[0])
        if folder is None:
            rest.append(run)
        else:
            latest[folder] = run
    return [*latest.values(), *rest]
