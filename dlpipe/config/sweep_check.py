"""A sweep whose jobs cannot all be composed stops before anything is made.

Hydra's basic sweeper composes each batch of jobs before launching it, but only after the sweep's
callbacks ran: the sweep folder was made and its parent MLflow run opened, and a typo in a swept
value (`dataset=tabular,tabluar`) left both behind with the one error line. This callback, first in
the list, composes every job the basic sweeper will launch, the same way (Hydra's own
`load_sweep_config`), and ends the process with that line before the others run. Other sweepers
(Optuna's) choose their jobs as they go: they keep Hydra's own check.
"""

import sys

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dlpipe.config.composition_errors import one_line

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def job_overrides(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, as the basic sweeper expands the sweep (its params, then the command line)."""
    given = config.hydra.sweeper.get("params")
    params = OmegaConf.to_container(given, resolve=False) if given else {}
    arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


class SweepCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER or not GlobalHydra.instance().is_initialized():
            return
        loader = GlobalHydra.instance().config_loader()
        try:
            for overrides in job_overrides(config):
                loader.load_sweep_config(master_config=config, sweep_overrides=overrides)
        except Exception as e:  # noqa: BLE001 - one line for what we can name; Hydra raises the rest itself
            line = one_line(e, sys.argv[1:])
            if line is None:
                return  # Hydra's own check meets it next, and the CLI reports it
            print(f"dlpipe: error: {line}", file=sys.stderr)
            sys.exit(2)  # an exception here would be only a warning (Hydra's callbacks)
