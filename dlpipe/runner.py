"""The training loop. Reads top to bottom: epochs -> micro-batches -> optimizer steps -> validation.

It takes built objects and plain settings (no config framework), so tests drive it directly.
"""

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dlpipe import rng
from dlpipe.console import Progress
from dlpipe.telemetry import EpochClock, ResourceSampler

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StopTraining(Exception):
    """Training stopped because stop_requested was set (by a signal): at an optimizer step
    (`interrupted_at` says after which batch), or mid-accumulation when the loader's workers died
    of the same signal (`interrupted_at` stays None: there is no step to checkpoint)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def workers_died(error: RuntimeError) -> bool:
    text = str(error)
    return "DataLoader worker" in text and ("exited unexpectedly" in text or "killed by signal" in text)


class MetricSink(Protocol):
    """What the loop needs from a tracker: cheap metric recording, and a flush between epochs."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...


class Peers(Protocol):
    """The other ranks of a data-parallel job (dlpipe.distributed.Collectives)."""

    def sum(self, values: list[float]) -> list[float]: ...

    def any(self, flag: bool) -> bool: ...

    def barrier(self) -> None: ...

    def epoch_row(self, row: dict[str, float]) -> dict[str, float]: ...


class NoMetrics:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        return None

    def flush(self) -> None:
        return None


@dataclass(frozen=True)
class TrainSettings:
    """Plain copy of the trainer config (see dlpipe/config/schema.py for each field's meaning)."""

    epochs: int = 1
    max_steps: int = -1
    limit_train_batches: int = -1
    limit_val_batches: int = -1
    accumulate: int = 1
    grad_clip: float = 0.0
    device: str = "cpu"
    amp: str = "off"
    empty_cache_every: int = 0
    log_every: int = 50
    progress: bool = True
    cuda_sync_every: int = 25


def _flat(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() == 3:  # [B, T, V] logits are token-level
        return logits.reshape(-1, logits.size(-1)), target.reshape(-1)
    return logits, target


def training_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; no accuracy: its argmax would cost every step for a number nobody logs."""
    return F.cross_entropy(*_flat(logits, target))


def loss_and_correct(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the count of correct predictions (validation)."""
    logits, target = _flat(logits, target)
    return F.cross_entropy(logits, target), (logits.argmax(dim=-1) == target).sum()


def to_device(batch, device: torch.device, non_blocking: bool):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


class Trainer:
    """Trains `model` with gradient accumulation, optional AMP and clipping, validating each epoch."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: TrainSettings,
        metrics: MetricSink | None = None,
        sampler: ResourceSampler | None = None,
        empty_cache: Callable[[], None] | None = None,
        on_epoch: Callable[[dict[str, float]], None] | None = None,
        profiler=None,
        peers: Peers | None = None,
    ):
        """`on_epoch` sees each epoch's metrics after they are logged (the job prints the verdict
        there); `profiler` gets .step() after every micro-batch (dlpipe.profiling.StepProfiler).

        With `peers` (a data-parallel job, process group started), the model is wrapped in
        DistributedDataParallel, the loaders must give each rank its share, and every logged
        number is the whole job's."""
        self.settings = settings
        self.device = torch.device(settings.device)
        self.model = model.to(self.device)
        self.peers = peers
        # `net` runs the training forward pass; `model` stays the bare module, so checkpoints
        # have the same keys with or without DDP.
        self.net = self.model
        if peers is not None:
            from torch.nn.parallel import DistributedDataParallel

            # Broadcasts rank 0's parameters: every rank starts from the same weights.
            self.net = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = optimizer
        self.metrics = metrics or NoMetrics()
        self.sampler = sampler
        self.on_epoch = on_epoch
        self.profiler = profiler
        self.empty_cache = empty_cache or torch.cuda.empty_cache
        self.amp_dtype = AMP_DTYPES.get(settings.amp)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=settings.amp == "fp16")
        self.step = 0  # optimizer steps taken
        self.stop_requested: str | None = None  # set (by a signal handler) to stop at the next optimizer step
        self.peer_stop = False  # stopping because another rank was asked to (stop_requested stays this rank's own)
        self.stopping = False  # set while a stop is being recorded (checkpoint, tracking)
        self.interrupted_at: int | None = None  # batches done in the epoch a stop interrupted
        self._epoch_start_generator = None
        self._resume: tuple[int, dict] | None = None
        self._log_loss = torch.zeros((), device=self.device)  # loss since the last train_loss_step
        self._log_samples = 0
        self.history: list[dict[str, float]] = []

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def state_dict(self, loader_generator: torch.Generator | None = None) -> dict:
        """Everything needed to continue exactly where training stopped, as plain containers and
        tensors (loadable with torch.load(weights_only=True)): after the last finished epoch, or,
        after a stop request, after the last optimizer step of the interrupted epoch."""
        mid_epoch = self.interrupted_at is not None
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": len(self.history),  # finished epochs
            "batches_done": self.interrupted_at or 0,  # of the next epoch; always at an optimizer step
            "history": [dict(r) for r in self.history],
            "rng": rng.capture(),
            # The shuffling order and worker seeds of an epoch come from this generator: after a
            # stop, its state from the start of the interrupted epoch, so resuming replays it.
            "loader_generator": (
                self._epoch_start_generator if mid_epoch
                else loader_generator.get_state() if loader_generator is not None else None
            ),
        }

    def load_state_dict(self, state: dict, loader_generator: torch.Generator | None = None) -> None:
        """Restore a state_dict(); fit() then continues with the epoch after state["epoch"]."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.history = [dict(r) for r in state["history"]]
        rng.restore(state["rng"])
        if loader_generator is not None and state["loader_generator"] is not None:
            loader_generator.set_state(state["loader_generator"])
        if state.get("batches_done", 0):
            # train_epoch replays the interrupted epoch's first batches without training on them,
            # then puts these RNG states back (fetching those batches may have drawn from them).
            self._resume = (int(state["batches_done"]), state["rng"])

    def fit(self, train_loader, val_loader=None) -> list[dict[str, float]]:
        """Run every epoch after those already in `history` (or until max_steps); return all epochs' metrics."""
        s = self.settings
        for epoch in range(len(self.history) + 1, s.epochs + 1):
            if self._done():  # a run resumed after it had already reached max_steps
                break
            row = {"epoch": float(epoch)}
            row.update(self.train_epoch(train_loader, epoch))
            if self.interrupted_at is not None:
                raise StopTraining(self.stop_requested or ("a stop on another rank" if self.peer_stop else "stop"))
            if val_loader is not None and s.limit_val_batches != 0:
                row.update(self.validate(val_loader))
            if self.sampler is not None:
                row.update(self.sampler.window())
            if self.peers is not None:
                row = self.peers.epoch_row(row)
            self.metrics.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=epoch)
            self.metrics.flush()  # between epochs: the write never interrupts a training step
            self.history.append(row)
            if self.on_epoch is not None:
                self.on_epoch(row)
            if self._done():
                log.info("stopping: reached trainer.max_steps=%d", s.max_steps)
                break
        return self.history

    def _done(self) -> bool:
        return 0 < self.settings.max_steps <= self.step

    def train_epoch(self, loader, epoch: int) -> dict[str, float]:
        s = self.settings
        self.model.train()
        total = len(loader) if hasattr(loader, "__len__") else None
        if s.limit_train_batches > 0:
            total = min(total, s.limit_train_batches) if total is not None else s.limit_train_batches
        progress = Progress(epoch, s.epochs, total, enabled=s.progress)
        # A window is the micro-batches of one optimizer step; the loss of each is scaled by its
        # share of the nominal window so gradients sum to a mean over samples (see _optimizer_step).
        batch_size = getattr(loader, "batch_size", None)  # None with a custom batch_sampler
        window_micro = window_samples = nominal = 0
        loss_sum = torch.zeros((), device=self.device)  # stays on device: no sync per step
        seen = 0
        non_blocking = self.device.type == "cuda" and getattr(loader, "pin_memory", False)
        # Copies are timed off the CPU only: pageable copies block here, pinned non_blocking ones
        # only enqueue, so the time measured is what the host really waits for.
        time_copies = self.device.type != "cpu"
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

        generator = getattr(loader, "generator", None)
        self._epoch_start_generator = generator.get_state() if generator is not None else None
        pending, self._resume = self._resume, None
        done, resume_rng = pending if pending else (0, None)
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # the order depends on (seed, epoch) only: resumable, like DistributedSampler
        iterator = iter(loader)
        for _ in range(done):  # resuming mid-epoch: same order and worker seeds, so skip what was trained
            if next(iterator, None) is None:
                break  # the epoch is shorter than when the checkpoint was written (batch size changed)
        if resume_rng is not None:
            rng.restore(resume_rng)
        clock = EpochClock(h2d_s=0.0 if time_copies else None)  # the skipped batches are not this epoch's time
        while total is None or done < total:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            except RuntimeError as e:
                if not (self.stop_requested and workers_died(e)):
                    raise
                # The stop signal reached the workers too (scancel, kill -PGID) while a spawned
                # worker was still starting, before it could shield itself: stop here if this is
                # an optimizer step boundary, else keep the last epoch's checkpoint as the resume point.
                if window_micro:
                    raise StopTraining(self.stop_requested) from None
                self.interrupted_at = done
                break
            clock.waited()
            if time_copies:
                started = time.perf_counter()
                inputs, target = to_device(batch, self.device, non_blocking)
                clock.h2d_s += time.perf_counter() - started
            else:
                inputs, target = to_device(batch, self.device, non_blocking)
            n = target.shape[0]
            if window_micro == 0:
                # samples a full window holds; from the first micro-batch when a sampler makes batches
                nominal = s.accumulate * (batch_size or n)
            # DDP averages gradients over ranks in backward; on the micro-batches that do not end
            # an optimizer step there is nothing to average yet, so skip that communication.
            steps_now = window_micro + 1 == s.accumulate or (total is not None and done + 1 >= total)
            with nullcontext() if steps_now or self.net is self.model else self.net.no_sync():
                with self._autocast():
                    loss = training_loss(self.net(inputs), target)
                self.scaler.scale(loss * (n / nominal)).backward()
            detached = loss.detach()
            loss_sum.add_(detached, alpha=n)  # in place, one op: this runs every micro-step
            self._log_loss.add_(detached, alpha=n)
            self._log_samples += n
            seen += n
            window_micro += 1
            window_samples += n
            if window_micro == s.accumulate:
                self._optimizer_step(window_samples, nominal)
                window_micro = window_samples = 0
                if cuda and s.cuda_sync_every and self.step % s.cuda_sync_every == 0:
                    # CPU-GPU sync point, on purpose and rarely: without it the host runs ahead and
                    # GPU time shows up later as "data wait" of whichever step blocks first.
                    torch.cuda.synchronize(self.device)
            if self.profiler is not None:
                self.profiler.step()
            clock.stepped(n)
            done += 1
            if progress.enabled:
                progress.update(done, *clock.rates())
            if self._done():
                break
            # Not on the epoch's last batch: then the epoch finishes and the stop comes at the next one.
            if window_micro == 0 and (total is None or done < total) and self._stop_now():
                self.interrupted_at = done  # at an optimizer step: no half-accumulated gradients
                break
        if window_micro:  # the last, partial window of the epoch still updates the model
            self._optimizer_step(window_samples, nominal)
        # (The StopIteration that ends an epoch is where non-persistent workers are joined: that
        # wait counts in epoch_time_s but not in data wait.)
        del iterator
        if cuda:
            torch.cuda.synchronize(self.device)  # the epoch's GPU work belongs to this epoch's time

        stats = clock.summary()
        if cuda:
            stats["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            stats["cuda_reserved_mb"] = torch.cuda.memory_reserved(self.device) / 2**20
        stats["train_loss"] = (loss_sum / max(seen, 1)).item()  # one sync per epoch
        progress.close(done, stats["samples_per_s"], stats["data_wait_frac"])
        return stats

    def _stop_now(self) -> bool:
        """Whether to stop at this optimizer step. All ranks must stop at the same step (DDP's
        next backward would wait for the missing ones), and a signal may reach only some of them."""
        if self.peers is None:
            return self.stop_requested is not None
        if self.peers.any(self.stop_requested is not None):
            self.peer_stop = self.stop_requested is None
            return True
        return False

    def _optimizer_step(self, window_samples: int, nominal: int) -> None:
        s = self.settings
        if window_samples != nominal:
            # Partial window (end of epoch, short last batch): the per-micro-batch shares summed to
            # window_samples / nominal; rescale so the update is the mean over the samples seen.
            # (Scaling the still loss-scaled fp16 gradients is fine: the scaler divides later.)
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(nominal / window_samples)
        if s.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if s.empty_cache_every and self.step % s.empty_cache_every == 0:
            self.empty_cache()
            log.info("step %d: released cached CUDA memory (trainer.empty_cache_every=%d)", self.step, s.empty_cache_every)
        if self.step % s.log_every == 0:
            # .item() is a CPU-GPU sync point: only once every log_every steps.
            loss_sum, samples = self._log_loss.item(), self._log_samples
            if self.peers is not None:
                loss_sum, samples = self.peers.sum([loss_sum, samples])
            mean = loss_sum / max(samples, 1)
            self.metrics.log_metrics({"train_loss_step": mean}, step=self.step)
            self._log_loss.zero_()
            self._log_samples = 0

    @torch.no_grad()
    def validate(self, loader) -> dict[str, float]:
        s = self.settings
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        samples = targets = 0
        non_blocking = self.device.type == "cuda" and getattr(loader, "pin_memory", False)
        for i, batch in enumerate(loader):
            if 0 < s.limit_val_batches <= i:
                break
            inputs, target = to_device(batch, self.device, non_blocking)
            with self._autocast():
                loss, right = loss_and_correct(self.model(inputs), target)
            loss_sum += loss.float() * target.shape[0]
            correct += right
            samples += target.shape[0]
            targets += target.numel()
        loss_total, right_total = loss_sum.item(), correct.item()
        if self.peers is not None:  # each rank scored its own share: add the counts up
            loss_total, right_total, samples, targets = self.peers.sum([loss_total, right_total, samples, targets])
        if samples == 0:
            return {}
        return {"val_loss": loss_total / samples, "val_accuracy": right_total / targets}
