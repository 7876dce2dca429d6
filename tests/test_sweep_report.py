"""The sweep comparison (table, best job, PNG chart) on real MLflow runs in a SQLite store."""

import struct
import subprocess
import sys
import time

import pytest

from dlpipe.tracking.run import PARENT_TAG
from dlpipe.tracking.sweep_report import job_names, sweep_plot, sweep_table

COMMON = "+recipe=smoke trainer.epochs=2"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from mlflow import MlflowClient

    # one store for the module (creating one costs seconds); each test uses its own experiment
    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path_factory.mktemp('sweep') / 'm.db'}")


def make_sweep(client, experiment: str, jobs: list[tuple[str, dict[str, float], str]]):
    """A parent run and one child per (varied override, last-epoch metrics, status); returns (parent id, children)."""
    from mlflow.entities import Metric

    exp = client.create_experiment(experiment)
    parent = client.create_run(exp, run_name="sweep", tags={"dlpipe.role": "sweep"}).info.run_id
    start = int(time.time() * 1000)
    for i, (override, metrics, status) in enumerate(jobs):
        run = client.create_run(exp, start_time=start + i, run_name=f"job {i}", tags={
            PARENT_TAG: parent, "dlpipe.overrides": f"{COMMON} {override}",
        }).info.run_id
        # two epochs: the table and chart show the last one
        first = [Metric(k, v * 0.5, start, 1) for k, v in metrics.items()]
        last = [Metric(k, v, start, 2) for k, v in metrics.items()]
        client.log_batch(run, metrics=first + last)
        client.set_terminated(run, status)
    children = client.search_runs([exp], filter_string=f"tags.`{PARENT_TAG}` = '{parent}'")
    return parent, children


def metrics(samples_per_s: float, **extra: float) -> dict[str, float]:
    return {"samples_per_s": samples_per_s, "data_wait_frac": 0.25, "epoch_time_s": 3.5, "val_loss": 1.2,
            "rss_peak_mb": 420.0, **extra}


def png_facts(path) -> tuple[int, int, dict[str, str]]:
    """(width, height, tEXt chunks) read from the PNG's bytes."""
    data = path.read_bytes()
    pos, texts, size = 8, {}, (0, 0)
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    return size[0], size[1], texts


def test_table_names_jobs_by_the_varied_override_only(client):
    _, children = make_sweep(client, "names", [
        (f"loader.num_workers={n}", metrics(100.0 + n), "FINISHED") for n in range(3)
    ])
    names = job_names(children)
    assert sorted(names.values()) == [f"loader.num_workers={n}" for n in range(3)]
    table, _, _ = sweep_table(children)
    rows = table.splitlines()
    assert rows[0].startswith("| job | status | samples/s | data wait |")
    assert [r.split(" | ")[0] for r in rows[2:]] == [f"| loader.num_workers={n}" for n in range(3)]
    assert "+recipe=smoke" not in table  # shared by every job: noise


def test_best_is_the_fastest_finished_job(client):
    _, children = make_sweep(client, "best", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=1", metrics(300.0), "FINISHED"),
        ("loader.num_workers=2", metrics(200.0), "FINISHED"),
    ])
    _, best, best_name = sweep_table(children)
    assert best_name == "loader.num_workers=1"
    assert best.data.metrics["samples_per_s"] == 300.0


def test_a_failed_job_is_never_best(client):
    _, children = make_sweep(client, "failed", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=1", metrics(900.0), "FAILED"),  # fastest, but it did not finish
        ("loader.num_workers=2", metrics(200.0), "FINISHED"),
    ])
    table, best, best_name = sweep_table(children)
    assert best_name == "loader.num_workers=2" and best.info.status == "FINISHED"
    assert "| loader.num_workers=1 | FAILED |" in table


def test_no_finished_job_means_no_best(client):
    _, children = make_sweep(client, "all-failed", [
        ("loader.num_workers=0", metrics(100.0), "FAILED"),
        ("loader.num_workers=1", metrics(200.0), "KILLED"),
    ])
    _, best, best_name = sweep_table(children)
    assert best is None and best_name == ""


def test_plot_is_a_png_without_gpu_panel_when_no_job_measured_gpu(client, tmp_path):
    _, children = make_sweep(client, "plot-cpu", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=1", metrics(300.0), "FINISHED"),
        ("loader.num_workers=2", metrics(200.0), "FAILED"),
    ])
    path = sweep_plot(children, job_names(children), tmp_path / "sweep.png")
    assert path == tmp_path / "sweep.png"
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG"
    assert len(data) > 10_000  # three panels of bars and labels, not an empty canvas
    width, height, texts = png_facts(path)
    assert width > height > 100
    assert texts["Description"] == "panels: samples_per_s, data_wait_frac, rss_peak_mb"
    assert "best: loader.num_workers=1 (300.0 samples/s)" in texts["Title"]


def test_gpu_panel_appears_when_a_job_measured_gpu(client, tmp_path):
    _, children = make_sweep(client, "plot-gpu", [
        ("loader.num_workers=0", metrics(100.0, gpu_util=40.0), "FINISHED"),
        ("loader.num_workers=1", metrics(300.0), "FINISHED"),  # no NVML in this job: a missing bar, not 0
    ])
    cpu_only = [c for c in children if "gpu_util" not in c.data.metrics]
    without = sweep_plot(cpu_only, job_names(children), tmp_path / "cpu.png")
    path = sweep_plot(children, job_names(children), tmp_path / "gpu.png")
    _, _, texts = png_facts(path)
    assert texts["Description"] == "panels: samples_per_s, data_wait_frac, gpu_util, rss_peak_mb"
    assert png_facts(without)[2]["Description"] == "panels: samples_per_s, data_wait_frac, rss_peak_mb"
    assert png_facts(path)[0] > png_facts(without)[0]  # one panel wider


def test_no_plot_without_metrics(client, tmp_path):
    _, children = make_sweep(client, "no-metrics", [
        ("loader.num_workers=0", {}, "FAILED"),
        ("loader.num_workers=1", {}, "FAILED"),
    ])
    assert sweep_plot(children, job_names(children), tmp_path / "a.png") is None
    assert sweep_plot([], {}, tmp_path / "b.png") is None
    assert not list(tmp_path.iterdir())


def test_sweep_end_logs_table_and_chart_to_the_parent(client, capsys):
    """The Hydra callback's end of sweep, on a real store: both artifacts, the best job, FINISHED."""
    from dlpipe.tracking.sweep import SweepTracking

    parent, _ = make_sweep(client, "callback", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=2", metrics(250.0), "FINISHED"),
    ])
    callback = SweepTracking()
    callback.client, callback.parent_id = client, parent
    callback._finish(ended_cleanly=True)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.tags["dlpipe.best_job"] == "loader.num_workers=2"
    assert sorted(a.path for a in client.list_artifacts(parent)) == ["sweep_summary.md", "sweep_summary.png"]
    png = client.download_artifacts(parent, "sweep_summary.png")
    assert open(png, "rb").read(4) == b"\x89PNG"
    assert "best job: loader.num_workers=2" in capsys.readouterr().out


def test_report_module_imports_neither_hydra_nor_matplotlib():
    code = ("import sys, dlpipe.tracking.sweep_report; "
            "print(sorted(m for m in ('hydra', 'omegaconf', 'matplotlib', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
