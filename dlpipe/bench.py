"""`dlpipe bench ...overrides`: measure the configured loader on this machine, without training.

Same config, recipes and overrides as training. With `--multirun` over loader keys, each job is a
child MLflow run and the sweep's parent gets the comparison table (the classic
`for workers in [0, 2, 4, 8]` loop, measured after warm-up, with CPU and memory per worker).
"""

import logging

from dlpipe import hardware
from dlpipe.job import JobContext, fit_workers, flatten, gpu_for, open_run, preflight, run_tags, warn_about_loaders
from dlpipe.redact import redact_tree

log = logging.getLogger("dlpipe")


def prepare(resolved: dict, raw: dict, with_model: bool):
    """The checks and objects bench and tune share: (train split, loader plan, model, optimizer, budget)."""
    from dlpipe.build import build_datasets, build_loaders, build_model
    from dlpipe.rng import seed_everything

    decided = preflight(raw, resolved, resolved.get("task", "bench"))
    seed_everything(resolved["trainer"]["seed"], resolved["trainer"]["deterministic"])
    train_set, _, dataset = build_datasets(resolved)
    fit_workers(raw, resolved, train_set, decided)
    model = optimizer = None
    if with_model:
        model, optimizer = build_model(resolved, dataset)
    plan, _ = build_loaders(resolved, train_set, None)
    budget = hardware.cpu_budget()
    warn_about_loaders(resolved, train_set, (plan,), budget.budget)
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
    train_set, plan, model, optimizer, budget = prepare(resolved, raw, with_model=bench["mode"] == "train")
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
    tags = run_tags(ctx, **{"dlpipe.task": "bench"})
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
