"""The MlflowClient every dlpipe process uses: HTTP calls that fail in seconds, a SQLite store opened
by one process at a time and created whole or not at all (tracking.store_lock), MLflow's own output
kept free of URI passwords and of urllib3's retry chatter."""

import logging
import os

from dlpipe.errors import DlpipeError
from dlpipe.redact import redact_logging, redact_text
from dlpipe.tracking.store_lock import create_whole, half_made, is_new, store_opening

# Imported inside functions: mlflow (seconds), only when a client is made or an error read: the CLI (through
# tracking.given_run), the sweep callback and the tracking process import this module before any run opens.


def client_for(uri: str, timeout_s: float, retries: int):
    """An MlflowClient whose HTTP calls fail in seconds, not MLflow's default of minutes."""
    # MLflow reads these when it builds each request session. The config keys decide (each job of
    # a sweep sets its own), rather than whatever an earlier job or the shell left behind.
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(max(timeout_s, 1)))
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(retries)
    if redact_text(uri) != uri:  # MLflow prints "View run ... at: <the URI, password included>"
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    logging.getLogger("alembic").setLevel(logging.WARNING)  # schema migrations of a new SQLite store
    # A full or locked SQLite store is an outage that dlpipe reports in one line (MlflowRun._went_away);
    # MLflow would also print the SQL error's traceback on every refused write.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    # urllib3 warns of every retry ("Retrying (Retry(total=1, ...)) after connection broken"); an
    # outage is said once by dlpipe (MlflowRun._went_away), and a failed request still raises.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    redact_logging(logging.getLogger("mlflow"))  # MLflow's own handler: its records skip the root's filter
    from mlflow import MlflowClient

    with store_opening(uri) as db:  # the client opens (creates, migrates) the store: one process at a time
        if db is not None and is_new(db):
            create_whole(uri, db, _create)
        try:
            return MlflowClient(tracking_uri=uri)
        except Exception as e:
            why = half_made(db, e) if db is not None else None
            if why is None:
                raise
            raise DlpipeError(f"tracking.uri={redact_text(uri)}: {db} is half-made ({why}; a job was killed while it "
                              f"created the store, or another tool was); move it aside (mv {db} {db}.broken) and run "
                              "again to start a new store") from e


def _create(uri: str) -> None:
    """Create (and migrate) the SQLite store of `uri`, and let go of its file."""
    from mlflow import MlflowClient

    # MLflow keeps an engine per URI whose pooled connections stay open on the file, renamed into
    # place by then: a tmpfs could not be unmounted or remounted read-only under them.
    MlflowClient(tracking_uri=uri)._tracking_client.store.engine.dispose()  # no public way to close a store


EXPERIMENT_KIND = "mlflow.experimentKind"
"""The experiment tag the MLflow 3 UI opens by: model training runs, not its GenAI overview."""
MODEL_TRAINING = "custom_model_development"


def _mark_for_training(client, experiment: str) -> None:
    """Tag an existing experiment for model training; a server that lets this user log runs but not
    edit the experiment (some managed ones) only costs the UI's default view, not the run."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_experiment_tag(experiment, EXPERIMENT_KIND, MODEL_TRAINING)
    except MlflowException as e:
        why = redact_text(str(e).splitlines()[0] if str(e) else type(e).__name__)
        logging.getLogger("dlpipe").warning("experiment %s not marked for model training (%s): the MLflow UI "
                                            "may open it on its GenAI view", experiment, why)


def experiment_id(client, name: str) -> str:
    """The experiment's id, made if it is new, marked for model training unless it says its kind."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            raise DlpipeError(f"tracking.experiment={name}: this experiment is deleted; "
                              "restore it or pick another name")
        if EXPERIMENT_KIND not in exp.tags:  # made before dlpipe marked them, or by another tool
            _mark_for_training(client, exp.experiment_id)
        return exp.experiment_id
    try:
        return client.create_experiment(name, tags={EXPERIMENT_KIND: MODEL_TRAINING})
    except Exception:  # another sweep job created it between our lookup and create
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id
