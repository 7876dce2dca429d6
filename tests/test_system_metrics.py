"""MLflow's system-metrics monitor as dlpipe runs it: a run ended before the first sampling
interval ran out still gets its `system/...` samples (MLflow's own monitor drops that window)."""

from dlpipe.tracking.system_metrics import start_system_monitor, stop_system_monitor

SAMPLES = {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"}


def test_a_run_shorter_than_one_interval_gets_its_samples(mlflow_client, mlflow_store, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "3600")  # no window ever runs out
    exp = mlflow_client.create_experiment("system-metrics-short")
    run_id = mlflow_client.create_run(exp).info.run_id
    monitor = start_system_monitor(run_id, resumed=False, tracking_uri=mlflow_store)
    stop_system_monitor(monitor)
    metrics = mlflow_client.get_run(run_id).data.metrics
    assert SAMPLES <= set(metrics)
    assert 0 < metrics["system/system_memory_usage_megabytes"]  # measured, not a placeholder
    [sample] = mlflow_client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert sample.step == 0  # the monitor's own step axis: one sample, the first


def test_a_resumed_run_goes_on_along_the_sample_axis(mlflow_client, mlflow_store, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "3600")
    exp = mlflow_client.create_experiment("system-metrics-resumed")
    run_id = mlflow_client.create_run(exp).info.run_id
    for resumed in (False, True):
        stop_system_monitor(start_system_monitor(run_id, resumed=resumed, tracking_uri=mlflow_store))
    steps = [m.step for m in mlflow_client.get_metric_history(run_id, "system/cpu_utilization_percentage")]
    assert sorted(steps) == [0, 1]
