"""MLflow tracking: run statuses, async metrics, params limits, and a real `mlflow server` on 127.0.0.1."""

import pytest
from conftest import runs_of
from mlflow_server import free_port, start_server, stop_tree

from dlpipe.errors import DlpipeError
from dlpipe.stop import Terminated
from dlpipe.tracking.run import MAX_PARAM_CHARS, MlflowRun


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` bound to 127.0.0.1; stopped with its children when the module ends."""
    try:
        proc = start_server(tmp_path_factory.mktemp("server"), port := free_port())
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_tree(proc)


def _run(store: str, experiment: str) -> MlflowRun:
    return MlflowRun(store, experiment, "unit", {"dlpipe.test": "1"})


@pytest.mark.parametrize(
    "exc, status, reason",
    [(None, "FINISHED", None), (RuntimeError("boom"), "FAILED", "RuntimeError: boom"),
     (KeyboardInterrupt(), "KILLED", "Ctrl-C"), (Terminated("SIGTERM"), "KILLED", "terminated (SIGTERM)")],
)
def test_run_always_ends_with_an_honest_status(mlflow_store, mlflow_client, exc, status, reason):
    """The context manager ends the run FINISHED, FAILED or KILLED and never swallows the exception."""
    exp = f"status-{status}-{type(exc).__name__}"
    with pytest.raises(type(exc)) if exc else _nothing():
        with _run(mlflow_store, exp) as run:
            run.log_metrics({"x": 1.0}, step=1)
            if exc:
                raise exc
    [stored] = runs_of(mlflow_client, exp)
    assert stored.info.status == status
    assert stored.data.metrics["x"] == 1.0  # the buffer was written before the run ended
    if reason:
        assert reason in stored.data.tags["dlpipe.end_reason"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_many_and_long_params_are_stored(mlflow_store, mlflow_client):
    """More params than one MLflow batch takes, and values over MLflow's length limit, are logged."""
    params = {f"p{i:03d}": i for i in range(250)}
    params["long"] = "x" * (MAX_PARAM_CHARS + 500)
    with _run(mlflow_store, "params") as run:
        run.log_params(params)
    [stored] = runs_of(mlflow_client, "params")
    assert len(stored.data.params) == 251
    assert len(stored.data.params["long"]) == MAX_PARAM_CHARS and stored.data.params["long"].endswith("...")


def test_metrics_are_buffered_until_flush(mlflow_store, mlflow_client):
    """log_metrics only buffers (no store write inside a training step); flush writes them all."""
    with _run(mlflow_store, "buffered") as run:
        run.log_metrics({"loss": 0.5}, step=1)
        assert mlflow_client.get_metric_history(run.run_id, "loss") == []
        run.flush()
        assert [m.value for m in mlflow_client.get_metric_history(run.run_id, "loss")] == [0.5]


def test_metric_history_keeps_every_step(mlflow_store, mlflow_client):
    """Batched logging loses nothing: every step's value is in the store after the run ends."""
    with _run(mlflow_store, "history") as run:
        for step in range(1, 201):
            run.log_metrics({"loss": 1.0 / step}, step=step)
        run_id = run.run_id
    history = mlflow_client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 201))


def test_train_against_real_server(dlpipe, mlflow_server):
    """A run logs params, metrics and its config artifact through a real tracking server over HTTP."""
    from mlflow import MlflowClient

    r = dlpipe("+recipe=smoke", "trainer.progress=false", "trainer.epochs=1",
               f"tracking.uri={mlflow_server}", "tracking.experiment=server")
    assert r.returncode == 0, r.stderr
    client = MlflowClient(tracking_uri=mlflow_server)
    [run] = runs_of(client, "server")
    assert run.info.status == "FINISHED"
    assert {"samples_per_s", "data_wait_frac", "epoch_time_s"} <= set(run.data.metrics)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "config")] == ["config/resolved.yaml"]


def test_unreachable_server_is_a_clear_error(dlpipe):
    """An unreachable tracking server fails fast with one line naming tracking.uri, before training."""
    port = free_port()  # nothing listens there
    r = dlpipe("+recipe=smoke", f"tracking.uri=http://127.0.0.1:{port}", "tracking.request_retries=0",
               timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error: ")]
    assert len(errors) == 1 and f"tracking.uri=http://127.0.0.1:{port}" in errors[0]
    assert "epoch 1/" not in r.stderr  # training never started


def test_deleted_experiment_is_reported(mlflow_store, mlflow_client):
    """Logging into a deleted experiment names it instead of failing inside MLflow."""
    exp_id = mlflow_client.create_experiment("deleted-one")
    mlflow_client.delete_experiment(exp_id)
    with pytest.raises(DlpipeError, match="tracking.experiment=deleted-one"):
        _run(mlflow_store, "deleted-one")
