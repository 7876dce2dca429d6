"""MLflow's run context, as mlflow.start_run records it: who ran what, from where. dlpipe makes its
runs with MlflowClient.create_run, which records none of it, so every run (a sweep's parent too)
gets these tags itself; the UI shows them as "Created by" and "Source"."""

import getpass
import subprocess


def context_tags() -> dict[str, str]:
    tags = {"mlflow.user": _user(), "mlflow.source.type": "LOCAL", "mlflow.source.name": "dlpipe"}
    commit = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def _user() -> str:
    """The login name, as MLflow records it (getpass: LOGNAME, USER, then the password database)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container uid with no passwd entry and no USER set
        return "unknown"


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None  # no git on this machine: the tag is optional
    return r.stdout.strip() if r.returncode == 0 else None
