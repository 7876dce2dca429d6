"""The training loop. Reads top to bottom: epochs -> micro-batches -> optimizer steps -> validation.

It takes built objects and plain settings (no config framework), so tests drive it directly.
"""

import logging
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from dlpipe.console import Progress
from dlpipe.telemetry import EpochClock, ResourceSampler

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MetricSink(Protocol):
    """What the loop needs from a tracker: cheap metric recording, and a flush between epochs."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...


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


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (all devices); optionally force deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # Set both ways: jobs of a basic-launcher sweep share this process, and one job's
    # deterministic=true must not leak into the next.
    torch.use_deterministic_algorithms(deterministic)


def loss_and_correct(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the count of correct predictions; [B, T, V] logits are token-level."""
    if logits.dim() == 3:
        logits, target = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
    loss = F.cross_entropy(logits, target)
    correct = (logits.argmax(dim=-1) == target).sum()
    return loss, correct


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
    ):
        """`on_epoch` sees each epoch's metrics after they are logged (the job prints the verdict
        there); `profiler` gets .step() after every micro-batch (dlpipe.profiling.StepProfiler)."""
        self.settings = settings
        self.device = torch.device(settings.device)
        self.model = model.to(self.device)
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
        self._log_loss = torch.zeros((), device=self.device)  # loss since the last train_loss_step
        self._log_samples = 0
        self.history: list[dict[str, float]] = []

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def state_dict(self, loader_generator: torch.Generator | None = None) -> dict:
        """Everything needed to continue exactly after the last finished epoch, as plain containers
        and tensors (loadable with torch.load(weights_only=True))."""
        np_state = np.random.get_state()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": len(self.history),
            "history": [dict(r) for r in self.history],
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                # NumPy's state holds an ndarray, which weights_only loading refuses: store a tensor
                "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
                "python": random.getstate(),
            },
            # the shuffling order and worker seeds of every later epoch come from this generator
            "loader_generator": loader_generator.get_state() if loader_generator is not None else None,
        }

    def load_state_dict(self, state: dict, loader_generator: torch.Generator | None = None) -> None:
        """Restore a state_dict(); fit() then continues with the epoch after state["epoch"]."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.history = [dict(r) for r in state["history"]]
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        name, keys, *rest = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
        if loader_generator is not None and state["loader_generator"] is not None:
            loader_generator.set_state(state["loader_generator"])

    def fit(self, train_loader, val_loader=None) -> list[dict[str, float]]:
        """Run every epoch after those already in `history` (or until max_steps); return all epochs' metrics."""
        s = self.settings
        for epoch in range(len(self.history) + 1, s.epochs + 1):
            if self._done():  # a run resumed after it had already reached max_steps
                break
            row = {"epoch": float(epoch)}
            row.update(self.train_epoch(train_loader, epoch))
            if val_loader is not None and s.limit_val_batches != 0:
                row.update(self.validate(val_loader))
            if self.sampler is not None:
                row.update(self.sampler.window())
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

        clock = EpochClock(h2d_s=0.0 if time_copies else None)
        iterator = iter(loader)
        while total is None or clock.batches < total:
            try:
                batch = next(iterator)
            except StopIteration:
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
            with self._autocast():
                logits = self.model(inputs)
                loss, _ = loss_and_correct(logits, target)
            self.scaler.scale(loss * (n / nominal)).backward()
            loss_sum += loss.detach() * n
            self._log_loss += loss.detach() * n
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
            progress.update(clock.batches, *clock.rates())
            if self._done():
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
        progress.close(clock.batches, stats["samples_per_s"], stats["data_wait_frac"])
        return stats

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
            mean = (self._log_loss / max(self._log_samples, 1)).item()
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
        if samples == 0:
            return {}
        return {"val_loss": (loss_sum / samples).item(), "val_accuracy": correct.item() / targets}
