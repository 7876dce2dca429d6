"""`dlpipe bench ...overrides`: measure the configured loader on this machine, without training.

Same config, recipes and overrides as training. With `--multirun` over loader keys, each job is a
child MLflow run and the sweep's parent gets the comparison table (the classic
`for workers in [0, 2, 4, 8]` loop, measured after warm-up, with CPU and memory per worker).
"""

import logging
import os

from dlpipe import hardware
from dlpipe.config.decisions import explain
from dlpipe.config.validation import validate
from dlpipe.job import JobContext, check_single_process, check_tracking_reachable, flatten, gpu_for, open_run
from dlpipe.redact import redact_tree

log = logging.getLogger("dlpipe")


def prepare(ctx: JobContext, resolved: dict, raw: dict, with_model: bool):
    """The checks and objects bench and tune share: (train split, loader plan, model, optimizer, budget)."""
    from dlpipe.build import build_datasets, build_loaders, build_model, fit_workers_to_data
    from dlpipe.lint import lint_job
    from dlpipe.rng import seed_everything

    check_single_process(os.environ)
    validate(resolved)
    check_tracking_reachable(resolved["tracking"])
    for key, why in explain(raw, resolved).items():
        log.info("%s = %s", key, why)
    seed_everything(resolved["trainer"]["seed"], resolved["trainer"]["deterministic"])
    train_set, _, dataset = build_datasets(resolved)
    fitted = fit_workers_to_data(raw, resolved, train_set)
    if fitted:
        log.info("loader.num_workers = %s", fitted)
    model = optimizer = None
    if with_model:
        model, optimizer = build_model(resolved, dataset)
    plan, _ = build_loaders(resolved, train_set, None)
    for note in plan.notes:
        log.warning(note)
    budget = hardware.cpu_budget()
    for line in lint_job(resolved, len(train_set), plan.batch_bytes, budget.budget):
        log.warning("lint: %s", line)
    return train_set, plan, model, optimizer, budget


def step_for(resolved: dict, model, optimizer):
    """bench.mode=train: the training step each batch also goes through; None for loader mode."""
    if resolved["bench"]["mode"] != "train":
        return None
    import torch

    from dlpipe.loader_bench import train_step

    device = torch.device(resolved["trainer"]["device"])
    return train_step(model.to(device), optimizer, device)


def describe(metrics: dict[str, float]) -> str:
    parts = [f"{metrics['samples_per_s']:.1f} samples/s", f"first batch {metrics['first_batch_s']:.2f} s"]
    if "cpu_util" in metrics:
        parts.append(f"cpu {metrics['cpu_util']:.0f}% of budget")
    if "cpu_per_worker_pct" in metrics:
        parts.append(f"{metrics['cpu_per_worker_pct']:.0f}% cpu and {metrics['worker_rss_mean_mb']:.0f} MB per worker")
    if "tree_rss_peak_mb" in metrics:
        parts.append(f"peak {metrics['tree_rss_peak_mb']:.0f} MB in all")
    return ", ".join(parts)


def run(ctx: JobContext, raw: dict, resolved: dict) -> float:
    """Measure the configured loader; returns samples/s."""
    from dlpipe.loader_bench import measure
    from dlpipe.telemetry import ResourceSampler

    bench = resolved["bench"]
    train_set, plan, model, optimizer, budget = prepare(ctx, resolved, raw, with_model=bench["mode"] == "train")
    step = step_for(resolved, model, optimizer)
    lc = resolved["loader"]
    log.info("bench: %d batches of %d after %d warm-up, num_workers=%d prefetch_factor=%s persistent_workers=%s "
             "pin_memory=%s (%s mode)", bench["batches"], lc["batch_size"], bench["warmup_batches"],
             plan.loader.num_workers, plan.loader.prefetch_factor, plan.loader.persistent_workers,
             plan.loader.pin_memory, bench["mode"])
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    params = flatten(redact_tree({"loader": lc, "bench": bench, "dataset": resolved["dataset"]}))
    params.update(hardware.host_facts(cpu=budget))
    params["loader.batch_bytes_est"] = str(plan.batch_bytes)
    sampler = ResourceSampler(resolved["telemetry"]["sample_interval_s"], budget.budget,
                              gpu_for(resolved["trainer"]["device"]))
    tags = {"dlpipe.task": "bench", "dlpipe.recipe": ctx.recipe or "none",
            "dlpipe.overrides": " ".join(ctx.overrides) or "none", "dlpipe.output_dir": str(ctx.output_dir)}
    with open_run(ctx, resolved["tracking"], tags) as tracked:
        tracked.log_params(params)
        sampler.start()
        try:
            result = measure(plan.loader, bench["batches"], bench["warmup_batches"], sampler, step)
        finally:
            plan.loader.shutdown()
            sampler.stop()
        metrics = result.metrics()
        tracked.log_metrics(metrics, step=0)
    print(f"bench: {describe(metrics)}", flush=True)
    return metrics["samples_per_s"]
