"""What the loop does when the training loss is not finite: trainer.on_nonfinite.

`stop` (default) and `warn` keep the loop free of a CPU-GPU sync per step: the step log's running
loss sum turns non-finite at the first non-finite loss and stays so (inf + x = inf, nan + x = nan),
so one device-side copy per optimizer step (`mark`) records where it turned, and the check reads
those copies only where the loop syncs anyway: at the log steps and at the end of an epoch. The run
then stops within trainer.log_every optimizer steps, naming the first bad one.

`skip_step` does what GradScaler does with inf/nan gradients: one check per optimizer step (a sync),
and a step whose window had a non-finite loss is skipped (no optimizer.step, gradients dropped). Its
losses stay out of train_loss and train_loss_step; `skipped_steps` counts the steps skipped so far.
With amp=fp16 the GradScaler still skips steps whose gradients overflow while the loss is finite:
those are its business (the loss scale adapts), not counted here.
"""

import logging
import math

import torch

from dlpipe.errors import DlpipeError
from dlpipe.training.protocols import Peers
from dlpipe.training.step_log import LossSum

log = logging.getLogger(__name__)

MODES = ("stop", "skip_step", "warn")
MAX_MARKS = 4096  # optimizer steps after a log step whose running loss sum is kept on the device


class NonFiniteLoss(DlpipeError):
    """The training loss was nan or inf with trainer.on_nonfinite=stop: the run ends FAILED."""


class NonFiniteGuard:
    """Watches the training loss for trainer.on_nonfinite (see the module docstring)."""

    def __init__(self, mode: str, every: int, device: torch.device, amp: str):
        self.mode = mode
        self.every = every
        self.amp = amp
        self.skipped = 0  # optimizer steps skipped (skip_step), over the whole run
        self.warned = False  # warn: said once; the losses after the first bad one are rarely finite again
        # The step log's running sum after each optimizer step since the last log step (the first
        # MAX_MARKS of them: trainer.log_every=10**9, "never", must not allocate gigabytes).
        self._marks = torch.zeros(min(every, MAX_MARKS) if mode != "skip_step" else 0, device=device)
        self._slots = self._marks.unbind()  # a view per step, made once: mark() is then a single copy_
        # skip_step: this optimizer step's losses, kept apart until the step is known to be clean
        self.window = LossSum(device) if mode == "skip_step" else None

    def add(self, loss: torch.Tensor, n: int, sums: tuple[LossSum, ...]) -> None:
        """A micro-batch's mean loss over `n` samples, into `sums` (into the window first with skip_step)."""
        if self.window is not None:
            self.window.add(loss, n)
            return
        for total in sums:
            total.add(loss, n)

    def skips(self, sums: tuple[LossSum, ...], step: int, peers: Peers | None = None) -> bool:
        """skip_step, at every optimizer step (a sync, like GradScaler's): whether the window that
        ends here had a non-finite loss. A clean window's losses go into `sums`. With several ranks,
        all skip together (the gradients they would average are poisoned anyway)."""
        if self.window is None:
            return False
        total = self.window.total.item()
        bad = not math.isfinite(total)
        if peers is not None:
            bad = peers.any(bad)
        if bad:
            self.skipped += 1
            if self.skipped == 1:
                log.warning("optimizer step %d skipped: training loss %s (trainer.on_nonfinite=skip_step; "
                            "the count is logged as skipped_steps)", step, total)
        else:
            for kept in sums:
                kept.merge(self.window)
        self.window.reset()
        return bad

    def mark(self, pending: LossSum, step: int) -> None:
        """After optimizer step `step` (from 1): keep the running sum, on the device (no sync)."""
        index = (step - 1) % self.every
        if self.window is None and not self.warned and index < len(self._slots):
            self._slots[index].copy_(pending.total)

    def check(self, pending: LossSum, step: int, optimizer: torch.optim.Optimizer, peers: Peers | None = None) -> None:
        """At a log step (before the step log resets) or an epoch's end: act on the first non-finite
        loss since the last log step. Raises NonFiniteLoss with trainer.on_nonfinite=stop."""
        if self.window is not None or self.warned:
            return
        first = self._first_bad(pending, step)
        # Every rank checks at the same steps; all stop together (DDP's next all-reduce would wait).
        if self.mode == "stop" and peers is not None and peers.any(first is not None) and first is None:
            raise NonFiniteLoss("the training loss was nan or inf on another rank (its own error names the step); "
                                "trainer.on_nonfinite=stop")
        if first is None:
            return
        line = describe(*first, self.amp, optimizer)
        if self.mode == "stop":
            raise NonFiniteLoss(line + "; trainer.on_nonfinite=stop (skip_step drops such steps, warn goes on)")
        log.warning("%s; trainer.on_nonfinite=warn: training goes on", line)
        self.warned = True

    def _first_bad(self, pending: LossSum, step: int) -> tuple[int, float] | None:
        """(optimizer step, its running loss sum) of the first non-finite loss since the last log step."""
        total = pending.total.item()  # a sync, where the step log syncs anyway
        if math.isfinite(total):
            return None
        count = (step - 1) % self.every + 1  # optimizer steps since the last log step, marked in order
        marks = self._marks[:count].tolist()
        bad = [i for i, v in enumerate(marks) if not math.isfinite(v)]
        # None marked: non-finite already in the checkpoint this run resumed from (the marks begin
        # after it), or past the first MAX_MARKS steps of a very long log interval: the window's start.
        if not bad:
            return step - count + 1, total
        return step - count + 1 + bad[0], marks[bad[0]]

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict | None) -> None:
        self.skipped = int((state or {}).get("skipped", 0))


def describe(step: int, value: float, amp: str, optimizer: torch.optim.Optimizer) -> str:
    """One line: the optimizer step, the loss and the likely cause, from what the loop knows."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    lr = max(lrs)
    half = any(p.dtype == torch.float16 for group in optimizer.param_groups for p in group["params"])
    if not math.isfinite(lr) or lr > 10:  # far above any optimizer's working range
        cause = f"the learning rate is too high (lr={lr:g}); lower optim.lr"
    elif half and amp != "fp16":
        cause = ("the model's weights are float16 without loss scaling; keep fp32 weights and use "
                 "trainer.amp=fp16 or bf16")
    elif amp == "fp16":
        cause = "an fp16 overflow in the forward pass (the GradScaler only scales gradients); try trainer.amp=bf16"
    elif step == 1:
        cause = ("bad data or a loss the model cannot compute: no update had been made yet (check for nan/inf "
                 "inputs or targets)")
    else:
        cause = (f"the learning rate may be too high (lr={lr:g}; lower optim.lr or set trainer.grad_clip) or a batch "
                 "holds nan/inf inputs or targets")
    return f"non-finite training loss ({value}) at optimizer step {step}: likely {cause}"
