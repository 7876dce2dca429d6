"""trainer.torch_threads through the real `dlpipe` command: the decision recorded in MLflow with its
reason, and the training step really running with that many torch threads (tests/thread_probe.py's
callback records torch.get_num_threads() after every optimizer step)."""

import json

from conftest import runs_of

TINY = ["+recipe=smoke", "dataset.size=64", "trainer.epochs=1", "trainer.progress=false", "checkpoint.enabled=false"]


def run_recorded(dlpipe, tmp_path, mlflow_store, mlflow_client, experiment: str, *overrides: str,
                 env: dict | None = None):
    """(the run's params and tags, the torch threads the step ran with) of a tiny training run."""
    record = tmp_path / f"{experiment}.json"
    r = dlpipe(*TINY, f"tracking.uri={mlflow_store}", f"tracking.experiment={experiment}",
               "+callbacks.threads._target_=thread_probe.RecordThreads", f"+callbacks.threads.record={record}",
               *overrides, env=env)
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, experiment)
    return {**run.data.params, **run.data.tags}, json.loads(record.read_text()), r.stdout + r.stderr


def test_the_automatic_value_is_recorded_and_used(dlpipe, tmp_path, mlflow_store, mlflow_client, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the dlpipe fixture passes on this process's environment
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    params, seen, log = run_recorded(dlpipe, tmp_path, mlflow_store, mlflow_client, "threads-auto",
                                     "loader.num_workers=2", "loader.worker_method=process")
    budget, device = int(params["cpu.budget"]), params["trainer.device"]
    if device == "cpu":  # the model computes on the training process's threads: the whole budget
        value, why = budget, f"CPU budget {budget}, trainer.device=cpu: the model computes on these threads"
        said = why
    else:  # an accelerator: the workers' CPUs are taken from the budget
        value, why = max(1, budget - 2), f"CPU budget {budget} - 2 worker processes"
        said = f"CPU budget {budget} - 2 workers"  # before the fit decided the workers' method
    assert params["trainer.torch_threads"] == str(value)
    # the param says it in a word (whole in the UI's tables), the tag why
    assert params["auto.trainer.torch_threads"] == f"{value} (auto)"
    assert params["dlpipe.auto.trainer.torch_threads"].startswith(f"{value} (auto: {why}")
    assert "torch's default was" in params["dlpipe.auto.trainer.torch_threads"]
    assert log.count(f"trainer.torch_threads = {value} (auto: {said}") == 1  # with the others, once
    assert seen == [value]


def test_an_explicit_value_is_honoured(dlpipe, tmp_path, mlflow_store, mlflow_client):
    params, seen, _ = run_recorded(dlpipe, tmp_path, mlflow_store, mlflow_client, "threads-mine",
                                   "trainer.torch_threads=3")
    assert (params["trainer.torch_threads"], params["auto.trainer.torch_threads"],
            params["dlpipe.auto.trainer.torch_threads"]) == ("3", "3 (user)", "3 (user override)")
    assert seen == [3]


def test_omp_num_threads_in_the_environment_is_kept(dlpipe, tmp_path, mlflow_store, mlflow_client):
    params, seen, _ = run_recorded(dlpipe, tmp_path, mlflow_store, mlflow_client, "threads-env",
                                   "loader=in_memory", env={"OMP_NUM_THREADS": "1"})
    assert params["dlpipe.auto.trainer.torch_threads"].startswith(
        "1 (auto: OMP_NUM_THREADS=1 in the environment: torch's choice kept")
    assert seen == [1]


def test_a_bad_value_is_one_line(dlpipe):
    r = dlpipe(*TINY, "tracking=none", "trainer.torch_threads=0")
    assert r.returncode == 2
    assert r.stderr.strip() == ("dlpipe: error: trainer.torch_threads=0: must be >= 1 (torch's intra-op threads "
                                "in each training process), or leave it out for the automatic value")
