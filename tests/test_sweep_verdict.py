"""What a sweep's parent names at its end (sweeps/objective.py, verdict.py, report.py, summary.py): the
objective it ranks by, the best and the fastest job apart, the table's columns and Hydra's job numbers;
on Run-like objects and on a real SQLite store."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_sweep_report import chart_facts, png_facts, table_rows

from dlpipe.sweeps.jobs import JOB_NUM_TAG, sweep_jobs
from dlpipe.sweeps.objective import Objective, monitored_metrics, sweep_objective
from dlpipe.sweeps.report import sweep_table
from dlpipe.sweeps.verdict import judge
from dlpipe.tracking.metric_names import mlflow_name
from dlpipe.tracking.run import PARENT_TAG


def child(i: int, metrics: dict[str, float], tags=None, params=None, status="FINISHED"):
    """A child run as search_runs returns it: metrics under MLflow's names."""
    return SimpleNamespace(
        info=SimpleNamespace(run_id=f"run{i}", run_name=f"job {i}", status=status, start_time=1000 + i),
        data=SimpleNamespace(metrics={mlflow_name(k): v for k, v in metrics.items()}, params=params or {},
                             tags={"dlpipe.overrides": f"+recipe=regression optim.lr=0.{i + 1}", **(tags or {})}))


def test_the_objective_comes_from_the_tags_then_the_monitor_then_val_loss():
    logged = {"val_loss": 0.1, "val_r2": 0.9}
    tagged = child(0, logged, {"dlpipe.objective": "val/r2", "dlpipe.objective_direction": "max"},
                   params={"sweep.objective": "val/r2"})
    assert sweep_objective([child(1, logged), tagged]) == Objective("val_r2", "max", "sweep.objective")
    # the same tags on a job whose sweep.objective was null: the default, the metric checkpoint.monitor names
    by_default = child(0, logged, tagged.data.tags, params={"sweep.objective": "None"})
    assert sweep_objective([by_default]) == Objective("val_r2", "max", "checkpoint.monitor")
    # older runs: the monitored metric where its direction is known
    by_mode = child(0, logged, params={"checkpoint.monitor": "val_r2", "checkpoint.mode": "max"})
    assert sweep_objective([by_mode]) == Objective("val_r2", "max", "checkpoint.monitor")
    a_loss = child(0, {**logged, "train_loss": 0.2}, params={"checkpoint.monitor": "train_loss"})
    assert sweep_objective([a_loss]) == Objective("train_loss", "min", "checkpoint.monitor")
    # checkpoint.mode=auto on a metric of unknown direction: val_loss, as every such run logs it
    auto = child(0, logged, params={"checkpoint.monitor": "val_r2", "checkpoint.mode": "auto"})
    assert sweep_objective([auto]) == Objective("val_loss", "min", "default")
    assert sweep_objective([child(0, {"samples_per_s": 10.0})]) is None
    assert monitored_metrics([auto, child(1, logged, params={"checkpoint.monitor": "null"})]) == ["val_r2"]


def regression_sweep():
    """The issue's regression sweep: the fastest job is not the best by val_r2, and a user metric
    (`metrics.acc`, logged as val_acc) sits beside the recipe's."""
    def m(sps, r2, **extra):
        return {"samples_per_s": sps, "val_loss": 1 - r2, "val_r2": r2, "val_acc": r2 / 2, "data_wait_frac": 0.04,
                "rss_peak_mb": 500.0, "tree_rss_peak_mb": 900.0, "worker_rss_mean_mb": 100.0, **extra}
    tags = {"dlpipe.objective": "val/r2", "dlpipe.objective_direction": "max"}
    params = {"checkpoint.monitor": "val_r2"}
    return [child(i, m(sps, r2), tags, params) for i, (sps, r2) in enumerate([(900.0, 0.80), (2000.0, 0.85),
                                                                               (950.0, 0.912), (1000.0, 0.86)])]


def test_the_table_shows_the_objective_the_monitored_and_user_metrics_in_hydras_numbers():
    runs = regression_sweep()
    jobs = sweep_jobs(runs)
    objective = sweep_objective(runs)
    verdict = judge(jobs, objective)
    table = sweep_table(jobs, objective, monitored_metrics(runs), verdict.sentences())
    header, _, *rows = table_rows(table)
    assert header == ["#", "job", "status", "samples/s", "val_r2 (objective, monitored)", "val_loss", "val_acc",
                      "data wait", "main peak RSS MB", "mean worker RSS MB", "tree peak RSS MB"]
    assert [r[0] for r in rows] == ["#0", "#1", "#2", "#3"]
    assert [r[4] for r in rows] == ["0.8", "0.85", "0.912", "0.86"]
    assert {r[7] for r in rows} == {"4.0%"}
    # one epoch a job: no spread measured, so the leads count (samples/s above MIN_GAIN)
    assert verdict.headline() == ("Best val_r2: job #2 optim.lr=0.3 (0.912); "
                                  "fastest: job #1 optim.lr=0.2 (2000.0 samples/s)")
    tags = verdict.tags()
    assert tags["dlpipe.best_job"] == "optim.lr=0.3" and tags["dlpipe.fastest_job"] == "optim.lr=0.2"
    assert verdict.metrics() == {"sweep/best_val_r2": 0.912, "sweep/best_samples_per_s": 2000.0}
    assert "- best val_r2: job #2 optim.lr=0.3 (0.912): 0.052 ahead of #3 (0.86)" in table


@pytest.fixture
def client(tmp_path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")


def test_sweep_end_names_best_and_fastest_apart_with_hydras_job_numbers(client, tmp_path, capsys):
    """The callback's end on a real store: jobs started out of Hydra's order (a submitit pool), each
    job folder holding Hydra's own record of its number; a repeated setting sets the speed noise, so
    the fastest is not named while the best by val_r2 is; the chart marks no speed bar."""
    from mlflow.entities import Metric

    from dlpipe.sweeps.callback import SweepTracking

    exp = client.create_experiment("verdict")
    parent = client.create_run(exp, run_name="sweep", tags={"dlpipe.role": "sweep"}).info.run_id
    start = int(time.time() * 1000)
    # (Hydra job number, lr, samples/s by epoch, val_r2 by epoch), in start order; #0 and #1 ran the same lr
    jobs = [(2, "0.03", [50.0, 900.0, 980.0], [0.80, 0.94, 0.95]),
            (0, "0.1", [50.0, 1000.0, 1010.0], [0.50, 0.60, 0.61]),
            (1, "0.1", [50.0, 600.0, 610.0], [0.50, 0.59, 0.60]),
            (3, "0.001", [50.0, 700.0, 690.0], [0.20, 0.30, 0.32])]
    for order, (num, lr, speeds, r2) in enumerate(jobs):
        folder = tmp_path / "multirun" / str(num)
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  job:\n    name: dlpipe\n    num: {num}\n")
        tags = {PARENT_TAG: parent, "dlpipe.overrides": f"+recipe=regression optim.lr={lr}",
                "dlpipe.output_dir": str(folder), "dlpipe.objective": "val/r2", "dlpipe.objective_direction": "max"}
        run = client.create_run(exp, start_time=start + order, run_name=f"lr={lr}", tags=tags).info.run_id
        client.log_param(run, "optim.lr", lr)
        client.log_batch(run, metrics=[Metric(mlflow_name(k), v, start, epoch)
                                       for k, values in (("samples_per_s", speeds), ("val_r2", r2))
                                       for epoch, v in enumerate(values, start=1)])
        client.set_terminated(run, "FINISHED")
    callback = SweepTracking()
    callback.client, callback.parent_id = client, parent
    callback._finish(ended_cleanly=True)

    run = client.get_run(parent)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["dlpipe.best_job"] == "optim.lr=0.03"
    assert client.get_run(tags["dlpipe.best_run_id"]).data.tags[JOB_NUM_TAG] == "2"  # recorded on the child
    assert "dlpipe.fastest_job" not in tags and "dlpipe.fastest_run_id" not in tags
    assert tags["dlpipe.fastest_verdict"] == ("jobs #0-#3 are within the noise of this sweep (epoch-to-epoch spread "
                                              "up to 9%, same settings up to 66% apart): no fastest job")
    assert tags["dlpipe.best_verdict"].endswith("0.34 ahead of #0 (0.61), beyond the noise of this sweep (0.02: "
                                                "val_r2 moved up to 0.02 in a job's last epoch, same settings up to "
                                                "0.01 apart)")
    assert run.data.metrics == {"sweep/best_val_r2": 0.95}
    headline = "Best val_r2: job #2 optim.lr=0.03 (0.95); fastest: indistinguishable (jobs #0-#3 within noise)"
    assert f"**{headline}**" in capsys.readouterr().out
    summary = open(client.download_artifacts(parent, "sweep_summary.md")).read()
    assert summary.startswith(f"**{headline}**\n\n") and tags["mlflow.note.content"] == summary.rstrip("\n")
    rows = table_rows(summary)[2:]
    assert [(r[0], r[1]) for r in rows] == [("#0", "`optim.lr=0.1`"), ("#1", "`optim.lr=0.1`"),
                                            ("#2", "`optim.lr=0.03`"), ("#3", "`optim.lr=0.001`")]
    png_path = Path(client.download_artifacts(parent, "sweep_summary.png"))
    panels, best, _ = chart_facts(png_path)
    assert panels[:2] == ["samples_per_s", "val_r2"]
    assert best["samples_per_s"] == "none" and best["val_r2"] == "2"
    assert png_facts(png_path)[2]["Title"].startswith(f"sweep: 4 jobs, last epoch of each; {headline}")
