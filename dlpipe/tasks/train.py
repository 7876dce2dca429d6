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

from dlpipe.console import summary_table
from dlpipe.redact import redact_text
from dlpipe.schema import DlpipeConfig
from dlpipe.stop import stop_gracefully
from dlpipe.tasks.common import JobContext, open_run, preflight
from dlpipe.tasks.train_job import build_job
from dlpipe.training import distributed

log = logging.getLogger("dlpipe")


def run(ctx: JobContext, raw: dict, resolved: dict) -> float | None:
    """Train one job; returns the last validation loss (for sweepers that minimise it)."""
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
    if not ranks.distributed:
        return train(ctx, raw, cfg, decided, distributed.SINGLE)
    distributed.start(ranks, cfg.trainer.device)
    try:
        # Every rank resumes from and reports to rank 0's output directory (the others' own,
        # from their own clock, may differ by a second).
        ctx = replace(ctx, output_dir=Path(distributed.broadcast(str(ctx.output_dir))))
        result = train(ctx, raw, cfg, decided, ranks)
        distributed.barrier()  # no rank tears its connections down while another still uses them
        return result
    finally:
        distributed.stop()


def train(ctx: JobContext, raw: dict, cfg: DlpipeConfig, decided: dict[str, str], ranks) -> float | None:
    from dlpipe.tracking.given_run import given_run_id
    from dlpipe.training.requeue import submitit_signal

    given = given_run_id(cfg.tracking) if ranks.is_main else None  # MLFLOW_RUN_ID, before anything is built
    job = build_job(ctx, raw, cfg, decided, ranks)
    resume_run_id = job.resume() or given  # a checkpoint's own run first: it holds the epochs resumed
    job.start_worker_helpers()
    tracking = cfg.tracking if ranks.is_main else replace(cfg.tracking, enabled=False)
    with stop_gracefully(job.trainer.stop, submitit_signal()), open_run(ctx, tracking, job.tags, resume_run_id) as run:
        job.run_id = run.run_id
        if tracking.system_metrics:
            run.watch_system()
        run.log_params(job.params, compared=job.config_flat)  # a resume compares config, not host facts
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
            run.log_artifact(model, "model")  # the run's model, as MLflow's UI lists it
        verdict = job.record_outcome(run, history)
    if ranks.is_main:
        print(summary_table(history), flush=True)
        print(f"bottleneck: {verdict.line()}", flush=True)
        if run.run_id:
            log.info("MLflow run %s (%s) in %s", run.run_id, run.status, redact_text(cfg.tracking.uri))
    return last_val_loss(history)


def last_val_loss(history: list[dict[str, float]]) -> float | None:
    return history[-1].get("val_loss") if history else None

