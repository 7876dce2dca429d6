"""One training job, wired from a resolved config: check, build, track, train, report.

Everything a user can get wrong is checked and built *before* a tracking run starts, so a bad
value or an unreadable dataset leaves no half-made MLflow run behind.
"""

import logging
import os
import signal
import socket
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from dlpipe import hardware
from dlpipe.config.decisions import explain
from dlpipe.config.validation import validate
from dlpipe.errors import ConfigError, DataError, DlpipeError, first_line
from dlpipe.outbox import OUTBOX_FILE, connect_error
from dlpipe.redact import redact_text, redact_tree

log = logging.getLogger("dlpipe")

PARENT_RUN_ENV = "DLPIPE_PARENT_RUN_ID"  # set by callbacks.SweepTracking for the jobs of a sweep


@dataclass(frozen=True)
class JobContext:
    """What Hydra knows about this job, as plain values."""

    output_dir: Path
    overrides: list[str]
    recipe: str | None
    multirun: bool


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{'a': {'b': 1}} -> {'a.b': '1'}: the resolved config as MLflow params."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = "null" if value is None else str(value)
    return out


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None  # no git on this machine: the tag is optional
    return r.stdout.strip() if r.returncode == 0 else None


def check_single_process(environ, task: str) -> None:
    """`dlpipe bench` and `dlpipe tune` measure one process's loader: N ranks would measure N
    copies of it competing for the same CPUs and write the same files."""
    from dlpipe.distributed import ranks_from_env

    ranks = ranks_from_env(environ)
    if ranks.distributed:
        raise DlpipeError(f"WORLD_SIZE={ranks.world}: dlpipe {task} measures one process; run it without torchrun "
                          "(auto_workers already divides the CPUs by LOCAL_WORLD_SIZE when you set it)")


def check_ranks(ranks, ctx: JobContext, device: str, environ, devices: int = 1) -> None:
    """What data-parallel training cannot do, refused before anything starts."""
    if not ranks.distributed:
        if devices > 1:  # the command-line shortcut restarts under torchrun; a config file cannot
            raise ConfigError([f"trainer.devices={devices}: set in a config file, where it cannot start processes; "
                               f"pass trainer.devices={devices} on the command line, or launch with "
                               f"torchrun --nproc_per_node={devices} -m dlpipe ..."])
        return
    if devices > 1 and devices != ranks.local_world:
        raise ConfigError([f"trainer.devices={devices}: this node runs {ranks.local_world} ranks (LOCAL_WORLD_SIZE); "
                           "leave trainer.devices at 1 under your own torchrun"])
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if missing:
        raise DlpipeError(f"WORLD_SIZE={ranks.world} without {', '.join(missing)}: start data-parallel training "
                          f"with torchrun --nproc_per_node={ranks.world} -m dlpipe ..., which sets them all")
    if ctx.multirun and "SUBMITIT_EXECUTOR" not in environ:
        raise DlpipeError(f"--multirun under torchrun (WORLD_SIZE={ranks.world}): every rank would run the whole "
                          "sweep; sweep with hydra/launcher=submitit_slurm (tasks_per_node=N) or run torchrun per job")
    if device.startswith("cuda:"):
        raise ConfigError([f"trainer.device={device}: with {ranks.world} ranks each one takes cuda:LOCAL_RANK; "
                           "use trainer.device=cuda"])
    if device == "mps":
        raise ConfigError([f"trainer.device=mps: data-parallel training ({ranks.world} ranks) needs cpu (gloo) or cuda (NCCL)"])


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@contextmanager
def stop_gracefully(trainer):
    """SIGTERM (Slurm preemption, `kill`, docker stop), SIGINT (Ctrl-C) and SIGUSR1/2 (Slurm's
    advance warning) ask the trainer to stop at its next optimizer step, where the job writes a
    checkpoint and ends the run KILLED.

    A second signal while training stops at once (the loader may be stuck); once the stop is being
    recorded, further signals are ignored so they cannot cut a checkpoint or the run's status short.
    Enter it before the tracking run so it also covers ending the run.
    """
    from dlpipe.data.worker_signals import clear_stop, mark_stop_began
    from dlpipe.tracking import Terminated

    from dlpipe.requeue import submitit_signal

    requeue_signal = submitit_signal()

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if trainer.stopping:
            if signum == requeue_signal:
                # A stop another rank began: this rank's own signal from submitit still means
                # "requeue" (job.train raises Terminated with the latest stop_requested).
                trainer.stop_requested = name
            log.warning("%s ignored: the stop is being recorded", name)
            return
        if trainer.stop_requested is None:
            mark_stop_began()  # workers that got the same signal leave their shutdown to us
            trainer.stop_requested = name
            log.warning("%s received: stopping at the next optimizer step (send it again to stop at once)", name)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(name)

    clear_stop()
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        clear_stop()
        for sig, old in previous.items():
            signal.signal(sig, old)


def open_run(ctx: JobContext, tracking: dict, tags: dict[str, str], resume_run_id: str | None = None):
    from dlpipe.tracking import MlflowRun, NullRun

    if not tracking["enabled"]:
        return NullRun()
    # Name a run by what distinguishes it: the recipe and the overrides, less the recipe itself and
    # the tracking settings that are the same for every run in the store.
    varied = [o for o in ctx.overrides if not o.lstrip("+~").startswith(("recipe=", "tracking."))]
    name = tracking["run_name"] or redact_text(" ".join([ctx.recipe or "dlpipe", *varied]))
    try:
        return MlflowRun(
            tracking["uri"], tracking["experiment"], name, tags,
            parent_run_id=os.environ.get(PARENT_RUN_ENV) if ctx.multirun else None,
            timeout_s=tracking["request_timeout_s"], retries=tracking["request_retries"],
            resume_run_id=resume_run_id, outbox_path=ctx.output_dir / OUTBOX_FILE,
            retry_every_s=tracking["retry_every_s"], offline_wait_s=tracking["offline_wait_s"],
        )
    except DlpipeError:
        raise
    except Exception as e:  # MLflow raises many types for a bad URI or an unreachable server
        raise DlpipeError(f"tracking.uri={redact_text(tracking['uri'])}: cannot start an MLflow run ({redact_text(first_line(e))}); use tracking=none to train without tracking") from e


def check_tracking_reachable(tracking: dict) -> None:
    """Fail in seconds, before anything is built, when the tracking server does not answer."""
    if not tracking["enabled"]:
        return
    why = connect_error(tracking["uri"], tracking["request_timeout_s"])
    if why:
        raise DlpipeError(f"tracking.uri={redact_text(tracking['uri'])}: {why}; start the server, "
                          "point tracking.uri at a running one, or use tracking=none")


def preflight(raw: dict, resolved: dict, task: str) -> dict[str, str]:
    """The checks every task (train, bench, tune) runs before building anything, then the logged
    reasons for each automatic value (returned, for the run's `auto.*` params)."""
    if task != "train":
        check_single_process(os.environ, task)
    validate(resolved)
    check_tracking_reachable(resolved["tracking"])
    decided = explain(raw, resolved)
    for key, why in decided.items():
        log.info("%s = %s", key, why)
    return decided


def fit_workers(raw: dict, resolved: dict, train_set, decided: dict[str, str]) -> None:
    """Automatic workers fitted to the data (build.fit_workers_to_data), logged and recorded."""
    from dlpipe.build import fit_workers_to_data

    fitted = fit_workers_to_data(raw, resolved, train_set)
    if fitted:
        decided["loader.num_workers"] = fitted
        log.info("loader.num_workers = %s", fitted)


def warn_about_loaders(resolved: dict, train_set, plans, cpu_budget: int) -> None:
    """Each loader's build notes, then the pre-flight lint of the training loader."""
    from dlpipe.lint import lint_job

    for plan in plans:
        for note in plan.notes if plan else ():
            log.warning(note)
    for line in lint_job(resolved, len(train_set), plans[0].batch_bytes, cpu_budget):
        log.warning("lint: %s", line)


def run_tags(ctx: JobContext, **extra: str) -> dict[str, str]:
    """Tags every dlpipe run carries (overrides redacted: they may hold a tracking password)."""
    return {
        "dlpipe.recipe": ctx.recipe or "none",
        "dlpipe.overrides": redact_text(" ".join(ctx.overrides)) or "none",
        "dlpipe.host": socket.gethostname(),
        "dlpipe.output_dir": str(ctx.output_dir),
        "mlflow.source.name": "dlpipe",
        **extra,
    }


def gpu_for(device: str) -> int | str | None:
    """The NVML device to sample for a torch device string (None off CUDA)."""
    from dlpipe.gpu import nvml_index

    if not device.startswith("cuda"):
        return None
    return nvml_index(int(device.partition(":")[2] or 0), os.environ)


def out_of_memory_advice(resolved: dict, error: BaseException) -> str:
    """One line for a CUDA OOM: halve the micro-batch and double accumulation, same effective batch."""
    batch, accumulate = resolved["loader"]["batch_size"], resolved["trainer"]["accumulate"]
    first = str(error).splitlines()[0] if str(error) else "CUDA out of memory"
    if batch <= 1:
        return f"{first}: loader.batch_size is already 1; use a smaller model or trainer.amp=bf16"
    return (
        f"{first}: with loader.batch_size={batch} trainer.accumulate={accumulate}, try "
        f"loader.batch_size={batch // 2} trainer.accumulate={accumulate * 2} to keep the effective batch "
        f"of {(batch // 2) * accumulate * 2} samples per optimizer step"
        + ("" if batch % 2 == 0 else f" (was {batch * accumulate})")
    )


def resume_point(store, policy: str, ranks) -> tuple[dict | None, Path | None]:
    """(state, path) to resume from; with several ranks, rank 0 chooses and the others load the
    same file (each rank's own listing of a network filesystem may lag behind)."""
    from dlpipe.checkpoint import load
    from dlpipe.resume import find_start

    if not ranks.distributed:
        return find_start(store, policy)
    from dlpipe import distributed

    start, path = find_start(store, policy) if ranks.is_main else (None, None)
    path = distributed.broadcast(None if path is None else str(path))
    if ranks.is_main or path is None:
        return start, None if path is None else Path(path)
    return load(Path(path)), Path(path)


def record_stop(trainer, reason: str, store, state: dict | None) -> None:
    """Checkpoint an interrupted epoch at its last optimizer step so the same command resumes it."""
    from dlpipe.checkpoint import save_atomic

    epoch = len(trainer.history) + 1
    if trainer.interrupted_at is None:
        log.warning("stopped by %s in epoch %d between optimizer steps (the loader's workers died of the "
                    "signal): resuming starts from the last finished epoch", reason, epoch)
        return
    if store is None:
        log.warning("stopped by %s in epoch %d: checkpoint.enabled=false, nothing saved", reason, epoch)
        return
    # Named after the epoch it is in: it is the newest, and the finished epoch before it stays as
    # the fallback. The next full save of this epoch replaces it.
    path = store.epoch_path(epoch)
    path.parent.mkdir(parents=True, exist_ok=True)  # a stop in the first epoch comes before any save
    save_atomic(state, path)  # not store.save: pruning would count it and drop a finished epoch
    log.warning("stopped by %s in epoch %d after batch %d: saved %s; run the same command to resume",
                reason, epoch, trainer.interrupted_at, path)


def run(ctx: JobContext, raw: dict, resolved: dict) -> float | None:
    """Train one job; returns the last validation loss (for sweepers that minimise it).

    Under torchrun (or a submitit job of several tasks) every rank runs this with the same config:
    each trains on its share of the data, rank 0 alone tracks, checkpoints and reports.
    """
    from dlpipe import distributed

    ranks = distributed.ranks_from_env()
    check_ranks(ranks, ctx, resolved["trainer"]["device"], os.environ, resolved["trainer"]["devices"])
    if ranks.distributed and resolved["trainer"]["device"] == "cuda":
        import torch

        resolved["trainer"]["device"] = distributed.device_for("cuda", ranks, torch.cuda.device_count())
    if not ranks.is_main:
        log.setLevel(logging.WARNING)  # rank 0 says it all once
    decided = preflight(raw, resolved, "train")
    if not ranks.distributed:
        return train(ctx, raw, resolved, decided, distributed.SINGLE)
    distributed.start(ranks, resolved["trainer"]["device"])
    try:
        # Every rank resumes from and reports to rank 0's output directory (the others' own,
        # from their own clock, may differ by a second).
        ctx = replace(ctx, output_dir=Path(distributed.broadcast(str(ctx.output_dir))))
        result = train(ctx, raw, resolved, decided, ranks)
        distributed.barrier()  # no rank tears its connections down while another still uses them
        return result
    finally:
        distributed.stop()


def train(ctx: JobContext, raw: dict, resolved: dict, decided: dict[str, str], ranks) -> float | None:
    import torch

    from dlpipe import distributed

    from dlpipe.build import build_data_and_model, build_loaders
    from dlpipe.checkpoint import CheckpointStore
    from dlpipe.data.faults import explain_loader_failure
    from dlpipe.data.worker_signals import start_helper_processes
    from dlpipe.resume import check_model_fits, config_changes
    from dlpipe.console import summary_table
    from dlpipe.profiling import AllocationSnapshot, StepProfiler
    from dlpipe.rng import seed_everything
    from dlpipe.runner import StopTraining, Trainer, TrainSettings
    from dlpipe.telemetry import ResourceSampler
    from dlpipe.tracking import Terminated
    from dlpipe.verdict import diagnose, rss_slope, run_metrics, worker_leak

    trainer_cfg, telemetry = resolved["trainer"], resolved["telemetry"]
    # Ranks draw different dropout and augmentation; their weights agree (DDP copies rank 0's).
    seed_everything(trainer_cfg["seed"] + ranks.rank, trainer_cfg["deterministic"])
    train_set, val_set, model, optimizer = build_data_and_model(resolved)
    fit_workers(raw, resolved, train_set, decided)
    train_plan, val_plan = build_loaders(resolved, train_set, val_set, ranks.rank, ranks.world)
    budget = hardware.cpu_budget()
    if ranks.is_main:
        warn_about_loaders(resolved, train_set, (train_plan, val_plan), budget.budget)

    shown = redact_tree(resolved)  # what is recorded anywhere; `resolved` itself builds the job
    resolved_yaml = yaml.safe_dump(shown, sort_keys=False)
    if ranks.is_main:
        ctx.output_dir.mkdir(parents=True, exist_ok=True)
        (ctx.output_dir / "resolved_config.yaml").write_text(resolved_yaml)

    config_flat = flatten(shown)
    params = dict(config_flat)
    params.update(hardware.host_facts(cpu=budget))
    params.update({f"auto.{k}": v for k, v in decided.items()})
    params["loader.batch_bytes_est"] = str(train_plan.batch_bytes)
    params["loader.inflight_bytes_est"] = str(train_plan.inflight_bytes)
    params["model.parameters"] = str(sum(p.numel() for p in model.parameters()))
    if ranks.distributed:
        params.update({"dist.world_size": str(ranks.world), "dist.local_world_size": str(ranks.local_world),
                       "dist.global_batch": str(trainer_cfg["accumulate"] * resolved["loader"]["batch_size"] * ranks.world)})
    tags = run_tags(ctx)
    commit = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit

    fields = TrainSettings.__dataclass_fields__
    settings = TrainSettings(**{k: v for k, v in trainer_cfg.items() if k in fields},
                             cuda_sync_every=telemetry["cuda_sync_every"])
    if not ranks.is_main:
        settings = replace(settings, progress=False)
    device_type = settings.device.partition(":")[0]
    sampler = ResourceSampler(telemetry["sample_interval_s"], budget.budget, gpu_for(settings.device))
    profile_dir = ctx.output_dir / "profile"
    # Profiles are rank 0's: the ranks run the same code, and one trace is what a person reads.
    profiler = StepProfiler(profile_dir, telemetry["profile_steps"] if ranks.is_main else 0,
                            telemetry["profile_wait"], device_type)
    allocations = AllocationSnapshot(profile_dir, telemetry["tracemalloc"] and ranks.is_main)
    loader = train_plan.loader
    peers = distributed.Collectives(ranks, torch.device(settings.device)) if ranks.distributed else None
    trainer = Trainer(model, optimizer, settings, sampler=sampler, profiler=profiler if profiler.enabled else None,
                      peers=peers)

    ck = resolved["checkpoint"]
    store = CheckpointStore(Path(ck["dir"]) if ck["dir"] else ctx.output_dir / "checkpoints",
                            ck["keep_last"], ck["monitor"], ck["mode"])
    start, start_path = resume_point(store, ck["resume"], ranks)
    if start is not None:
        check_model_fits(model, start["model"], start_path)
        changed = config_changes(start.get("config", {}), config_flat)
        if changed:
            log.warning("resuming with a changed config: %s", ", ".join(changed))
        own = start.get("ranks") or []
        if ranks.distributed and len(own) == ranks.world:
            start.update(own[ranks.rank])  # this rank's RNG and loader-generator states
        trainer.load_state_dict(start, loader.generator)
        tags["dlpipe.resumed_from"] = f"{start_path} (epoch {start['epoch']})"

    def judge(metrics: dict[str, float]):
        return diagnose(metrics, num_workers=loader.num_workers, cpu_budget=budget.budget,
                        pin_memory=loader.pin_memory, device_type=device_type)

    def checkpoint_state() -> dict:
        """The trainer's state; with several ranks, each rank's random state too (called on every rank)."""
        state = trainer.state_dict(loader.generator)
        if peers is not None:
            state["ranks"] = peers.gather({k: state[k] for k in ("rng", "loader_generator")})
        state.update(mlflow_run_id=tracked.run_id, config=config_flat)
        return state

    def after_epoch(row: dict[str, float]) -> None:
        log.info("epoch %d: %s", int(row["epoch"]), judge(row).line())
        if ck["enabled"]:
            state = checkpoint_state()
            if ranks.is_main:
                store.save(state, int(row["epoch"]), row)

    start_helper_processes(resolved["loader"]["multiprocessing_context"] if loader.num_workers else None)
    resume_run = start.get("mlflow_run_id") if start else None
    tracking = resolved["tracking"] if ranks.is_main else {**resolved["tracking"], "enabled": False}
    with stop_gracefully(trainer), open_run(ctx, tracking, tags, resume_run) as tracked:
        tracked.log_params(params)
        tracked.log_text(resolved_yaml, "config/resolved.yaml")
        sampler.start()
        if sampler.gpu_status.startswith("not available"):
            log.info("GPU metrics %s", sampler.gpu_status)
        allocations.start()
        profiler.start()
        trainer.metrics, trainer.on_epoch = tracked, after_epoch
        if peers is not None:
            peers.barrier()  # start the clocks together: rank 0 took longer, opening the run
        try:
            history = trainer.fit(train_plan.loader, val_plan.loader if val_plan else None)
        except StopTraining as stop:
            trainer.stopping = True
            state = checkpoint_state() if trainer.interrupted_at is not None and ck["enabled"] else None
            if ranks.is_main:
                record_stop(trainer, stop.reason, store if ck["enabled"] else None, state)
            if peers is not None:
                peers.barrier()  # nobody exits (and gets the job torn down) before rank 0 has saved
            if stop.reason == "SIGINT":
                raise KeyboardInterrupt from None
            raise Terminated(trainer.stop_requested or stop.reason) from None
        except torch.cuda.OutOfMemoryError as e:
            raise DlpipeError(out_of_memory_advice(resolved, e)) from e
        except RuntimeError as e:
            if ranks.distributed and distributed.lost_peer(e):
                raise DlpipeError(f"another rank left the job mid-step ({first_line(e)[:200]}); its own error, "
                                  "printed by that rank, is the cause") from e
            why = explain_loader_failure(e, resolved["loader"])
            if why is None:
                raise
            raise DataError(why) from e
        finally:
            for plan in (train_plan, val_plan):
                if plan is not None:
                    plan.loader.shutdown()  # persistent workers end with training, not at exit
            sampler.stop()
            written = profiler.finish() + allocations.finish()  # files stay in the output dir on failure
        for path in written:
            tracked.log_artifact(path, "profile")

        verdict = judge(run_metrics(history))
        end_tags = {"dlpipe.gpu_metrics": sampler.gpu_status, "dlpipe.optimizer_steps": str(trainer.step),
                    "dlpipe.verdict": verdict.kind, "dlpipe.verdict_detail": verdict.line()}
        leak = worker_leak(history, loader.persistent_workers)
        if leak:
            log.warning(leak)
            end_tags["dlpipe.worker_memory"] = leak
        rss = [r["worker_rss_max_mb"] for r in history if "worker_rss_max_mb" in r]
        if len(rss) >= 2:
            tracked.log_metrics({"worker_rss_slope_mb_per_epoch": rss_slope(rss)}, step=len(history))
        tracked.set_tags(end_tags)

    if not ranks.is_main:
        return history[-1].get("val_loss") if history else None
    print(summary_table(history), flush=True)
    print(f"bottleneck: {verdict.line()}", flush=True)
    if tracked.run_id:
        log.info("MLflow run %s (%s) in %s", tracked.run_id, tracked.status, redact_text(resolved["tracking"]["uri"]))
    return history[-1].get("val_loss") if history else None
