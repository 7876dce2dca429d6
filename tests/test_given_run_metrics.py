"""MLFLOW_RUN_ID naming a run that already holds a job's training metrics: refused in one line before
anything is built unless the job resumes that run's checkpoint; a run the user made (empty, or with
metrics of their own) is continued as given."""

import pytest
from conftest import runs_of

FAST = ["+recipe=smoke", "trainer.progress=false"]
pytestmark = pytest.mark.integration


def snapshot(client, run_id: str) -> dict:
    """Everything a later job could change in a run: status, params, tags, each metric's whole history."""
    run = client.get_run(run_id)
    history = {key: sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))
               for key in run.data.metrics}
    return {"status": run.info.status, "params": run.data.params, "tags": run.data.tags, "metrics": history}


def test_a_trained_run_is_continued_only_by_resuming_it(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """A second job given a trained run by MLFLOW_RUN_ID (other overrides, its own folder): exit 2 and
    one line saying why and what to do; not one metric, param or tag of it reaches the run, and no
    other run is made. Resuming the first job's checkpoint, as the line says, continues the run."""
    track = [f"tracking.uri={mlflow_store}", "tracking.experiment=given-trained"]
    first = dlpipe(*FAST, "trainer.epochs=2", *track, "hydra.run.dir=first")
    assert first.returncode == 0, first.stderr
    [run] = runs_of(mlflow_client, "given-trained")
    before = snapshot(mlflow_client, run.info.run_id)

    second = dlpipe(*FAST, "trainer.epochs=2", "optim.lr=0.5", *track, "hydra.run.dir=second",
                    env={"MLFLOW_RUN_ID": run.info.run_id})
    assert second.returncode == 2, second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("dlpipe: error: ")]
    assert errors == [f"dlpipe: error: MLFLOW_RUN_ID={run.info.run_id} (environment variable): the run already "
                      "holds the training metrics of 2 epoch(s); this job starts at step 0, and a metric is never "
                      "logged twice at one step, so all of its metrics would be dropped; to continue it, resume the "
                      f"job that trained it (checkpoint.resume=must hydra.run.dir={tmp_path / 'first'}), or unset "
                      "MLFLOW_RUN_ID for a new run"], second.stderr
    assert "Traceback" not in second.stderr and "epoch 1:" not in second.stdout + second.stderr
    assert snapshot(mlflow_client, run.info.run_id) == before
    assert [r.info.run_id for r in runs_of(mlflow_client, "given-trained")] == [run.info.run_id]
    assert not list((tmp_path / "second").glob("checkpoints/*.pt"))

    resumed = dlpipe(*FAST, "trainer.epochs=3", *track, "checkpoint.resume=must", f"hydra.run.dir={tmp_path / 'first'}",
                     env={"MLFLOW_RUN_ID": run.info.run_id})
    assert resumed.returncode == 0, resumed.stderr
    assert [r.info.run_id for r in runs_of(mlflow_client, "given-trained")] == [run.info.run_id]
    epochs = sorted(m.value for m in mlflow_client.get_metric_history(run.info.run_id, "epoch"))
    assert sorted(set(epochs)) == [1.0, 2.0, 3.0]


def test_a_run_the_user_made_with_metrics_of_their_own_is_continued(dlpipe, mlflow_store, mlflow_client):
    """`mlflow.start_run()` by the user, a metric of their own logged, then dlpipe: the job logs into it."""
    exp = mlflow_client.create_experiment("given-users")
    given = mlflow_client.create_run(exp, run_name="made by the user").info.run_id
    mlflow_client.log_metric(given, "prep_seconds", 3.5)
    mlflow_client.log_metric(given, "system/cpu_utilization_percentage", 12.0)  # MLflow's monitor's name
    r = dlpipe(*FAST, "trainer.epochs=1", f"tracking.uri={mlflow_store}", "tracking.experiment=given-users",
               env={"MLFLOW_RUN_ID": given})
    assert r.returncode == 0, r.stderr
    run = mlflow_client.get_run(given)
    assert run.info.status == "FINISHED" and run.data.metrics["prep_seconds"] == 3.5
    assert "perf/samples_per_s" in run.data.metrics and run.data.metrics["epoch"] == 1
