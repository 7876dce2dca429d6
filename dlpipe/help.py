"""`dlpipe --version`, and which help page `dlpipe COMMAND --help` shows.

The pages are Hydra help templates in conf/hydra/help/: dlpipe.yaml for `dlpipe --help`, and one per
command that runs through Hydra (bench, tune, eval, plan), each replacing only the header. Hydra
fills in the groups and recipes it finds at that moment (--config-dir and $DLPIPE_RECIPE_PATH
included) and the command-line overrides still apply, which a fixed text printed here could not do.
`dlpipe sync` is not a Hydra app: its help is its argparse parser's.
"""

import platform
from importlib import metadata

from dlpipe import __version__

HELP_FLAGS = ("-h", "--help")

# What a bug report needs beside dlpipe's own version, read from the installed metadata: importing
# torch or mlflow to ask them would cost seconds.
REPORTED = ("torch", "hydra-core", "mlflow")


def version_line() -> str:
    """`dlpipe X.Y.Z (torch A, hydra-core B, mlflow C, Python D)`."""
    found = []
    for dist in REPORTED:
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            found.append(f"{dist} not installed")
    return f"dlpipe {__version__} ({', '.join(found)}, Python {platform.python_version()})"


def help_page(command: str, args: list[str]) -> list[str]:
    """The override that makes Hydra print COMMAND's page (conf/hydra/help/COMMAND.yaml) when ARGS ask
    for help; [] otherwise."""
    return [f"hydra/help={command}"] if set(HELP_FLAGS) & set(args) else []
