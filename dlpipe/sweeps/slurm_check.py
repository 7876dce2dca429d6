"""A Slurm sweep whose jobs could never start is refused before anything is submitted.

Slurm 22.05 takes a job that asks for more than its partition can ever give and leaves it PENDING
for ever (the presets' 8 CPUs and 32 GB on a smaller partition did): the sweep would wait with no
word. So before a sweep opens its parent run, the launcher's request is held against the partition
slurmctld describes (machine.slurm_partition): one line per key to change, naming the value and what
the partition allows, and the process ends as for any bad input. Where slurmctld cannot be asked
(no scontrol, no answer) the sweep is submitted as before, with one warning.

A Hydra callback of its own (SlurmCheck), listed before OutputFolders claims the sweep's folder and
SweepTracking opens its parent run: a refused sweep leaves nothing behind.
"""

import logging
import math
import sys

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dlpipe.machine.slurm_partition import Partition, read_partitions

log = logging.getLogger("dlpipe")

KEY = "hydra.launcher"


def is_slurm_sweep(config: DictConfig) -> bool:
    """Whether the sweep submits through submitit's Slurm executor (Hydra's launcher or dlpipe's)."""
    target = OmegaConf.select(config, "hydra.launcher._target_", default="") or ""
    return target.endswith(".SlurmLauncher")


def _named(partitions: dict[str, Partition]) -> str:
    return ", ".join(f"{p.name} (the default)" if p.default else p.name for p in partitions.values())


def problems(launcher: dict, partitions: dict[str, Partition]) -> list[str]:
    """Why a job of `launcher` (the resolved hydra.launcher) could never start, one line per key."""
    name = launcher.get("partition")
    if name is None:
        default = next((p for p in partitions.values() if p.default), None)
        if default is None:
            return [f"{KEY}.partition=null: this cluster has no default partition; name one of {_named(partitions)}"]
        part = default
    elif name not in partitions:
        return [f"{KEY}.partition={name}: no such partition on this cluster; it has {_named(partitions)}"]
    else:
        part = partitions[name]
    which = f"partition {part.name}" + (" (the default)" if name is None else "")
    found = []
    cpus, tasks = launcher.get("cpus_per_task"), launcher.get("tasks_per_node") or 1
    most_cpus = part.largest_cpus()
    if cpus is not None and most_cpus is not None and cpus * tasks > most_cpus:
        asked = f"{cpus} x tasks_per_node={tasks} = {cpus * tasks}" if tasks > 1 else str(cpus)
        found.append(f"{KEY}.cpus_per_task={cpus}: a node of {which} gives a job at most {most_cpus} "
                     f"CPU{'s' if most_cpus != 1 else ''} (asked {asked}); set it to at most {most_cpus // tasks}")
    mem_gb, most_mb = launcher.get("mem_gb"), part.largest_mem_mb()
    if mem_gb is not None and most_mb is not None and mem_gb * 1024 > most_mb:  # submitit asks --mem=<mem_gb>GB
        found.append(f"{KEY}.mem_gb={mem_gb}: a node of {which} gives a job at most {most_mb} MB "
                     f"({most_mb / 1024:.1f} GB); set it to at most {math.floor(most_mb / 1024)}")
    minutes = launcher.get("timeout_min")
    if minutes is not None and part.max_time_min is not None and minutes > part.max_time_min:
        found.append(f"{KEY}.timeout_min={minutes}: {which} allows at most {part.max_time_min:g} minutes "
                     f"(MaxTime); set it to at most {math.floor(part.max_time_min)}")
    nodes = launcher.get("nodes") or 1
    most_nodes = min((n for n in (part.max_nodes, part.total_nodes) if n is not None), default=None)
    if most_nodes is not None and nodes > most_nodes:
        found.append(f"{KEY}.nodes={nodes}: {which} gives a job at most {most_nodes} node"
                     f"{'s' if most_nodes > 1 else ''}; set it to at most {most_nodes}")
    return found


def refuse_what_cannot_start(config: DictConfig, read=read_partitions) -> None:
    """End the process with one line per problem when a Slurm sweep's jobs could never start."""
    if not is_slurm_sweep(config):
        return
    try:
        partitions = read()
    except OSError as e:
        log.warning("cannot check the Slurm partition before submitting (%s): submitting as asked", e)
        return
    launcher = OmegaConf.to_container(config.hydra.launcher, resolve=True)
    found = problems(launcher, partitions)
    if not found:
        return
    for line in found:
        print(f"dlpipe: error: {line}", file=sys.stderr)
    sys.exit(2)  # an exception in a Hydra callback would be only a warning


class SlurmCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        refuse_what_cannot_start(config)
