"""sweep.objective: the one number a training job returns to Hydra's sweepers, and which way is better.

Hydra's Optuna sweeper (and any sweeper but the basic one, which ignores it) optimises what the task
function returns. A job returns its objective's value at the last epoch: the model the job ends with
is the last epoch's, and a best epoch picked over noisy validation scores flatters every trial (the
longer or noisier one most), so trials would be ranked by luck.

Checked in two steps, each refusing in one line naming the key, the value and the metrics this job
logs: `choose_objective` from the config alone, before anything is built (a typo, a validation
metric without validation, a metric the loss's kind does not log); `settle` once the validation
metrics exist (a user metric's name and its torchmetrics `higher_is_better`), before a tracking run
opens. A sweeper that reads a direction of its own (Optuna's `hydra.sweeper.direction`) must agree.

This layer knows nothing of MLflow's names or of the telemetry's metrics: the caller maps an MLflow
name to dlpipe's first and passes the epoch metrics besides the losses.
"""

import difflib
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from dlpipe.errors import ConfigError
from dlpipe.schema import DlpipeConfig

log = logging.getLogger("dlpipe")

DEFAULT_METRICS = {"classification": {"accuracy": "max"}, "binary": {"accuracy": "max"},
                   "regression": {"mse": "min", "mae": "min", "r2": "max"}}
"""The validation metrics tasks.build.build_metrics gives each loss kind when `metrics` is null, with
their torchmetrics direction (held to it by tests/test_sweep_objective.py); other kinds (loss=model,
your own loss) get none."""
MAXIMISED = frozenset({"samples_per_s"})
"""Epoch metrics besides the losses whose higher value is better; times, waits, fractions of time lost,
memory and CPU seconds a sample are better lower (LOWER_IS_BETTER); utilisation is a choice left to you."""
LOWER_IS_BETTER = ("_s", "_ms", "_frac", "_mb", "_per_sample", "_per_s", "skipped_steps", "_used_pct")
OPTUNA_DIRECTIONS = {"minimize": "min", "maximize": "max"}
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@dataclass(frozen=True)
class SweepObjective:
    metric: str
    """dlpipe's name of the metric (val_r2); the tags carry MLflow's."""
    direction: str | None
    """min or max; None until `settle` reads it from the built validation metric."""
    given: bool
    """sweep.objective named it (a refusal names that key); else checkpoint.monitor did."""
    named: str = ""
    """The name as the config gave it (`val/r2`, MLflow's), for messages."""

    @property
    def key(self) -> str:
        named = self.named or self.metric
        return f"sweep.objective={named}" if self.given else f"sweep.objective=null: checkpoint.monitor={named}"

    def value(self, history: list[dict[str, float]]) -> float | None:
        """The objective at the last epoch (a run stopped early or resumed: its last epoch too)."""
        last = history[-1] if history else {}
        if self.metric not in last:
            log.warning("%s: the last epoch logged no value of it; the job returns none to the sweeper", self.key)
            return None
        return float(last[self.metric])


@dataclass(frozen=True)
class Sweeper:
    """The sweeper running this job (Hydra's job config), as far as the objective cares."""

    target: str
    direction: object = None
    """Optuna's `direction`: minimize or maximize (an enum or a word), or a list for several objectives."""

    @property
    def reads_objective(self) -> bool:
        return self.target != BASIC_SWEEPER  # the basic sweeper ignores what jobs return


def sweeper_of_this_job() -> Sweeper | None:
    """The sweeper of the --multirun this job belongs to; None for a single run (or outside Hydra)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    node = HydraConfig.get().sweeper
    return Sweeper(str(node.get("_target_")), node.get("direction"))


def validates(cfg: DlpipeConfig) -> bool:
    """Whether the config asks for validation (the split may still come out empty: `settle` knows)."""
    return bool(cfg.val_dataset or cfg.trainer.val_fraction) and cfg.trainer.limit_val_batches != 0


def choose_objective(cfg: DlpipeConfig, epoch_metrics: Collection[str], loss_kind: str,
                     sweeper: Sweeper | None = None, ours: Callable[[str], str] = str) -> SweepObjective | None:
    """The job's objective from the config alone (cfg.sweep), or None where it is left to
    checkpoint.monitor and this run does not log that. `epoch_metrics`: the metrics every epoch logs
    besides the losses; `loss_kind`: training.objective's kind of the built loss; `ours`: dlpipe's name
    of a metric named as MLflow names it (tracking.metric_names.dlpipe_name)."""
    sweep, given = cfg.sweep, cfg.sweep.objective is not None
    named = sweep.objective if given else cfg.checkpoint.monitor
    metric = None if named is None else ours(named)
    logged = logged_metrics(cfg, loss_kind)
    why = None if metric is None else _not_logged(metric, cfg, logged, epoch_metrics)
    if not given and (metric is None or why):
        if sweeper is not None and sweeper.reads_objective:
            raise ConfigError([f"sweep.objective=null: the sweeper optimises what each job returns, and the default, "
                               f"checkpoint.monitor={named or 'null'}, {why or 'names no metric'}; set "
                               f"sweep.objective to one of {_listing(logged)}"])
        return None
    if why:
        raise ConfigError([f"sweep.objective={named}: {why}; it logs {_listing(logged)}{_guess(metric, logged)}"])
    direction = sweep.direction
    if direction == "auto" and not given and cfg.checkpoint.mode != "auto":
        direction = cfg.checkpoint.mode  # the monitor's own direction, as checkpoint.mode says it
    if direction == "auto":
        direction = _known_direction(metric, epoch_metrics, {} if cfg.metrics is not None else
                                     DEFAULT_METRICS.get(loss_kind, {}))
    objective = SweepObjective(metric, direction, given, named)
    if direction is not None:
        check_sweeper(objective, sweeper)
    return objective


def logged_metrics(cfg: DlpipeConfig, loss_kind: str) -> list[str]:
    """The losses and validation metrics the config says this job logs every epoch."""
    names = cfg.metrics.keys() if cfg.metrics is not None else DEFAULT_METRICS.get(loss_kind, ())
    return ["train_loss", *(["val_loss", *(f"val_{n}" for n in names)] if validates(cfg) else [])]


def _not_logged(metric: str, cfg: DlpipeConfig, logged: list[str], epoch_metrics: Collection[str]) -> str | None:
    if metric in logged or metric in epoch_metrics:
        return None
    if metric.startswith("val_") and not validates(cfg):
        return ("this job does not validate (trainer.val_fraction=0 without a val_dataset, or "
                "trainer.limit_val_batches=0), so it logs no val_ metric")
    return "this job does not log it"


def _listing(logged: list[str]) -> str:
    return (f"{', '.join(logged)} or a timing such as samples_per_s, epoch_time_s, data_wait_frac (by these names "
            "or MLflow's: train/loss, perf/samples_per_s)")


def _guess(metric: str, logged: list[str]) -> str:
    close = difflib.get_close_matches(metric, logged, n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _known_direction(metric: str, epoch_metrics: Collection[str], defaults: Mapping[str, str]) -> str | None:
    """min or max where the name says it: losses, times and costs min, throughput max, a default
    validation metric its own; None for your metrics (their torchmetrics class says, in `settle`)."""
    if metric.endswith("loss"):
        return "min"
    if metric.startswith("val_") and metric.removeprefix("val_") in defaults:
        return defaults[metric.removeprefix("val_")]
    if metric in MAXIMISED:
        return "max"
    if metric in epoch_metrics:
        if metric.endswith(LOWER_IS_BETTER):
            return "min"
        raise ConfigError([f"sweep.objective={metric} with sweep.direction=auto: whether more of it is better is "
                           "yours to say; set sweep.direction=min or sweep.direction=max"])
    return None


def settle(objective: SweepObjective | None, val_metrics: Mapping[str, object], validating: bool,
           sweeper: Sweeper | None = None) -> SweepObjective | None:
    """The objective checked against the validation metrics as built (`validating`: the run has a
    validation split and passes), its direction read from the metric where it was left to it."""
    if objective is None or not objective.metric.startswith("val_"):
        return objective
    name = objective.metric.removeprefix("val_")
    if not validating or (name not in val_metrics and name != "loss"):
        if not objective.given and (sweeper is None or not sweeper.reads_objective):
            return None  # checkpoint.monitor's metric, which this run does not log after all
        logged = ["train_loss", *(["val_loss", *(f"val_{n}" for n in val_metrics)] if validating else [])]
        why = "this job has no validation split" if not validating else "no validation metric of that name was built"
        raise ConfigError([f"{objective.key}: {why}; it logs {_listing(logged)}{_guess(objective.metric, logged)}"])
    if objective.direction is not None:
        return objective  # checked against the sweeper when it was chosen
    higher = getattr(val_metrics[name], "higher_is_better", None)
    if higher is None:
        raise ConfigError([f"{objective.key} with sweep.direction=auto: "
                           f"{type(val_metrics[name]).__name__} does not say whether higher is better; set "
                           "sweep.direction=min or sweep.direction=max"])
    settled = SweepObjective(objective.metric, "max" if higher else "min", objective.given, objective.named)
    check_sweeper(settled, sweeper)
    return settled


def check_sweeper(objective: SweepObjective, sweeper: Sweeper | None) -> None:
    """A sweeper with a direction of its own (Optuna's) must optimise the objective the same way."""
    if sweeper is None or sweeper.direction is None:
        return
    given = sweeper.direction
    words = [getattr(d, "name", d) for d in (given if isinstance(given, list | tuple) else [given])]
    shown = ",".join(str(w) for w in words)
    if len(words) != 1:
        raise ConfigError([f"hydra.sweeper.direction=[{shown}]: dlpipe returns one objective ({objective.key}); "
                           "give one direction"])
    wanted = {v: k for k, v in OPTUNA_DIRECTIONS.items()}[objective.direction]
    if OPTUNA_DIRECTIONS.get(str(words[0])) != objective.direction:
        raise ConfigError([f"hydra.sweeper.direction={shown}: {objective.metric} is better "
                           f"{'higher' if objective.direction == 'max' else 'lower'} (sweep.direction="
                           f"{objective.direction}), so the sweeper would seek the worst trial; set "
                           f"hydra.sweeper.direction={wanted}"])
