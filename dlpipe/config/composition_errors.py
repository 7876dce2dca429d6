"""Hydra's composition errors as one line naming the override, the key and what is allowed.

Hydra reports a typo or an unknown option over several lines (plus its config search path); the
CLI asks Hydra to raise instead (HYDRA_FULL_ERROR) and prints what `one_line` makes of it.
"""

import difflib
import re

import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from dlpipe.config.interpolations import unresolved_in_print
from dlpipe.config.store import UNREADABLE, misplaced_recipe, unreadable_recipe
from dlpipe.config.yaml_errors import yaml_problem
from dlpipe.schema import allowed


def _override_for(key: str, overrides: list[str]) -> str:
    """The command-line override that set `key` (the key itself if none did, e.g. in a recipe)."""
    for o in overrides:
        if o.lstrip("+~").split("=", 1)[0] == key:
            return o
    return key


def _allowed_keys(error: OmegaConfBaseException) -> list[str]:
    parent = error.parent_node
    if parent is not None and hasattr(parent, "keys"):
        return sorted(str(k) for k in parent.keys())
    fields = getattr(error.object_type, "__dataclass_fields__", None)
    return sorted(fields) if fields else []


def _unknown_key(error: OmegaConfBaseException, overrides: list[str]) -> str:
    key = error.full_key or str(error.key)
    section, _, name = key.rpartition(".")
    allowed = _allowed_keys(error)
    guess = difflib.get_close_matches(name, allowed, n=1)
    hint = f"did you mean {section + '.' if section else ''}{guess[0]}? " if guess else ""
    where = section or "the config"
    return f"{_override_for(key, overrides)}: no key {name!r} in {where}; {hint}allowed: {', '.join(allowed)}"


_RECIPE = re.compile(r"In 'recipe/([^']+)'")
# Hydra configs that exist only once a plugin is installed, and dlpipe's extra that installs it
_PLUGIN_EXTRAS = {"hydra/launcher/submitit_slurm": "slurm", "hydra/launcher/submitit_local": "slurm",
                  "hydra/sweeper/optuna": "hpo"}
_WITHIN = re.compile(r"In '(hydra/\w+/\w+)'")


def _config_dirs(argv: list[str]) -> list[str]:
    """The folders `--config-dir DIR` (`-cd DIR`, `--config-dir=DIR`) adds to Hydra's search path."""
    dirs = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--config-dir", "-cd"):
            dirs.append(value if eq else argv[i + 1] if i + 1 < len(argv) else "")
    return [d for d in dirs if d]


def one_line(exc: BaseException, overrides: list[str]) -> str | None:
    """A one-line message for a Hydra composition error; None for anything else."""
    if isinstance(exc, yaml.YAMLError):  # a file under --config-dir (or --config-name's) that does not parse
        return yaml_problem(exc)
    plugin = _missing_plugin(exc, overrides)
    if plugin:
        return plugin
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        if group.lstrip("/") == UNREADABLE:  # a recipe whose file is broken (config.store): why, not this stand-in
            return unreadable_recipe(option) or f"recipe={option}: its file cannot be read"
        if group and exc.options:
            return f"{group}={option}: no such {group} option; available: {', '.join(sorted(exc.options))}"
        return str(exc).splitlines()[0]
    if isinstance(exc, OverrideParseException):
        reason = str(exc).splitlines()[0]
        return (f"{exc.override}: not a valid override ({reason}); write key=value, quoting values with "
                "spaces or brackets: 'key=\"a b\"'")
    if isinstance(exc, ValueError) and str(exc).startswith("Only one of --run, --multirun"):
        return f"{str(exc).splitlines()[0]}: --cfg and --info print the config of a single run; drop --multirun"
    if isinstance(exc, InterpolationResolutionError):  # `--cfg job --resolve`: Hydra resolved it
        return unresolved_in_print(exc, overrides)
    if not isinstance(exc, ConfigCompositionException):
        return None
    recipe = _RECIPE.match(str(exc))
    misplaced = misplaced_recipe(recipe.group(1), _config_dirs(overrides)) if recipe else None
    if misplaced:
        return misplaced
    cause = exc.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return _unknown_key(cause, overrides)
    if isinstance(cause, ValidationError):  # a wrong type or null for a typed key: say what it takes
        key = cause.full_key or str(cause.key)
        takes = f"; allowed: {allowed(key)}" if allowed(key) else ""
        return f"{_override_for(key, overrides)}: {str(cause).splitlines()[0]}{takes}"
    lines = str(exc).splitlines()
    if lines and lines[0].startswith("Could not append to config. An item is already at"):
        key = lines[0].rsplit("'", 2)[-2]
        override = _override_for(key, overrides)
        return f"{override}: {key} already exists; drop the + to change it ({override.lstrip('+')})"
    return " ".join(line.strip() for line in lines[:2] if line.strip()) or None


def _missing_plugin(exc: BaseException, overrides: list[str]) -> str | None:
    """`hydra/launcher=slurm` or `hydra/sweeper=optuna` without the Hydra plugin behind it: which extra
    installs it (Hydra says only that a config could not be loaded, or that the option does not exist).
    Named as the user chose it: Hydra names the config that loads the plugin's (slurm for slurm_gpu)."""
    if not isinstance(exc, MissingConfigException) or exc.missing_cfg_file not in _PLUGIN_EXTRAS:
        return None
    missing = exc.missing_cfg_file
    within = _WITHIN.match(str(exc))  # a dlpipe preset built on it: In 'hydra/launcher/slurm': ...
    group, _, option = (within.group(1) if within else missing).rpartition("/")
    chosen = [o.lstrip("+~").partition("=")[2] for o in overrides if o.lstrip("+~").startswith(f"{group}=")]
    option = chosen[-1] if chosen else option
    return (f"{group}={option}: needs the Hydra plugin that provides {missing}, which is not installed; "
            f"pip install 'dlpipe[{_PLUGIN_EXTRAS[missing]}]'")
