"""A stream's epoch on several ranks: the ranks end it together, and its short last windows step alike.

DistributedDataParallel needs every rank to run the same backward passes. A map dataset's EpochOrder
and dlpipe's dealing of a stream (loader.stream_share=dlpipe, loader.stream_deal.Deal) give every rank
the same number of batches. A stream that shares itself out (loader.stream_share=source, e.g. Hugging
Face's split_dataset_by_node) splits itself between the ranks as it likes, and ranks may get
different counts: a rank whose stream ended would leave the others waiting in their next all-reduce
(a hang, until the collective's timeout). So for such a stream, before every micro-batch the ranks
agree whether each of them has one (`all_have`, one all-reduce of two numbers), and the epoch ends
for all when one is out: the batches the others still hold are not trained on this epoch (`left`
counts the ranks that held one; with items split round-robin that is all they lose, with whole
files per rank as many batches as the shares differ). dlpipe's dealing loses nothing.

Either way a stream's last batches may be short, and not equally on every rank (Deal splits the last
round as evenly as it can), so the ranks' windows of micro-batches may hold different numbers of
samples. dlpipe makes a window's gradients the mean over its samples (training.accumulation.Window);
on several ranks the factor must be the job's, not each rank's, or the ranks' weights drift apart:
`job_window` sums them at every optimizer step (one all-reduce of a number, as the stop check's;
`mean_loss` does the same for the epoch's train_loss).
And a window that the stream's end cut short ran its backward passes without DDP's all-reduce (no
step was known to come): `cut_short` averages its gradients before the step.
"""

import logging
import math

import torch
import torch.distributed as dist

from dlpipe.stop import StopRequest
from dlpipe.training.protocols import Peers
from dlpipe.training.step_log import LossSum

log = logging.getLogger(__name__)


class StreamRanks:
    """The agreements between ranks that a stream's epoch needs (see the module docstring); without
    `peers` (one process, or a map dataset, whose ranks already agree) each is free and changes nothing."""

    def __init__(self, peers: Peers | None = None, uneven: bool = False):
        """`uneven`: the stream splits itself between ranks (loader.stream_share=source), so their
        batch counts may differ and every micro-batch waits for `all_have`."""
        self.peers, self.uneven = peers, uneven
        self.left = 0  # ranks that still held a batch when the epoch ended for all (uneven shares)

    @classmethod
    def of(cls, loader, peers: Peers | None) -> "StreamRanks":
        """For a loader over a stream (loader.streams.StreamShare) in a job of several ranks; one that
        does nothing otherwise."""
        dataset = getattr(loader, "dataset", None)
        if peers is None or not hasattr(dataset, "share"):
            return cls()
        return cls(peers, uneven=not dataset.share)

    def all_have(self, has_batch: bool, stop: StopRequest, done: int) -> bool:
        """Whether every rank has a next batch (without a collective where the ranks' counts are
        equal). A rank whose loader ended on a stop at an optimizer step (its workers died of the
        signal: `stop.at_batch` set) stops every rank there, after the `done` batches of each."""
        if not self.uneven:
            return has_batch
        having, world, stopped = self.peers.sum([float(has_batch), 1.0, float(stop.at_batch is not None)])
        if stopped:
            if stop.at_batch is None:
                stop.at_batch, stop.by_peer = done, not stop.requested
            return False
        if having < world:
            self.left = int(having)
            if self.left:  # said by rank 0 (the others log warnings only)
                log.info("the epoch ended for every rank when one rank's stream did: %d other rank(s) had batches "
                         "left, not trained on this epoch (loader.stream_share=source: the stream split itself "
                         "between the ranks unevenly)", self.left)
        return having == world

    def mean_loss(self, loss: LossSum) -> float:
        """The epoch's train_loss over the job's samples: the ranks' counts may differ, so the mean of
        their means (dlpipe.training.distributed.Collectives.epoch_row) would weigh a sample by its rank."""
        if self.peers is None:
            return loss.mean()
        total, samples = self.peers.sum([loss.total.item(), float(loss.samples)])
        return total / samples if samples else math.nan

    def job_window(self, samples: int) -> tuple[int, int] | None:
        """(the samples of this optimizer step's window on all ranks together, the ranks); None
        where each rank's own count is the job's (training.accumulation.Window.mean_over_samples)."""
        if self.peers is None:
            return None
        total, world = self.peers.sum([float(samples), 1.0])
        return int(total), int(world)

    def cut_short(self, model: torch.nn.Module) -> None:
        """Before stepping on a window the stream's end cut short: do what DDP's all-reduce would have
        done to its gradients, which its backward passes skipped (no_sync: no step was known to come)."""
        if self.peers is None:
            return
        world = dist.get_world_size()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
