"""Run names that say what differs, short enough for the MLflow UI's run list, which cuts a name to
its first twenty-odd characters: a sweep's job is named by its swept values only
(`num_workers=2 pin_memory=true`), its parent by what was swept (`sweep smoke: num_workers=0,2`),
a single run by its recipe and overrides. A key is shown by its last part unless two shown keys
share it. The full overrides stay in the `dlpipe.overrides` tag.
"""

import json
import os

from dlpipe.redact import redact_overrides, redact_text

SWEPT_KEYS_ENV = "DLPIPE_SWEPT_KEYS"  # the sweep's swept keys (JSON), set by sweeps.callback for its jobs
# Settings that say nothing about the run: how it is printed and where it is tracked.
NOT_NAMED = ("recipe", "trainer.progress", "tracking.", "hydra.")


def short(overrides: list[str]) -> list[str]:
    """`loader.num_workers=2` -> `num_workers=2`, the full key where two of them end alike
    (`model.width=8 dataset.width=8`); secrets masked."""
    overrides = redact_overrides(overrides)
    leaves = [override_key(o).rpartition(".")[2] for o in overrides]
    shown = []
    for override, leaf in zip(overrides, leaves, strict=True):
        _, eq, value = override.partition("=")
        if override.startswith("~"):  # a deletion says so
            shown.append(override)
        else:
            shown.append(f"{leaf}{eq}{value}" if leaves.count(leaf) == 1 else override.lstrip("+"))
    return shown


def named(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not override_key(o).startswith(NOT_NAMED)]


def job_name(recipe: str | None, overrides: list[str], swept: list[str] | None = None) -> str:
    """A sweep job (`swept` given): its swept values; a run of its own: the recipe and its overrides."""
    if swept:
        own = [o for o in overrides if override_key(o) in swept]
        if own:
            return redact_text(" ".join(short(own)))
    return redact_text(" ".join([recipe or "dlpipe", *short(named(overrides))]))


def sweep_name(recipe: str | None, overrides: list[str], swept: list[str]) -> str:
    """`sweep smoke: num_workers=0,2`: the parent of a sweep over `swept` keys."""
    shown = short([o for o in overrides if override_key(o) in swept])
    return redact_text(f"sweep {recipe or 'dlpipe'}" + (": " + " ".join(shown) if shown else ""))


def swept_keys_of_parent() -> list[str] | None:
    """The swept keys the sweep's parent handed its jobs, or None outside a sweep."""
    text = os.environ.get(SWEPT_KEYS_ENV)
    try:
        keys = json.loads(text) if text else None
    except ValueError:
        return None
    return keys if isinstance(keys, list) else None


def override_key(override: str) -> str:
    """`+loader.pin_memory=true` -> `loader.pin_memory`: the config key, as params name it."""
    return override.partition("=")[0].lstrip("+~")
