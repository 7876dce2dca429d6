"""MLflow tracking: run statuses, async metrics, params limits, and a real `mlflow server` on 127.0.0.1."""

import json
import urllib.request

import pytest
from conftest import runs_of
from mlflow_server import free_port, start_server, stop_tree

from dlpipe.errors import DlpipeError
from dlpipe.stop import Terminated
from dlpipe.tracking.outbox import MAX_PARAM_CHARS
from dlpipe.tracking.run import MlflowRun


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


def rest(server: str, endpoint: str, body: dict | None = None) -> dict:
    """MLflow's REST API, as the UI calls it: GET with a query, or POST with a JSON body."""
    if body is None:
        with urllib.request.urlopen(f"{server}/api/2.0/mlflow/{endpoint}", timeout=30) as r:
            return json.load(r)
    request = urllib.request.Request(f"{server}/api/2.0/mlflow/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)


def test_a_sweep_reads_at_a_glance_in_what_the_ui_shows(dlpipe, mlflow_server):
    """A 4-job sweep through a real server, read back through the REST API the UI reads: the
    experiment opens on training runs; short names say what differs (the parent what was swept);
    children nest under the parent; descriptions hold the comparison and each verdict; metric names
    fall into chart sections, the parent's apart; the dataset is each run's input."""
    r = dlpipe("--multirun", "+recipe=smoke", "trainer.progress=false", "trainer.epochs=1", "loader.num_workers=0,1",
               "loader.batch_size=16,32", f"tracking.uri={mlflow_server}", "tracking.experiment=ui")
    assert r.returncode == 0, r.stderr
    exp = rest(mlflow_server, "experiments/get-by-name?experiment_name=ui")["experiment"]
    assert {t["key"]: t["value"] for t in exp["tags"]}["mlflow.experimentKind"] == "custom_model_development"
    runs = rest(mlflow_server, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 50})["runs"]
    tags = {run["info"]["run_id"]: {t["key"]: t["value"] for t in run["data"]["tags"]} for run in runs}
    [parent] = [run for run in runs if tags[run["info"]["run_id"]].get("dlpipe.role") == "sweep"]
    children = [run for run in runs if run is not parent]
    assert parent["info"]["run_name"] == "num_workers=0,1 batch_size=16,32 (sweep smoke)"
    assert sorted(c["info"]["run_name"] for c in children) == ["0 16", "0 32", "1 16", "1 32"]
    assert {tags[c["info"]["run_id"]]["mlflow.parentRunId"] for c in children} == {parent["info"]["run_id"]}
    assert all(tags[run["info"]["run_id"]]["mlflow.source.name"] == "dlpipe" for run in runs)  # the UI's Source
    assert all(run["info"]["status"] == "FINISHED" for run in runs)
    assert tags[parent["info"]["run_id"]]["mlflow.note.content"].startswith("**Best val_loss: ")
    assert all(tags[c["info"]["run_id"]]["mlflow.note.content"].startswith("**Bottleneck:** ") for c in children)
    # a best and a fastest job only where the sweep's noise allows one: their metrics likewise
    assert {m["key"] for m in parent["data"].get("metrics", [])} <= {"sweep/best_val_loss", "sweep/best_samples_per_s"}
    for child in children:
        sections = {m["key"].partition("/")[0] for m in child["data"]["metrics"] if m["key"] != "epoch"}
        # contention/ where this kernel gives the figures (PSI, schedstat, /proc/stat)
        # none under system/, which MLflow's UI charts against wall-clock time as its own system metrics
        assert {"train", "val", "perf", "loader", "resources"} <= sections <= {
            "train", "val", "perf", "loader", "resources", "contention"}, sections
        contexts = [i["tags"][0]["value"] for i in child["inputs"]["dataset_inputs"]]
        assert sorted(contexts) == ["train", "validation"]
    files = rest(mlflow_server, f"artifacts/list?run_id={children[0]['info']['run_id']}&path=config")["files"]
    assert [f["path"] for f in files] == ["config/resolved.yaml"]


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
