"""Checks on the tracking section: a URI MLflow can open, an experiment name, sane request limits.

A bad URI used to surface as MLflow's own exception when the run opened, after the data and the
model were built, and an empty experiment name was blamed on the URI. The URI's scheme is checked
here against the stores MLflow ships (and the ones plugins register), without importing mlflow.
Values may come from MLflow's environment variables (conf/tracking/mlflow.yaml reads them): the
message then says so, since the command line shows no such value.
"""

import json
import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from urllib.parse import urlsplit

from dlpipe.redact import redact_text
from dlpipe.schema import TrackingConfig

SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc", "file")
"""The tracking stores MLflow 3 ships (its tracking-store registry); plugins add theirs."""
FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"
ALLOWED = ("allowed: sqlite:///FILE.db, http(s)://HOST[:PORT], postgresql://, mysql://, mssql://, databricks, "
           "or tracking=none")


def _schemes() -> set[str]:
    return {*SCHEMES, *(e.name for e in entry_points(group="mlflow.tracking_store"))}


def _from_env(value: str, variable: str, environ: Mapping[str, str]) -> str:
    """' (from VARIABLE)' when the value is that environment variable's: the command line does not show it."""
    return f" (from the environment variable {variable})" if environ.get(variable) == value else ""


def uri_problem(uri: str, environ: Mapping[str, str]) -> str | None:
    """Why MLflow cannot open `uri` as a tracking store, or None."""
    parts = urlsplit(uri)
    scheme = parts.scheme.split("+", 1)[0].lower()  # postgresql+psycopg2: SQLAlchemy's dialect+driver
    if uri in ("databricks", "databricks-uc", "uc"):
        return None
    if scheme in ("", "file") and environ.get(FILE_STORE_ENV, "").lower() not in ("true", "1"):
        # MLflow 3 refuses its old file store (a bare path is one) unless told to allow it
        what = "a bare word or path" if not scheme else "a file: URI"
        return f"{what} is MLflow's retired file store (allowed only with {FILE_STORE_ENV}=true)"
    if scheme in ("http", "https") and not parts.hostname:
        return f"no host after {parts.scheme}://"
    if scheme and scheme not in _schemes():
        return f"unknown scheme '{parts.scheme}'"
    return None


def check_tracking(c: TrackingConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    p = []
    uri = f"tracking.uri={redact_text(c.uri) or repr('')}{_from_env(c.uri, 'MLFLOW_TRACKING_URI', environ)}"
    if c.enabled and not c.uri:
        p.append(f"{uri}: set a URI (sqlite:///mlflow.db, http://host:5000) or use tracking=none")
    elif c.enabled and uri_problem(c.uri, environ):
        p.append(f"{uri}: {uri_problem(c.uri, environ)}; {ALLOWED}")
    if c.enabled and not c.experiment.strip():
        p.append(f"tracking.experiment={c.experiment!r}{_from_env(c.experiment, 'MLFLOW_EXPERIMENT_NAME', environ)}: "
                 "must be a name (the MLflow experiment the run goes to)")
    if c.request_timeout_s <= 0:
        p.append(f"tracking.request_timeout_s={c.request_timeout_s}: must be > 0")
    if c.request_retries < 0:
        p.append(f"tracking.request_retries={c.request_retries}: must be >= 0")
    if c.retry_every_s <= 0:
        p.append(f"tracking.retry_every_s={c.retry_every_s}: must be > 0")
    if c.offline_wait_s < 0:
        p.append(f"tracking.offline_wait_s={c.offline_wait_s}: must be >= 0")
    if c.enabled and tags_problem(environ.get(TAGS_ENV)):
        p.append(f"{TAGS_ENV}={environ[TAGS_ENV]!r} (environment variable): {tags_problem(environ[TAGS_ENV])}")
    return p


TAGS_ENV = "MLFLOW_TAGS"
"""Extra run tags as a JSON object, as HF Trainer's MLflowCallback reads them."""


def env_tags(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """MLFLOW_TAGS's tags ({} when unset); check_tracking has refused a malformed value already."""
    text = environ.get(TAGS_ENV)
    return {str(k): str(v) for k, v in json.loads(text).items()} if text and not tags_problem(text) else {}


def tags_problem(text: str | None) -> str | None:
    """Why MLFLOW_TAGS is not a JSON object of tags, or None (also when unset)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e}); allowed: a JSON object such as '{{\"team\": \"vision\"}}'"
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float, bool)) for v in value.values()):
        return "must be a JSON object of names to strings or numbers, such as '{\"team\": \"vision\"}'"
    return None
