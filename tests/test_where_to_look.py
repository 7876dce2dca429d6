"""The line every run's end prints (tracking/where_to_look.py): the `mlflow ui` command for a local
store and the URL of the experiment's run list in the model-training workspace, checked against a
real `mlflow ui` and a real `mlflow server` on 127.0.0.1 and the UI routes they serve."""

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request

import pytest
from mlflow_server import free_port, start_server, stop_tree

from dlpipe.tracking.where_to_look import UI_URL, where_to_look, without_credentials

RUN_LIST = re.compile(r"(?P<base>\S+)/#/experiments/(?P<id>\d+)/runs\?workflowType=machine_learning$")


def local_line(line: str) -> tuple[str, str]:
    """(the `mlflow ui` command, the URL) of a local store's line."""
    command, _, url = line.removeprefix("MLflow UI: ").partition(", then open ")
    return command, url


def made_experiment(uri: str, name: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri).create_experiment(name)


def test_a_local_store_is_named_by_its_absolute_path_with_the_url_of_its_run_list(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # sqlite:///mlflow.db is relative to the folder dlpipe ran in
    # made through the absolute path: MLflow caches a store by its URI, and a relative one made in another
    # test's folder would still point there
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    other = made_experiment(store, "other")
    wanted = made_experiment(store, "mine")
    command, url = local_line(where_to_look("sqlite:///mlflow.db", "mine"))
    assert shlex.split(command) == ["mlflow", "ui", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    match = RUN_LIST.fullmatch(url)
    assert match and match["base"] == UI_URL and match["id"] == wanted != other


def test_an_experiment_the_store_lacks_gets_the_experiment_list(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    made_experiment(uri, "there")
    assert where_to_look(uri, "not there").endswith(f"{UI_URL}/#/experiments?workflowType=machine_learning")
    assert not (tmp_path / "absent.db").exists()
    where_to_look(f"sqlite:///{tmp_path / 'absent.db'}", "x")
    assert not (tmp_path / "absent.db").exists()  # read-only: looking never makes a store


def test_credentials_never_reach_the_printed_line():
    assert without_credentials("https://alice:s3cret@mlflow.example:8443/prefix/") == \
        "https://mlflow.example:8443/prefix/"
    line = where_to_look("https://alice:s3cret@mlflow.example:8443", "e", experiment_id="7")
    assert line == "MLflow UI: https://mlflow.example:8443/#/experiments/7/runs?workflowType=machine_learning"
    line = where_to_look("postgresql://bob:pw@db/mlflow", "e")
    assert "pw" not in line and "postgresql://bob:***@db/mlflow" in line


def test_a_server_that_does_not_answer_gets_the_experiment_list_in_time():
    port = free_port()  # nothing listens there
    line = where_to_look(f"http://127.0.0.1:{port}", "e", timeout_s=2)
    assert line == f"MLflow UI: http://127.0.0.1:{port}/#/experiments?workflowType=machine_learning"


def ui_bundle(base: str) -> str:
    """The JS the UI's page loads (its routes live there: the page routes after `#`)."""
    with urllib.request.urlopen(base + "/", timeout=10) as page:
        html = page.read().decode()
    [script] = re.findall(r'<script[^>]+src="([^"]+main[^"]*\.js)"', html)
    with urllib.request.urlopen(f"{base}/{script}", timeout=30) as js:
        return js.read().decode()


def assert_ui_serves_the_run_list(base: str, experiment_id: str, name: str) -> None:
    """The page at `base` is MLflow's UI, whose routes include the experiment's run table and which
    reads the workspace from the URL; the server holds the experiment under that id."""
    bundle = ui_bundle(base)
    assert '"/experiments/:experimentId/runs"' in bundle
    assert 'get("workflowType")' in bundle and 'MACHINE_LEARNING="machine_learning"' in bundle
    with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get?experiment_id={experiment_id}",
                                timeout=10) as answer:
        assert json.load(answer)["experiment"]["name"] == name


@pytest.mark.integration
def test_the_server_url_opens_the_experiments_run_list(tmp_path):
    proc = start_server(tmp_path, port := free_port())
    try:
        uri = f"http://127.0.0.1:{port}"
        made_experiment(uri, "first")
        wanted = made_experiment(uri, "dlpipe")
        match = RUN_LIST.fullmatch(where_to_look(uri + "/", "dlpipe").removeprefix("MLflow UI: "))
        assert match and match["base"] == uri and match["id"] == wanted
        assert_ui_serves_the_run_list(uri, wanted, "dlpipe")
    finally:
        stop_tree(proc)


@pytest.mark.integration
def test_the_printed_mlflow_ui_command_opens_the_store_from_another_folder(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    store = f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"  # absolute: MLflow caches a store by its URI
    made_experiment(store, "first")
    wanted = made_experiment(store, "dlpipe")
    command, url = local_line(where_to_look("sqlite:///mlflow.db", "dlpipe"))
    argv = shlex.split(command)
    argv[0] = os.path.join(os.path.dirname(sys.executable), "mlflow")
    port = free_port()  # the test's own port, not the default the line names
    proc = subprocess.Popen([*argv, "--port", str(port)], cwd=tmp_path / "elsewhere", stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(base, proc)
        match = RUN_LIST.fullmatch(url)
        assert match and match["base"] == UI_URL and match["id"] == wanted
        assert_ui_serves_the_run_list(base, wanted, "dlpipe")
    finally:
        stop_tree(proc)
    assert not (tmp_path / "elsewhere" / "mlflow.db").exists()  # it opened the store it was told, made none


def wait_for_health(base: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)  # not listening yet
    raise AssertionError(f"mlflow ui did not answer on {base}")
