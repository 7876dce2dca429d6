"""Objects from a validated config: dataset splits, model, optimizer, objective, metrics, callbacks and
schedule (the DataLoaders are loader.fitting's).

Everything here runs before a tracking run exists, so every user mistake it finds (a class that
does not build, a device this machine lacks, a batch size that leaves no batch) is a ConfigError
naming the key, and nothing is left half-made.
"""

import copy
import inspect
import itertools
import logging

import torch
from torch.utils.data import Subset

from dlpipe.config.targets import DATASET_ALLOWED, locate, not_a_dataset, stream_split_refused
from dlpipe.errors import ConfigError, DlpipeError
from dlpipe.instantiate import instantiate_group
from dlpipe.loader.collate import collate_first
from dlpipe.loader.faults import NamedErrors
from dlpipe.loader.split import train_val_split
from dlpipe.loader.stream_end import declared_endless
from dlpipe.loader.streams import StreamShare, is_stream
from dlpipe.schema import SCHEDULER_DEFAULT_INTERVAL, DlpipeConfig
from dlpipe.tasks.fit_checks import check_monitored, model_data_mismatch
from dlpipe.training import objective as kinds
from dlpipe.training import rng
from dlpipe.training.callbacks import Callbacks, EarlyStopping
from dlpipe.training.losses import IGNORE_INDEX
from dlpipe.training.objective import Objective
from dlpipe.training.schedule import Schedule, schedule_length

# Imported inside functions: torchmetrics (over a second), needed only for a training or eval job's default
# metrics; plan, bench and tune build their datasets here too and never use it.

log = logging.getLogger("dlpipe")


def check_device(device: str) -> None:
    """The requested device must exist here; checked before anything is built or tracked."""
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(["trainer.device=mps: this torch build or machine has no MPS device; use cpu"])
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError([f"trainer.device={device}: torch sees no CUDA device (CPU-only build or no driver); "
                               "use trainer.device=cpu"])
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            last = torch.cuda.device_count() - 1
            raise ConfigError([f"trainer.device={device}: only cuda:0 to cuda:{last} are visible"])


def validation_view(dataset):
    """The same samples without random augmentation, so every epoch and every sweep job scores
    identical inputs. Applies to datasets with an `augment` attribute (the built-in image ones);
    a shallow copy shares the decoded-once data."""
    if not getattr(dataset, "augment", False):
        return dataset
    plain = copy.copy(dataset)
    plain.augment = False
    return plain


def build_datasets(cfg: DlpipeConfig):
    """(train split, validation split or None, the whole dataset); raises ConfigError/DataError.
    Validation is val_dataset where given, else trainer.val_fraction of a map dataset (a seeded
    split); a stream (an IterableDataset) has no split to take it from."""
    check_device(cfg.trainer.device)
    dataset = instantiate_group("dataset", cfg.dataset)
    check_dataset("dataset", cfg.dataset["_target_"], dataset)
    val_set = instantiate_group("val_dataset", cfg.val_dataset) if cfg.val_dataset else None
    if val_set is not None:
        check_dataset("val_dataset", cfg.val_dataset["_target_"], val_set)
    check_streams_end(cfg, dataset, val_set)
    if val_set is not None:
        if cfg.trainer.val_fraction:
            log.info("trainer.val_fraction=%g not used: val_dataset is the validation data", cfg.trainer.val_fraction)
        return _named(dataset), _named(validation_view(val_set)), dataset
    if is_stream(dataset):
        if cfg.trainer.val_fraction:  # a function returned a stream: validation could not tell
            raise ConfigError([stream_split_refused(cfg.dataset["_target_"], cfg.trainer.val_fraction)])
        return dataset, None, dataset
    train_set, val_set = train_val_split(dataset, cfg.trainer.val_fraction, cfg.trainer.seed)
    if val_set is not None:
        val_set = NamedErrors(Subset(validation_view(dataset), val_set.indices))
    return NamedErrors(train_set), val_set, dataset


def check_streams_end(cfg: DlpipeConfig, dataset, val_set) -> None:
    """A stream that declares it never ends (loader.stream_end) needs a limit: the training stream
    trainer.limit_train_batches or trainer.max_steps where it is trained on (train, and plan, which
    shows what a run does: bench and tune read bench.batches of it, eval scores val_dataset), a
    val_dataset stream trainer.limit_val_batches. Refused here, before anything is tracked."""
    problems = []
    endless = declared_endless(dataset) if is_stream(dataset) and cfg.task in ("train", "plan") else None
    if endless and cfg.trainer.limit_train_batches == -1 and cfg.trainer.max_steps == -1:
        problems.append(f"trainer.limit_train_batches=-1, trainer.max_steps=-1: dataset._target_="
                        f"{cfg.dataset['_target_']} is a stream that never ends ({endless}), so its first epoch "
                        "would never end; set trainer.limit_train_batches=N (micro-batches an epoch) or "
                        "trainer.max_steps=N (optimizer steps in all), N >= 1")
    endless = declared_endless(val_set) if val_set is not None and is_stream(val_set) else None
    if endless and cfg.trainer.limit_val_batches == -1:
        problems.append(f"trainer.limit_val_batches=-1: val_dataset._target_={cfg.val_dataset['_target_']} is a "
                        f"stream that never ends ({endless}), so validation would never end; set "
                        "trainer.limit_val_batches=N (batches a validation pass, N >= 1), or 0 for no validation")
    if problems:
        raise ConfigError(problems)


def _named(dataset):
    """A map dataset's failures named by index (NamedErrors); a stream's are named where it is read
    (loader.streams.StreamShare)."""
    return dataset if is_stream(dataset) else NamedErrors(dataset)


def check_dataset(group: str, target: str, dataset) -> None:
    """What dataset._target_ (or val_dataset._target_) built must be a dataset: validation checked a
    class, but a function (os.getcwd) is only known by what it returns."""
    why = not_a_dataset(type(dataset))
    if why:
        raise ConfigError([f"{group}._target_={target}: returned a {type(dataset).__name__} ({why}); "
                           f"{DATASET_ALLOWED}"])


def build_model(cfg: DlpipeConfig, dataset):
    """Model and optimizer (the model's num_classes and in_features may come from the data)."""
    model_cfg = dict(cfg.model)
    if model_cfg.get("num_classes", 0) is None:
        if not hasattr(dataset, "num_classes"):
            raise ConfigError([f"model.num_classes=null: {type(dataset).__name__} has no num_classes; "
                               "set model.num_classes"])
        model_cfg["num_classes"] = int(dataset.num_classes)
        log.info("model.num_classes = %d (the dataset's num_classes)", model_cfg["num_classes"])
    if model_cfg.get("in_features", 0) is None:
        model_cfg["in_features"], source = in_features_of(dataset, cfg.batch.input)
        log.info("model.in_features = %d (%s)", model_cfg["in_features"], source)
    model = instantiate_group("model", model_cfg)
    # The model's parameters are the optimizer's first argument, `params`, passed here.
    optimizer = instantiate_group("optim", cfg.optim, params=model.parameters())
    return model, optimizer


def in_features_of(dataset, input_field: str | None) -> tuple[int, str]:
    """(the model's in_features, where it came from): the dataset's num_features, else the last
    dimension of item 0's input, as the objective's batch layout reads it (the first part of a
    tuple, or the dict field batch.input names)."""
    if hasattr(dataset, "num_features"):
        return int(dataset.num_features), "the dataset's num_features"
    fix = "set model.in_features to the length of one input vector (or give the dataset a num_features attribute)"
    state = rng.capture()
    try:
        item = (first_items(dataset, 1) or [None])[0]
    finally:
        rng.restore(state)  # an augmenting dataset draws here: the run's streams stay as they were
    if item is None:
        raise ConfigError([f"model.in_features=null: {type(dataset).__name__} has no num_features and no items; {fix}"])
    args, _, _ = Objective(input_field=input_field).split(item)
    value = args[0] if args else item
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        what = "a scalar tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
        raise ConfigError([f"model.in_features=null: {type(dataset).__name__} has no num_features and item 0's "
                           f"input is {what}, not a feature tensor; {fix}"])
    return int(value.shape[-1]), f"the last dimension of dataset item 0's input, shape {list(value.shape)}"


def first_items(dataset, count: int) -> list:
    """The first `count` items (fewer if there are fewer) of a map dataset by index, of a stream as
    the main process reads it; failures named."""
    if is_stream(dataset):
        return list(itertools.islice(StreamShare(dataset, share=False), count))
    named = dataset if isinstance(dataset, NamedErrors) else NamedErrors(dataset)
    return [named[i] for i in range(min(count, len(dataset)))]


def build_data_and_model(cfg: DlpipeConfig):
    """Dataset splits, model and optimizer; raises ConfigError/DataError naming the bad key."""
    train_set, val_set, dataset = build_datasets(cfg)
    model, optimizer = build_model(cfg, dataset)
    return train_set, val_set, model, optimizer


def build_objective_and_metrics(cfg: DlpipeConfig, model, train_set, collate_fn):
    """The loss with its batch layout, checked on two real samples, and the validation metrics
    (sized by the model's output for the default accuracy)."""
    objective = build_objective(cfg)
    state, training = rng.capture(), model.training
    model.eval()  # no dropout: the check draws no random numbers the run would then miss
    try:
        prediction = check_objective(cfg, objective, model, train_set, collate_fn)
    finally:
        model.train(training)
        rng.restore(state)  # fetching the items may have augmented them: the run's streams stay as they were
    return objective, build_metrics(cfg, objective, prediction)


def build_objective(cfg: DlpipeConfig):
    """The loss (conf/loss/: any nn.Module or callable) and the batch layout it is fed from."""
    return Objective(instantiate_group("loss", cfg.loss), cfg.batch.input, cfg.batch.target)


def check_objective(cfg: DlpipeConfig, objective, model, train_set, collate_fn=None):
    """Two real samples through the model and the loss, before anything is tracked: a sample the
    loss cannot use is one line naming the field. Returns the model's predictions for them."""
    batch = collate_first(first_items(train_set, 2), collate_fn)
    try:
        return objective.check(model, batch, f"loss._target_={cfg.loss.get('_target_')}")
    except DlpipeError:
        raise
    except Exception as e:  # the loss's own failures are ConfigErrors already: the model cannot take the batch
        raise ConfigError([model_data_mismatch(cfg, batch, e)]) from e


def build_metrics(cfg: DlpipeConfig, objective, prediction) -> dict:
    """Validation metrics by name: cfg.metrics when given, else the defaults for the loss's kind
    (accuracy for classification, sized by the model's output; mse, mae and r2 for regression)."""
    import torchmetrics

    if cfg.metrics is not None:
        return {name: instantiate_group(f"metrics.{name}", node) for name, node in cfg.metrics.items()}
    if objective.kind == kinds.CLASSIFICATION:
        classes = int(prediction.shape[objective.class_dim if prediction.dim() > 2 else -1])
        return {"accuracy": torchmetrics.classification.MulticlassAccuracy(
            num_classes=classes, average="micro", ignore_index=IGNORE_INDEX)}
    if objective.kind == kinds.BINARY:
        return {"accuracy": torchmetrics.classification.BinaryAccuracy()}
    if objective.kind == kinds.REGRESSION:
        return {"mse": torchmetrics.MeanSquaredError(), "mae": torchmetrics.MeanAbsoluteError(),
                "r2": torchmetrics.R2Score()}
    return {}


def monitor_mode(cfg: DlpipeConfig, metrics: dict, validates: bool) -> str:
    """checkpoint.mode for checkpoint.monitor (see metric_direction)."""
    return metric_direction("checkpoint", cfg.checkpoint.monitor, cfg.checkpoint.mode, metrics, validates)


def metric_direction(section: str, monitor: str | None, mode: str, metrics: dict, validates: bool) -> str:
    """min or max for a monitored metric: `auto` takes the direction from the metric (a loss is
    minimised, a torchmetrics metric says `higher_is_better`). The metric must be one this run
    logs (fit_checks.check_monitored); `section` names the setting in errors (checkpoint, trainer.early_stopping)."""
    check_monitored(section, monitor, metrics, validates)
    if mode != "auto" or monitor is None:
        return mode if mode != "auto" else "min"
    if monitor.endswith("loss"):
        return "min"
    higher = getattr(metrics.get(monitor.removeprefix("val_")), "higher_is_better", None)
    if higher is None:
        raise ConfigError([f"{section}.monitor={monitor} with {section}.mode=auto: its direction is unknown; "
                           f"set {section}.mode=min or {section}.mode=max"])
    return "max" if higher else "min"


def build_callbacks(cfg: DlpipeConfig, metrics: dict, validates: bool):
    """The user's callbacks (cfg.callbacks, in order) and, with trainer.early_stopping.monitor set,
    early stopping after them."""
    callbacks = {name: instantiate_group(f"callbacks.{name}", node) for name, node in (cfg.callbacks or {}).items()}
    stop = cfg.trainer.early_stopping
    if stop.monitor is not None:
        if stop.monitor.startswith("val_") and not validates:
            raise ConfigError([f"trainer.early_stopping.monitor={stop.monitor}: this run does not validate "
                               "(trainer.val_fraction=0 or trainer.limit_val_batches=0); monitor train_loss or "
                               "validate"])
        mode = metric_direction("trainer.early_stopping", stop.monitor, stop.mode, metrics, validates)
        callbacks["early_stopping"] = EarlyStopping(stop.monitor, mode, stop.patience, stop.min_delta)
    return Callbacks(callbacks)


def build_scheduler(cfg: DlpipeConfig, optimizer, steps_per_epoch: int | None):
    """The learning-rate schedule (dlpipe.training.schedule.Schedule), or None for scheduler=none.

    The optimizer is the class's first argument, `optimizer`, passed here (as optim gets `params`).
    A `total_steps` the class takes and the config leaves out is derived, never a key to compute:
    the run's optimizer steps (epochs x `steps_per_epoch`, capped by trainer.max_steps) with
    interval=step, its epochs with interval=epoch."""
    if not cfg.scheduler:
        return None
    node = dict(cfg.scheduler)
    interval = node.pop("interval", SCHEDULER_DEFAULT_INTERVAL)  # dlpipe's keys, not the class's
    monitor = node.pop("monitor", None)  # ReduceLROnPlateau: the epoch metric its step() is given
    span = schedule_length(cfg.trainer, steps_per_epoch, interval)
    unit = "optimizer steps" if interval == "step" else "epochs"
    extra = {}
    try:
        takes = inspect.signature(locate(node["_target_"])).parameters  # validation located it already
    except (TypeError, ValueError):
        takes = {}  # no signature to read: the class gets what the config gives
    if "total_steps" in takes and node.get("total_steps") is None and node.get("epochs") is None:
        if span is None:
            raise ConfigError([f"scheduler._target_={node['_target_']}: its total_steps cannot be derived, the "
                               "training loader has no length; set trainer.max_steps (or +scheduler.total_steps=N)"])
        extra["total_steps"] = span
    warmup = node.get("warmup_steps") or 0
    if span is not None and warmup >= span:
        # Not refused: a quick run of a recipe (trainer.limit_train_batches=3) is legitimately this short.
        log.warning(
            "scheduler.warmup_steps=%s: the schedule spans only %d %s in this run (interval=%s), so the lr never "
            "reaches optim.lr; warm up over fewer", warmup, span, unit, interval)
    return Schedule(instantiate_group("scheduler", node, optimizer=optimizer, **extra), interval, monitor)
