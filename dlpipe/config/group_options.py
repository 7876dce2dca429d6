"""A group option is a name, never a path: `dataset=../../x` (or `dataset=/abs/x`) would make Hydra
load `dataset/../../x.yaml`, any YAML file on disk, and build the `_target_` it names.

A nested option (`model=vision/resnet`, DIR/model/vision/resnet.yaml) stays inside its group and is
allowed. Checked on the command line before Hydra composes anything; your own options go in
`--config-dir DIR` as DIR/GROUP/NAME.yaml (recipes as DIR/recipe/NAME.yaml or on $DLPIPE_RECIPE_PATH).
"""

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException

from dlpipe.config.paths import conf_dir
from dlpipe.config.store import find_recipes
from dlpipe.errors import ConfigError

CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def _leaves_the_group(option: str) -> bool:
    """Whether Hydra would read the option's file outside GROUP/ (`../x`, `/abs/x`); a nested option
    (`vision/resnet`: GROUP/vision/resnet.yaml) stays inside and is Hydra's own feature."""
    return option.startswith(("/", "~")) or "\\" in option or ".." in option.split("/")


def _config_dir(args: list[str]) -> Path | None:
    """--config-dir DIR (or --config-dir=DIR, -cd DIR) as given on the command line."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_DIR_FLAGS:
            return Path(value) if eq else Path(args[i + 1]) if i + 1 < len(args) else None
    return None


def _groups(roots: list[Path]) -> set[str]:
    """Every config group (a folder of YAML files, `hydra/launcher` included) under the roots."""
    return {f.parent.relative_to(root).as_posix() for root in roots if root.is_dir() for f in root.rglob("*.yaml")
            if f.parent != root}


def _options(group: str, roots: list[Path]) -> list[str]:
    names = {f.stem for root in roots for f in (root / group).glob("*.yaml")}
    if group == "recipe":
        names |= set(find_recipes())
    return sorted(names) + (["Hydra's own"] if group.startswith("hydra/") else [])  # its plugins' options


def _chosen(override) -> list[str]:
    """The option names an override picks: one, or each of a sweep's (`dataset=a,b`, choice(...))."""
    if override.is_sweep_override():
        try:
            return list(override.sweep_string_iterator())
        except HydraException:  # a glob or interval sweep: no names to enumerate here, Hydra expands them
            return []
    value = override.value()
    return [value] if isinstance(value, str) else []


def refuse_paths_as_options(args: list[str]) -> None:
    """Raise ConfigError naming the first `GROUP=OPTION` override whose option holds a path separator
    or `..`, with the group's options; overrides that do not parse are left to Hydra's own error."""
    config_dir = _config_dir(args)
    roots = [conf_dir(), *([config_dir] if config_dir else [])]
    groups = _groups(roots) | {"recipe"}
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except OverrideParseException:
        return
    for override in overrides:
        group = override.key_or_group
        bad = [o for o in _chosen(override) if _leaves_the_group(o)]
        if group in groups and bad:
            raise ConfigError([f"{override.input_line}: a {group} option is a name, not a path ({bad[0]}); allowed: "
                               f"{', '.join(_options(group, roots))}; for a file of your own use --config-dir DIR "
                               f"with it at DIR/{group}/NAME.yaml"])
