"""Learning-rate schedules: the warm-up + decay shapes of conf/scheduler/{cosine,linear}.yaml, how
many steps a schedule spans, and `Schedule`, which steps a torch scheduler when the config says.

Any torch.optim.lr_scheduler class works as it is; only warm-up + decay is written here, as one
closed-form factor for LambdaLR. SequentialLR(LinearLR, CosineAnnealingLR) would give the same
curve, but CosineAnnealingLR's `eta_min` is one absolute lr for every parameter group (not a
ratio of each group's lr), its recursive update drifts from the closed form, and SequentialLR
steps it with the deprecated `epoch` argument at the milestone (a warning in every run).
"""

import logging
import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from dlpipe.errors import ConfigError
from dlpipe.schema import TrainerConfig

log = logging.getLogger("dlpipe")


def warmup_decay(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, shape: str) -> float:
    """The factor of each group's lr for scheduler step `step` (0 for the first optimizer step).

    Warm-up: (step + 1) / (warmup_steps + 1), so the first step is small but not wasted at 0 and
    step warmup_steps is the first at the full lr. Then `shape` (cosine or linear) from 1 down to
    min_lr_ratio, reached at the last step (total_steps - 1), and held there if the run goes on."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min((step - warmup_steps) / max(total_steps - 1 - warmup_steps, 1), 1.0)
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if shape == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> LambdaLR:
    """scheduler=cosine: linear warm-up over warmup_steps, then cosine decay to min_lr_ratio x lr."""
    return _warmup_then(optimizer, "cosine", total_steps, warmup_steps, min_lr_ratio)


def warmup_linear(optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> LambdaLR:
    """scheduler=linear: linear warm-up over warmup_steps, then linear decay to min_lr_ratio x lr."""
    return _warmup_then(optimizer, "linear", total_steps, warmup_steps, min_lr_ratio)


def _warmup_then(optimizer, shape: str, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> LambdaLR:
    # A partial, not a lambda: it pickles, and LambdaLR saves no state for it (only a callable
    # object's __dict__), so a resumed run takes the span from its own config and the step from
    # the checkpoint.
    factor = partial(warmup_decay, warmup_steps=int(warmup_steps), total_steps=int(total_steps),
                     min_lr_ratio=float(min_lr_ratio), shape=shape)
    return LambdaLR(optimizer, factor)


def schedule_length(settings: TrainerConfig, steps_per_epoch: int | None, interval: str) -> int | None:
    """How many times the schedule is stepped over the whole run: its optimizer steps (epochs x
    steps per epoch, capped by trainer.max_steps) with interval=step, its epochs with interval=epoch.
    None when it cannot be known (a loader without a length and no max_steps)."""
    cap = settings.max_steps if settings.max_steps > 0 else None
    if interval == "epoch":
        if cap is None or not steps_per_epoch:
            return settings.epochs
        return min(settings.epochs, math.ceil(cap / steps_per_epoch))
    if steps_per_epoch is None:
        return cap
    total = settings.epochs * steps_per_epoch
    return min(total, cap) if cap is not None else total


def current_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The lr of each parameter group (what the next optimizer step uses)."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def lr_metrics(lrs: list[float], name: str = "lr") -> dict[str, float]:
    """Learning rates as metrics: `lr` for one parameter group, `lr/group_N` for several. Each
    epoch's is `epoch_lr`: one metric name is one step axis in MLflow (`lr` counts optimizer steps)."""
    if len(lrs) == 1:
        return {name: lrs[0]}
    return {f"{name}/group_{i}": lr for i, lr in enumerate(lrs)}


class Schedule:
    """A torch lr scheduler and when it moves: after every optimizer step or after every epoch."""

    def __init__(self, scheduler, interval: str, monitor: str | None = None):
        """`monitor`: the epoch metric a metric-driven scheduler (ReduceLROnPlateau) steps on."""
        self.scheduler = scheduler
        self.interval = interval
        self.monitor = monitor
        self.last_used: list[float] | None = None  # each group's lr in the last optimizer step (interval=step)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.interval == "step":
            # The epoch's `lr` is the last step's; once stepped, the optimizer holds the next one.
            self.last_used = current_lrs(optimizer)
            self.scheduler.step()

    def end_epoch(self, optimizer: torch.optim.Optimizer, metrics: dict[str, float] | None = None) -> list[float]:
        """Step an epoch schedule (on `metrics[monitor]` for a metric-driven one: a missing value is
        NaN, which never counts as an improvement); return each group's lr the epoch trained with."""
        if self.interval == "step":
            return self.last_used or current_lrs(optimizer)
        used = current_lrs(optimizer)
        if self.monitor is not None:
            self.scheduler.step(float((metrics or {}).get(self.monitor, math.nan)))
        else:
            self.scheduler.step()
        return used

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        saved, now = state.get("total_steps"), getattr(self.scheduler, "total_steps", None)
        if saved is not None and now is not None and saved != now:
            # OneCycleLR keeps its span in its state and raises once stepped past it.
            raise ConfigError([
                f"scheduler.total_steps={now}: the checkpoint's {type(self.scheduler).__name__} spans {saved} "
                "steps (trainer.epochs or trainer.max_steps changed) and cannot be stretched; resume with the "
                "values it was written with, or start over with checkpoint.resume=never"])
        self.scheduler.load_state_dict(state)


def restore(schedule: Schedule | None, saved: dict | None) -> None:
    """Put a checkpoint's schedule state back. Checkpoints from before schedules have none."""
    if schedule is not None and saved is not None:
        schedule.load_state_dict(saved)
    elif schedule is not None:
        log.warning("the checkpoint holds no learning-rate schedule (written with scheduler=none): "
                    "the schedule starts from its beginning at this step")
    elif saved is not None:
        log.warning("the checkpoint was written with a learning-rate schedule and this run has none "
                    "(scheduler=none): the lr stays where the schedule had brought it")
