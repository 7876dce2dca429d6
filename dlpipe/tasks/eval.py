"""`dlpipe eval ...overrides checkpoint.init_from=PATH`: score saved weights on the job's validation
split (or, with trainer.val_fraction=0, on the whole dataset: point `dataset` at a test set) with
the job's loss and metrics, and record it as an MLflow run.

The split, its order and the metrics are the ones training used with the same config, so scoring
a run's checkpoint reproduces that run's validation numbers for the epoch it was saved at.
"""

import logging

import torch

from dlpipe.errors import ConfigError
from dlpipe.loader import torch_threads
from dlpipe.loader.faults import NamedErrors
from dlpipe.loader.fetch import item_collate
from dlpipe.loader.fitting import build_loaders
from dlpipe.machine import hardware
from dlpipe.tasks.build import build_data_and_model, build_objective_and_metrics, validation_view
from dlpipe.tasks.params import auto_params, auto_tags, flatten, recorded_config
from dlpipe.tasks.preflight import JobContext, preflight
from dlpipe.tasks.tracking_run import open_run, print_where_to_look, run_tags
from dlpipe.training.evaluate import evaluate
from dlpipe.training.net import autocast_for
from dlpipe.training.resume import init_weights
from dlpipe.training.rng import seed_everything

log = logging.getLogger("dlpipe")


def run(ctx: JobContext, raw: dict, resolved: dict) -> float:
    """Score the weights; returns the loss over the scored split."""
    cfg, decided = preflight(raw, resolved, "eval", ctx)
    if not cfg.checkpoint.init_from:
        raise ConfigError(["checkpoint.init_from=null: dlpipe eval scores saved weights; set "
                           "checkpoint.init_from=PATH (a checkpoint file or a run's checkpoints/ folder)"])
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    train_set, val_set, model, _ = build_data_and_model(cfg)
    if val_set is not None:
        split, name = val_set, "validation split"
    else:  # a test set: all of it, without the random augmentation training applies
        split, name = NamedErrors(validation_view(train_set.dataset)), "whole dataset"
    # Scored with validation's loader (in order, every sample, no augmentation): the numbers match
    # the training run's; the training loader built beside it is never iterated.
    _, plan = build_loaders(cfg, train_set, split)
    # the threads training's validation ran with (its loader has the same workers): the same reductions
    torch_threads.settle(raw["trainer"], cfg.trainer, plan.loader.num_workers, plan.worker_method,
                         hardware.cpu_budget().budget, decided)
    torch_threads.apply(cfg.trainer.torch_threads)
    objective, metrics = build_objective_and_metrics(cfg, model, split, item_collate(plan.loader))
    weights = init_weights(model, cfg.checkpoint.init_from)
    device = torch.device(cfg.trainer.device)
    model.to(device).eval()
    try:
        scores = evaluate(model, plan.loader, objective, {k: m.to(device) for k, m in metrics.items()},
                          device=device, limit_batches=cfg.trainer.limit_val_batches,
                          autocast=autocast_for(device, cfg.trainer.amp))  # as training's validation ran
    finally:
        plan.loader.shutdown()
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    params = {**flatten(recorded_config(cfg)), **hardware.host_facts(),
              **auto_params(decided), "eval.samples": str(len(split))}
    tags = run_tags(ctx, **auto_tags(decided), **{"dlpipe.task": "eval", "dlpipe.init_from": str(weights),
                                                   "dlpipe.eval_split": name})
    with open_run(ctx, cfg.tracking, tags) as tracked:
        tracked.log_params(params)
        tracked.log_metrics(scores, step=0)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
    print(f"eval: {shown} ({len(split)} samples of the {name}, weights {weights})", flush=True)
    print_where_to_look(ctx, cfg.tracking, tracked.run_id)
    return scores.get("val_loss", float("nan"))
