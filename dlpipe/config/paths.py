"""Where the shipped YAML lives: inside the package when installed from a wheel, at the top of a checkout otherwise."""

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent

# Users add their own recipes without touching the package: every folder on this path
# (os.pathsep-separated, like PATH) is searched for NAME.yaml after the shipped recipes.
RECIPE_PATH_ENV = "DLPIPE_RECIPE_PATH"


def _shipped(name: str) -> Path:
    # A wheel carries conf/ and recipes/ as dlpipe/conf and dlpipe/recipes (pyproject force-include);
    # a checkout (editable install, or PYTHONPATH) keeps them beside the package, one source of truth.
    inside = _PACKAGE_DIR / name
    if inside.is_dir():
        return inside
    beside = _PACKAGE_DIR.parent / name
    if beside.is_dir():
        return beside
    raise FileNotFoundError(f"dlpipe is installed without its {name}/ folder (looked in {inside} and {beside})")


def conf_dir() -> Path:
    """The folder holding config.yaml and the config groups."""
    return _shipped("conf")


def user_cache_dir() -> str:
    """$XDG_CACHE_HOME, or ~/.cache where it is unset, empty or relative (the XDG spec's rule: an
    empty value must not put the cache at the filesystem's root)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return xdg if os.path.isabs(xdg) else str(Path("~/.cache").expanduser())


def recipe_dirs() -> list[Path]:
    """The shipped recipes folder followed by the user's folders from $DLPIPE_RECIPE_PATH."""
    dirs = [_shipped("recipes")]
    for entry in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep):
        if entry.strip():
            dirs.append(Path(entry).expanduser())
    return dirs
