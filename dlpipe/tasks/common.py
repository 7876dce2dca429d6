"""What every task (train, bench, tune) shares: the job's context, the pre-flight checks, the tracking
run and its tags, and the loader set-up steps that run before anything is measured or trained.

Everything a user can get wrong is checked here, before a tracking run starts, so a bad value or an
unreachable server leaves no half-made MLflow run behind.
"""

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from dlpipe import hardware
from dlpipe.config.decisions import explain
from dlpipe.config.sources import Origin
from dlpipe.config.tracking_checks import env_tags
from dlpipe.config.validation import validate
from dlpipe.errors import DlpipeError, first_line
from dlpipe.redact import redact_logging, redact_overrides, redact_text, redact_tree
from dlpipe.schema import DlpipeConfig, TrackingConfig
from dlpipe.stop import Unbroken
from dlpipe.tracking.context_tags import context_tags
from dlpipe.tracking.given_run import refuse_outside_training
from dlpipe.tracking.outbox import OUTBOX_FILE, connect_error
from dlpipe.tracking.run import PARENT_RUN_ENV

log = logging.getLogger("dlpipe")


@dataclass(frozen=True)
class JobContext:
    """What Hydra knows about this job, as plain values."""

    output_dir: Path
    overrides: list[str]
    recipe: str | None
    multirun: bool
    config_dir: str | None = None  # --config-dir, if given: with the overrides, what a resume repeats
    choices: dict[str, str] = field(default_factory=dict)  # group -> option, as Hydra composed them

    @property
    def origin(self) -> Origin:
        """How the config was composed: what says where each value came from."""
        return Origin(tuple(self.overrides), dict(self.choices), self.config_dir)


def preflight(raw: dict, resolved: dict, task: str, ctx: JobContext) -> tuple[DlpipeConfig, dict[str, str]]:
    """The checks every task runs before building anything: (the typed config, the source of each
    hardware-aware value with the reason for each automatic one, logged here and recorded as the
    run's `auto.*` params)."""
    if task != "train":
        check_single_process(os.environ, task)
    cfg = validate(resolved)
    accept_mlflow_names(cfg)
    check_tracking_reachable(cfg.tracking)
    refuse_outside_training(task, ctx.multirun)  # MLFLOW_RUN_ID continues one training run
    decided = explain(raw, resolved, ctx.origin)
    for key, why in decided.items():
        log.info("%s = %s", key, why)
    return cfg, decided


def accept_mlflow_names(cfg: DlpipeConfig) -> None:
    """A monitored metric may be named as the MLflow UI shows it (`val/loss`, `val/accuracy`): each
    monitor key so named is set to dlpipe's name for it (`val_loss`), and the log says so."""
    from dlpipe.tracking.metric_names import dlpipe_name

    def ours(key: str, name):
        mapped = dlpipe_name(name) if isinstance(name, str) else name
        if mapped != name:
            log.info("%s=%s: MLflow's name of %s", key, name, mapped)
        return mapped

    cfg.checkpoint.monitor = ours("checkpoint.monitor", cfg.checkpoint.monitor)
    stopping = cfg.trainer.early_stopping
    stopping.monitor = ours("trainer.early_stopping.monitor", stopping.monitor)
    if isinstance(cfg.scheduler, dict) and "monitor" in cfg.scheduler:
        cfg.scheduler["monitor"] = ours("scheduler.monitor", cfg.scheduler["monitor"])


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


def prepare_measurement(ctx: JobContext, raw: dict, resolved: dict) -> Measurement:
    """The checks and objects bench and tune share."""
    from dlpipe.loader.threads import fetch_cpu_seconds
    from dlpipe.tasks.build import build_datasets, build_model
    from dlpipe.tasks.loaders import build_loaders
    from dlpipe.telemetry.sampler import ResourceSampler
    from dlpipe.training.rng import seed_everything

    cfg, decided = preflight(raw, resolved, resolved.get("task", "bench"), ctx)
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    train_set, _, dataset = build_datasets(cfg)
    fit_loader(raw, cfg, train_set, decided)
    step = None
    if cfg.bench.mode == "train":  # the measured batches also go through the training step
        step = measured_train_step(cfg, *build_model(cfg, dataset))
    plan, _ = build_loaders(cfg, train_set, None)
    budget = hardware.cpu_budget()
    warn_about_loaders(cfg, train_set, (plan,), budget.budget)
    sampler = ResourceSampler(cfg.telemetry.sample_interval_s, budget.budget, gpu_for(cfg.trainer.device),
                              thread_cpu=fetch_cpu_seconds)
    return Measurement(cfg, train_set, plan, step, sampler, budget, decided)


def measured_train_step(cfg: DlpipeConfig, model, optimizer):
    """bench.mode=train: the training step (forward, loss, backward, optimizer step) each measured
    batch also goes through."""
    import torch

    from dlpipe.tasks.build import build_objective
    from dlpipe.training.batches import to_device

    device = torch.device(cfg.trainer.device)
    model = model.to(device).train()
    objective = build_objective(cfg)

    def step(batch) -> None:
        batch = to_device(batch, device, non_blocking=True)
        objective.loss(*objective.forward(model, batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def check_single_process(environ, task: str) -> None:
    """`dlpipe bench` and `dlpipe tune` measure one process's loader: N ranks would measure N
    copies of it competing for the same CPUs and write the same files."""
    from dlpipe.training.distributed import ranks_from_env

    ranks = ranks_from_env(environ)
    if ranks.distributed:
        raise DlpipeError(f"WORLD_SIZE={ranks.world}: dlpipe {task} measures one process; run it without torchrun "
                          "(auto_workers already divides the CPUs by LOCAL_WORLD_SIZE when you set it)")


def check_tracking_reachable(tracking: TrackingConfig) -> None:
    """Fail in seconds, before anything is built, when the tracking server does not answer."""
    if not tracking.enabled:
        return
    # From here on MLflow and its HTTP libraries may log the URI, password included: the console
    # and the job's log file mask it.
    redact_logging()
    why = connect_error(tracking.uri, tracking.request_timeout_s)
    if why:
        raise DlpipeError(f"tracking.uri={redact_text(tracking.uri)}: {why}; start the server, "
                          "point tracking.uri at a running one, or use tracking=none")


def fit_loader(raw: dict, cfg: DlpipeConfig, train_set, decided: dict[str, str], world: int = 1,
               model=None) -> None:
    """The automatic loader values fitted to the built training split (tasks.loaders.fit_loader_to_data;
    `model` where already built): cfg.loader updated, each new reason logged and recorded."""
    from dlpipe.tasks.loaders import fit_loader_to_data

    cfg.loader, reasons = fit_loader_to_data(raw["loader"], cfg.loader, cfg.trainer.epochs, train_set, world, model)
    for key, why in reasons.items():
        if decided.get(key) != why:  # said once: the resolver's reason stands when it already knew
            decided[key] = why
            log.info("%s = %s", key, why)


def warn_about_loaders(cfg: DlpipeConfig, train_set, plans, cpu_budget: int) -> None:
    """Each loader's build notes, then the pre-flight lint of the training loader."""
    from dlpipe.loader.lint import lint_job

    for note in loader_notes(plans):
        log.warning(note)
    for line in lint_job(cfg, len(train_set), plans[0].batch_bytes, cpu_budget):
        log.warning("lint: %s", line)


def loader_notes(plans) -> list[str]:
    """The loaders' build notes, each said once with the loaders it applies to ('train, val: ...'):
    a setting dropped for both is one change, and a task with only a training loader (bench, tune)
    says the same words as training does."""
    roles: dict[str, list[str]] = {}
    for plan in plans:
        for note in plan.notes if plan else ():
            role, _, text = note.partition(": ")
            roles.setdefault(text, []).append(role)
    return [f"{', '.join(where)}: {text}" for text, where in roles.items()]


def recorded_config(cfg: DlpipeConfig) -> dict:
    """The config as it is recorded anywhere (params, artifacts, checkpoints): secrets masked."""
    return redact_tree(dataclasses.asdict(cfg))


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


def config_params(cfg: DlpipeConfig, plan, decided: dict[str, str], *sections: str) -> dict[str, str]:
    """The config's `sections` as params (secrets masked), with the loader values `plan`'s DataLoader
    got, and `auto.KEY` for each hardware-aware value with its source, as training records them."""
    shown = recorded_config(cfg)
    return {**flatten({key: shown[key] for key in sections}), **loader_params(plan),
            **{f"auto.{key}": why for key, why in decided.items()}}


def loader_params(plan) -> dict[str, str]:
    """A built loader's settings as params: under each loader key the value the DataLoader got (a
    prefetch_factor dropped at 0 workers, pin_memory off without CUDA), and `requested.loader.KEY`
    beside it where the config asked for another value. Logged after the config's params, so these
    win: jobs that asked differently but ran the same loader record the same values."""
    return settings_params({**plan.settings, "fetch": plan.fetch, "worker_method": plan.worker_method},
                           plan.requested)


def job_params(cfg: DlpipeConfig, ranks, train_plan, model) -> dict[str, str]:
    """Params measured from what was built (the training loader's effective settings, loader memory,
    model size, the data-parallel layout)."""
    params = {**loader_params(train_plan), "loader.batch_bytes_est": str(train_plan.batch_bytes),
              "loader.inflight_bytes_est": str(train_plan.inflight_bytes),
              "model.parameters": str(sum(p.numel() for p in model.parameters()))}
    if ranks.distributed:
        params.update({"dist.world_size": str(ranks.world), "dist.local_world_size": str(ranks.local_world),
                       "dist.global_batch": str(cfg.trainer.accumulate * cfg.loader.batch_size * ranks.world)})
    return params


def settings_params(settings: dict, requested: dict) -> dict[str, str]:
    """`loader.KEY` params of the settings a DataLoader got, `requested.loader.KEY` of those asked otherwise."""
    return {**flatten({"loader": settings}), **flatten({"requested": {"loader": requested}})}


def run_tags(ctx: JobContext, **extra: str) -> dict[str, str]:
    """Tags every dlpipe run carries (overrides redacted: they may hold a tracking password)."""
    return {
        **env_tags(),  # MLFLOW_TAGS: the user's, under dlpipe's own
        "dlpipe.recipe": ctx.recipe or "none",
        "dlpipe.overrides": " ".join(redact_overrides(ctx.overrides)) or "none",
        "dlpipe.host": socket.gethostname(),
        "dlpipe.output_dir": str(ctx.output_dir),
        **context_tags(),  # MLflow's own run context: who ran what, from where
        **extra,
    }


def start_tracking(tracking: TrackingConfig):
    """The tracking process (tracking.sidecar), started before the job is built so that importing
    mlflow and opening the store overlap the build; None with tracking off. open_run opens the
    run in it; close() it if the job ends before."""
    if not tracking.enabled:
        return None
    from dlpipe.tracking.sidecar_run import SidecarRun

    return SidecarRun.start(tracking.uri, tracking.request_timeout_s, tracking.request_retries)


def open_run(ctx: JobContext, tracking: TrackingConfig, tags: dict[str, str], resume_run_id: str | None = None,
             sidecar=None):
    """The job's MLflow run (a NullRun with tracking=none), as a context manager that ends it: kept
    in `sidecar` (start_tracking) when given, else in this process."""
    from dlpipe.tracking.null_run import NullRun
    from dlpipe.tracking.run import MlflowRun

    if not tracking.enabled:
        return NullRun()
    from dlpipe.tracking.run_names import job_name, swept_keys_of_parent

    # Named by what distinguishes it (tracking.run_names): in a sweep, its swept values
    swept = swept_keys_of_parent() if ctx.multirun else None
    name = redact_text(tracking.run_name) if tracking.run_name else job_name(ctx.recipe, ctx.overrides, swept)
    args = dict(uri=tracking.uri, experiment=tracking.experiment, run_name=name, tags=tags,
                parent_run_id=os.environ.get(PARENT_RUN_ENV) if ctx.multirun else None,
                timeout_s=tracking.request_timeout_s, retries=tracking.request_retries,
                resume_run_id=resume_run_id, outbox_path=ctx.output_dir / OUTBOX_FILE,
                retry_every_s=tracking.retry_every_s, offline_wait_s=tracking.offline_wait_s,
                marker_dir=ctx.output_dir)
    if sidecar is not None:
        return Unbroken(lambda: sidecar.open(**args))

    def start():
        try:
            return MlflowRun(**args)
        except DlpipeError:
            raise
        except Exception as e:  # MLflow raises many types for a bad URI or an unreachable server
            raise DlpipeError(f"tracking.uri={redact_text(tracking.uri)}: cannot start an MLflow run "
                              f"({redact_text(first_line(e))}); use tracking=none to train without tracking") from e

    return Unbroken(start)  # a stop signal while it opens or ends leaves no run RUNNING


def gpu_for(device: str) -> int | str | None:
    """The NVML device to sample for a torch device string (None off CUDA)."""
    from dlpipe.gpu import nvml_index

    if not device.startswith("cuda"):
        return None
    return nvml_index(int(device.partition(":")[2] or 0), os.environ)
