"""Deciding where a job starts: fresh, or from the newest readable checkpoint, and whether it fits.

All of this runs before a tracking run is opened, so a missing or unusable checkpoint is a
one-line error with nothing half-made.
"""

import logging
from pathlib import Path

from dlpipe.errors import ConfigError
from dlpipe.training.checkpoint import CheckpointStore

log = logging.getLogger("dlpipe")


def find_start(store: CheckpointStore, policy: str) -> tuple[dict | None, Path | None]:
    """(state, path) to resume from, or (None, None) to start fresh, following checkpoint.resume."""
    for stale in store.clean_stale():
        log.warning("removed %s: a checkpoint save that was interrupted (the previous checkpoint is intact)", stale)
    if policy == "never":
        return None, None
    found = store.load_latest(warn=log.warning)
    if found is None:
        if policy == "must":
            raise ConfigError([f"checkpoint.resume=must: no checkpoint in {store.directory}"])
        log.info("no checkpoint in %s: starting from scratch", store.directory)
        return None, None
    state, path = found
    log.info("resuming from %s (epoch %d, step %d)", path, state["epoch"], state["step"])
    return state, path


def check_model_fits(model, saved: dict, path: Path) -> None:
    """A checkpoint whose parameters do not match the model: name the parameter, not a tensor dump."""
    current = model.state_dict()
    problems = []
    for name, tensor in saved.items():
        if name not in current:
            problems.append(f"checkpoint {path}: parameter '{name}' is not in the model (model config changed?)")
        elif tuple(current[name].shape) != tuple(tensor.shape):
            problems.append(
                f"checkpoint {path}: parameter '{name}' has shape {list(tensor.shape)} there but "
                f"{list(current[name].shape)} in the model (model config changed?)"
            )
    missing = [n for n in current if n not in saved]
    problems += [f"checkpoint {path}: the model's parameter '{n}' is missing from it" for n in missing]
    if problems:
        raise ConfigError(problems)


# Keys that legitimately differ between a run and its resumption: where checkpoints go, how long to
# train, and the loader settings that decide only how fast batches come (which samples a batch holds
# and their random draws depend on seed, epoch and sample index alone), so `dlpipe tune` or loader=auto
# deciding differently on a busier machine changes nothing the run computes.
_EXPECTED_TO_CHANGE = ("checkpoint.", "trainer.epochs", "trainer.max_steps")
LOADER_SPEED_KEYS = frozenset(
    f"loader.{k}" for k in ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "timeout",
                            "multiprocessing_context", "fetch", "worker_method", "tuned_on")
)
# Those that decide which worker fetches a sample: they do change the draws of a dataset that takes
# them from the global RNGs (each worker's are seeded apart).
_WHO_FETCHES = frozenset(f"loader.{k}" for k in ("num_workers", "persistent_workers", "multiprocessing_context",
                                                  "fetch", "worker_method"))


def changes_results(key: str, samples_follow_loader: bool = False) -> bool:
    """Whether another value of `key` changes what a resumed run computes; `samples_follow_loader`: the
    dataset draws from the global RNGs while fetching (dlpipe.loader.worker_method.global_draws)."""
    if key.startswith(_EXPECTED_TO_CHANGE):
        return False
    return key not in LOADER_SPEED_KEYS or (samples_follow_loader and key in _WHO_FETCHES)


def config_changes(saved: dict[str, str], current: dict[str, str],
                   samples_follow_loader: bool = False) -> tuple[list[str], list[str]]:
    """Flattened config keys whose values differ from the checkpoint's: (those that change what the
    run computes, the loader settings that change only its speed)."""
    differ = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    changed = [k for k in differ if changes_results(k, samples_follow_loader)]
    return changed, [k for k in differ if k in LOADER_SPEED_KEYS and k not in changed]


def init_weights(model, source: str) -> Path:
    """Load the model weights of `source` (a checkpoint file, or a checkpoints/ folder: its best.pt,
    else its newest epoch) into `model`; only the weights: optimizer and schedule start fresh.
    Returns the file used. A checkpoint that does not fit the model names the parameter."""
    from dlpipe.training.checkpoint import load

    path = Path(source)
    if path.is_dir():
        store = CheckpointStore(path)
        path = store.best_path if store.best_path.is_file() else next(iter(store.candidates()), None)
        if path is None:
            raise ConfigError([f"checkpoint.init_from={source}: the folder holds no best.pt or epoch-N.pt"])
    state = load(path)
    check_model_fits(model, state["model"], path)
    model.load_state_dict(state["model"])
    log.info("model weights from %s (epoch %s)", path, state.get("epoch", "?"))
    return path
