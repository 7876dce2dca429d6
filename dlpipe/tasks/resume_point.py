"""How a training job picks up again: where it resumes from, the command that resumes it, and the
checkpoint a stop signal leaves behind."""

import logging
import shlex
from pathlib import Path

from dlpipe.errors import ConfigError
from dlpipe.redact import MASK, redact_overrides, redact_text
from dlpipe.tasks.preflight import JobContext
from dlpipe.training import distributed
from dlpipe.training.checkpoint import CheckpointError, CheckpointStore, load, save_atomic
from dlpipe.training.resume import find_start

log = logging.getLogger("dlpipe")


def checkpoint_folder(cfg, ctx: JobContext) -> Path:
    """Where a job keeps its checkpoints: checkpoint.dir, else its output folder's checkpoints/."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else ctx.output_dir / "checkpoints"


def require_checkpoint(cfg, ctx: JobContext) -> None:
    """checkpoint.resume=must where no checkpoint file exists at all: refused before the job is built
    (seconds of imports and data). Files that all turn out unreadable are found when they are loaded."""
    folder = checkpoint_folder(cfg, ctx)
    if cfg.checkpoint.resume == "must" and not CheckpointStore(folder).candidates():
        raise ConfigError([f"checkpoint.resume=must: no checkpoint in {folder}"])


def resume_point(store, policy: str, ranks) -> tuple[dict | None, Path | None]:
    """(state, path) to resume from; with several ranks, rank 0 chooses and the others load the
    same file (each rank's own listing of a network filesystem may lag behind)."""
    if not ranks.distributed:
        return find_start(store, policy)
    start, path = find_start(store, policy) if ranks.is_main else (None, None)
    path = distributed.broadcast(None if path is None else str(path))
    if ranks.is_main or path is None:
        return start, None if path is None else Path(path)
    return load(Path(path)), Path(path)


# A tracking.uri password typed on the command line is not printed: the command reads the URI from
# MLflow's own variable instead, which the user sets with the password (conf/tracking/mlflow.yaml reads it too).
URI_FROM_ENV = "tracking.uri=${oc.env:MLFLOW_TRACKING_URI}"


def _printable(override: str) -> tuple[str, str | None]:
    """(the override as the printed command carries it, what the user must supply for it, if anything)."""
    key, _, value = override.partition("=")
    if key.lstrip("+~") == "tracking.uri" and redact_text(value) != value:
        # (a placeholder such as PASSWORD would be masked as a password by the log's filter all the same)
        return URI_FROM_ENV, f"MLFLOW_TRACKING_URI={redact_text(value)} in the environment, the password for {MASK}"
    [masked] = redact_overrides([override])
    return masked, None if masked == override else f"{key.lstrip('+~')}'s secret in place of {MASK}"


def resume_hint(ctx: JobContext) -> str:
    """The command that continues this job: its config folder and overrides as Hydra recorded them
    (not this process's argv: under a launcher that is submitit's or joblib's), in this job's output
    folder (Hydra's default one is named after the launch time, so the same command would start over
    in a new one), with checkpoint.resume=must (an override `never` would start over and overwrite).
    Secrets are not printed: what to supply for them follows the command (a 401 otherwise)."""
    config = ["--config-dir", ctx.config_dir] if ctx.config_dir else []
    overrides = [o for o in ctx.overrides if not o.lstrip("+~").startswith("checkpoint.resume=")]
    shown, needs = zip(*map(_printable, overrides)) if overrides else ((), ())
    args = [*config, *shown, "checkpoint.resume=must", f"hydra.run.dir={ctx.output_dir}"]
    supply = [n for n in needs if n]
    note = f" (secrets are not printed; supply {', '.join(supply)})" if supply else ""
    return f"resume with: dlpipe {shlex.join(args)}{note}"


def save_stop_checkpoint(trainer, reason: str, store, state: dict | None, hint: str) -> None:
    """Write the interrupted epoch's checkpoint (rank 0), or say why there is none."""
    epoch = len(trainer.history) + 1
    if not trainer.stop.interrupted_epoch:
        log.warning("stopped by %s in epoch %d between optimizer steps (the loader's workers died of the "
                    "signal): resuming starts from the last finished epoch", reason, epoch)
        return
    if store is None:
        log.warning("stopped by %s in epoch %d: checkpoint.enabled=false, nothing saved", reason, epoch)
        return
    # Named after the epoch it is in: it is the newest, and the finished epoch before it stays as
    # the fallback. The next full save of this epoch replaces it.
    path = store.epoch_path(epoch)
    try:
        save_atomic(state, path)  # not store.save: pruning would count it and drop a finished epoch
    except CheckpointError as e:  # a full disk: the stop itself still ends KILLED (a requeue resumes)
        log.error("stopped by %s in epoch %d: %s; resuming starts from the last finished epoch", reason, epoch, e)
        return
    log.warning("stopped by %s in epoch %d after batch %d: saved %s; %s", reason, epoch, trainer.stop.at_batch,
                path, hint)
