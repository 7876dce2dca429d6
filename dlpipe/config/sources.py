"""Where a config value came from: a user override, the recipe, a config option, or a resolver.

Hydra composes in a fixed order (the schema, each group's option, the recipe, then the command
line), so the last of these that sets a key is its source. The group choices and the overrides are
Hydra's record of the job (HydraConfig runtime.choices, overrides.task); the recipe's own keys and
the groups it picks are read from its file.
"""

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml

from dlpipe.config.paths import conf_dir
from dlpipe.config.store import find_recipes
from dlpipe.loader import policy


@dataclass(frozen=True)
class Origin:
    """What Hydra knows about how this job's config was composed."""

    overrides: tuple[str, ...] = ()
    choices: dict[str, str] = field(default_factory=dict)
    """group -> chosen option (Hydra's runtime.choices), the recipe included."""
    config_dir: str | None = None
    """--config-dir: its group folders hold options (and recipe/ recipes) of the user's own."""

    @cached_property
    def overridden(self) -> dict[str, str]:
        """Override key (`loader.num_workers`, `loader`, `+recipe` as `recipe`) -> its value as typed."""
        out = {}
        for override in self.overrides:
            key, sep, value = override.partition("=")
            if sep:
                out[key.lstrip("+~").removeprefix("override ").strip()] = value
        return out

    @cached_property
    def recipes(self) -> list[tuple[str, dict]]:
        """(name, content) of the recipe and of the recipes it builds on (`/recipe/NAME` in its
        defaults), the recipe itself first: its own keys win over theirs. Empty without a recipe;
        a file that cannot be found is left out."""
        chain, todo = [], [self.choices.get("recipe")]
        while todo:
            name = todo.pop(0)
            path = recipe_file(name, self.config_dir) if name and name not in dict(chain) else None
            if path is None:
                continue
            node = yaml.safe_load(path.read_text()) or {}
            chain.append((name, node))
            todo += [included for entry in node.get("defaults") or () if (included := _included_recipe(entry))]
        return chain

    def source(self, key: str, raw_value=None) -> str:
        """Where the value of `key` (dotted) came from, in words: `auto` for a resolver (its reason
        is the resolver's to give), `user override`, `recipe NAME`, or `config option GROUP=NAME,
        chosen by ...` (a value the option file sets, or the schema's default it keeps)."""
        if is_resolver(raw_value):
            return "auto"
        if key in self.overridden:
            return "user override"
        recipe = next((name for name, node in self.recipes if _has(node, key)), None)
        if recipe:
            return f"recipe {recipe}"
        group = key.partition(".")[0]
        option = self.choices.get(group)
        if option is None:
            return "the schema's default"  # a key of no group (task, batch, metrics)
        path = option_file(group, option, self.config_dir)
        mine = self.config_dir and path and path.parents[1] == Path(self.config_dir)
        where = f" from --config-dir {self.config_dir}" if mine else ""
        # An option that leaves the key keeps dlpipe/schema.py's default: said, so nobody looks for it in the file.
        kept = "" if self.option_sets(group, option, key.partition(".")[2]) else ", which keeps the schema's default"
        return f"config option {group}={option}{where}, chosen by {self.chooser(group)}{kept}"

    def option_sets(self, group: str, option: str, key: str) -> bool:
        """Whether the option's file, or an option of the group it builds on (loader=padded on
        in_memory), sets `key`; True when the file cannot be found (the option gets the credit)."""
        path = option_file(group, option, self.config_dir)
        if path is None:
            return True
        node = yaml.safe_load(path.read_text()) or {}
        if _has(node, key):
            return True
        bases = (d for d in node.get("defaults") or () if isinstance(d, str) and d != "_self_")
        return any(option_file(group, base, self.config_dir) and self.option_sets(group, base, key) for base in bases)

    def chooser(self, group: str) -> str:
        """Who picked the group's option: the user, the recipe (its defaults list), or the defaults."""
        if group in self.overridden:
            return "the user"
        for recipe, node in self.recipes:
            picked = (next(iter(entry)) for entry in node.get("defaults") or () if isinstance(entry, dict))
            if any(name.removeprefix("override ").strip().lstrip("/") == group for name in picked):
                return f"recipe {recipe}"
        return "default"


def _included_recipe(entry) -> str | None:
    """The recipe a defaults entry pulls in (`/recipe/tabular` or `{/recipe: tabular}`), else None."""
    if isinstance(entry, str):
        group, _, name = entry.strip().lstrip("/").partition("/")
        return name if group == "recipe" and name else None
    if isinstance(entry, dict) and len(entry) == 1:
        [(group, name)] = entry.items()
        return name if str(group).removeprefix("override ").strip().lstrip("/") == "recipe" else None
    return None


def is_resolver(raw_value) -> bool:
    """Whether a value before interpolation is one of dlpipe's automatic resolvers."""
    resolvers = {*policy.AUTO_RESOLVERS.values(), "auto_device", "auto_amp"}
    return any(policy.is_auto(raw_value, name) for name in resolvers)


def option_file(group: str, option: str, config_dir: str | None) -> Path | None:
    """The file of `GROUP=OPTION`: --config-dir's first, as Hydra searches them, then conf/."""
    roots = [Path(config_dir)] if config_dir else []
    return next((f for root in [*roots, conf_dir()] if (f := root / group / f"{option}.yaml").is_file()), None)


def recipe_file(name: str, config_dir: str | None) -> Path | None:
    """The file `+recipe=NAME` composed: --config-dir's recipe/ folder first, as Hydra searches it,
    then $DLPIPE_RECIPE_PATH and the shipped recipes/."""
    if config_dir and (Path(config_dir) / "recipe" / f"{name}.yaml").is_file():
        return Path(config_dir) / "recipe" / f"{name}.yaml"
    return find_recipes().get(name)


def _has(tree: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True
