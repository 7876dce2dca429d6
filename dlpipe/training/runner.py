"""The training loop. Reads top to bottom: epochs -> micro-batches -> optimizer steps -> validation.

It takes built objects, the trainer's typed settings (dlpipe.schema.TrainerConfig) and small Protocols
(no config framework, no tracker), so tests drive it directly.
"""

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch
from torch.utils.data import IterableDataset

from dlpipe.console import Progress
from dlpipe.schema import TrainerConfig
from dlpipe.stop import StopRequest, StopTraining
from dlpipe.telemetry.sampler import EpochClock, ResourceSampler
from dlpipe.training import rng, trainer_state
from dlpipe.training.accumulation import Window, epoch_batches

# Also importable from here: tests and benchmarks drive the loop with these names.
from dlpipe.training.batches import non_blocking_copies, to_device, workers_died
from dlpipe.training.callbacks import Callbacks
from dlpipe.training.evaluate import evaluate
from dlpipe.training.first_step import FirstStep
from dlpipe.training.net import autocast_for, training_net
from dlpipe.training.nonfinite import NonFiniteGuard
from dlpipe.training.objective import Objective
from dlpipe.training.protocols import MetricSink, NoMetrics, Peers
from dlpipe.training.schedule import Schedule, current_lrs, lr_metrics
from dlpipe.training.step_log import LossSum, StepLog, gradient_norm
from dlpipe.training.stream_ranks import StreamRanks

log = logging.getLogger(__name__)

_END = object()  # _next_batch: no more batches this epoch


class Trainer:
    """Trains `model` with gradient accumulation, optional AMP and clipping, validating each epoch."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: TrainerConfig,
        metrics: MetricSink | None = None,
        sampler: ResourceSampler | None = None,
        empty_cache: Callable[[], None] | None = None,
        on_epoch: Callable[[dict[str, float]], None] | None = None,
        profiler=None,
        peers: Peers | None = None,
        stop: StopRequest | None = None,
        cuda_sync_every: int = 25,
        objective: Objective | None = None,
        val_metrics: dict | None = None,
        schedule: Schedule | None = None,
        callbacks: Callbacks | None = None,
    ):
        """`on_epoch` sees each epoch's metrics after they are logged (the job prints the verdict
        there); `profiler` gets .step() after every micro-batch (dlpipe.telemetry.profiling.StepProfiler);
        `schedule` moves the optimizer's lr after every optimizer step or epoch; `callbacks` are
        called at the hooks of dlpipe.training.callbacks and may request_stop().

        With `peers` (a data-parallel job, process group started), the model is wrapped in
        DistributedDataParallel, the loaders must give each rank its share, and every logged
        number is the whole job's."""
        self.settings = settings
        self.device = torch.device(settings.device)
        self.model = model.to(self.device)
        self.peers = peers
        # `net` runs the training forward pass; `model` stays the bare module, so checkpoints
        # have the same keys with or without DDP.
        self.net = training_net(self.model, self.device, peers is not None, settings.compile)
        self.first_step = FirstStep(settings.compile)
        self.optimizer = optimizer
        self.schedule = schedule
        self.metrics = metrics or NoMetrics()
        self.sampler = sampler
        self.on_epoch = on_epoch
        self.profiler = profiler
        self.empty_cache = empty_cache or torch.cuda.empty_cache
        self._autocast = autocast_for(self.device, settings.amp)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=settings.amp == "fp16")
        self.step = 0  # optimizer steps taken: the step axis of every logged metric
        self.epoch = 0  # the epoch being trained, counted from 1
        self.stop = stop or StopRequest()  # a signal handler (dlpipe.stop) sets it; read at every optimizer step
        self.cuda_sync_every = cuda_sync_every
        self.objective = objective or Objective()  # cross-entropy on (input, target) batches
        # torchmetrics objects by name, logged as val_<name>; their states live on the device
        self.val_metrics = {k: m.to(self.device) for k, m in (val_metrics or {}).items()}
        self.epoch_start_generator = None
        self.pending_resume: tuple[int, dict, dict | None] | None = None  # (batches done, RNG states, epoch loss)
        self.step_log = StepLog(settings.log_every, self.device)  # train_loss_step, lr, grad_norm
        self.epoch_loss = LossSum(self.device)  # this epoch's train_loss, summed on the device
        self.guard = NonFiniteGuard(settings.on_nonfinite, settings.log_every, self.device, settings.amp)
        self.history: list[dict[str, float]] = []
        self.callbacks = callbacks or Callbacks()
        self.stopped_early: str | None = None  # why a callback ended training (the run still FINISHES)
        self.stream_ranks = StreamRanks()  # a stream's epoch on several ranks (training.stream_ranks)

    def request_stop(self, reason: str) -> None:
        """End training at the next optimizer step; the epoch is still scored, logged and saved."""
        self.stopped_early = self.stopped_early or reason

    def state_dict(self, loader_generator: torch.Generator | None = None) -> dict:
        """Everything needed to continue exactly where training stopped, logged sums included
        (dlpipe.training.trainer_state)."""
        return trainer_state.capture(self, loader_generator)

    def load_state_dict(self, state: dict, loader_generator: torch.Generator | None = None) -> None:
        """Restore a state_dict(); fit() then continues with the epoch after state["epoch"]."""
        trainer_state.restore(self, state, loader_generator)

    def fit(self, train_loader, val_loader=None) -> list[dict[str, float]]:
        """Run every epoch after those already in `history` (or until max_steps); return all epochs' metrics."""
        s = self.settings
        self.callbacks.call("on_train_start", self)
        for epoch in range(len(self.history) + 1, s.epochs + 1):
            if self._done() or self.stopped_early:  # resumed after max_steps, or after an early stop
                break
            row = {"epoch": float(epoch)}
            row.update(self.train_epoch(train_loader, epoch))
            if self.stop.interrupted_epoch:
                raise StopTraining(self.stop.reason())
            if val_loader is not None and s.limit_val_batches != 0:
                row.update(self.validate(val_loader))
            if self.sampler is not None:
                row.update(self.sampler.window())
            if self.peers is not None:
                row = self.peers.epoch_row(row)
            # The same on every rank (not averaged); an epoch schedule moves before on_epoch checkpoints.
            lrs = self.schedule.end_epoch(self.optimizer, row) if self.schedule else current_lrs(self.optimizer)
            row.update(lr_metrics(lrs, "epoch_lr"))
            # On the optimizer-step axis, as the step log: one x axis for every chart; `epoch` is a metric.
            self.metrics.log_metrics(row, step=self.step)
            self.metrics.flush()  # between epochs: the write never interrupts a training step
            self.history.append(row)
            if self.on_epoch is not None:
                self.on_epoch(row)
            self.callbacks.call("on_epoch_end", self, epoch, row)
            if self._done() or self._early_stop():
                log.info("stopping: %s", self.stopped_early or f"reached trainer.max_steps={s.max_steps}")
                break
        self.callbacks.call("on_train_end", self, self.history)
        return self.history

    def _early_stop(self) -> bool:
        """Whether a callback asked to stop; with several ranks, on any of them (all stop together)."""
        if self.peers is None or not self.callbacks:
            return self.stopped_early is not None
        if self.peers.any(self.stopped_early is not None):
            self.stopped_early = self.stopped_early or "a callback on another rank asked to stop"
            return True
        return False

    def _done(self) -> bool:
        return 0 < self.settings.max_steps <= self.step

    def train_epoch(self, loader, epoch: int) -> dict[str, float]:
        s = self.settings
        self.epoch = epoch
        self.model.train()
        total = self._batches_per_epoch(loader)
        progress = Progress(epoch, s.epochs, total, enabled=s.progress)
        iterator, done = self._start_epoch(loader, epoch)
        # Copies timed off the CPU only (pinned non_blocking ones just enqueue); the clock skips a resume's replay.
        clock = EpochClock(h2d_s=0.0 if self.device.type != "cpu" else None,
                           cpu_s=self.sampler.tree_cpu_s if self.sampler is not None else None)
        non_blocking = non_blocking_copies(self.device, loader)
        window = Window(s.accumulate, getattr(loader, "batch_size", None))
        sums = (self.epoch_loss, self.step_log.pending)  # on the device: no sync per step
        self.stream_ranks = ranks = StreamRanks.of(loader, self.peers)
        while total is None or done < total:
            batch = self._next_batch(iterator, window.micro > 0, done)
            if not ranks.all_have(batch is not _END, self.stop, done):  # the end; on ranks, any one's
                break
            clock.waited()
            batch = self._to_device(batch, non_blocking, clock)
            n = self.objective.samples(batch)
            scale = window.add(n)
            last = done + 1 == total  # the epoch's last batch; never known without a length
            # The epoch's last batch ends its window too: a last, partial window still updates the model.
            steps_now = window.full or last
            self.first_step.before(self.objective, batch)  # once: compiling? unshifted labels?
            # DDP averages gradients over ranks in backward; on the micro-batches that do not end
            # an optimizer step there is nothing to average yet, so skip that communication.
            with nullcontext() if steps_now or self.net is self.model else self.net.no_sync():
                with self._autocast():
                    loss = self.objective.loss(*self.objective.forward(self.net, batch))
                # a full window of full batches scales by 1: no multiply, and no node for backward to visit
                self.scaler.scale(loss if scale == 1 else loss * scale).backward()
            self.first_step.after()
            self.guard.add(loss.detach(), n, sums)
            if steps_now:
                self._optimizer_step(window)
            if self.profiler is not None:
                self.profiler.step()
            clock.stepped(n)
            done += 1
            if progress.enabled:
                progress.update(done, *clock.rates())
            if self._done() or (steps_now and self.callbacks.per_step and self._early_stop()):
                break
            # Not on the epoch's last batch: then the epoch finishes and the stop comes at the next one.
            if steps_now and not last and self._stop_now():
                self.stop.at_batch = done  # at an optimizer step: no half-accumulated gradients
                break
        if window.micro:  # ended mid-window (the loader ran short of `total`, or has no length): step on it too
            ranks.cut_short(self.model)  # a stream's on several ranks: its gradients are not averaged yet
            self._optimizer_step(window)
        self.guard.check(self.step_log.pending, self.step, self.optimizer, self.peers)
        # (The StopIteration that ends an epoch is where non-persistent workers are joined: that
        # wait counts in epoch_time_s but not in data wait.)
        del iterator
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the epoch's GPU work belongs to this epoch's time
        return self._epoch_stats(clock, progress, done)

    def _batches_per_epoch(self, loader) -> int | None:
        """Micro-batches to train on this epoch: the loader's length (None without one), capped
        by limit_train_batches."""
        return epoch_batches(loader, self.settings.limit_train_batches)

    def _start_epoch(self, loader, epoch: int) -> tuple[Iterator, int]:
        """iter(loader) for `epoch` and how many of its batches were already trained on: resuming
        mid-epoch (load_state_dict), the iterator is already past them."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the epoch's cuda_max_allocated_mb
        generator = getattr(loader, "generator", None)
        # state_dict() after a stop saves this: resuming replays the interrupted epoch's order
        self.epoch_start_generator = generator.get_state() if generator is not None else None
        pending, self.pending_resume = self.pending_resume, None
        self.epoch_loss.reset()
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # the order depends on (seed, epoch) only: resumable, like DistributedSampler
        elif isinstance(getattr(loader, "dataset", None), IterableDataset) and hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)  # a stream orders itself by the epoch (a Hugging Face stream does)
        dataset = getattr(loader, "dataset", None)
        dealt = pending is not None and getattr(dataset, "share", False) and hasattr(dataset, "resume")
        if dealt:  # a stream dealt by dlpipe (loader.streams.StreamShare): its workers leave those batches out
            dataset.resume(epoch, pending[0])
        iterator = iter(loader)
        if pending is None:
            return iterator, 0
        done, resume_rng, epoch_loss = pending
        if epoch_loss is not None:  # the interrupted epoch's train_loss goes on from its batches so far
            self.epoch_loss.load_state_dict(epoch_loss)
        for _ in range(0 if dealt else done):  # resuming mid-epoch: same order and seeds, so skip what was trained
            if next(iterator, None) is None:
                break  # the epoch is shorter than when the checkpoint was written (batch size changed)
        rng.restore(resume_rng)  # fetching the skipped batches may have drawn from the RNGs
        return iterator, done

    def _next_batch(self, iterator: Iterator, mid_window: bool, done: int):
        """The loader's next batch, or _END: the epoch is over, or the loader's workers died of the
        stop signal at an optimizer step (then `stop.at_batch` is set)."""
        try:
            return next(iterator)
        except StopIteration:
            return _END
        except RuntimeError as e:
            if not (self.stop.requested and workers_died(e)):
                raise
            # The stop signal reached the workers too (scancel, kill -PGID) while a spawned
            # worker was still starting, before it could shield itself: stop here if this is
            # an optimizer step boundary, else keep the last epoch's checkpoint as the resume point.
            if mid_window:
                raise StopTraining(self.stop.reason()) from None
            self.stop.at_batch = done
            return _END

    def _to_device(self, batch, non_blocking: bool, clock: EpochClock):
        """to_device, timed into clock.h2d_s when the clock measures copies."""
        if clock.h2d_s is None:
            return to_device(batch, self.device, non_blocking)
        started = time.perf_counter()
        moved = to_device(batch, self.device, non_blocking)
        clock.h2d_s += time.perf_counter() - started
        return moved

    def _epoch_stats(self, clock: EpochClock, progress: Progress, done: int) -> dict[str, float]:
        stats = clock.summary()  # timings: of this attempt only, when the epoch was resumed
        if self.device.type == "cuda":
            stats["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            stats["cuda_reserved_mb"] = torch.cuda.memory_reserved(self.device) / 2**20
        stats["train_loss"] = self.stream_ranks.mean_loss(self.epoch_loss)  # a sync an epoch; resumed or not
        if self.guard.window is not None:
            stats["skipped_steps"] = float(self.guard.skipped)
        progress.close(done, stats["samples_per_s"], stats["data_wait_frac"])
        return stats

    def _stop_now(self) -> bool:
        """Whether to stop at this optimizer step. All ranks must stop at the same step (DDP's
        next backward would wait for the missing ones), and a signal may reach only some of them."""
        if self.peers is None:
            return self.stop.requested
        if self.peers.any(self.stop.requested):
            self.stop.by_peer = not self.stop.requested
            return True
        return False

    def _optimizer_step(self, window: Window) -> None:
        """Step on the window's gradients, start the next window, and do the every-N-steps work."""
        s = self.settings
        logged = self.step_log.due(self.step + 1)
        norm = None
        # skip_step: a non-finite loss in this window drops its gradients instead of stepping on them
        if not self.guard.skips((self.epoch_loss, self.step_log.pending), self.step + 1, self.peers):
            norm = self._update(window, logged)
        self.optimizer.zero_grad(set_to_none=True)
        window.clear()
        self.step += 1
        self.guard.mark(self.step_log.pending, self.step)
        if s.empty_cache_every and self.step % s.empty_cache_every == 0:
            self.empty_cache()
            log.info("step %d: released cached CUDA memory (trainer.empty_cache_every=%d)",
                     self.step, s.empty_cache_every)
        if logged:
            self.guard.check(self.step_log.pending, self.step, self.optimizer, self.peers)  # before the log resets
            self.step_log.record(self.step, self.epoch, self.optimizer, norm, self.metrics, self.peers)
        if self.schedule is not None:
            self.schedule.after_step(self.optimizer)  # after the log: `lr` is the one this step used
        if self.callbacks:
            self.callbacks.call("on_step_end", self, self.step)
        if self.device.type == "cuda" and self.cuda_sync_every and self.step % self.cuda_sync_every == 0:
            # CPU-GPU sync point, on purpose and rarely: without it the host runs ahead and
            # GPU time shows up later as "data wait" of whichever step blocks first.
            torch.cuda.synchronize(self.device)

    def _update(self, window: Window, logged: bool) -> torch.Tensor | None:
        """optimizer.step on the window's mean gradients, clipped; returns their norm when measured."""
        window.mean_over_samples(self.optimizer, self.stream_ranks.job_window(window.samples))  # then clipped
        norm = None
        if self.settings.grad_clip > 0 or logged:
            # Clip and measure the true gradients, not fp16's scaled ones (step() then skips its unscale).
            self.scaler.unscale_(self.optimizer)
            norm = gradient_norm(self.model, self.settings.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return norm

    def validate(self, loader) -> dict[str, float]:
        """val_loss and every validation metric over the whole split (training.evaluate)."""
        self.model.eval()
        return evaluate(self.model, loader, self.objective, self.val_metrics, device=self.device,
                        limit_batches=self.settings.limit_val_batches, autocast=self._autocast, peers=self.peers)
