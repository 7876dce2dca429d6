"""`dlpipe ...`: train one job. `run` sets up the ranks; `train` is the job in named phases:
build it (everything a user can get wrong fails here, before a tracking run exists), resume it,
fit it inside a tracking run, report it. `TrainJob` (tasks/train_job.py) holds what was built
and owns its teardown.

Under torchrun (or a submitit job of several tasks) every rank runs this with the same config:
each trains on its share of the data, rank 0 alone tracks, checkpoints and reports.
"""

import logging
import os
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dlpipe.config.objective import SweepObjective, choose_objective, settle, sweeper_of_this_job
from dlpipe.console import summary_table
from dlpipe.redact import redact_text
from dlpipe.schema import DlpipeConfig, TrackingConfig
from dlpipe.stop import ignore_termination, stop_gracefully
from dlpipe.tasks.fit_checks import TELEMETRY_METRICS
from dlpipe.tasks.preflight import JobContext, preflight
from dlpipe.tasks.tracking_run import objective_tags, open_run, print_where_to_look, start_tracking
from dlpipe.tracking.given_run import given_run_id
from dlpipe.tracking.metric_names import dlpipe_name
from dlpipe.tracking.protocols import JobRun
from dlpipe.tracking.sidecar_run import SidecarRun
from dlpipe.training import distributed
from dlpipe.training.requeue import submitit_signal

# Imported inside functions: torch and every module that imports it (train_job, resume_point, build,
# training's checkpoint and resume, loader.fetch, logged_model). The CLI imports this module before it
# resolves the config, to call start_early: the tracking process starts while torch loads (~1 s).

log = logging.getLogger("dlpipe")


def run(ctx: JobContext, raw: dict, resolved: dict, sidecar=None) -> float | None:
    """Train one job; returns its objective at the last epoch (sweep.objective, for Hydra's sweepers), or
    None without one. `sidecar`: the tracking process the CLI started (start_early), if it did; the CLI
    closes it."""
    ranks = distributed.ranks_from_env()
    trainer = resolved["trainer"]  # before validation: refuse a launch that cannot work first
    distributed.check_ranks(ranks, ctx.multirun, trainer["device"], os.environ, trainer["devices"])
    if not ranks.is_main:
        log.setLevel(logging.WARNING)  # rank 0 says it all once
    if ranks.distributed and trainer["device"] == "cuda":
        import torch

        # Each rank its own GPU, before the config is checked and its values explained.
        trainer["device"] = distributed.device_for("cuda", ranks, torch.cuda.device_count())
    cfg, decided = preflight(raw, resolved, "train", ctx)
    objective = sweep_objective(cfg)
    if not ranks.distributed:
        return train(ctx, raw, cfg, decided, distributed.SINGLE, sidecar, objective)
    distributed.start(ranks, cfg.trainer.device)
    try:
        # Every rank resumes from and reports to rank 0's output directory (the others' own,
        # from their own clock, may differ by a second).
        ctx = replace(ctx, output_dir=Path(distributed.broadcast(str(ctx.output_dir))))
        result = train(ctx, raw, cfg, decided, ranks, sidecar, objective)
        distributed.barrier()  # no rank tears its connections down while another still uses them
        return result
    except BaseException as error:
        # The first rank to exit makes torchrun terminate the others: this one still has its model
        # to free, its connections to close and its line to print.
        ignore_termination(f"rank {ranks.rank} is ending its failed job")
        distributed.release_failed(error)  # the job, for stop() to free with the group still there
        raise
    finally:
        distributed.stop()


def start_early(cfg: DictConfig):
    """The tracking process (tracking.sidecar), started by the CLI before it resolves the config:
    resolving imports torch (~1 s), and the process imports mlflow and opens the store meanwhile.
    None off rank 0, with tracking off, or when the tracking keys do not resolve to usable values
    (validation then says which, and train starts none)."""
    try:
        tracking = OmegaConf.to_container(cfg.tracking, resolve=True)
    except OmegaConfBaseException:
        return None
    uri, timeout_s, retries = (tracking.get(k) for k in ("uri", "request_timeout_s", "request_retries"))
    usable = isinstance(uri, str) and isinstance(timeout_s, int | float) and isinstance(retries, int)
    if tracking.get("enabled") is not True or not usable or not distributed.ranks_from_env().is_main:
        return None
    return SidecarRun.start(uri, timeout_s, retries)


def sweep_objective(cfg: DlpipeConfig) -> SweepObjective | None:
    """sweep.objective checked on the config, before anything is built (config.objective). A metric
    may be named as MLflow names it (`val/r2`)."""
    from dlpipe.tasks.build import build_objective

    return choose_objective(cfg, TELEMETRY_METRICS, build_objective(cfg).kind, sweeper_of_this_job(), dlpipe_name)


def train(ctx: JobContext, raw: dict, cfg: DlpipeConfig, decided: dict[str, str], ranks, sidecar,
          objective: SweepObjective | None = None) -> float | None:
    from dlpipe.tasks.resume_point import checkpoint_folder, require_checkpoint
    from dlpipe.training.checkpoint import CheckpointStore

    if ranks.is_main:  # rank 0 alone chooses the checkpoint (resume_point)
        require_checkpoint(cfg, ctx)
    # MLFLOW_RUN_ID, before anything is built: a run that holds epochs is continued only by a resume
    resumes = cfg.checkpoint.resume != "never" and bool(CheckpointStore(checkpoint_folder(cfg, ctx)).candidates())
    given = given_run_id(cfg.tracking, resumes) if ranks.is_main else None
    tracking = cfg.tracking if ranks.is_main else replace(cfg.tracking, enabled=False)
    own = sidecar is None and tracking.enabled
    if own:  # the CLI started none: the values it read were not usable as they were
        sidecar = start_tracking(tracking)
    try:
        return train_tracked(ctx, raw, cfg, decided, ranks, tracking, given, sidecar, objective)
    finally:
        if own:
            sidecar.close()  # a job refused while it was built leaves no run (the process opened none)


def resume_comparisons(config_keys, samples_follow_loader: bool = False) -> dict[str, list[str]]:
    """What a reopened run tags as changed since its first attempt (MlflowRun.log_params): the config
    keys that change what it computes (training.resume.changes_results) apart from the loader settings
    that change only its speed; never host facts."""
    from dlpipe.training.resume import LOADER_SPEED_KEYS, changes_results

    computed = [k for k in config_keys if changes_results(k, samples_follow_loader)]
    return {"dlpipe.resumed_changed_params": computed,
            "dlpipe.resumed_loader_changes": [k for k in config_keys if k in LOADER_SPEED_KEYS and k not in computed]}


def train_tracked(ctx: JobContext, raw: dict, cfg: DlpipeConfig, decided: dict[str, str], ranks,
                  tracking: TrackingConfig, given: str | None, sidecar, objective: SweepObjective | None = None
                  ) -> float | None:
    """Build the job, resume it, fit it inside its tracking run (`tracking`: this rank's settings,
    off but on rank 0; `given`: MLFLOW_RUN_ID's run; `sidecar`: the started tracking process), report it;
    returns `objective`'s last value."""
    from dlpipe.tasks.train_job import build_job

    # Our own process must not be importing mlflow while the loader is measured.
    job = build_job(ctx, raw, cfg, decided, ranks, before_measuring=sidecar.wait_prepared if sidecar else None)
    # A validation metric's name and direction are known once built: still before the run opens.
    validating = job.val_plan is not None and cfg.trainer.limit_val_batches != 0
    objective = settle(objective, job.trainer.val_metrics, validating, sweeper_of_this_job())
    job.tags.update(objective_tags(objective))
    resume_run_id = job.resume() or given  # a checkpoint's own run first: it holds the epochs resumed
    job.start_worker_helpers()
    with (stop_gracefully(job.trainer.stop, submitit_signal()),
          open_run(ctx, tracking, job.tags, resume_run_id, sidecar, params=job.params) as run):
        job.run_id = run.run_id
        if tracking.system_metrics:
            run.watch_system()
        run.log_params(job.params, compared=resume_comparisons(job.config_flat, job.samples_follow_loader))
        run.log_text(job.resolved_yaml, "config/resolved.yaml")
        run.log_inputs(job.dataset_input)
        try:
            with job.failures_translated():
                history = job.fit(run)
        finally:
            written = job.close()  # the files stay in the output dir on failure
        for path in written:
            run.log_artifact(path, "profile")
        model = job.model_file(tracking.log_model) if tracking.enabled and tracking.log_model != "none" else None
        if model is not None:
            run.log_artifact(model, "checkpoints")  # as it is; "model" is the MLflow model's name
            log_pytorch_model(run, job, model)
        verdict = job.record_outcome(run, history)
    if ranks.is_main:
        print(summary_table(history), flush=True)
        print(f"bottleneck: {verdict.line()}", flush=True)
        if run.run_id:
            log.info("MLflow run %s (%s) in %s", run.run_id, run.status, redact_text(cfg.tracking.uri))
        print_where_to_look(ctx, cfg.tracking, run.run_id)
    return objective.value(history) if objective is not None else None


def log_pytorch_model(run: JobRun, job, checkpoint: Path) -> None:
    """The checkpoint's weights as an MLflow PyTorch model too (tasks.logged_model), where it can."""
    from dlpipe.loader.fetch import item_collate, unwrapped
    from dlpipe.tasks.logged_model import export_model

    exported = export_model(job.trainer.model, checkpoint, job.trainer.objective, unwrapped(job.loader.dataset),
                            item_collate(job.loader), job.ctx.output_dir)
    if exported is not None:
        run.log_pytorch_model(*exported)

