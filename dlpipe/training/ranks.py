"""Where this process sits among a data-parallel job's processes, and which launcher said so.

Ranks come from the environment that the launcher sets: torchrun's RANK / WORLD_SIZE /
LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT; for a submitit job with one task per
GPU (Slurm), from submitit's job environment; for a plain `srun` step of several tasks, from
Slurm's own variables (`dlpipe.machine.slurm_ranks`). Both are exported into torchrun's variables
before the config is resolved (so `${auto_workers:}` divides the node's CPUs among its ranks).
What data-parallel training cannot do is refused here, before anything starts.
"""

import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from dlpipe.errors import ConfigError, DlpipeError
from dlpipe.machine import slurm_ranks

# Imported inside functions: submitit (optional: the slurm extra), only in a job that runs under it.


@dataclass(frozen=True)
class Ranks:
    """Where this process sits among the job's processes."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 tracks, checkpoints and prints; the others only train."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    value = environ.get(key, "")
    return int(value) if value.isdigit() else default


def ranks_from_env(environ: Mapping[str, str] | None = None) -> Ranks:
    """The ranks torchrun (or export_submitit_env, or export_srun_env) put in the environment; one
    process otherwise. A task of a plain srun step is a rank once the CLI exported its ranks."""
    env = os.environ if environ is None else environ
    world = _int(env, "WORLD_SIZE", 1)
    if world <= 1:
        return SINGLE
    return Ranks(rank=_int(env, "RANK", 0), world=world, local_rank=_int(env, "LOCAL_RANK", 0),
                 local_world=_int(env, "LOCAL_WORLD_SIZE", world))


def export_srun_env(environ=None) -> bool:
    """In a task of a plain srun step of several tasks, set torch.distributed's variables from
    Slurm's (`slurm_ranks.step_ranks`). Returns whether it did: not outside such a step, nor where
    torchrun or submitit set them, nor where Slurm's variables do not fit together (check_ranks
    then refuses the job, in one line)."""
    env = os.environ if environ is None else environ
    try:
        found = slurm_ranks.step_ranks(env)
    except slurm_ranks.StepError:
        return False
    if found is None:
        return False
    env.update(found)
    return True


def ranks_source(environ: Mapping[str, str]) -> str:
    """Which launcher gave this process its ranks, for the log: torchrun, submitit, srun, or the environment."""
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun"
    if "SUBMITIT_EXECUTOR" in environ:
        return "submitit"
    if "SLURM_STEP_ID" in environ and environ.get("SLURM_PROCID") == environ.get("RANK"):
        return "srun"
    return "the environment"


def _unresolved(address: str) -> str | None:
    """Why `address` cannot be reached by name from here (None: it resolves)."""
    try:
        socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError) as e:
        return str(e)
    return None


def _sweep_refusal(ranks: Ranks, srun: bool) -> str:
    under = f"in an srun step of {ranks.world} tasks" if srun else f"under torchrun (WORLD_SIZE={ranks.world})"
    return (f"--multirun {under}: every rank would run the whole sweep; sweep with hydra/launcher=slurm_node "
            f"(tasks_per_node=N), or start one {'srun' if srun else 'torchrun'} per job")


def sweep_across_ranks(args: list[str], environ=None) -> str | None:
    """Why `dlpipe ARGS` cannot run here, when ARGS sweep (--multirun) and this process is one of
    several ranks (torchrun's, or an srun step's tasks): for the CLI to refuse before Hydra opens
    the sweep's folder and parent run. None where it can (a submitit job runs one sweep point)."""
    env = dict(os.environ if environ is None else environ)
    export_srun_env(env)  # a copy: an srun step's tasks are ranks here whether or not the CLI exported them yet
    ranks = ranks_from_env(env)
    if not {"--multirun", "-m"} & set(args) or not ranks.distributed or "SUBMITIT_EXECUTOR" in env:
        return None
    return _sweep_refusal(ranks, ranks_source(env) == "srun")


def check_ranks(ranks: Ranks, multirun: bool, device: str, environ: Mapping[str, str], devices: int = 1) -> None:
    """What data-parallel training cannot do, refused before anything starts."""
    if not ranks.distributed:
        try:
            slurm_ranks.step_ranks(environ)  # a step of several tasks whose ranks export_srun_env could not tell
        except slurm_ranks.StepError as e:
            raise DlpipeError(f"srun with {environ.get('SLURM_STEP_NUM_TASKS') or environ.get('SLURM_NTASKS')} "
                              f"tasks: {e}") from None
        if devices > 1:  # the command-line shortcut restarts under torchrun; a config file cannot
            raise ConfigError([f"trainer.devices={devices}: set in a config file, where it cannot start processes; "
                               f"pass trainer.devices={devices} on the command line, or launch with "
                               f"torchrun --nproc_per_node={devices} -m dlpipe ..."])
        return
    source = ranks_source(environ)
    srun = source == "srun"
    if devices > 1 and devices != ranks.local_world:
        how = (f"srun --ntasks-per-node={devices} to run {devices}, or leave trainer.devices at 1" if srun
               else "leave trainer.devices at 1 under your own torchrun")
        raise ConfigError([f"trainer.devices={devices}: this node runs {ranks.local_world} ranks (LOCAL_WORLD_SIZE); "
                           f"{how}"])
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if missing:
        raise DlpipeError(f"WORLD_SIZE={ranks.world} without {', '.join(missing)}: start data-parallel training "
                          f"with torchrun --nproc_per_node={ranks.world} -m dlpipe ..., which sets them all")
    if multirun and "SUBMITIT_EXECUTOR" not in environ:
        raise DlpipeError(_sweep_refusal(ranks, srun))
    if source in ("srun", "submitit"):  # MASTER_ADDR is a node's name from Slurm: every rank must reach it
        why = _unresolved(environ["MASTER_ADDR"])
        if why is not None:
            raise DlpipeError(f"MASTER_ADDR={environ['MASTER_ADDR']} (rank 0's node, from Slurm's node list) does not "
                              f"resolve here ({why}): export MASTER_ADDR=<its address> before srun")
    if device.startswith("cuda:"):
        raise ConfigError([f"trainer.device={device}: with {ranks.world} ranks each one takes cuda:LOCAL_RANK; "
                           "use trainer.device=cuda"])
    if device == "mps":
        raise ConfigError([f"trainer.device=mps: data-parallel training ({ranks.world} ranks) needs cpu (gloo) "
                           "or cuda (NCCL)"])


_DEVICES = re.compile(r"\+{0,2}trainer\.devices=(\d+)")
# Options after which dlpipe only prints or inspects, so there is nothing to start processes for.
_NO_TRAINING = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--version", "--shell-completion", "-sc"}


def devices_requested(args: list[str]) -> int:
    """N from a `trainer.devices=N` override on the command line (the last one wins), else 1."""
    n = 1
    for arg in args:
        m = _DEVICES.fullmatch(arg)
        if m:
            n = int(m.group(1))
    return n


def torchrun_command(args: list[str], environ: Mapping[str, str]) -> list[str] | None:
    """The command that runs `dlpipe ARGS` as trainer.devices=N ranks under torchrun on this node,
    or None when it should run as it is (one device, already a rank, or nothing to train)."""
    n = devices_requested(args)
    # in an srun step of several tasks, the tasks are the ranks (export_srun_env; check_ranks compares)
    if n <= 1 or "WORLD_SIZE" in environ or slurm_ranks.in_step_of_several(environ) or _NO_TRAINING & set(args):
        return None
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            "-m", "dlpipe", *args]


def export_submitit_env(environ=None) -> bool:
    """In a submitit job of several tasks (one per GPU, possibly over several nodes), set the
    torch.distributed variables from submitit's job environment, as torchrun would have.

    Returns whether it did. A no-op outside submitit, for single-task jobs, and when the variables
    are already there (torchrun started inside a Slurm job).
    """
    env = os.environ if environ is None else environ
    if "SUBMITIT_EXECUTOR" not in env or "WORLD_SIZE" in env:
        return False
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks <= 1:
        return False
    # Devices stay addressed as cuda:LOCAL_RANK, as under torchrun: NVML's mapping and the logs agree.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True
