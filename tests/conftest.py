"""Shared fixtures: run the real `dlpipe` command in a subprocess against a real MLflow store."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from slurm_cluster import slurm  # noqa: F401  (the session's one-node Slurm cluster, for tests/test_slurm*.py)

TESTS_DIR = Path(__file__).resolve().parent

# MLflow 3 starts a usage-telemetry thread that reports to MLflow's servers; tests talk to
# 127.0.0.1 only, so switch it off here and in every dlpipe subprocess.
NO_PHONE_HOME = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
os.environ.update(NO_PHONE_HOME)

# A test run started in the background by a shell without job control (`nohup .ci/run &`) inherits
# SIGINT ignored, and every dlpipe it starts would too: the Ctrl-C tests would see their signal
# ignored (measured: 3 failures). A handler of ours is reset to the default at exec, so the children
# get Ctrl-C as a terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# -- Test tiers. `pytest -m "not integration"` is the fast tier: everything in this process. A test
# that starts the product's programs (dlpipe, an mlflow server, torchrun) is in the integration tier:
# marked by hand, or here when it takes one of the fixtures that start them. The fast tier refuses
# such a start, so a test cannot slip into it by mistake.
INTEGRATION_FIXTURES = {"dlpipe", "server", "mlflow_server"}
PROGRAMS = {"dlpipe", "mlflow", "torchrun", "srun", "sbatch"}
PROGRAM_ARGS = ("-m dlpipe", "torch.distributed.run", "-m mlflow")


def pytest_collection_modifyitems(items):
    for item in items:
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def starts_a_program(args) -> bool:
    """Whether a subprocess's argv starts dlpipe, an mlflow server or torchrun (also through `sh -c`)."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [os.fsdecode(a) for a in argv]
    joined = " ".join(words)
    return any(Path(w.split()[0] if w.strip() else w).name in PROGRAMS for w in words) or any(
        p in joined for p in PROGRAM_ARGS)


@pytest.fixture(autouse=True)
def fast_tier_stays_in_process(request):
    """Outside the integration tier, starting dlpipe, mlflow or torchrun fails the test, naming the fix."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    real_init = subprocess.Popen.__init__

    def refuse(self, args, *rest, **kwargs):
        if starts_a_program(args):
            raise AssertionError(f"{request.node.nodeid} starts {args!r}: mark it @pytest.mark.integration "
                                 "(the fast tier runs in-process)")
        real_init(self, args, *rest, **kwargs)

    with mock.patch.object(subprocess.Popen, "__init__", refuse):
        yield


@pytest.fixture(scope="session")
def matplotlib_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("matplotlib"))


@pytest.fixture(autouse=True)
def own_measurements(tmp_path_factory, matplotlib_cache, monkeypatch):
    """Every test its own measurement journal (telemetry.measurements_file lives under
    XDG_CACHE_HOME), outside the folder it runs in: what one test measured must never steer another's
    advice, nor the user's. matplotlib keeps its font cache under XDG_CACHE_HOME too: it gets one
    for the session (building it costs a second or two)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
    monkeypatch.setenv("MPLCONFIGDIR", matplotlib_cache)


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory) -> str:
    """One SQLite store for the session (creating one costs seconds); tests use their own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def dlpipe(tmp_path):
    """Run `python -m dlpipe ARGS` in tmp_path (no checkout on the path: the installed package's conf is used)."""

    def run(*args: str, env: dict | None = None, timeout: float = 180, new_session: bool = False
            ) -> subprocess.CompletedProcess:
        """`new_session`: in a process group of its own, which a test's job may signal as a whole."""
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "LOCAL_WORLD"))}
        full_env["PYTHONPATH"] = str(TESTS_DIR)  # for tests/faulty_data.py datasets
        full_env.update(NO_PHONE_HOME)
        full_env.update(env or {})
        return subprocess.run(
            [sys.executable, "-m", "dlpipe", *args], cwd=tmp_path, env=full_env,
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=new_session,
        )

    return run


@pytest.fixture(scope="session")
def mlflow_client(mlflow_store):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow_store)


def epoch_history(client, run_id: str, metric: str) -> list[tuple[int, float]]:
    """(epoch, value) for each value of `metric` (MLflow's name) the run holds, in step order. Epoch
    metrics sit on the optimizer-step axis, at each epoch's last step, where the run's `epoch`
    metric says which epoch it was."""
    epoch_at = {m.step: int(m.value) for m in client.get_metric_history(run_id, "epoch")}
    history = sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)
    return [(epoch_at[m.step], m.value) for m in history]


def epochs_logged(client, run_id: str, metric: str) -> list[int]:
    """The epochs whose value of `metric` the run holds: [1, 2] for a metric logged once per epoch of two."""
    return sorted(epoch for epoch, _ in epoch_history(client, run_id, metric))


def runs_of(client, experiment: str):
    """All runs of an experiment (empty list when the experiment does not exist)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], max_results=1000)
