"""`dlpipe tune ...overrides`: search for the fastest loader settings and write them as a config.

The search itself (candidates, memory guard, the climb over worker counts, prefetch, persistence
and pinning) is loader.search; this task wires it to the job's data, tracks every trial as a child
MLflow run and writes the winner as OUTPUT_DIR/loader/NAME.yaml with a header saying what it measured
(tasks.tune_result: what the search may claim, inconclusive when the noise hides the gaps). Every
trial goes into the measurement journal with the search's noise and id, which `loader.tuned_on`
names: a run with the file checks its advice against what the search found (judging.advice).
"""

import dataclasses
import logging
import secrets
import socket
import time
from pathlib import Path

import yaml

from dlpipe.errors import DlpipeError
from dlpipe.judging.evidence import bench_mode, measurement_file, tune_context
from dlpipe.loader import policy, torch_threads, worker_method
from dlpipe.loader.build import NORMALISED, normalise
from dlpipe.loader.fetch import find_gather
from dlpipe.loader.fitting import build_collate, loader_settings
from dlpipe.loader.measure import describe
from dlpipe.loader.search import Candidate, Search, Trial, measure_candidate, memory_guard
from dlpipe.loader.stream_fit import share_decided_on, thread_workers_possible
from dlpipe.loader.stream_threads import EpochPositions
from dlpipe.loader.streams import is_stream
from dlpipe.machine import hardware
from dlpipe.machine.disk import write_atomic, write_failure
from dlpipe.schema import DlpipeConfig
from dlpipe.stop import Terminated, Unbroken
from dlpipe.tasks.measurement import prepare_measurement
from dlpipe.tasks.params import auto_tags, config_params, settings_params
from dlpipe.tasks.preflight import JobContext
from dlpipe.tasks.tracking_run import open_run, print_where_to_look, run_tags
from dlpipe.tasks.tune_result import TuneResult, header, trial_table
from dlpipe.tracking.run import MlflowRun

log = logging.getLogger("dlpipe")


def run(ctx: JobContext, raw: dict, resolved: dict) -> float:
    """Search, write OUTPUT_DIR/loader/NAME.yaml, log every trial; returns the best samples/s."""
    job = prepare_measurement(ctx, raw, resolved)
    cfg, plan, budget, sampler = job.cfg, job.plan, job.budget, job.sampler
    if is_stream(job.train_set):  # before the tracking run: a stream that cannot be shared out is one line
        cfg.loader = dataclasses.replace(cfg.loader, stream_share=share_among_workers(cfg.loader, job.train_set))
    bench, cuda = cfg.bench, cfg.trainer.device.startswith("cuda")
    max_workers = bench.max_workers if bench.max_workers is not None else budget.budget + max(2, budget.budget // 2)
    # (a stream's workers start anew each epoch, persistent or not: loader.build; some have no length)
    crosses_epochs = not is_stream(job.train_set) and bench.warmup_batches + bench.batches > len(plan.loader)
    start = start_candidate(plan)
    tags = run_tags(ctx, **auto_tags(job.decided), **{"dlpipe.task": "tune"})
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    with open_run(ctx, cfg.tracking, tags) as parent:
        parent.log_params({**config_params(cfg, plan, job.decided, "loader", "bench"),
                           **hardware.host_facts(cpu=budget)})
        done: dict[Candidate, Trial] = {}  # every trial as soon as it is measured: a stop still reports it
        # A trial runs with the threads a run of its loader would get (trainer.torch_threads automatic).
        threads = torch_threads.rule_for(budget.budget, cfg.trainer.device) if job.auto_threads else None
        evaluate = evaluator(cfg, parent, tags, job.train_set, plan.batch_bytes, sampler, job.step, done, threads)
        tune_id = secrets.token_hex(6)
        search = Search(evaluate, bench.min_gain, max_workers,
                        tune_persistent=crosses_epochs and cfg.trainer.epochs > 1, tune_pin=cuda,
                        seed_workers=hardware.recommended_workers(budget.budget),
                        persist=automatic_persistence(raw, cfg, job.train_set),
                        **dataset_options(cfg, job.train_set))
        started = time.perf_counter()
        sampler.start()
        try:
            best = search.run(start)
        except (KeyboardInterrupt, Terminated) as stop:  # the runs end KILLED on the way out
            record_trials(cfg, budget.budget, done, search.threshold, tune_id)
            report_stopped(done, stop)
            raise
        finally:
            sampler.stop()
        record_trials(cfg, budget.budget, search.trials, search.threshold, tune_id)
        result = TuneResult(list(search.trials.values()), search.trials[best], search.trials[start],
                            time.perf_counter() - started, search.outcome(best), budget.budget)
        save_result(ctx, cfg, budget, result, parent, {"stream_share": raw["loader"].get("stream_share", "auto")},
                    tune_id)
    print(result.table(), flush=True)
    said = result.inconclusive()
    if said:
        print(said, flush=True)
    print(f"tuned: {best.label()}: {result.best.samples_per_s:.1f} samples/s, {result.speedup:.2f}x "
          f"the automatic config, {len(result.trials)} trials in {result.seconds:.0f} s"
          + (" (inconclusive: see above)" if said else ""), flush=True)
    print(f"use it: dlpipe --config-dir {bench.output_dir} loader={bench.name} ...", flush=True)
    print_where_to_look(ctx, cfg.tracking, parent.run_id)
    return result.best.samples_per_s


def report_stopped(trials: dict[Candidate, Trial], stop: BaseException) -> None:
    """A search stopped by a signal: what it measured so far (each trial is a child run too), and
    that no config was written (a part of the search is no result)."""
    why = "Ctrl-C" if isinstance(stop, KeyboardInterrupt) else str(stop)
    measured = [t for t in trials.values() if not t.skipped]
    if measured:
        print(trial_table(list(trials.values()), None, max(measured, key=lambda t: t.samples_per_s).candidate),
              flush=True)
    n = len(measured)
    print(f"tune: search stopped ({why}) with {n} candidate{'' if n == 1 else 's'} measured; no config written",
          flush=True)


def start_candidate(plan) -> Candidate:
    """The search's start: the settings the job's own DataLoader got (normalised: pin_memory is off
    without CUDA, so no trial pins there and the search flips pinning only with CUDA)."""
    loader = plan.loader  # PyTorch's own prefetch default included: what the workers really keep ready
    return Candidate(loader.num_workers, loader.prefetch_factor if loader.num_workers else None,
                     loader.persistent_workers, bool(loader.pin_memory), plan.fetch, plan.worker_method)


def share_among_workers(loader, stream) -> str:
    """loader.stream_share for the candidates with workers: the job's, unless it was decided for no
    workers (the main process reads a stream once either way), then decided as for workers
    (loader.stream_fit): a candidate must read each sample once an epoch, or it measures duplicates."""
    if loader.num_workers or loader.stream_share == "source":
        return loader.stream_share
    return share_decided_on(dataclasses.replace(loader, num_workers=2), stream, 1)


def dataset_options(cfg: DlpipeConfig, train_set) -> dict[str, bool]:
    """What the dataset allows the search: whole-batch gathers (loader.fetch=batch) where they equal
    its per-item collate, threads unless it draws from the global RNGs (loader.worker_method). A
    stream is read item by item; threads only where it reads positions and dlpipe deals it
    (loader.stream_threads), else each worker process has its own reader."""
    if is_stream(train_set):
        threads = thread_workers_possible(dataclasses.replace(cfg.loader, num_workers=2), train_set)
        return {"gathers": False,
                "tune_threads": threads and worker_method.global_draws(EpochPositions(train_set)) is None}
    if not len(train_set):
        return {"gathers": False, "tune_threads": False}
    how, _ = find_gather(train_set, build_collate(cfg.loader))
    return {"gathers": how is not None, "tune_threads": worker_method.global_draws(train_set) is None}


def automatic_persistence(raw: dict, cfg: DlpipeConfig, train_set):
    """persistent_workers for a worker count by the job's own rule (loader.policy) when the config
    leaves it automatic, so the written file never holds a value the lint would then question. A
    stream's workers start anew each epoch (its set_epoch reaches them only then: loader.build)."""
    if is_stream(train_set):
        return lambda workers: False
    if not policy.is_auto(raw["loader"]["persistent_workers"], "auto_persistent"):
        return None
    batches = policy.batches_per_epoch(len(train_set), cfg.loader.batch_size, 1, cfg.loader.drop_last)
    return lambda workers: policy.persist_workers(workers, cfg.trainer.epochs, batches)[0]


def evaluator(cfg: DlpipeConfig, parent, tags: dict[str, str], train_set, batch_bytes: int, sampler, step,
              done: dict[Candidate, Trial], threads=None):
    """evaluate(candidate) -> Trial for the search: the memory guard, the measurement, a log line
    and a child MLflow run per measured candidate; each trial also goes into `done` once measured.
    `threads`: (workers, worker_method) -> the torch threads Decision a trial runs with (None: the
    job's trainer.torch_threads)."""
    bench, tracking = cfg.bench, cfg.tracking
    settings = loader_settings(cfg.loader)  # loader.collate_fn built: every candidate collates like the job
    cuda = cfg.trainer.device.startswith("cuda")
    worker_rss = [0.0]  # the largest per-worker RSS measured so far, for the memory guard

    def evaluate(c: Candidate) -> Trial:
        why = memory_guard(c, batch_bytes, hardware.shm_free_bytes(), hardware.memory_available_bytes(), worker_rss[0])
        if why:
            log.warning("tune: skip %s: %s", c.label(), why)
            done[c] = Trial(c, skipped=why)
            return done[c]
        with torch_threads.using(threads(c.num_workers, c.worker_method).value if threads else
                                 cfg.trainer.torch_threads):
            trial = measure_candidate(c, train_set, settings, bench.batches, bench.warmup_batches, bench.repeats,
                                      cfg.trainer.seed, cuda, sampler, step)
        done[c] = trial
        worker_rss[0] = max(worker_rss[0], trial.metrics.get("worker_rss_mean_mb", 0.0) * 2**20)
        log.info("tune: %s: %s (runs %s)", c.label(), describe(trial.metrics), " ".join(f"{v:.0f}" for v in trial.runs))
        if tracking.enabled:
            with Unbroken(lambda: MlflowRun(tracking.uri, tracking.experiment, c.label(),
                                            {**tags, "dlpipe.task": "tune-trial"}, parent_run_id=parent.run_id,
                                            timeout_s=tracking.request_timeout_s,
                                            retries=tracking.request_retries)) as child:
                child.log_params(trial_params(c, settings, cuda))
                child.log_metrics(trial.metrics, step=0)
        return trial

    return evaluate


def trial_params(c: Candidate, settings: dict, cuda: bool) -> dict[str, str]:
    """A trial's params as a job's (common.loader_params): the settings its DataLoader got (the
    candidate's over the config's, normalised as build_loader does), the requested ones beside."""
    chosen = {**settings, **c.settings()}
    asked = {key: chosen[key] for key in NORMALISED}
    effective, requested, _ = normalise(c.num_workers, asked, cuda, c.worker_method)
    return settings_params({**c.settings(), **effective}, requested)


def record_trials(cfg: DlpipeConfig, cpu_budget: int, trials: dict[Candidate, Trial], noise: float,
                  tune_id: str) -> None:
    """Every measured trial into the measurement journal, for later runs' advice (judging.advice), with
    the search's noise (a gap under it decides nothing), its id (the written file's loader.tuned_on
    names it) and what the job was (a run with the file may change the batch size or the device)."""
    journal = measurement_file(cfg, cpu_budget, bench_mode(cfg))
    context = tune_context(cfg, cpu_budget)
    cuda = cfg.trainer.device.startswith("cuda")
    for c, trial in trials.items():
        if not trial.skipped:
            journal.append({**c.settings(), "pin_memory": c.pin_memory and cuda}, trial.samples_per_s, "dlpipe tune",
                           noise=round(noise, 4), tune=tune_id, context=context)


def save_result(ctx: JobContext, cfg: DlpipeConfig, budget, result: TuneResult, parent, kept: dict,
                tune_id: str) -> None:
    """The tuned loader config and the trial table into the parent run first (tune/NAME.yaml,
    tune/trials.md, metrics and tags), then as files: OUTPUT_DIR/loader/NAME.yaml, a copy and the
    table in the job's folder. `kept`: values written as the config gave them (a stream's share is
    decided again by the job that uses the file). A file that cannot be written (a full disk) fails
    the job in one line naming it, after the config is printed: the search's result is never lost."""
    bench = cfg.bench
    loader = {**dataclasses.asdict(cfg.loader), **kept,
              "tuned_on": f"cpu_budget={budget.budget} host={socket.gethostname()} tune={tune_id}"}
    text = header(cfg, budget, result) + yaml.safe_dump({**loader, **result.best.candidate.settings()},
                                                        sort_keys=False)
    table = result.table()
    artifact = f"tune/{bench.name}.yaml"
    parent.log_text(text, artifact)
    parent.log_text(table + "\n", "tune/trials.md")
    # under a prefix of its own, as a sweep parent's: the chart view never mixes them with the trials'
    parent.log_metrics({"tune/best_samples_per_s": result.best.samples_per_s,
                        "tune/start_samples_per_s": result.start.samples_per_s, "tune/speedup": result.speedup,
                        "tune/seconds": result.seconds, "tune/trials": float(len(result.trials)),
                        "tune/noise": result.outcome.noise, "tune/inconclusive": float(not result.outcome.conclusive)},
                       step=0)
    parent.set_tags({"dlpipe.tuned": result.best.candidate.label(),
                     "dlpipe.tuned_threshold": f"{result.threshold:.3f}", "dlpipe.tune_id": tune_id,
                     "dlpipe.tune_outcome": result.inconclusive() or "conclusive: no candidate measured faster"})
    files = [(f"bench.output_dir={bench.output_dir}", Path(bench.output_dir) / "loader" / f"{bench.name}.yaml", text),
             (f"hydra.run.dir={ctx.output_dir}", ctx.output_dir / f"{bench.name}.yaml", text),
             (f"hydra.run.dir={ctx.output_dir}", ctx.output_dir / "tune_trials.md", table + "\n")]
    failed, kept = [], ["printed above"] + ([f"in MLflow run {parent.run_id} as {artifact}"] if parent.run_id else [])
    for key, path, content in files:  # each one tried: a full disk under one folder spares the other's copy
        try:
            write_whole(path, content)
        except OSError as e:
            failed.append(f"{key}: cannot write {path} ({write_failure(e, path)})")
        else:
            kept += [f"in {path}"] if content is text else []
    if failed:
        print(text, end="", flush=True)  # the result, for the user to save
        raise DlpipeError(f"{failed[0]}; free space there or choose another folder; the tuned config is "
                          f"{', '.join(kept)}")


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (disk.write_atomic: of two tunes writing one config,
    the last one's, whole); a tuned config already there is named in the log with what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = written_by(path)
    write_atomic(path, text)  # 0644: a config to share
    if earlier:
        log.warning("tune: replaced %s (%s)", path, earlier)


def written_by(path: Path) -> str | None:
    """What the header of a config `dlpipe tune` wrote at `path` says: when, for what, and what it
    measured; None when there is no such file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [f.readline().removeprefix("# ").strip() for _ in range(4)]  # header()'s lines
    except (FileNotFoundError, IsADirectoryError):
        return None
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    said = [line.removesuffix(" Tune again on another machine.") for line in lines
            if line.startswith("Written by") or " candidates measured " in line]
    return " ".join(said) or "not written by dlpipe tune"
