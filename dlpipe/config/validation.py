"""Range and cross-field checks on the resolved config; every problem is collected into one error."""

import dataclasses
import difflib
import inspect
import math
import os
import re
import typing

from dlpipe.config.targets import check_named_targets, check_target, is_stream_class, locate, stream_split_refused
from dlpipe.config.tracking_checks import check_tracking
from dlpipe.errors import ConfigError
from dlpipe.loader import policy
from dlpipe.machine import hardware
from dlpipe.schema import (
    CHOICES,
    SCHEDULER_DEFAULT_INTERVAL,
    SCHEDULER_INTERVALS,
    BatchConfig,
    BenchConfig,
    CheckpointConfig,
    DlpipeConfig,
    LoaderConfig,
    SweepConfig,
    TelemetryConfig,
    TrackingConfig,
    TrainerConfig,
    allowed,
)


def _not_allowed(key: str, value) -> list[str]:
    """A word key (schema.CHOICES) holding another word; None passes (the schema refuses it where the
    key is not Optional)."""
    return [] if value is None or value in CHOICES[key] else [f"{key}={value}: allowed: {allowed(key)}"]


def _check_loader(c: LoaderConfig) -> list[str]:
    p = []
    if c.batch_size < 1:
        p.append(f"loader.batch_size={c.batch_size}: must be >= 1")
    if c.val_batch_size is not None and c.val_batch_size < 1:
        p.append(f"loader.val_batch_size={c.val_batch_size}: must be >= 1 or null")
    if c.num_workers < 0:
        p.append(f"loader.num_workers={c.num_workers}: must be >= 0 (0 loads in the main process)")
    # (With num_workers=0 a prefetch_factor is dropped with a note when the loader is built, like the
    # other worker-only settings: a sweep over workers x prefetch must run its 0-worker jobs.)
    if c.prefetch_factor is not None and c.prefetch_factor < 1:
        p.append(f"loader.prefetch_factor={c.prefetch_factor}: must be >= 1 or null")
    if c.timeout < 0:
        p.append(f"loader.timeout={c.timeout}: must be >= 0 (0 waits forever)")
    p += _not_allowed("loader.fetch", c.fetch) + _not_allowed("loader.worker_method", c.worker_method)
    p += _not_allowed("loader.stream_share", c.stream_share)
    return p + _not_allowed("loader.multiprocessing_context", c.multiprocessing_context)


def _check_trainer(c: TrainerConfig) -> list[str]:
    p = []
    if c.epochs < 1:
        p.append(f"trainer.epochs={c.epochs}: must be >= 1")
    if c.max_steps == 0 or c.max_steps < -1:
        p.append(f"trainer.max_steps={c.max_steps}: must be >= 1, or -1 for no limit")
    if c.limit_train_batches == 0 or c.limit_train_batches < -1:
        p.append(f"trainer.limit_train_batches={c.limit_train_batches}: must be >= 1, or -1 for all")
    if c.limit_val_batches < -1:
        p.append(f"trainer.limit_val_batches={c.limit_val_batches}: must be >= 0, or -1 for all")
    if c.devices < 1:
        p.append(f"trainer.devices={c.devices}: must be >= 1 (processes on this node, one per GPU)")
    if c.accumulate < 1:
        p.append(f"trainer.accumulate={c.accumulate}: must be >= 1 (micro-batches per optimizer step)")
    if not math.isfinite(c.grad_clip) or c.grad_clip < 0:  # nan < 0 is False: nan would disable clipping
        p.append(f"trainer.grad_clip={c.grad_clip}: must be a finite number >= 0 (0 disables clipping)")
    p += _not_allowed("trainer.amp", c.amp) + _not_allowed("trainer.on_nonfinite", c.on_nonfinite)
    if c.empty_cache_every < 0:
        p.append(f"trainer.empty_cache_every={c.empty_cache_every}: must be >= 0 (0 never)")
    if not 0.0 <= c.val_fraction < 1.0:
        p.append(f"trainer.val_fraction={c.val_fraction}: must be in [0, 1)")
    if c.log_every < 1:
        p.append(f"trainer.log_every={c.log_every}: must be >= 1")
    if c.torch_threads is not None and c.torch_threads < 1:
        p.append(f"trainer.torch_threads={c.torch_threads}: must be >= 1 (torch's intra-op threads in each training "
                 "process), or leave it out for the automatic value")
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", c.device):
        p.append(f"trainer.device={c.device}: allowed: cpu, cuda, cuda:N, mps")
    stop = c.early_stopping
    p += _not_allowed("trainer.early_stopping.mode", stop.mode)
    if stop.patience < 1:
        p.append(f"trainer.early_stopping.patience={stop.patience}: must be >= 1 (epochs without improvement)")
    if stop.min_delta < 0:
        p.append(f"trainer.early_stopping.min_delta={stop.min_delta}: must be >= 0")
    if c.amp == "fp16" and not c.device.startswith("cuda"):
        p.append(f"trainer.amp=fp16 with trainer.device={c.device}: fp16 needs CUDA; use bf16 or off")
    return p


def _check_telemetry(c: TelemetryConfig) -> list[str]:
    p = []
    if c.sample_interval_s <= 0:
        p.append(f"telemetry.sample_interval_s={c.sample_interval_s}: must be > 0")
    if c.cuda_sync_every < 0:
        p.append(f"telemetry.cuda_sync_every={c.cuda_sync_every}: must be >= 0 (0 = only at epoch ends)")
    if c.profile_steps < 0:
        p.append(f"telemetry.profile_steps={c.profile_steps}: must be >= 0 (0 = off)")
    if c.profile_wait < 0:
        p.append(f"telemetry.profile_wait={c.profile_wait}: must be >= 0")
    return p


def _check_checkpoint(c: CheckpointConfig) -> list[str]:
    p = []
    p += _not_allowed("checkpoint.resume", c.resume) + _not_allowed("checkpoint.mode", c.mode)
    if c.keep_last < 1:
        p.append(f"checkpoint.keep_last={c.keep_last}: must be >= 1")
    if c.resume == "must" and not c.enabled:
        p.append("checkpoint.resume=must with checkpoint.enabled=false: resuming needs checkpoints")
    if c.init_from is not None and not os.path.exists(c.init_from):
        p.append(f"checkpoint.init_from={c.init_from}: no such file or folder (a checkpoint such as "
                 "outputs/DATE/TIME/checkpoints/best.pt, or a run's checkpoints/ folder)")
    return p


def _check_metrics(metrics) -> list[str]:
    """metrics: null (defaults for the loss) or name -> `_target_` node, each importable."""
    return check_named_targets("metrics", metrics, "torchmetrics.MeanAbsoluteError")


def _check_validation_data(resolved: dict) -> list[str]:
    """val_dataset, where given, is a dataset like `dataset`; a stream without it has no split to take
    trainer.val_fraction from (a function returning a stream is checked once built)."""
    if resolved.get("val_dataset"):  # val_dataset=none composes to {}
        return check_target("val_dataset", resolved["val_dataset"])
    target, fraction = resolved["dataset"].get("_target_"), resolved["trainer"].get("val_fraction", 0)
    if target and fraction and is_stream_class(target):
        return [stream_split_refused(target, fraction)]
    return []


def _check_bench(c: BenchConfig) -> list[str]:
    p = []
    if c.warmup_batches < 1:
        p.append(f"bench.warmup_batches={c.warmup_batches}: must be >= 1 (the first batch is always warm-up)")
    if c.batches < 1:
        p.append(f"bench.batches={c.batches}: must be >= 1")
    p += _not_allowed("bench.mode", c.mode)
    if c.repeats < 1:
        p.append(f"bench.repeats={c.repeats}: must be >= 1")
    if c.min_gain < 0:
        p.append(f"bench.min_gain={c.min_gain}: must be >= 0")
    if c.max_workers is not None and c.max_workers < 0:
        p.append(f"bench.max_workers={c.max_workers}: must be >= 0 or null")
    if not c.name or "/" in c.name:
        p.append(f"bench.name={c.name!r}: must be a file name (no /)")
    return p


def _check_scheduler(node) -> list[str]:
    """scheduler: {} or null (scheduler=none), or a `_target_` node built with the optimizer as its
    first argument, plus dlpipe's own `interval`, which is removed before the class is checked."""
    if not node:
        return []
    if not isinstance(node, dict):
        return [f"scheduler={node}: must be a node with a _target_ (scheduler=cosine, linear, onecycle, step) "
                "or scheduler=none"]
    p = []
    interval = node.get("interval", SCHEDULER_DEFAULT_INTERVAL)
    if interval not in SCHEDULER_INTERVALS:
        shown = "null" if interval is None else interval  # as typed: scheduler.interval=null
        p.append(f"scheduler.interval={shown}: allowed: step (after every optimizer step), epoch (after every "
                 "epoch)")
    warmup = node.get("warmup_steps")
    if isinstance(warmup, (int, float)) and warmup < 0:
        p.append(f"scheduler.warmup_steps={warmup}: must be >= 0 (steps of linear warm-up; 0 for none)")
    ratio = node.get("min_lr_ratio")
    if isinstance(ratio, (int, float)) and not 0 <= ratio <= 1:
        p.append(f"scheduler.min_lr_ratio={ratio}: must be in [0, 1] (the last step's lr as a share of optim.lr)")
    # the optimizer comes first, as optim's params do: skip it in the 'allowed' listing
    ours = ("interval", "monitor")  # dlpipe's keys, not the class's
    target = check_target("scheduler", {k: v for k, v in node.items() if k not in ours}, extra_args=1,
                          fills_in=("total_steps",))  # build.build_scheduler derives a null total_steps
    if target:
        return p + target
    monitor, on_metric = node.get("monitor"), _steps_on_a_metric(node["_target_"])
    if on_metric and not monitor:
        p.append(f"scheduler._target_={node['_target_']}: it steps on a metric (step(metrics)); name it with "
                 "scheduler.monitor=val_loss (any epoch metric)")
    elif on_metric and interval != "epoch":
        p.append(f"scheduler.interval={interval}: a schedule that steps on a metric moves once an epoch, when the "
                 "metric is measured; use scheduler.interval=epoch")
    elif monitor and not on_metric:
        p.append(f"scheduler.monitor={monitor}: {node['_target_']} steps on the step count, not on a metric; "
                 "remove scheduler.monitor")
    return p


def _steps_on_a_metric(target: str) -> bool:
    """ReduceLROnPlateau and its kind: their step() wants the monitored value."""
    try:
        step = getattr(locate(target), "step", None)
        return step is not None and "metrics" in inspect.signature(step).parameters
    except (ImportError, TypeError, ValueError):
        return False


_SECTIONS = {"loader": (LoaderConfig, _check_loader), "trainer": (TrainerConfig, _check_trainer),
             "tracking": (TrackingConfig, check_tracking), "telemetry": (TelemetryConfig, _check_telemetry),
             "checkpoint": (CheckpointConfig, _check_checkpoint), "bench": (BenchConfig, _check_bench),
             "batch": (BatchConfig, lambda c: []),
             "sweep": (SweepConfig, lambda c: _not_allowed("sweep.direction", c.direction))}


def _unknown_keys(section: str, schema, node: dict) -> list[str]:
    """Keys a `+key=value` override added to a typed section (Hydra lets `+` bypass the schema),
    in nested sections too (trainer.early_stopping)."""
    allowed = list(schema.__dataclass_fields__)
    nested = typing.get_type_hints(schema)
    problems = []
    for key, value in node.items():
        if key not in allowed:
            guess = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {section}.{guess[0]}? " if guess else ""
            problems.append(f"{section}.{key}: no such key; {hint}allowed: {', '.join(sorted(allowed))}")
        elif dataclasses.is_dataclass(nested.get(key)) and isinstance(value, dict):
            problems += _unknown_keys(f"{section}.{key}", nested[key], value)
    return problems


def _typed(schema, node: dict):
    """A schema object from a plain dict, its nested sections included."""
    nested = typing.get_type_hints(schema)
    return schema(**{k: _typed(nested[k], v) if dataclasses.is_dataclass(nested.get(k)) and isinstance(v, dict)
                     else v for k, v in node.items()})


def _check_lr(optim: dict) -> list[str]:
    """optim.lr, when given: a finite number > 0 (inf or nan would train to nan and end FINISHED), or
    null for optimizers that choose their own step size (transformers' Adafactor with relative_step)."""
    lr = optim.get("lr")
    if lr is None or (type(lr) in (int, float) and math.isfinite(lr) and lr > 0):
        return []
    return [f"optim.lr={lr}: must be a finite number > 0 (e.g. optim.lr=1e-3), or null for an optimizer that sets "
            "its own"]


def _check_worker_bound(loader: LoaderConfig, cpu_budget: int) -> list[str]:
    """Thousands of workers would fork thousands of processes before the first batch."""
    bound = policy.max_workers(cpu_budget)
    if loader.num_workers <= bound:
        return []
    return [f"loader.num_workers={loader.num_workers}: at most {bound} here ({policy.MAX_WORKERS_PER_CPU} per CPU "
            f"of this job's budget of {cpu_budget}, at least {policy.MAX_WORKERS_FLOOR}): each worker is a process "
            "with its own copy of the dataset, and beyond a few per CPU they only add start-up time and memory"]


def _check_log_model(tracking: TrackingConfig, checkpoint: CheckpointConfig) -> list[str]:
    if tracking.log_model not in CHOICES["tracking.log_model"]:
        return _not_allowed("tracking.log_model", tracking.log_model)
    if tracking.log_model != "none" and not checkpoint.enabled:
        return [f"tracking.log_model={tracking.log_model}: logs a checkpoint, and checkpoint.enabled=false writes "
                "none; enable checkpoints or set tracking.log_model=none"]
    if tracking.log_model == "best" and not checkpoint.monitor:
        return ["tracking.log_model=best: no best checkpoint without checkpoint.monitor; set one or use "
                "tracking.log_model=last"]
    return []


def validate(resolved: dict, cpu_budget: int | None = None) -> DlpipeConfig:
    """The resolved config (a plain dict) as typed sections; raises ConfigError listing every problem.
    `cpu_budget` bounds loader.num_workers (None: this process's, hardware.cpu_budget)."""
    problems = []
    if resolved.get("task", "train") not in CHOICES["task"]:
        problems.append(f"task={resolved['task']}: allowed: {allowed('task')}")
    sections = {}
    for section, (schema, check) in _SECTIONS.items():
        node = resolved[section] if section != "sweep" else resolved.get(section) or {}  # sweep: newer than stores
        unknown = _unknown_keys(section, schema, node)
        if unknown:
            problems += unknown
            continue
        sections[section] = _typed(schema, node)
        problems += check(sections[section])
    if "loader" in sections:
        problems += _check_worker_bound(sections["loader"], cpu_budget or hardware.cpu_budget().budget)
    if "tracking" in sections and "checkpoint" in sections:
        problems += _check_log_model(sections["tracking"], sections["checkpoint"])
    problems += check_target("dataset", resolved["dataset"])
    problems += _check_validation_data(resolved)
    problems += check_target("model", resolved["model"])
    # optimizers take the parameters first (a partial): skip it in the 'allowed' listing
    problems += check_target("optim", resolved["optim"], extra_args=1, fills_in=())
    problems += _check_lr(resolved["optim"])
    problems += check_target("loss", resolved["loss"])
    problems += _check_metrics(resolved.get("metrics"))
    problems += check_named_targets("callbacks", resolved.get("callbacks"))
    problems += _check_scheduler(resolved.get("scheduler"))
    if problems:
        raise ConfigError(problems)
    return DlpipeConfig(dataset=resolved["dataset"], val_dataset=resolved.get("val_dataset") or None,
                        model=resolved["model"], optim=resolved["optim"], loss=resolved["loss"],
                        metrics=resolved.get("metrics"), callbacks=resolved.get("callbacks"),
                        scheduler=resolved.get("scheduler"), task=resolved.get("task", "train"), **sections)
