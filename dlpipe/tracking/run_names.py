"""Run names that say what differs, short enough for the MLflow UI's run list, whose name column
(190 px at first in MLflow 3) shows about 18 characters, fewer for a sweep's nested rows.

A sweep's parent names what was swept first (`num_workers=0,2 pin_memory=false,true (sweep smoke)`), so
its jobs are named by their values only, in the parent's order (`2 false`); a single run by its
recipe and overrides (`vision epochs=3 num_workers=8`). A key is shown by its last part unless two
shown keys share it. Where dlpipe ran another value than the one asked for (the job's params hold
`requested.<key>` beside `<key>`, e.g. pin_memory without CUDA), the name says both: `true->false`.
A `_target_` is named by its class's last part (`acc=MulticlassAccuracy`), never its module path.
The full overrides stay in the `dlpipe.overrides` tag.
"""

import json
import os
import re

from dlpipe.redact import redact_overrides, redact_text

SWEPT_KEYS_ENV = "DLPIPE_SWEPT_KEYS"  # the sweep's swept keys (JSON), set by sweeps.callback for its jobs
# Settings that say nothing about the run: how it is printed and where it is tracked.
NOT_NAMED = ("recipe", "trainer.progress", "tracking.", "hydra.")
REQUESTED = "requested."  # + config key: the param of the value asked for, where the job ran another
TARGET = "_target_"
_CLASS_PATH = re.compile(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)\b")  # torchmetrics.classification.X -> X
_FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+)([eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+")  # not an int
LONG_FLOAT = 8  # characters: a value sampled by a search (0.0031622776) is shown to 4 significant digits


def short(overrides: list[str], ran: dict[str, str] | None = None) -> list[str]:
    """`loader.num_workers=2` -> `num_workers=2`, the full key where two of them end alike
    (`model.width=8 dataset.width=8`); secrets masked; values as `value` shows them."""
    overrides = redact_overrides(overrides)
    leaves = [_shown_key(override_key(o)).rpartition(".")[2] for o in overrides]
    shown = []
    for override, leaf in zip(overrides, leaves, strict=True):
        if override.startswith("~"):  # a deletion says so
            shown.append(override)
            continue
        key = leaf if leaves.count(leaf) == 1 else _shown_key(override_key(override))
        shown.append(f"{key}={value(override, ran)}" if "=" in override else override.lstrip("+"))
    return shown


def value(override: str, ran: dict[str, str] | None = None) -> str:
    """The override's value as a name shows it: a class by its last part, a long float to 4
    significant digits, and `asked->ran` where the job's params say dlpipe ran another value."""
    key, _, given = override.lstrip("+~").partition("=")
    # (Hydra hands a sweep's jobs `pin_memory=False` for the `false` its parent was given)
    shown = _CLASS_PATH.sub(r"\1", given) if TARGET in override else _yaml(_short_number(given))
    ran = ran or {}
    if REQUESTED + key in ran and key in ran and ran[key] != ran[REQUESTED + key]:
        return f"{shown}->{_yaml(ran[key])}"
    return shown


def named(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not override_key(o).startswith(NOT_NAMED)]


def job_name(recipe: str | None, overrides: list[str], swept: list[str] | None = None,
             ran: dict[str, str] | None = None) -> str:
    """A sweep job (`swept` given): its swept values, as the parent orders its keys; a run of its
    own: the recipe and its overrides. `ran`: the job's params, where known, for what dlpipe ran."""
    if swept:
        own = [o for o in redact_overrides(overrides) if override_key(o) in swept]
        if own:
            return redact_text(" ".join(value(o, ran) for o in own))
    return redact_text(" ".join([recipe or "dlpipe", *short(named(overrides), ran)]))


def sweep_name(recipe: str | None, overrides: list[str], swept: list[str]) -> str:
    """`num_workers=0,2 (sweep smoke)`: the parent of a sweep over `swept` keys, what it swept first
    (the run list shows about 18 characters of a name: a common prefix would fill them)."""
    shown = short([o for o in overrides if override_key(o) in swept])
    what = f"sweep {recipe or 'dlpipe'}"
    return redact_text(f"{' '.join(shown)} ({what})" if shown else what)


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


def _shown_key(key: str) -> str:
    """`metrics.acc._target_` -> `metrics.acc`: a class is named after the key that holds it."""
    return key.removesuffix("." + TARGET) if key != TARGET else key


def _short_number(text: str) -> str:
    if len(text) > LONG_FLOAT and _FLOAT.fullmatch(text):
        return f"{float(text):.4g}"
    return text


def _yaml(param: str) -> str:
    """Python's spelling (`False`, `None`: params, Hydra's job overrides) as YAML's (`false`, `null`)."""
    return {"True": "true", "False": "false", "None": "null"}.get(param, param)
