"""Checks that the built parts fit each other, run before a tracking run exists: the model takes the
dataset's batches (tasks.build.check_objective runs two real samples through it), and a monitored
metric is one the run logs every epoch (else best.pt is never written and nobody is told).
"""

import logging

from dlpipe.errors import ConfigError, first_line
from dlpipe.schema import DlpipeConfig

log = logging.getLogger("dlpipe")

TELEMETRY_METRICS = frozenset({
    "epoch_time_s", "samples_per_s", "data_wait_s", "data_wait_frac", "first_batch_s", "h2d_s", "h2d_frac",
    "step_time_p50_ms", "step_time_p95_ms", "cpu_util", "cpu_main_pct", "cpu_workers_pct", "cpu_per_worker_pct",
    "rss_mb", "rss_peak_mb", "tree_rss_peak_mb", "workers_rss_mb", "worker_rss_max_mb", "worker_rss_mean_mb",
    "workers_alive", "sys_mem_used_pct", "shm_used_mb", "gpu_util", "gpu_mem_used_mb", "cuda_max_allocated_mb",
    "cuda_reserved_mb", "skipped_steps", "cpu_s_per_sample", "run_queue_s_per_s", "run_queue_main_s_per_s",
    "run_queue_workers_s_per_s", "cpu_pressure_frac", "cpu_steal_frac", "cpu_others_frac"})
"""Epoch metrics besides the losses (the runner's clock, telemetry.sampler): a monitor may name one,
with its mode given (their direction is not known)."""


def model_data_mismatch(cfg: DlpipeConfig, batch, error: BaseException) -> str:
    """One line for a model that fails on a batch of the dataset: both targets and the batch's shapes.
    A field collated into a list (items of Python lists: a Hugging Face dataset without a format) is
    the data's to fix, not the model's."""
    fix = ("give tensors, not Python lists (a Hugging Face dataset: .with_format(\"torch\"))" if _has_lists(batch)
           and "list" in str(error) else "pick a model for this data, or set model.* to fit it")
    return (f"model._target_={cfg.model.get('_target_')} cannot take a batch of dataset._target_="
            f"{cfg.dataset.get('_target_')} ({describe_batch(batch)}): {type(error).__name__}: "
            f"{first_line(error)[:300]}; {fix}")


def _has_lists(batch) -> bool:
    """Whether a field of the batch (a dict's values, a pair's parts) is a list, not a tensor."""
    fields = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    return any(isinstance(field, list) for field in fields)


def describe_batch(batch) -> str:
    """'input [2, 64] int64, target [2] int64', or the fields of a dict batch, for messages."""
    if isinstance(batch, dict):
        return ", ".join(f"{k} {_shape(v)}" for k, v in batch.items())
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return f"input {_shape(batch[0])}, target {_shape(batch[1])}"
    return f"input {_shape(batch)}"


def _shape(value) -> str:
    if getattr(value, "shape", None) is None:
        return type(value).__name__
    return f"{list(value.shape)} {str(getattr(value, 'dtype', '')).removeprefix('torch.')}"


def check_monitored(section: str, monitor: str | None, metrics: dict, validates: bool) -> None:
    """`monitor` (of checkpoint, trainer.early_stopping, scheduler) must be logged every epoch by this
    run: train_loss, its validation metrics when it validates, or a telemetry metric."""
    if monitor is None:
        return
    logged = ["val_loss", *(f"val_{name}" for name in metrics)] if validates else []
    allowed = ", ".join(["train_loss", *logged])
    if monitor == "val_loss" and not validates and section == "checkpoint":
        # the default: a run without validation is legitimate, it just has no best checkpoint
        log.info("checkpoint.monitor=val_loss: this run does not validate, so it keeps no best.pt")
        return
    if monitor.startswith("val_") and not validates:
        raise ConfigError([f"{section}.monitor={monitor}: this run does not validate (trainer.val_fraction=0 or "
                           f"trainer.limit_val_batches=0), so it logs no val_ metric; allowed: {allowed}"])
    if monitor.startswith("val_") and monitor not in logged:
        raise ConfigError([f"{section}.monitor={monitor}: this run logs no such validation metric; "
                           f"allowed: {', '.join(logged)} (or any epoch metric, e.g. train_loss)"])
    if not monitor.startswith("val_") and monitor != "train_loss" and monitor not in TELEMETRY_METRICS:
        raise ConfigError([f"{section}.monitor={monitor}: this run logs no such epoch metric; allowed: {allowed} "
                           "(or a timing metric such as samples_per_s)"])
