"""One training job's parts, built from the validated config, and the steps `tasks.train` runs on them.

`build_job` does everything a user can get wrong before a tracking run exists. `TrainJob` then
resumes, fits (its failures translated into one-line errors in one place), records the outcome and
owns its teardown (`close`).
"""

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from dlpipe.errors import DataError, DlpipeError, first_line
from dlpipe.judging.advice import Evidence
from dlpipe.judging.evidence import gather, measurement_file, settings_of
from dlpipe.judging.journal import MeasurementFile
from dlpipe.judging.verdict import diagnose, rss_slope, run_metrics, worker_leak
from dlpipe.loader import torch_threads
from dlpipe.loader.build import LoaderPlan
from dlpipe.loader.faults import explain_loader_failure
from dlpipe.loader.fetch import fetch_mode, item_collate
from dlpipe.loader.fitting import build_loaders, fit_loader, warn_about_loaders
from dlpipe.loader.streams import is_stream, size_of
from dlpipe.loader.threads import fetch_cpu_seconds, worker_method_of
from dlpipe.loader.worker_method import global_draws
from dlpipe.loader.worker_signals import start_helper_processes
from dlpipe.machine import hardware
from dlpipe.machine.gpu import gpu_for
from dlpipe.schema import DlpipeConfig
from dlpipe.stop import StopTraining, Terminated
from dlpipe.tasks.build import (
    build_callbacks,
    build_data_and_model,
    build_objective_and_metrics,
    build_scheduler,
    metric_direction,
    monitor_mode,
)
from dlpipe.tasks.params import auto_params, auto_tags, flatten, job_params, recorded_config
from dlpipe.tasks.preflight import JobContext
from dlpipe.tasks.resume_point import checkpoint_folder, resume_hint, resume_point, save_stop_checkpoint
from dlpipe.tasks.tracking_run import run_tags
from dlpipe.telemetry.profiling import AllocationSnapshot, StepProfiler
from dlpipe.telemetry.sampler import ResourceSampler
from dlpipe.tracking.dataset_input import describe as describe_dataset
from dlpipe.tracking.protocols import JobRun
from dlpipe.training import distributed
from dlpipe.training.accumulation import epoch_batches, optimizer_steps, out_of_memory_advice
from dlpipe.training.checkpoint import CheckpointStore
from dlpipe.training.distributed import Ranks
from dlpipe.training.net import compile_failure
from dlpipe.training.resume import check_model_fits, config_changes, init_weights
from dlpipe.training.rng import seed_everything
from dlpipe.training.runner import Trainer

log = logging.getLogger("dlpipe")


@dataclass
class TrainJob:
    """What one training job built, and the one place that tears it down."""

    ctx: JobContext
    cfg: DlpipeConfig
    ranks: Ranks
    train_plan: LoaderPlan
    val_plan: LoaderPlan | None
    trainer: Trainer
    store: CheckpointStore
    sampler: ResourceSampler
    profiler: StepProfiler
    allocations: AllocationSnapshot
    params: dict[str, str]
    tags: dict[str, str]
    resolved_yaml: str
    config_flat: dict[str, str]
    cpu_budget: int
    evidence: Evidence
    journal: MeasurementFile
    """This job's training-run lines of the measurement journal: the run's own samples/s goes there."""
    dataset_input: dict
    """The dataset as the run's input (tracking.dataset_input.describe)."""
    run_id: str | None = None
    samples_follow_loader: bool = False
    """A resumed job's dataset draws from the global RNGs while fetching: who fetches changes its samples."""
    _closed: list | None = field(default=None, repr=False)

    @property
    def loader(self):
        return self.train_plan.loader

    def resume(self) -> str | None:
        """Load the checkpoint `checkpoint.resume` points to, if any, and return its MLflow run id;
        else start from checkpoint.init_from's weights, if given (fine-tuning)."""
        start, path = resume_point(self.store, self.cfg.checkpoint.resume, self.ranks)
        if start is None:
            if self.cfg.checkpoint.init_from:  # every rank loads the same file: their weights agree
                self.tags["dlpipe.init_from"] = str(init_weights(self.trainer.model, self.cfg.checkpoint.init_from))
            return None
        check_model_fits(self.trainer.model, start["model"], path)
        # Batches follow the loader where the dataset draws from the global RNGs while fetching (the
        # loader's wrapper holds it: a few items are fetched), and for a stream that shares itself out
        # among the workers (its order is theirs); dlpipe deals a stream's batches in its own order.
        dataset = self.loader.dataset
        shared_at_source = is_stream(dataset) and not dataset.share
        self.samples_follow_loader = shared_at_source or global_draws(dataset.dataset) is not None
        changed, speed = config_changes(start.get("config", {}), self.config_flat, self.samples_follow_loader)
        if changed:
            log.warning("resuming with a changed config: %s", ", ".join(changed))
        if speed:
            log.info("resuming with other loader settings (the batches stay the same): %s", ", ".join(speed))
        own = start.get("ranks") or []
        if self.ranks.distributed and len(own) == self.ranks.world:
            start.update(own[self.ranks.rank])  # this rank's RNG and loader-generator states
        self.trainer.load_state_dict(start, self.loader.generator)
        self.tags["dlpipe.resumed_from"] = f"{path} (epoch {start['epoch']})"
        return start.get("mlflow_run_id")

    def start_worker_helpers(self) -> None:
        """multiprocessing's helper processes for spawn/forkserver workers, started with the stop
        signals ignored: call it before the stop handlers are installed (a signal in those few
        milliseconds would otherwise be dropped)."""
        start_helper_processes(self.cfg.loader.multiprocessing_context if self.loader.num_workers else None)

    def fit(self, metrics) -> list[dict[str, float]]:
        """Start the telemetry, train every epoch left; `metrics` is the tracking run."""
        if self.ranks.is_main:  # only now: a job refused before its run opened leaves no folder (cli)
            self.ctx.output_dir.mkdir(parents=True, exist_ok=True)
            (self.ctx.output_dir / "resolved_config.yaml").write_text(self.resolved_yaml)
        self.sampler.start()
        if self.sampler.gpu_status.startswith("not available"):
            log.info("GPU metrics %s", self.sampler.gpu_status)
        self.allocations.start()
        self.profiler.start()
        self.trainer.metrics, self.trainer.on_epoch = metrics, self.after_epoch
        if self.trainer.peers is not None:
            self.trainer.peers.barrier()  # start the clocks together: rank 0 took longer, opening the run
        return self.trainer.fit(self.loader, self.val_plan.loader if self.val_plan else None)

    def judge(self, metrics: dict[str, float], warm: bool):
        loader = self.loader
        return diagnose(metrics, num_workers=loader.num_workers, cpu_budget=self.cpu_budget,
                        pin_memory=bool(loader.pin_memory), device_type=self.trainer.device.type,
                        prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                        fetch=fetch_mode(loader), worker_method=worker_method_of(loader),
                        evidence=self.evidence, warm=warm)

    def after_epoch(self, row: dict[str, float]) -> None:
        log.info("epoch %d: %s", int(row["epoch"]), self.judge(row, warm=row["epoch"] > 1).line())
        if self.cfg.checkpoint.enabled:
            state = self.checkpoint_state()
            if self.ranks.is_main:
                self.store.save(state, int(row["epoch"]), row)

    def checkpoint_state(self) -> dict:
        """The trainer's state; with several ranks, each rank's random state too (called on every rank)."""
        state = self.trainer.state_dict(self.loader.generator)
        if self.trainer.peers is not None:
            # each rank's random state and its own partial loss sums (trainer_state)
            own = ("rng", "loader_generator", "step_log", "epoch_loss")
            state["ranks"] = self.trainer.peers.gather({k: state[k] for k in own})
        state.update(mlflow_run_id=self.run_id, config=self.config_flat)
        return state

    @contextmanager
    def failures_translated(self):
        """What can end the loop early, as what the CLI and the tracking run expect: a stop becomes
        KeyboardInterrupt or Terminated (after its checkpoint), a fault a user can act on one line."""
        try:
            yield
        except StopTraining as stop:
            self.record_stop(stop.reason)
            if stop.reason == "SIGINT":
                raise KeyboardInterrupt from None
            raise Terminated(self.trainer.stop.signal or stop.reason) from None
        except torch.cuda.OutOfMemoryError as e:
            raise DlpipeError(out_of_memory_advice(self.cfg.loader.batch_size, self.cfg.trainer.accumulate, e)) from e
        except RuntimeError as e:
            if self.ranks.distributed and distributed.lost_peer(e):
                raise DlpipeError(f"another rank left the job mid-step ({first_line(e)[:200]}); its own error, "
                                  "printed by that rank, is the cause") from e
            compiled = compile_failure(e) if self.cfg.trainer.compile else None
            if compiled:
                raise DlpipeError(compiled) from e
            why = explain_loader_failure(e, self.cfg.loader)
            if why is None:
                raise
            raise DataError(why) from e

    def record_stop(self, reason: str) -> None:
        """Checkpoint an interrupted epoch at its last optimizer step so the same command resumes it."""
        stop = self.trainer.stop
        stop.recording = True
        saving = self.cfg.checkpoint.enabled and stop.interrupted_epoch
        state = self.checkpoint_state() if saving else None  # every rank: it gathers their states
        if self.ranks.is_main:
            save_stop_checkpoint(self.trainer, reason, self.store if self.cfg.checkpoint.enabled else None, state,
                                 resume_hint(self.ctx))
        if self.trainer.peers is not None:
            self.trainer.peers.barrier()  # nobody exits (and gets the job torn down) before rank 0 has saved

    def close(self) -> list[Path]:
        """Stop what the job started: the loaders' persistent workers (they end with training, not
        at exit), the sampler thread, the profilers. Returns the profile files written. Idempotent."""
        if self._closed is None:
            for plan in (self.train_plan, self.val_plan):
                if plan is not None:
                    plan.loader.shutdown()
            self.sampler.stop()
            self._closed = self.profiler.finish() + self.allocations.finish()
        return self._closed

    def model_file(self, which: str) -> Path | None:
        """The checkpoint tracking.log_model names ("best" or "last"), or None when there is none; a
        best.pt never written (no epoch had the monitored metric) gives the last, with a warning."""
        newest = next(iter(self.store.candidates()), None)
        if which == "best" and not self.store.best_path.exists():
            log.warning("tracking.log_model=best: no best.pt (no epoch had %s): logging the last epoch's",
                        self.cfg.checkpoint.monitor)
            return newest
        return self.store.best_path if which == "best" else newest

    def record_outcome(self, run: JobRun, history: list[dict[str, float]]):
        """The run's verdict, worker-memory warning and end tags; returns the verdict."""
        measured = run_metrics(history)
        verdict = self.judge(measured, warm=len(history) > 1)  # run_metrics leaves the first epoch out
        tags = {"dlpipe.gpu_metrics": self.sampler.gpu_status, "dlpipe.optimizer_steps": str(self.trainer.step),
                "dlpipe.verdict": verdict.kind, "dlpipe.verdict_detail": verdict.line(),
                "mlflow.note.content": f"**Bottleneck:** {verdict.line()}"}  # the run's description in the UI
        if verdict.change:
            tags["dlpipe.advice"] = verdict.change  # the sweep checks it against its other jobs
        # Judged before it is recorded (the run is not its own evidence); a single epoch's figure carries
        # the start-up that the journal's other lines leave out.
        if self.ranks.is_main and len(history) > 1:
            self.journal.append(settings_of(self.loader), measured.get("samples_per_s", 0.0), "training run")
        if self.trainer.stopped_early:
            log.info("training ended early: %s", self.trainer.stopped_early)
            tags["dlpipe.stopped_early"] = self.trainer.stopped_early
        leak = worker_leak(history, self.loader.persistent_workers)
        if leak:
            log.warning(leak)
            tags["dlpipe.worker_memory"] = leak
        rss = [r["worker_rss_max_mb"] for r in history if "worker_rss_max_mb" in r]
        if len(rss) >= 2:
            run.log_metrics({"worker_rss_slope_mb_per_epoch": rss_slope(rss)}, step=self.trainer.step)
        run.set_tags(tags)
        return verdict


def build_job(ctx: JobContext, raw: dict, cfg: DlpipeConfig, decided: dict[str, str], ranks,
              before_measuring=None) -> TrainJob:
    """Data, model, loaders, trainer, telemetry and checkpoint store, and the run's params and tags.
    `before_measuring` is called before the loader is fitted to the data (which may time it)."""
    # Ranks draw different dropout and augmentation; their weights agree (DDP copies rank 0's).
    seed_everything(cfg.trainer.seed + ranks.rank, cfg.trainer.deterministic)
    train_set, val_set, model, optimizer = build_data_and_model(cfg)
    if before_measuring is not None:
        before_measuring()
    fit_loader(raw, cfg, train_set, decided, ranks.world, model)
    train_plan, val_plan = build_loaders(cfg, train_set, val_set, ranks.rank, ranks.world)
    batches = epoch_batches(train_plan.loader, cfg.trainer.limit_train_batches)
    schedule = build_scheduler(cfg, optimizer, optimizer_steps(batches, cfg.trainer.accumulate))
    budget = hardware.cpu_budget()
    # The loader's workers are final here (the fit may have changed them): the threads follow them, and
    # are set before the first step (and before the resume's weights are loaded).
    torch_threads.settle(raw["trainer"], cfg.trainer, train_plan.loader.num_workers, train_plan.worker_method,
                         budget.budget, decided)
    torch_threads.apply(cfg.trainer.torch_threads)
    if ranks.is_main:
        warn_about_loaders(cfg, train_set, (train_plan, val_plan), budget.budget)
    # Ranks' samples/s add up: a journal of single-process runs would compare it against the wrong thing.
    journal = measurement_file(cfg, budget.budget, "epoch", enabled=not ranks.distributed)
    evidence = gather(cfg, budget.budget, train_set, train_plan.loader, enabled=not ranks.distributed)
    objective, val_metrics = build_objective_and_metrics(cfg, model, train_set,
                                                            item_collate(train_plan.loader))
    validates = val_plan is not None and cfg.trainer.limit_val_batches != 0
    mode = monitor_mode(cfg, val_metrics, validates)
    if schedule is not None and schedule.monitor:  # only for the check: the scheduler has its own mode
        metric_direction("scheduler", schedule.monitor, "min", val_metrics, validates)
    callbacks = build_callbacks(cfg, val_metrics, validates)  # user code runs here: before anything is written
    # (torch.compile may refuse here, before anything is written)
    trainer, sampler, profiler, allocations = build_trainer(
        ctx, cfg, ranks, model, optimizer, budget.budget,
        extras={"schedule": schedule, "objective": objective, "val_metrics": val_metrics, "callbacks": callbacks})
    shown = recorded_config(cfg)  # what is recorded anywhere; `cfg` itself builds the job
    resolved_yaml = yaml.safe_dump(shown, sort_keys=False)
    config_flat = flatten(shown)
    ck = cfg.checkpoint
    store = CheckpointStore(checkpoint_folder(cfg, ctx), ck.keep_last, ck.monitor, mode)
    params = {**config_flat, **hardware.host_facts(cpu=budget), **auto_params(decided),
              **job_params(cfg, ranks, train_plan, model)}
    config_flat = {k: params[k] for k in config_flat}  # as it runs: the loader's effective settings
    tags = run_tags(ctx, **auto_tags(decided))  # why each hardware-aware value: the params say it in a word
    sizes = {"train": size_of(train_set), **({"validation": size_of(val_set)} if val_set is not None else {})}
    return TrainJob(ctx, cfg, ranks, train_plan, val_plan, trainer, store, sampler, profiler, allocations,
                    params, tags, resolved_yaml, config_flat, budget.budget, evidence, journal,
                    describe_dataset(shown["dataset"], sizes))


def build_trainer(ctx: JobContext, cfg: DlpipeConfig, ranks, model, optimizer, cpu_budget: int, extras: dict):
    """The Trainer with its telemetry: (trainer, sampler, profiler, allocation snapshot). `extras` are
    the Trainer's schedule, objective, val_metrics and callbacks (built in tasks.build)."""
    telemetry = cfg.telemetry
    # Ranks other than 0 show no progress bar: one per job is what a person reads.
    settings = cfg.trainer if ranks.is_main else replace(cfg.trainer, progress=False)
    device_type = settings.device.partition(":")[0]
    sampler = ResourceSampler(telemetry.sample_interval_s, cpu_budget, gpu_for(settings.device),
                              thread_cpu=fetch_cpu_seconds)
    profile_dir = ctx.output_dir / "profile"
    # Profiles are rank 0's: the ranks run the same code, and one trace is what a person reads.
    profiler = StepProfiler(profile_dir, telemetry.profile_steps if ranks.is_main else 0, telemetry.profile_wait,
                            device_type)
    allocations = AllocationSnapshot(profile_dir, telemetry.tracemalloc and ranks.is_main)
    peers = distributed.Collectives(ranks, torch.device(settings.device)) if ranks.distributed else None
    trainer = Trainer(model, optimizer, settings, sampler=sampler, profiler=profiler if profiler.enabled else None,
                      peers=peers, cuda_sync_every=telemetry.cuda_sync_every, **extras)
    return trainer, sampler, profiler, allocations
