"""`dlpipe bench ...overrides`: measure the configured loader on this machine, without training.

Same config, recipes and overrides as training. With `--multirun` over loader keys, each job is a
child MLflow run and the sweep's parent gets the comparison table (the classic
`for workers in [0, 2, 4, 8]` loop, measured after warm-up, with CPU and memory per worker).
"""

import logging

from dlpipe.judging.evidence import bench_mode, measurement_file, settings_of
from dlpipe.loader.measure import describe, measure
from dlpipe.machine import hardware
from dlpipe.tasks.measurement import prepare_measurement
from dlpipe.tasks.params import auto_tags, config_params
from dlpipe.tasks.preflight import JobContext
from dlpipe.tasks.tracking_run import open_run, print_where_to_look, run_tags

log = logging.getLogger("dlpipe")


def run(ctx: JobContext, raw: dict, resolved: dict) -> float:
    """Measure the configured loader; returns samples/s."""
    job = prepare_measurement(ctx, raw, resolved)
    cfg, bench, loader = job.cfg, job.cfg.bench, job.plan.loader
    log.info("bench: %d batches of %d after %d warm-up, num_workers=%d worker_method=%s fetch=%s prefetch_factor=%s "
             "persistent_workers=%s pin_memory=%s (%s mode)", bench.batches, cfg.loader.batch_size,
             bench.warmup_batches, loader.num_workers, job.plan.worker_method, job.plan.fetch, loader.prefetch_factor,
             loader.persistent_workers, loader.pin_memory, bench.mode)
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    params = config_params(cfg, job.plan, job.decided, "loader", "bench", "dataset")
    params.update(hardware.host_facts(cpu=job.budget))
    params["loader.batch_bytes_est"] = str(job.plan.batch_bytes)
    with open_run(ctx, cfg.tracking, run_tags(ctx, **auto_tags(job.decided), **{"dlpipe.task": "bench"})) as tracked:
        tracked.log_params(params)
        job.sampler.start()
        try:
            result = measure(loader, bench.batches, bench.warmup_batches, job.sampler, job.step)
        finally:
            loader.shutdown()
            job.sampler.stop()
        metrics = result.metrics()
        tracked.log_metrics(metrics, step=0)
    # for the advice of later runs of this job (judging.evidence)
    measurement_file(cfg, job.budget.budget, bench_mode(cfg)).append(settings_of(loader), metrics["samples_per_s"],
                                                                     "dlpipe bench")
    print(f"bench: {describe(metrics)}", flush=True)
    print_where_to_look(ctx, cfg.tracking, tracked.run_id)
    return metrics["samples_per_s"]
