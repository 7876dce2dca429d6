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


def build_data_and_model(resolved: dict):
    """Dataset splits, model and optimizer; raises ConfigError/DataError naming the bad key."""
    import torch

    from dlpipe.data.split import train_val_split

    trainer = resolved["trainer"]
    device = trainer["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError([f"trainer.device={device}: torch sees no CUDA device (CPU-only build or no driver); use trainer.device=cpu"])
    dataset = _instantiate("dataset", resolved["dataset"])
    train_set, val_set = train_val_split(dataset, trainer["val_fraction"], trainer["seed"])
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
    val = None
    if val_set is not None:
        # Validation never shuffles or drops samples: every run scores the same items.
        lc.update(batch_size=val_batch, shuffle=False, drop_last=False)
        val = build_loader(val_set, **lc, seed=seed, cuda=cuda, role="val")
    return train, val


@contextmanager
def sigterm_ends_run():
    """SIGTERM (Slurm preemption, `kill`, docker stop) raises Terminated so the run ends KILLED."""
    from dlpipe.tracking import Terminated

    def handler(signum, frame):
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
    name = tracking["run_name"] or " ".join([ctx.recipe or "dlpipe", *ctx.overrides])
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

    with open_run(ctx, resolved["tracking"], tags) as tracked, sigterm_ends_run():
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
