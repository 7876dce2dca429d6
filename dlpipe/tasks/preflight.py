"""The job's context and the checks every task runs before it builds anything.

Everything a user can get wrong is checked here, before a tracking run starts, so a bad value or an
unreachable server leaves no half-made MLflow run behind.
"""

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from dlpipe.config.decisions import explain
from dlpipe.config.sources import Origin
from dlpipe.config.validation import validate
from dlpipe.errors import DlpipeError
from dlpipe.redact import redact_logging, redact_text
from dlpipe.schema import DlpipeConfig, TrackingConfig
from dlpipe.tracking.given_run import refuse_outside_training
from dlpipe.tracking.metric_names import dlpipe_name
from dlpipe.tracking.outbox import connect_error
from dlpipe.training.distributed import ranks_from_env

log = logging.getLogger("dlpipe")


@dataclass(frozen=True)
class JobContext:
    """What Hydra knows about this job, as plain values."""

    output_dir: Path
    overrides: list[str]
    recipe: str | None
    multirun: bool
    config_dir: str | None = None  # --config-dir, if given: with the overrides, what a resume repeats
    choices: dict[str, str] = field(default_factory=dict)  # group -> option, as Hydra composed them
    job_num: int | None = None  # Hydra's job number in a multirun (#N in the sweep's summary); None outside one

    @property
    def origin(self) -> Origin:
        """How the config was composed: what says where each value came from."""
        return Origin(tuple(self.overrides), dict(self.choices), self.config_dir)


def preflight(raw: dict, resolved: dict, task: str, ctx: JobContext) -> tuple[DlpipeConfig, dict[str, str]]:
    """The checks every task runs before building anything: (the typed config, the source of each
    hardware-aware value with the reason for each automatic one, logged here and recorded as the
    run's `auto.*` params)."""
    if task != "train":
        check_single_process(os.environ, task)
    cfg = validate(resolved)
    accept_mlflow_names(cfg)
    check_tracking_reachable(cfg.tracking)
    refuse_outside_training(task, ctx.multirun)  # MLFLOW_RUN_ID continues one training run
    decided = explain(raw, resolved, ctx.origin)
    for key, why in decided.items():
        log.info("%s = %s", key, why)
    return cfg, decided


def accept_mlflow_names(cfg: DlpipeConfig) -> None:
    """A monitored metric may be named as the MLflow UI shows it (`val/loss`, `val/accuracy`): each
    monitor key so named is set to dlpipe's name for it (`val_loss`), and the log says so."""
    def ours(key: str, name):
        mapped = dlpipe_name(name) if isinstance(name, str) else name
        if mapped != name:
            log.info("%s=%s: MLflow's name of %s", key, name, mapped)
        return mapped

    cfg.checkpoint.monitor = ours("checkpoint.monitor", cfg.checkpoint.monitor)
    stopping = cfg.trainer.early_stopping
    stopping.monitor = ours("trainer.early_stopping.monitor", stopping.monitor)
    if isinstance(cfg.scheduler, dict) and "monitor" in cfg.scheduler:
        cfg.scheduler["monitor"] = ours("scheduler.monitor", cfg.scheduler["monitor"])


def check_single_process(environ, task: str) -> None:
    """`dlpipe bench` and `dlpipe tune` measure one process's loader: N ranks would measure N
    copies of it competing for the same CPUs and write the same files."""
    ranks = ranks_from_env(environ)
    if ranks.distributed:
        raise DlpipeError(f"WORLD_SIZE={ranks.world}: dlpipe {task} measures one process; run it as one process, "
                          "not under torchrun or in a several-task srun step (auto_workers already divides the "
                          "CPUs by LOCAL_WORLD_SIZE when you set it)")


def check_tracking_reachable(tracking: TrackingConfig) -> None:
    """Fail in seconds, before anything is built, when the tracking server does not answer."""
    if not tracking.enabled:
        return
    # From here on MLflow and its HTTP libraries may log the URI, password included: the console
    # and the job's log file mask it.
    redact_logging()
    why = connect_error(tracking.uri, tracking.request_timeout_s)
    if why:
        raise DlpipeError(f"tracking.uri={redact_text(tracking.uri)}: {why}; start the server, "
                          "point tracking.uri at a running one, or use tracking=none")
