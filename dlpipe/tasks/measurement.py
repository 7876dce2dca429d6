"""What bench and tune share: the checked config, the training split, its loader fitted to the
data, the step each measured batch goes through, and the resource sampler.
"""

import logging
from dataclasses import dataclass

import torch

from dlpipe.loader import torch_threads
from dlpipe.loader.fitting import build_loaders, fit_loader, warn_about_loaders
from dlpipe.loader.threads import fetch_cpu_seconds
from dlpipe.machine import hardware
from dlpipe.machine.gpu import gpu_for
from dlpipe.schema import DlpipeConfig
from dlpipe.tasks.build import build_datasets, build_model, build_objective
from dlpipe.tasks.preflight import JobContext, preflight
from dlpipe.telemetry.sampler import ResourceSampler
from dlpipe.training.batches import to_device
from dlpipe.training.rng import seed_everything

log = logging.getLogger("dlpipe")


@dataclass(frozen=True)
class Measurement:
    """What bench and tune measure: the validated config, the training split and its loader, the
    step each batch goes through (None in loader mode), the resource sampler and the CPU budget."""

    cfg: DlpipeConfig
    train_set: object
    plan: object  # loader.build.LoaderPlan
    step: object  # callable(batch) or None
    sampler: object  # telemetry.sampler.ResourceSampler
    budget: hardware.CpuBudget
    decided: dict[str, str]  # each hardware-aware value with its source (preflight, fitted to the data)
    auto_threads: bool = False  # trainer.torch_threads left to the rule: tune decides it per candidate


def prepare_measurement(ctx: JobContext, raw: dict, resolved: dict) -> Measurement:
    """The checks and objects bench and tune share."""
    cfg, decided = preflight(raw, resolved, resolved.get("task", "bench"), ctx)
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    train_set, _, dataset = build_datasets(cfg)
    fit_loader(raw, cfg, train_set, decided)
    step = None
    if cfg.bench.mode == "train":  # the measured batches also go through the training step
        step = measured_train_step(cfg, *build_model(cfg, dataset))
    plan, _ = build_loaders(cfg, train_set, None)
    budget = hardware.cpu_budget()
    # As training sets them for this loader: the measured step (bench.mode=train) and the main process's
    # part of fetching run with the threads a run would have.
    torch_threads.settle(raw["trainer"], cfg.trainer, plan.loader.num_workers, plan.worker_method, budget.budget,
                         decided)
    torch_threads.apply(cfg.trainer.torch_threads)
    warn_about_loaders(cfg, train_set, (plan,), budget.budget)
    sampler = ResourceSampler(cfg.telemetry.sample_interval_s, budget.budget, gpu_for(cfg.trainer.device),
                              thread_cpu=fetch_cpu_seconds)
    return Measurement(cfg, train_set, plan, step, sampler, budget, decided, torch_threads.is_auto(raw["trainer"]))


def measured_train_step(cfg: DlpipeConfig, model, optimizer):
    """bench.mode=train: the training step (forward, loss, backward, optimizer step) each measured
    batch also goes through."""
    device = torch.device(cfg.trainer.device)
    model = model.to(device).train()
    objective = build_objective(cfg)

    def step(batch) -> None:
        batch = to_device(batch, device, non_blocking=True)
        objective.loss(*objective.forward(model, batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
