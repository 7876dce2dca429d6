"""What dlpipe puts in Hydra's ConfigStore: the typed schema (as `base_config`) and the recipes.

Recipes: named presets in recipes/*.yaml (and the user's $DLPIPE_RECIPE_PATH folders).

Hydra names a config group after its folder, and the shipped folder is `recipes/` while the group
is `recipe` (`+recipe=vision`), so the files are read here and stored in the ConfigStore under
group `recipe` at package `_global_`. Hydra then treats them like any other group option: their
defaults lists may override groups, and `+recipe=nope` lists the available names.

A recipe file that cannot be read fails only the commands that compose it, as a broken file under
`--config-dir` does in Hydra (which reads a group's files only when they are chosen): it is stored as
a stand-in that picks an option of UNREADABLE, a group with no options, and the composition error
that follows is reported as the file's own problem (`unreadable_recipe`).
"""

from pathlib import Path

import yaml
from hydra.core.config_store import ConfigStore
from hydra.plugins.config_source import ConfigSource
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dlpipe.config.paths import recipe_dirs
from dlpipe.config.yaml_errors import yaml_problem
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


UNREADABLE = "dlpipe_unreadable_recipe"


def _load(path: Path):
    """The recipe's node, or the line saying why it cannot be used."""
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        return yaml_problem(e)
    except (OSError, UnicodeDecodeError, OmegaConfBaseException) as e:
        return f"recipe {path}: cannot be read ({str(e).splitlines()[0]}); fix or remove the file"
    if not isinstance(node, DictConfig):
        return f"recipe {path}: holds a list, not keys to set; write it as `key: value` lines"
    return node


def register_recipes(dirs: list[Path] | None = None) -> dict[str, Path]:
    """Store every recipe in Hydra's ConfigStore; idempotent (a later store overwrites)."""
    cs = ConfigStore.instance()
    recipes = find_recipes(dirs)
    for name, path in recipes.items():
        node = _load(path)
        if isinstance(node, str):  # composing it fails, naming the file (unreadable_recipe): not every command
            node = OmegaConf.create({"defaults": [f"/{UNREADABLE}/{name}"]})
        cs.store(group="recipe", name=name, node=node, package="_global_", provider=str(path.parent))
    return recipes


def unreadable_recipe(name: str) -> str | None:
    """Why the recipe NAME cannot be used (its file read again), or None once it can."""
    path = find_recipes().get(name)
    problem = _load(path) if path else None
    return problem if isinstance(problem, str) else None


PACKAGE_LINE = "# @package _global_"


def misplaced_recipe(name: str, config_dirs: list[str]) -> str | None:
    """Why the recipe NAME under a `--config-dir` folder (DIR/recipe/NAME.yaml) failed to compose,
    when it is its package: Hydra reads `# @package` only in the comment lines that open a file, and
    without `_global_` there the recipe's keys and group overrides land under `recipe.`, which the
    schema refuses. (Recipes on DLPIPE_RECIPE_PATH are stored at `_global_` whatever they say.)"""
    for folder in config_dirs:
        path = Path(folder).expanduser() / "recipe" / f"{name}.yaml"
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        try:
            package = ConfigSource._get_header_dict(text).get("package")  # Hydra's own reading of the header
        except ValueError:
            package = None
        if package != "_global_":
            return (f"recipe {path}: does not start with `{PACKAGE_LINE}`, so Hydra puts its keys under recipe.; "
                    f"add `{PACKAGE_LINE}` as line 1")
    return None


def register_schemas() -> None:
    """Store the schema in Hydra's ConfigStore (idempotent: the store overwrites by name)."""
    ConfigStore.instance().store(name="base_config", node=DlpipeConfig)
