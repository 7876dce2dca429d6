"""Data-parallel training across processes: which rank this is, the process group, and the few
collectives the runner needs (gradients themselves are averaged by DistributedDataParallel).

Ranks come from the environment that the launcher sets: torchrun's RANK / WORLD_SIZE /
LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, or, for a submitit job with one task
per GPU (Slurm), from submitit's job environment, exported into the same variables before the
config is resolved (so `${auto_workers:}` divides the node's CPUs among its ranks).
"""

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger("dlpipe")

# How long a collective may wait for a peer before failing. torchrun ends every rank when one
# fails, but under srun a dead task leaves the others waiting: this bounds that wait.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


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
    """The ranks torchrun (or export_submitit_env) put in the environment; one process otherwise."""
    env = os.environ if environ is None else environ
    world = _int(env, "WORLD_SIZE", 1)
    if world <= 1:
        return SINGLE
    return Ranks(rank=_int(env, "RANK", 0), world=world, local_rank=_int(env, "LOCAL_RANK", 0),
                 local_world=_int(env, "LOCAL_WORLD_SIZE", world))


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


def device_for(device: str, ranks: Ranks) -> str:
    """`cuda` becomes this rank's GPU, cuda:LOCAL_RANK; other devices are unchanged."""
    if ranks.distributed and device == "cuda":
        return f"cuda:{ranks.local_rank}"
    return device


def start(ranks: Ranks, device: str) -> None:
    """Join the process group: NCCL between GPUs, gloo on the CPU."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)  # NCCL's own buffers go to this rank's GPU, not to cuda:0
    dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    log.info("rank %d of %d (local %d of %d), %s on %s", ranks.rank, ranks.world, ranks.local_rank,
             ranks.local_world, backend, device)


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def stop() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(value):
    """Rank 0's value of a picklable object, on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def lost_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank went away (it crashed or was stopped)."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return any(mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL"))


class Collectives:
    """The runner's view of the other ranks (dlpipe.runner takes any object with these methods)."""

    def __init__(self, ranks: Ranks, device):
        self.ranks = ranks
        self.device = device

    def sum(self, values: list[float]):
        """Element-wise sum over ranks of a few numbers (one collective)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def barrier(self) -> None:
        barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a stop request reaching some ranks only)."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def epoch_row(self, row: dict[str, float]) -> dict[str, float]:
        """One epoch's metrics for the whole job: throughput adds up over ranks, times and peaks
        are the slowest or largest rank's, rates and fractions are means over ranks. Validation
        metrics arrive already exact (runner.validate sums its counts over ranks)."""
        import torch
        import torch.distributed as dist

        keys = sorted(k for k in row if k not in ("epoch", "val_loss", "val_accuracy"))
        if not keys:
            return dict(row)
        values = torch.tensor([row[k] for k in keys], dtype=torch.float64, device=self.device)
        totals, peaks = values.clone(), values.clone()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        out = dict(row)
        for key, total, peak in zip(keys, totals.tolist(), peaks.tolist()):
            out[key] = total if key in SUMMED else peak if key.endswith(PEAK_SUFFIXES) else total / self.ranks.world
        return out


# Rates of the whole job: the sum over ranks.
SUMMED = {"samples_per_s"}
# The job waits for its slowest rank and needs room for its largest: the maximum over ranks.
PEAK_SUFFIXES = ("_time_s", "_peak_mb", "_max_mb", "first_batch_s", "_p95_ms", "_reserved_mb", "_allocated_mb")
