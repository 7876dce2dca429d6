"""The names dlpipe's metrics take in MLflow: grouped by prefix, so the UI's chart view shows one
section per concern (`train/`, `val/`, `perf/`, `contention/`, `loader/`, `resources/`), as Lightning's
and HF's loggers group theirs.

No dlpipe metric is under `system/`: MLflow's UI takes every metric so named for its own system
metrics and charts it against wall-clock time (`startsWith("system/")` -> `xAxisKey: "time"` in
MLflow 3.17's JS), so a sweep's jobs could not be overlaid on the step axis. MLflow's own system
metrics (tracking.system_metrics) keep that prefix.

dlpipe itself (the runner, the verdict, checkpoint.monitor, results files) keeps the flat names
(`val_loss`, `data_wait_frac`): the mapping is made where metrics enter MLflow (MlflowRun) and undone
where dlpipe reads them back (the sweep report), so the two never drift apart. A name dlpipe does not
know (a user callback's own, MLflow's system metrics) is left as it is.
"""

import re
import time
from functools import cache

SECTIONS = {
    # how fast the job trains
    "perf": ("samples_per_s", "cpu_s_per_sample", "epoch_time_s", "step_time_p50_ms", "step_time_p95_ms"),
    # how much the job was starved of CPU (dlpipe.telemetry.contention)
    "contention": ("run_queue_s_per_s", "run_queue_main_s_per_s", "run_queue_workers_s_per_s", "cpu_pressure_frac",
                   "cpu_steal_frac", "cpu_others_frac"),
    # what the loader costs: the wait for data, host-to-device copies, the workers and their memory
    "loader": ("data_wait_frac", "data_wait_s", "first_batch_s", "h2d_frac", "h2d_s", "workers_alive",
               "cpu_workers_pct", "cpu_per_worker_pct", "workers_rss_mb", "worker_rss_mean_mb", "worker_rss_max_mb",
               "worker_rss_slope_mb_per_epoch", "shm_used_mb"),
    # the job's processes and the machine: CPU, memory, GPU, per epoch like the rest
    "resources": ("cpu_util", "cpu_main_pct", "rss_mb", "rss_peak_mb", "tree_rss_peak_mb", "sys_mem_used_pct",
                  "gpu_util", "gpu_mem_used_mb", "cuda_max_allocated_mb", "cuda_reserved_mb"),
    # the optimisation itself, besides the losses
    "train": ("lr", "epoch_lr", "grad_norm", "skipped_steps"),
}
_SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
_LR_GROUP = re.compile(r"(lr|epoch_lr)/group_(\d+)")  # with several parameter groups (schedule.lr_metrics)
_MLFLOW_LR_GROUP = re.compile(r"train/(lr|epoch_lr)_group_(\d+)")


@cache  # called for every logged value, in the training loop
def mlflow_name(name: str) -> str:
    """`val_loss` -> `val/loss`, `train_loss_step` -> `train/loss_step`, `data_wait_frac` ->
    `loader/data_wait_frac`, `lr/group_1` -> `train/lr_group_1`; `epoch` and unknown names unchanged."""
    if name in _SECTION_OF:
        return f"{_SECTION_OF[name]}/{name}"
    if group := _LR_GROUP.fullmatch(name):
        return f"train/{group[1]}_group_{group[2]}"
    for split in ("train", "val"):
        if name.startswith(split + "_"):
            return f"{split}/{name.removeprefix(split + '_')}"
    return name


def dlpipe_name(name: str) -> str:
    """mlflow_name undone: the name dlpipe uses for a metric read back from MLflow."""
    section, slash, rest = name.partition("/")
    if not slash:
        return name
    if _SECTION_OF.get(rest) == section:
        return rest
    if group := _MLFLOW_LR_GROUP.fullmatch(name):
        return f"{group[1]}/group_{group[2]}"
    if section in ("train", "val") and "/" not in rest:
        return f"{section}_{rest}"
    return name


def dlpipe_names(metrics: dict[str, float]) -> dict[str, float]:
    """A run's metrics (MLflow's run.data.metrics) under dlpipe's names."""
    return {dlpipe_name(k): v for k, v in metrics.items()}


def metric_rows(metrics: dict[str, float], step: int) -> list[tuple[str, float, int, int]]:
    """(MLflow name, value, wall-clock ms, step) rows: plain tuples, cheap inside the training loop."""
    ts = int(time.time() * 1000)
    return [(mlflow_name(k), float(v), ts, step) for k, v in metrics.items()]
