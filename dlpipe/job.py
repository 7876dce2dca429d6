"""One training job, wired from a resolved config: check, build, track, train, report.

Everything a user can get wrong is checked and built *before* a tracking run starts, so a bad
value or an unreadable dataset leaves no half-made MLflow run behind.
"""

import copy
import logging
import os
import signal
import socket
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from dlpipe import hardware
from dlpipe.config.decisions import explain
from dlpipe.config.validation import validate
from dlpipe.errors import ConfigError, DlpipeError

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


def _instantiate(group: str, node: dict, **extra):
    from hydra.utils import instantiate

    try:
        return instantiate(node, **extra)
    except DlpipeError:
        raise
    except Exception as e:  # a user's class may raise anything: name the group and target
        cause = e.__cause__ or e  # Hydra wraps the constructor's exception
        raise ConfigError([f"{group}._target_={node.get('_target_')}: {type(cause).__name__}: {cause}"]) from e


def check_device(device: str) -> None:
    """The requested device must exist here; checked before anything is built or tracked."""
    import torch

    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(["trainer.device=mps: this torch build or machine has no MPS device; use cpu"])
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError([f"trainer.device={device}: torch sees no CUDA device (CPU-only build or no driver); use trainer.device=cpu"])
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError([f"trainer.device={device}: only cuda:0 to cuda:{torch.cuda.device_count() - 1} are visible"])


def check_single_process(environ) -> None:
    """Refuse torchrun/Slurm multi-rank launches until data-parallel training exists: N ranks would
    each train the whole dataset and write to the same output directory."""
    world = environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        raise DlpipeError(f"WORLD_SIZE={world}: dlpipe trains in one process for now; launch it without torchrun")


def validation_view(dataset):
    """The same samples without random augmentation, so every epoch and every sweep job scores
    identical inputs. Applies to datasets with an `augment` attribute (the built-in image ones);
    a shallow copy shares the decoded-once data."""
    if not getattr(dataset, "augment", False):
        return dataset
    plain = copy.copy(dataset)
    plain.augment = False
    return plain


def build_data_and_model(resolved: dict):
    """Dataset splits, model and optimizer; raises ConfigError/DataError naming the bad key."""
    from torch.utils.data import Subset

    from dlpipe.data.split import train_val_split

    trainer = resolved["trainer"]
    check_device(trainer["device"])
    dataset = _instantiate("dataset", resolved["dataset"])
    train_set, val_set = train_val_split(dataset, trainer["val_fraction"], trainer["seed"])
    if val_set is not None:
        val_set = Subset(validation_view(dataset), val_set.indices)
    model_cfg = dict(resolved["model"])
    if model_cfg.get("num_classes", 0) is None:
        if not hasattr(dataset, "num_classes"):
            raise ConfigError([f"model.num_classes=null: {type(dataset).__name__} has no num_classes; set model.num_classes"])
        model_cfg["num_classes"] = int(dataset.num_classes)
    model = _instantiate("model", model_cfg)
    # The model's parameters are the optimizer's first argument, `params`, passed here.
    optimizer = _instantiate("optim", resolved["optim"], params=model.parameters())
    return train_set, val_set, model, optimizer


def build_loaders(resolved: dict, train_set, val_set):
    from dlpipe.data.loader import build_loader

    lc = dict(resolved["loader"])
    val_batch = lc.pop("val_batch_size") or lc["batch_size"]
    cuda = resolved["trainer"]["device"].startswith("cuda")
    seed = resolved["trainer"]["seed"]
    train = build_loader(train_set, **lc, seed=seed, cuda=cuda, role="train")
    if len(train.loader) == 0:
        raise ConfigError([
            f"loader.batch_size={lc['batch_size']} with loader.drop_last={str(lc['drop_last']).lower()}: the training "
            f"split has {len(train_set)} samples, so there is no batch to train on; lower batch_size or set drop_last=false"
        ])
    val = None
    if val_set is not None:
        # Validation never shuffles or drops samples: every run scores the same items. Its workers
        # live only while it runs: persistent ones would sit idle, holding memory, through training.
        lc.update(batch_size=val_batch, shuffle=False, drop_last=False, persistent_workers=False)
        val = build_loader(val_set, **lc, seed=seed, cuda=cuda, role="val")
    return train, val


@contextmanager
def sigterm_ends_run():
    """SIGTERM (Slurm preemption, `kill`, docker stop) raises Terminated so the run ends KILLED.

    Enter it *before* the tracking run so the handler is still in place while the run is ended.
    Only the first SIGTERM interrupts: a second one (schedulers often repeat it) must not break
    into the code that is recording the KILLED status.
    """
    from dlpipe.tracking import Terminated

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def open_run(ctx: JobContext, tracking: dict, tags: dict[str, str]):
    from dlpipe.tracking import MlflowRun, NullRun

    if not tracking["enabled"]:
        return NullRun()
    # Name a run by what distinguishes it: the recipe and the overrides, less the recipe itself and
    # the tracking settings that are the same for every run in the store.
    varied = [o for o in ctx.overrides if not o.lstrip("+~").startswith(("recipe=", "tracking."))]
    name = tracking["run_name"] or " ".join([ctx.recipe or "dlpipe", *varied])
    try:
        return MlflowRun(
            tracking["uri"], tracking["experiment"], name, tags,
            parent_run_id=os.environ.get(PARENT_RUN_ENV) if ctx.multirun else None,
            timeout_s=tracking["request_timeout_s"], retries=tracking["request_retries"],
        )
    except DlpipeError:
        raise
    except Exception as e:  # MLflow raises many types for a bad URI or an unreachable server
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DlpipeError(f"tracking.uri={tracking['uri']}: cannot start an MLflow run ({first}); use tracking=none to train without tracking") from e


def run(ctx: JobContext, raw: dict, resolved: dict) -> float | None:
    """Train one job; returns the last validation loss (for sweepers that minimise it)."""
    check_single_process(os.environ)
    validate(resolved)
    decided = explain(raw, resolved)
    for key, why in decided.items():
        log.info("%s = %s", key, why)

    from dlpipe.console import summary_table
    from dlpipe.runner import Trainer, TrainSettings, seed_everything
    from dlpipe.telemetry import ResourceSampler

    trainer_cfg = resolved["trainer"]
    seed_everything(trainer_cfg["seed"], trainer_cfg["deterministic"])
    train_set, val_set, model, optimizer = build_data_and_model(resolved)
    train_plan, val_plan = build_loaders(resolved, train_set, val_set)
    for plan in (train_plan, val_plan):
        for note in plan.notes if plan else ():
            log.warning(note)

    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    resolved_yaml = yaml.safe_dump(resolved, sort_keys=False)
    (ctx.output_dir / "resolved_config.yaml").write_text(resolved_yaml)

    budget = hardware.cpu_budget()
    params = flatten(resolved)
    params.update(hardware.host_facts(cpu=budget))
    params.update({f"auto.{k}": v for k, v in decided.items()})
    params["loader.batch_bytes_est"] = str(train_plan.batch_bytes)
    params["loader.inflight_bytes_est"] = str(train_plan.inflight_bytes)
    params["model.parameters"] = str(sum(p.numel() for p in model.parameters()))
    tags = {
        "dlpipe.recipe": ctx.recipe or "none",
        "dlpipe.overrides": " ".join(ctx.overrides) or "none",
        "dlpipe.host": socket.gethostname(),
        "dlpipe.output_dir": str(ctx.output_dir),
        "mlflow.source.name": "dlpipe",
    }
    commit = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit

    settings = TrainSettings(**{k: trainer_cfg[k] for k in TrainSettings.__dataclass_fields__})
    device = settings.device
    gpu_index = (int(device.split(":")[1]) if ":" in device else 0) if device.startswith("cuda") else None
    sampler = ResourceSampler(resolved["tracking"]["sample_interval_s"], budget.budget, gpu_index)

    with sigterm_ends_run(), open_run(ctx, resolved["tracking"], tags) as tracked:
        tracked.log_params(params)
        tracked.log_text(resolved_yaml, "config/resolved.yaml")
        sampler.start()
        if sampler.gpu_status.startswith("not available"):
            log.info("GPU metrics %s", sampler.gpu_status)
        try:
            trainer = Trainer(model, optimizer, settings, metrics=tracked, sampler=sampler)
            history = trainer.fit(train_plan.loader, val_plan.loader if val_plan else None)
        finally:
            sampler.stop()
        tracked.set_tags({"dlpipe.gpu_metrics": sampler.gpu_status, "dlpipe.optimizer_steps": str(trainer.step)})

    print(summary_table(history), flush=True)
    if tracked.run_id:
        log.info("MLflow run %s (%s) in %s", tracked.run_id, tracked.status, resolved["tracking"]["uri"])
    return history[-1].get("val_loss") if history else None
