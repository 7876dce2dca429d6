"""What is said once, at the first batch a Trainer trains on: that torch.compile is compiling (the
first step is slow for that reason, not the loader's) and how long that step took, and a warning
when a token-level target equals its input (a causal LM given unshifted labels learns to copy)."""

import logging
import time

import torch

from dlpipe.training.losses import IGNORE_INDEX
from dlpipe.training.objective import MODEL, Objective

log = logging.getLogger("dlpipe")

UNSHIFTED = ("the first batch's targets equal its inputs ({shape} token ids): a causal LM trained so learns to copy "
             "its input (validation accuracy near 1.0 after one epoch, and nothing learnt); if these are "
             "next-token labels, shift them by one (target[t] = input[t + 1]), or use loss=model with a model "
             "that shifts its labels itself")


def unshifted_labels(objective: Objective, batch) -> str | None:
    """The warning for a `[B, T]` integer target equal to the `[B, T]` input (positions the loss
    ignores, -100 padding, left out), or None. loss=model is left alone: such models (Hugging Face
    causal LMs) are given labels equal to their input and shift them themselves."""
    if objective.kind == MODEL:
        return None
    args, _, target = objective.split(batch)
    inputs = args[0] if args else None
    if not (isinstance(inputs, torch.Tensor) and isinstance(target, torch.Tensor)):
        return None
    if inputs.dim() != 2 or inputs.shape != target.shape or inputs.is_floating_point() or target.is_floating_point():
        return None
    scored = target != IGNORE_INDEX
    # One CPU-GPU sync, once per run.
    if not bool(scored.any()) or not torch.equal(inputs[scored], target[scored]):
        return None
    return UNSHIFTED.format(shape=list(target.shape))


class FirstStep:
    """Called around the first training step of this process (a resumed run's included: its model is
    compiled afresh)."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self.pending = True
        self.started = 0.0

    def before(self, objective: Objective, batch) -> None:
        if not self.pending:
            return
        warning = unshifted_labels(objective, batch)
        if warning:
            log.warning(warning)
        if self.compiled:
            log.info("compiling the model with torch.compile (first steps are slow)")
            self.started = time.perf_counter()

    def after(self) -> None:
        if not self.pending:
            return
        self.pending = False
        if self.compiled:  # forward and backward as the host saw them: compilation happens there
            log.info("first compiled step (forward and backward) took %.1f s", time.perf_counter() - self.started)
