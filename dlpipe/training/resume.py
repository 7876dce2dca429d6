"""Deciding where a job starts: fresh, or from the newest readable checkpoint, and whether it fits.

All of this runs before a tracking run is opened, so a missing or unusable checkpoint is a
one-line error with nothing half-made.
"""

import logging
from pathlib import Path

from dlpipe.errors import ConfigError
from dlpipe.training.checkpoint import CheckpointStore, load

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


def _first(names: list[str], show=repr, few: int = 3) -> str:
    return ", ".join(map(show, names[:few])) + (f", ... ({len(names) - few} more)" if len(names) > few else "")


def check_model_fits(model, saved: dict, path: Path, key: str = "") -> None:
    """A checkpoint whose parameters do not match the model: one line with how many differ and the first
    few of each kind (another model's checkpoint differs in every parameter), not a tensor dump.
    `key`: the setting that named the checkpoint (`checkpoint.init_from=...`), said first."""
    current = model.state_dict()
    foreign = [n for n in saved if n not in current]
    reshaped = [n for n in saved if n in current and tuple(current[n].shape) != tuple(saved[n].shape)]
    missing = [n for n in current if n not in saved]
    if not (foreign or reshaped or missing):
        return
    def shapes(n: str) -> str:
        return f"{n!r} has shape {list(saved[n].shape)} there but {list(current[n].shape)} in the model"

    kinds = []
    if reshaped:
        kinds.append(f"{len(reshaped)} with another shape ({_first(reshaped, shapes)})")
    if foreign:
        kinds.append(f"{len(foreign)} not in the model ({_first(foreign)})")
    if missing:
        kinds.append(f"{len(missing)} of the model's missing from it ({_first(missing)})")
    total = len(foreign) + len(reshaped) + len(missing)
    raise ConfigError([f"{key + ': ' if key else ''}checkpoint {path} does not fit the model, {total} parameters "
                       f"differ: {'; '.join(kinds)}; is it another model's, or did the model config change?"])


# Keys that legitimately differ between a run and its resumption: where checkpoints go, how long to
# train, and the loader settings that decide only how fast batches come (which samples a batch holds
# and their random draws depend on seed, epoch and sample index alone), so `dlpipe tune` or loader=auto
# deciding differently on a busier machine changes nothing the run computes.
_EXPECTED_TO_CHANGE = ("checkpoint.", "sweep.", "trainer.epochs", "trainer.max_steps")
LOADER_SPEED_KEYS = frozenset(
    f"loader.{k}" for k in ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "timeout",
                            "multiprocessing_context", "fetch", "worker_method", "tuned_on")
) | {"trainer.torch_threads"}  # beside the workers: decided from the same budget, and only as fast
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
    path = Path(source)
    if path.is_dir():
        store = CheckpointStore(path)
        path = store.best_path if store.best_path.is_file() else next(iter(store.candidates()), None)
        if path is None:
            raise ConfigError([f"checkpoint.init_from={source}: the folder holds no best.pt or epoch-N.pt"])
    state = load(path)
    check_model_fits(model, state["model"], path, key=f"checkpoint.init_from={source}")
    model.load_state_dict(state["model"])
    log.info("model weights from %s (epoch %s)", path, state.get("epoch", "?"))
    return path
