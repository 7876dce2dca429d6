"""What dlpipe puts in Hydra's ConfigStore: the typed schema (as `base_config`) and the recipes.

Recipes: named presets in recipes/*.yaml (and the user's $DLPIPE_RECIPE_PATH folders).

Hydra names a config group after its folder, and the shipped folder is `recipes/` while the group
is `recipe` (`+recipe=vision`), so the files are read here and stored in the ConfigStore under
group `recipe` at package `_global_`. Hydra then treats them like any other group option: their
defaults lists may override groups, and `+recipe=nope` lists the available names.
"""

from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dlpipe.config.paths import recipe_dirs
from dlpipe.errors import ConfigError
from dlpipe.schema import DlpipeConfig


def find_recipes(dirs: list[Path] | None = None) -> dict[str, Path]:
    """Recipe name -> file; a user's folder may shadow a shipped recipe of the same name."""
    found: dict[str, Path] = {}
    for d in dirs if dirs is not None else recipe_dirs():
        if not d.is_dir():
            raise ConfigError([f"DLPIPE_RECIPE_PATH entry '{d}': not a directory"])
        for f in sorted(d.glob("*.yaml")):
            found[f.stem] = f
    return found


def register_recipes(dirs: list[Path] | None = None) -> dict[str, Path]:
    """Store every recipe in Hydra's ConfigStore; idempotent (a later store overwrites)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    recipes = find_recipes(dirs)
    for name, path in recipes.items():
        try:
            node = OmegaConf.load(path)
        except (OSError, yaml.YAMLError, OmegaConfBaseException) as e:
            # one broken user recipe must not break every dlpipe command: name the file
            raise ConfigError([f"recipe {path}: cannot be read ({str(e).splitlines()[0]})"]) from None
        cs.store(group="recipe", name=name, node=node, package="_global_", provider=str(path.parent))
    return recipes


def register_schemas() -> None:
    """Store the schema in Hydra's ConfigStore (idempotent: the store overwrites by name)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=DlpipeConfig)
