"""Data-parallel training across processes: which rank this is, the process group, and the few
collectives the runner needs (gradients themselves are averaged by DistributedDataParallel).

Which rank this is, and from which launcher, is `dlpipe.training.ranks` (its names are imported
here too, where the CLI and the tasks have always found them).
"""

import gc
import logging
import math
import os
import traceback
from datetime import timedelta

from dlpipe.training.ranks import SINGLE as SINGLE
from dlpipe.training.ranks import Ranks as Ranks
from dlpipe.training.ranks import check_ranks as check_ranks
from dlpipe.training.ranks import devices_requested as devices_requested
from dlpipe.training.ranks import export_srun_env as export_srun_env
from dlpipe.training.ranks import export_submitit_env as export_submitit_env
from dlpipe.training.ranks import ranks_from_env as ranks_from_env
from dlpipe.training.ranks import ranks_source
from dlpipe.training.ranks import sweep_across_ranks as sweep_across_ranks
from dlpipe.training.ranks import torchrun_command as torchrun_command

# Imported inside functions: torch (seconds), only in a job that trains: the CLI imports this module
# to export the ranks before it resolves the config, and `dlpipe --help` must not load torch.

log = logging.getLogger("dlpipe")

# How long a collective may wait for a peer before failing. torchrun ends every rank when one
# fails, but under srun a dead task leaves the others waiting: this bounds that wait.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def device_for(device: str, ranks: Ranks, visible_gpus: int | None = None) -> str:
    """`cuda` becomes this rank's GPU: cuda:LOCAL_RANK, or cuda:0 where the scheduler shows each
    rank only its own GPU (Slurm with --gpu-bind or one GPU per task); other devices are unchanged."""
    if ranks.distributed and device == "cuda":
        if visible_gpus is not None and visible_gpus < ranks.local_world:
            return f"cuda:{ranks.local_rank % max(visible_gpus, 1)}"
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
    log.info("rank %d of %d (local %d of %d), %s on %s; ranks from %s, rendezvous at %s:%s", ranks.rank,
             ranks.world, ranks.local_rank, ranks.local_world, backend, device, ranks_source(os.environ),
             os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def release_failed(error: BaseException) -> None:
    """For a rank whose job failed: let go of what the error's finished frames hold, the job and its
    DDP model among it, so that stop() frees them while the group lives. The traceback still prints:
    clearing a frame keeps its code and line."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # skips the frames still running (the caller's)
        error = error.__cause__ or error.__context__


def stop() -> None:
    """Destroy the process group, once nothing that is garbage holds it. A finished job's DDP model
    sits in reference cycles (the trainer calls back into the job); left to a later gc pass, or to
    the interpreter's teardown, its reducer would hold the group's last reference and destroy it
    while holding the GIL, joining gloo's threads: a deadlock when one of them waits for the GIL
    (a hang in CI), an abort ("terminate called without an active exception": 1 resumed run in 14
    under load) at exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def broadcast(value):
    """Rank 0's value of a picklable object, on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def lost_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank went away (it crashed or was stopped);
    not a timeout or a mismatch, which are bugs or stragglers and keep their own message."""
    import torch.distributed as dist

    if isinstance(error, dist.DistNetworkError):
        return True
    return any(mark in str(error) for mark in ("Connection closed by peer", "Connection reset by peer"))


class Collectives:
    """The runner's view of the other ranks (dlpipe.runner takes any object with these methods)."""

    def __init__(self, ranks: Ranks, device):
        import torch.distributed as dist

        self.ranks = ranks
        # The runner's few numbers travel over gloo on the CPU even when training uses NCCL: an
        # NCCL collective on a CUDA tensor would make the host wait for the GPU at every step.
        self.group = dist.new_group(backend="gloo") if getattr(device, "type", device) == "cuda" else None

    def _reduce(self, values: list[float], op) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a few numbers (one collective)."""
        import torch.distributed as dist

        return self._reduce(values, dist.ReduceOp.SUM)

    def gather(self, value) -> list:
        """Every rank's value of a picklable object, in rank order, on every rank."""
        import torch.distributed as dist

        out = [None] * self.ranks.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a stop request reaching some ranks only)."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def epoch_row(self, row: dict[str, float]) -> dict[str, float]:
        """One epoch's metrics for the whole job: throughput adds up over ranks, times and peaks
        are the slowest or largest rank's, rates and fractions are means over the ranks that have
        them. Ranks may report different keys (a sampler metric needs live workers): the union is
        reduced. Validation metrics arrive already exact (runner.validate sums its counts)."""
        import torch.distributed as dist

        own = {k: v for k, v in row.items() if k not in ("epoch", "val_loss", "val_accuracy")}
        keys = sorted(set().union(*self.gather(sorted(own))))
        if not keys:
            return dict(row)
        present = [1.0 if k in own else 0.0 for k in keys]
        totals = self._reduce([own.get(k, 0.0) for k in keys] + present, dist.ReduceOp.SUM)
        peaks = self._reduce([own.get(k, -math.inf) for k in keys], dist.ReduceOp.MAX)
        out = dict(row)
        for i, key in enumerate(keys):
            total, count = totals[i], totals[len(keys) + i]
            out[key] = total if key in SUMMED else peaks[i] if key.endswith(PEAK_SUFFIXES) else total / count
        return out


# Rates of the whole job: the sum over ranks.
SUMMED = {"samples_per_s"}
# The job waits for its slowest rank and needs room for its largest: the maximum over ranks.
PEAK_SUFFIXES = ("_time_s", "_peak_mb", "_max_mb", "first_batch_s", "_p95_ms", "_reserved_mb", "_allocated_mb")
