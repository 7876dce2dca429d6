"""Where to look at a run in the MLflow UI: one line printed at every run's end.

MLflow 3's UI opens on its GenAI workspace (traces, token usage) in a browser that has not chosen
one: the "Model training" toggle is kept in the browser, and the URL's `workflowType` query
parameter sets it. The UI routes inside the page (`/#/experiments/ID/runs` is the run table, read
from MLflow 3.17's bundled JS), so one URL with the experiment's id skips the overview.

With a tracking server the line is that URL; with a local store (SQLite) it is the `mlflow ui`
command that opens the same store from any folder, and the URL it will serve. The experiment's
id is read without importing mlflow (seconds in the training process, which never loads it): from
the SQLite file with the standard library, or by one REST call to the server. A store it cannot
read that way (another database) gets the UI's experiment list instead.
"""

import base64
import json
import os
import shlex
import sqlite3
import urllib.parse
import urllib.request
from pathlib import Path

from dlpipe.redact import redact_text

UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default (its --host and --port)
WORKSPACE = "workflowType=machine_learning"  # the UI's "Model training" workspace, not GenAI
LOOKUP_TIMEOUT_S = 5.0  # the run is over: the line must not hold the job's exit up for long


def where_to_look(uri: str, experiment: str, experiment_id: str | None = None,
                  timeout_s: float = LOOKUP_TIMEOUT_S) -> str:
    """`MLflow UI: URL` for a server, `MLflow UI: mlflow ui --backend-store-uri STORE, then open URL`
    for a local store: URL opens the experiment's run list in the model-training workspace.
    `experiment_id` where known, else looked up by the `experiment` name."""
    scheme = urllib.parse.urlsplit(uri).scheme.lower()
    if scheme in ("http", "https"):
        found = experiment_id or _server_experiment_id(uri, experiment, timeout_s)
        return f"MLflow UI: {without_credentials(uri).rstrip('/')}/{run_list(found)}"
    if scheme.startswith("databricks"):
        return f"MLflow UI: the experiment {experiment} in your Databricks workspace"
    store = local_store_uri(uri)
    found = experiment_id or _sqlite_experiment_id(store, experiment, timeout_s)
    return (f"MLflow UI: mlflow ui --backend-store-uri {shlex.quote(redact_text(store))}, "
            f"then open {UI_URL}/{run_list(found)}")


def run_list(experiment_id: str | None) -> str:
    """The UI's route to an experiment's run table; the experiment list where the id is unknown."""
    if experiment_id is None:
        return f"#/experiments?{WORKSPACE}"
    return f"#/experiments/{urllib.parse.quote(str(experiment_id))}/runs?{WORKSPACE}"


def without_credentials(uri: str) -> str:
    """`https://user:pw@host/x` -> `https://host/x`: a URL to print and to paste into a browser."""
    parts = urllib.parse.urlsplit(uri)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def local_store_uri(uri: str) -> str:
    """The store as `mlflow ui` opens it from any folder: a SQLite file by its absolute path
    (`sqlite:///mlflow.db` is relative to the folder dlpipe ran in); other stores as they are."""
    if not uri.lower().startswith("sqlite:///"):
        return uri
    path, query = _sqlite_path(uri)
    return f"sqlite:///{Path(path).resolve()}" + (f"?{query}" if query else "")


def _sqlite_path(uri: str) -> tuple[str, str]:
    """(file path, query) of `sqlite:///PATH?QUERY`: three slashes then a relative path, four an absolute one."""
    rest = uri[len("sqlite:///"):]
    path, _, query = rest.partition("?")
    return urllib.parse.unquote(path), query


def _sqlite_experiment_id(store: str, experiment: str, timeout_s: float) -> str | None:
    """The id of the experiment named `experiment` in a SQLite store, read-only; None where the
    store is no SQLite file, has no such experiment, or cannot be read now."""
    if not store.lower().startswith("sqlite:///"):
        return None
    path, _ = _sqlite_path(store)
    if not Path(path).is_file():
        return None
    try:
        # read-only: never creates or migrates a store, and waits at most timeout_s for a writer's lock
        db = sqlite3.connect(f"{Path(path).as_uri()}?mode=ro", uri=True, timeout=timeout_s)
        try:
            row = db.execute("SELECT experiment_id FROM experiments WHERE name = ? AND lifecycle_stage = 'active'",
                             (experiment,)).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return None if row is None else str(row[0])


def _server_experiment_id(uri: str, experiment: str, timeout_s: float) -> str | None:
    """The experiment's id from the server's REST API (`experiments/get-by-name`), with the
    credentials MLflow's client would send; None where the server does not answer with one."""
    query = urllib.parse.urlencode({"experiment_name": experiment})
    request = urllib.request.Request(f"{without_credentials(uri).rstrip('/')}/api/2.0/mlflow/experiments/"
                                     f"get-by-name?{query}")
    auth = _authorization(uri)
    if auth:
        request.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            found = json.load(answer).get("experiment", {}).get("experiment_id")
    except (OSError, ValueError, AttributeError):  # refused, timed out, an HTTP error, not MLflow's JSON
        return None
    return str(found) if found is not None else None


def _authorization(uri: str) -> str | None:
    """The Authorization header MLflow's client sends: the URI's user and password, else
    MLFLOW_TRACKING_USERNAME/PASSWORD, else MLFLOW_TRACKING_TOKEN."""
    parts = urllib.parse.urlsplit(uri)
    user = urllib.parse.unquote(parts.username or "") or os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = urllib.parse.unquote(parts.password or "") or os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return f"Bearer {token}" if token else None
