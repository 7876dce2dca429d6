"""Typed schemas for the config groups that dlpipe itself interprets: every key is declared here, once.

A leaf module (plain dataclasses; no torch, no Hydra): the tasks pass these objects, validated, to
the runner, the loader builder and the trackers, so a new key reaches its user by being declared
here and read there, never by being copied into another settings class.

`dataset`, `model`, `optim`, `loss`, `metrics` and `scheduler` are `_target_` nodes (any importable
class, checked against its signature before anything is built), so they are open dicts here. The
other groups are closed dataclasses: a typo or a wrong type fails at composition, naming the key.
Ranges and cross-field rules live in `config/validation.py` because OmegaConf does not run
`__post_init__` on merges.
"""

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class LoaderConfig:
    """torch.utils.data.DataLoader settings; conf/loader/auto.yaml derives them from the machine."""

    batch_size: int = 64
    """Samples per micro-batch (per rank). The optimizer sees batch_size x trainer.accumulate."""
    num_workers: int = 0
    """Worker processes; 0 loads in the main process (best for in-memory tensors). At most 8 per CPU of
    the job's budget, at least 16 (loader.policy.max_workers)."""
    pin_memory: bool = False
    """Page-locked host buffers for faster, asynchronous host-to-GPU copies; useless without CUDA."""
    prefetch_factor: int | None = None
    """Batches each worker keeps ready; RAM held = workers x prefetch x batch bytes. None with 0 workers."""
    persistent_workers: bool = False
    """Keep workers alive across epochs (saves their start-up; holds their memory)."""
    shuffle: bool = True
    """Reshuffle the training set every epoch (validation is never shuffled)."""
    drop_last: bool = False
    """Drop the last incomplete training batch (keeps batch statistics and step counts uniform)."""
    timeout: float = 0.0
    """Seconds to wait for a batch from a worker before failing; 0 waits forever. Dropped, with a note,
    without workers (there is no worker to wait for)."""
    multiprocessing_context: str | None = None
    """Worker start method: fork, spawn or forkserver; None uses the platform default."""
    collate_fn: Any = None
    """A `_target_` node that builds the function turning a list of items into a batch (e.g.
    dlpipe.loader.collate.PadSequences for variable-length sequences); None: PyTorch's default_collate."""
    fetch: str = "auto"
    """item: __getitem__ per index, then collate (PyTorch's way); batch: one gather per batch (a list
    of indices in, the collated batch out: TensorDataset, dlpipe's tabular and token datasets, a
    __getitems__ returning a batch); auto: batch where the dataset's gather equals the per-item
    collate exactly (checked on a few indices), else item (dlpipe/loader/fetch.py)."""
    worker_method: str = "auto"
    """Who fetches when num_workers > 0: process (PyTorch's worker processes), thread (threads of the
    main process: no start-up, no pickling, no /dev/shm, one GIL; dlpipe/loader/threads.py) or auto:
    threads where a probe shows they scale (the dataset releases the GIL) and the dataset draws no
    randomness from the global RNGs, or where /dev/shm cannot hold the batches; else processes."""
    stream_share: str = "auto"
    """A stream (an IterableDataset) with workers: dlpipe (each worker keeps every Nth item of the whole
    stream it reads), source (the stream shares itself out, by get_worker_info()) or auto: measured by
    two workers reading its first items (dlpipe/loader/streams.py). Map datasets ignore it."""
    val_batch_size: int | None = None
    """Validation batch size; None uses batch_size (no gradients, so larger is usually fine)."""
    tuned_on: str | None = None
    """Set by `dlpipe tune` in the file it writes ("cpu_budget=N host=NAME"): the values were measured
    there, so the lint trusts them on a machine with the same CPU budget and says to re-tune elsewhere."""


@dataclass
class EarlyStoppingConfig:
    """Stop training when a metric stops improving (dlpipe.training.callbacks.EarlyStopping)."""

    monitor: str | None = None
    """The epoch metric to watch (val_loss, val_accuracy, ...); None: no early stopping."""
    mode: str = "auto"
    """min or max: whether lower or higher is better; auto: min for a loss, else the metric's own
    direction (torchmetrics' higher_is_better)."""
    patience: int = 3
    """Epochs without improvement before training stops."""
    min_delta: float = 0.0
    """A change must exceed this to count as an improvement."""


@dataclass
class TrainerConfig:
    """The training loop."""

    epochs: int = 3
    """Passes over the training split."""
    max_steps: int = -1
    """Stop after this many optimizer steps in total; -1 for no limit."""
    limit_train_batches: int = -1
    """Micro-batches per training epoch; -1 for the whole split (quick runs, smoke tests)."""
    limit_val_batches: int = -1
    """Batches per validation pass; -1 for the whole split, 0 to skip validation."""
    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    device: str = "cpu"
    """torch device: cpu, cuda, cuda:N or mps."""
    devices: int = 1
    """Processes training data-parallel on this node, one per GPU (or gloo processes on the CPU).
    `dlpipe ... trainer.devices=N` on the command line restarts dlpipe under `torchrun --standalone
    --nproc_per_node=N`; under your own torchrun leave it at 1 (or equal to --nproc_per_node)."""
    amp: str = "off"
    """Mixed precision: off, bf16 or fp16 (fp16 uses a GradScaler)."""
    empty_cache_every: int = 0
    """Call torch.cuda.empty_cache() every N optimizer steps; 0 never (it costs a sync)."""
    val_fraction: float = 0.1
    """Share of the dataset held out for validation; 0 disables validation."""
    seed: int = 0
    """Seeds Python, NumPy, torch, the shuffling generator and every DataLoader worker."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): reproducible kernels, sometimes slower."""
    log_every: int = 50
    """Record the training loss every N optimizer steps (buffered in memory, written to the tracker
    between epochs: a write inside the loop would cost the step)."""
    progress: bool = True
    """Show a progress bar per epoch (a line per epoch when stderr is not a terminal)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when trainer.early_stopping.monitor stops improving (off while monitor is null)."""
    compile: bool = False
    """torch.compile the model (the first steps pay for compilation; off by default)."""
    torch_threads: int | None = None
    """torch's intra-op threads in each training process (each rank): conf/trainer/default.yaml leaves
    it to the rule (dlpipe/loader/torch_threads.py: on an accelerator the CPU budget less the loader's
    workers, on the CPU the budget, or what OMP_NUM_THREADS/MKL_NUM_THREADS gave torch); an int >= 1
    sets it; None: torch's own choice."""
    on_nonfinite: str = "stop"
    """A nan or inf training loss: `stop` (the run ends FAILED naming the step, within log_every
    steps), `skip_step` (drop that optimizer step, like GradScaler; counted as skipped_steps) or `warn`."""


@dataclass
class BatchConfig:
    """How a collated batch feeds the model and the loss. Tuple and list samples are (input, target);
    dict samples (Hugging Face style) name their fields here."""

    input: str | None = None
    """Dict samples: the field the model is called with (`pixel_values`). None: the whole dict goes
    to the model as keyword arguments, `model(**batch)`, as Hugging Face models take it."""
    target: str | None = None
    """Dict samples: the field the loss and the metrics compare the output with (`labels`). None
    with `loss=model`, where the model computes its own loss from the fields it was given."""


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    enabled: bool = True
    """False turns tracking off entirely (tracking=none)."""
    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI: a SQLite file (relative to the working directory) or an http(s) server."""
    experiment: str = "dlpipe"
    """MLflow experiment name."""
    run_name: str | None = None
    """Run name; None derives one from the recipe and the overrides."""
    request_timeout_s: float = 10.0
    """HTTP timeout per tracking request, so an unreachable server fails in seconds, not minutes."""
    request_retries: int = 2
    """HTTP retries per tracking request."""
    retry_every_s: float = 30.0
    """While the server is away mid-run: seconds between reconnect attempts (made at metric flushes)."""
    offline_wait_s: float = 30.0
    """At the end of a run with the server away: seconds to wait for it before leaving the unsent
    writes in the output directory for `dlpipe sync`."""
    system_metrics: bool = False
    """MLflow's own system metrics (`system/cpu_utilization_percentage`, disk, network, GPU) beside
    dlpipe's, sampled by MLflow's monitor thread every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds
    (10 by default); the config follows MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING. Off by default, as in MLflow."""
    log_model: str = "none"
    """The checkpoint the run stores when training ends, as its artifact `checkpoints/` and as an MLflow
    PyTorch model named `model` (where the model pickles): none, best (best.pt, the best monitored
    epoch) or last (the newest epoch). None by default, as Lightning's MLFlowLogger and HF Trainer: a
    model can be large, and the checkpoints stay in the output folder either way."""


@dataclass
class TelemetryConfig:
    """What is measured besides the step clock (which is always on and costs two clock reads a step)."""

    sample_interval_s: float = 0.5
    """Seconds between CPU/memory/GPU samples taken by the telemetry thread."""
    cuda_sync_every: int = 25
    """On CUDA, synchronise every N optimizer steps so time is charged to the step that spent it."""
    profile_steps: int = 0
    """Record this many micro-steps with torch.profiler (table + trace as MLflow artifacts); 0 = off."""
    profile_wait: int = 5
    """Micro-steps to skip before profiling (worker start-up and first allocations would dominate)."""
    tracemalloc: bool = False
    """Trace Python allocations and store the top ones at the end (slows Python-heavy loaders)."""
    measurements_file: str | None = None
    """Where train, bench and tune keep what they measured of each job's loader, so advice never
    suggests a setting already measured slower (dlpipe/judging/journal.py); conf/telemetry/default.yaml
    sets ~/.cache/dlpipe/measurements.jsonl (XDG_CACHE_HOME respected); null keeps nothing."""


@dataclass
class CheckpointConfig:
    """Atomic epoch checkpoints and resuming from them."""

    enabled: bool = True
    """Write a checkpoint at the end of every epoch."""
    dir: str | None = None
    """Where checkpoints live; None means `checkpoints/` in the job's output directory."""
    resume: str = "auto"
    """auto: resume from the newest readable checkpoint in `dir` if there is one; must: fail if
    there is none; never: always start from scratch (existing checkpoints are left alone)."""
    init_from: str | None = None
    """A checkpoint file (best.pt, epoch-N.pt) or a run's checkpoints/ folder (its best.pt, else its
    newest epoch) whose model weights start this run: fine-tuning, with a fresh optimizer, schedule
    and epoch count. `dlpipe eval` scores these weights. A checkpoint of this run's own folder to
    resume from takes precedence: an interrupted fine-tune continues where it stopped."""
    keep_last: int = 2
    """Epoch checkpoints to keep (the best one is kept in addition)."""
    monitor: str | None = "val_loss"
    """Epoch metric that decides best.pt; None keeps no best checkpoint."""
    mode: str = "auto"
    """min or max: whether a lower or a higher `monitor` is better; auto: min for a loss, and the
    metric's own direction for a validation metric (torchmetrics' higher_is_better)."""


@dataclass
class BenchConfig:
    """`dlpipe bench` (measure the configured loader) and `dlpipe tune` (search for a faster one)."""

    warmup_batches: int = 5
    """Batches fetched before measuring; the first one (worker start-up) is reported as first_batch_s."""
    batches: int = 50
    """Batches measured per measurement (across epoch boundaries, as training sees them)."""
    mode: str = "loader"
    """loader: iterate the loader alone; train: also run the training step on each batch (tune:
    the best worker count depends on how many cores the step itself takes)."""
    repeats: int = 3
    """tune: measurements per candidate, the median counts; the start candidate's spread is the noise."""
    min_gain: float = 0.03
    """tune: a candidate must beat the best by this fraction (or by twice the measured noise) to win."""
    max_workers: int | None = None
    """tune: the most workers tried; None = the CPU budget plus half of it (at least 2 more)."""
    output_dir: str = "tuned"
    """tune: the written config goes to OUTPUT_DIR/loader/NAME.yaml; use it with
    `dlpipe --config-dir OUTPUT_DIR loader=NAME`."""
    name: str = "tuned"
    """tune: the loader option name the result is written as."""


@dataclass
class SweepConfig:
    """What a training job returns to Hydra's sweepers (`--multirun hydra/sweeper=optuna`): one number, the
    objective's value at the last epoch (dlpipe/config/objective.py)."""

    objective: str | None = None
    """The metric returned: any epoch metric the job logs, by dlpipe's name or MLflow's (val_r2 or val/r2,
    val_acc for a user metric `metrics.acc`, samples_per_s or perf/samples_per_s); None: the metric
    checkpoint.monitor names (val_loss by default), and nothing when this run does not log it."""
    direction: str = "auto"
    """min or max: whether a lower or a higher objective is better; auto: min for a loss or a time, the
    metric's own direction for a validation metric (torchmetrics' higher_is_better), max for samples_per_s."""


SCHEDULER_INTERVALS = ("step", "epoch")
"""scheduler.interval: step the schedule after every optimizer step, or after every epoch."""
SCHEDULER_DEFAULT_INTERVAL = "epoch"
"""For a scheduler node without `interval` (your own `_target_`): once an epoch, as PyTorch's examples step them."""


@dataclass
class DlpipeConfig:
    """The whole job."""

    dataset: Any = MISSING
    val_dataset: Any = None
    """Validation data of its own: a `_target_` node built like `dataset` (a stream's validation, or a
    held-out set). None: validation is trainer.val_fraction of `dataset`, a seeded split; given, it
    replaces that split (trainer.val_fraction is not used)."""
    model: Any = MISSING
    optim: Any = MISSING
    loss: Any = MISSING
    """A `_target_` node: an nn.Module or a callable (output, target) -> scalar; conf/loss/ has the
    built-in options, `loss=model` uses the loss the model returns."""
    metrics: Any = None
    """Validation metrics, name -> `_target_` node (torchmetrics), logged as val_<name>; None picks
    them by the loss (accuracy for classification, mse/mae/r2 for regression), {} logs none."""
    scheduler: Any = None
    """The learning-rate schedule: a `_target_` node built with the optimizer as its first argument
    (any torch.optim.lr_scheduler class; conf/scheduler/ has cosine and linear with warm-up, onecycle,
    step), or None / {} (scheduler=none) for the optimizer's lr throughout. dlpipe's own key
    `interval` (step or epoch, SCHEDULER_INTERVALS; default SCHEDULER_DEFAULT_INTERVAL) says when it is
    stepped and is not passed on; a `total_steps` the class takes and the node leaves out is derived
    (the run's optimizer steps, or its epochs with interval=epoch)."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    callbacks: Any = None
    """The user's callbacks, name -> `_target_` node (hooks: dlpipe/training/callbacks.py); None: none."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    task: str = "train"
    """train, bench, tune, eval or plan (`dlpipe bench ...`, `dlpipe tune ...`, `dlpipe eval ...` and
    `dlpipe plan ...` set it)."""


CHOICES: dict[str, tuple[str, ...]] = {
    "task": ("train", "bench", "tune", "eval", "plan"),  # the one list: each is dlpipe.tasks.<name>, `dlpipe <name>`
    "loader.fetch": ("auto", "item", "batch"),
    "loader.worker_method": ("auto", "process", "thread"),
    "loader.stream_share": ("auto", "dlpipe", "source"),
    "loader.multiprocessing_context": ("fork", "spawn", "forkserver"),
    "trainer.amp": ("off", "bf16", "fp16"),
    "trainer.on_nonfinite": ("stop", "skip_step", "warn"),
    "trainer.early_stopping.mode": ("auto", "min", "max"),
    "checkpoint.resume": ("auto", "must", "never"),
    "checkpoint.mode": ("auto", "min", "max"),
    "bench.mode": ("loader", "train"),
    "tracking.log_model": ("none", "best", "last"),
    "sweep.direction": ("auto", "min", "max"),
}
"""The typed keys that take one of a few words (checked in config/validation.py)."""

_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def allowed(key: str) -> str | None:
    """What a typed key ("trainer.early_stopping.mode") accepts, in words: its choices, or its kind ("an
    integer"), "or null" where it may be None; None for a key no dataclass here types."""
    kind: Any = DlpipeConfig
    for part in key.split("."):
        hints = typing.get_type_hints(kind) if dataclasses.is_dataclass(kind) else {}
        if part not in hints:
            return None
        kind = hints[part]
    kinds = [k for k in typing.get_args(kind) if k is not type(None)] or [kind]
    words = ", ".join(CHOICES[key]) if key in CHOICES else _KINDS.get(kinds[0])
    if words is None:
        return None
    return words + (" or null" if type(None) in typing.get_args(kind) else "")
