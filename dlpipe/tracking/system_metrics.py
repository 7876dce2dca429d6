"""MLflow's own system-metrics monitor on a dlpipe run (`tracking.system_metrics`), with one change:
the run's last samples are published at its end.

MLflow's monitor samples, waits `sampling_interval`, and publishes only when the wait runs out; a
stop drops the window in progress. A run shorter than one interval (or one whose monitor thread
was slow to get going on a loaded machine) so ended with no `system/...` metric at all, though the
user asked for them. Publishing the window in progress after the thread has stopped gives every
run at least one sample, and never a made-up one: it is measured at that moment.
"""

from __future__ import annotations

# Imported inside functions: mlflow's monitor (seconds, with its psutil and pynvml probes), only when the user
# asked for system metrics; tracking.run imports this module, and the training process imports tracking.run.


def start_system_monitor(run_id: str, resumed: bool, tracking_uri: str):
    """What mlflow.start_run(log_system_metrics=True) starts: a thread that samples CPU, memory,
    disk, network and GPU and writes `system/...` on a step axis of its own (samples)."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=tracking_uri)
    monitor.start()
    return monitor


def stop_system_monitor(monitor) -> None:
    """Stop the thread, then publish the window it was in (with one sample taken now) and flush.
    Called while the run is still RUNNING, so the samples land on it."""
    monitor.finish()  # joins the thread: nothing else touches the monitor from here on
    monitor.collect_metrics()
    monitor.publish_metrics(monitor.aggregate_metrics())
    monitor.mlflow_logger.flush()
