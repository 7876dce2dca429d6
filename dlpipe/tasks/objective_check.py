"""A search whose objective every trial would refuse stops before anything is made.

A sweeper that reads what the jobs return (Optuna's) is checked by each job (config.objective):
`hydra.sweeper.direction=maximize` (or Optuna's default, minimize) against a metric better the other
way, or a sweep.objective the job will not log, failed every trial one by one, after the sweep's
folder and parent run were made. This callback, beside config.sweep_check at the head of the list,
runs the same check once on the sweep's own config (the values every trial shares) and ends the
process with the job's line before the others run.

What only a built job knows (the direction of a torchmetrics metric of your own, a validation split
that comes out empty) is still checked by each job; so is a search that sweeps a key the objective
depends on (`loss=choice(mse,l1)`: the default loss would log other metrics than every trial does),
and a config this one cannot resolve or type outside a job (the job then says what is wrong).
"""

import sys

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dlpipe.config.objective import Sweeper, choose_objective
from dlpipe.config.validation import validate
from dlpipe.errors import ConfigError, DlpipeError
from dlpipe.sweeps.callback import swept_keys
from dlpipe.tasks.fit_checks import TELEMETRY_METRICS
from dlpipe.tracking.metric_names import dlpipe_name

# Imported inside functions: tasks.build, which imports torch (about 1 s), only for a sweeper that reads
# what jobs return: the basic sweeper's sweeps start without it.


OBJECTIVE_KEYS = ("recipe", "task", "loss", "metrics", "sweep", "checkpoint", "val_dataset", "batch",
                  "trainer.val_fraction", "trainer.limit_val_batches")
"""What the objective, its direction and whether the job logs it depend on (config.objective)."""


def sweeps_the_objective(config: DictConfig) -> bool:
    """Whether the search sweeps a key the objective depends on: on the command line, or in
    `hydra.sweeper.params` (Optuna's search space written in the config)."""
    params = config.hydra.sweeper.get("params") or {}
    keys = [*swept_keys(list(config.hydra.overrides.task)), *(str(k).lstrip("+~") for k in params)]
    return any(k == o or k.startswith(f"{o}.") for k in keys for o in OBJECTIVE_KEYS)


def shared_config(config: DictConfig) -> dict | None:
    """The sweep's config without Hydra's node, resolved: what every trial starts from (the swept
    keys at their defaults); None where it does not resolve outside a job."""
    job = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    try:
        return OmegaConf.to_container(job, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException:
        return None


def objective_problem(config: DictConfig) -> list[str]:
    """The lines a training trial of this sweep would refuse its objective with; none where it would
    not, where the sweeper ignores what jobs return, or where only a job can tell."""
    node = config.hydra.sweeper
    sweeper = Sweeper(str(node.get("_target_")), node.get("direction"))
    if not sweeper.reads_objective or config.get("task", "train") != "train" or sweeps_the_objective(config):
        return []
    resolved = shared_config(config)
    if resolved is None:
        return []
    try:
        cfg = validate(resolved)
        from dlpipe.tasks.build import build_objective

        kind = build_objective(cfg).kind
    except DlpipeError:
        return []  # a value the trials set or that each job reports itself
    try:
        choose_objective(cfg, TELEMETRY_METRICS, kind, sweeper, dlpipe_name)
    except ConfigError as e:
        return list(e.problems)
    return []


class ObjectiveCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        problems = objective_problem(config)
        for line in problems:
            print(f"dlpipe: error: {line}", file=sys.stderr)
        if problems:
            sys.exit(2)  # an exception here would be only a warning (Hydra's callbacks)
