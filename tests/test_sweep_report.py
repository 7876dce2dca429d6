"""The sweep comparison (table, best job, PNG chart): on real MLflow runs in a SQLite store, and
in-process on Run-like objects for the cases a store cannot easily hold."""

import re
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from dlpipe.sweeps.chart import sweep_plot
from dlpipe.sweeps.jobs import sweep_jobs
from dlpipe.sweeps.noise import fastest
from dlpipe.sweeps.report import sweep_table
from dlpipe.tracking.metric_names import mlflow_name
from dlpipe.tracking.run import PARENT_TAG

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
        first = [Metric(mlflow_name(k), v * 0.5, start, 1) for k, v in metrics.items()]  # as MlflowRun logs them
        last = [Metric(mlflow_name(k), v, start, 2) for k, v in metrics.items()]
        client.log_batch(run, metrics=first + last)
        client.set_terminated(run, status)
    children = client.search_runs([exp], filter_string=f"tags.`{PARENT_TAG}` = '{parent}'")
    return parent, children


def metrics(samples_per_s: float, **extra: float) -> dict[str, float]:
    return {"samples_per_s": samples_per_s, "data_wait_frac": 0.25, "epoch_time_s": 3.5, "val_loss": 1.2,
            "rss_peak_mb": 420.0, "tree_rss_peak_mb": 900.0, **extra}


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


def chart_facts(path) -> tuple[list[str], dict[str, str], list[str]]:
    """(panel metrics, metric -> jobs marked best, same-settings notes) from the PNG's Description."""
    lines = png_facts(path)[2]["Description"].splitlines()
    panels = lines[0].removeprefix("panels: ").split(", ")
    best = dict(line.removeprefix("best ").split(": ") for line in lines if line.startswith("best "))
    same = [line.removeprefix("same settings: ") for line in lines if line.startswith("same settings: ")]
    return panels, best, same


def table_rows(table: str) -> list[list[str]]:
    """The table's rows split into cells as GitHub-flavoured markdown does: at every `|` not escaped
    by a backslash, outer pipes dropped. Lines before the table (the headline) and after it (its
    notes) are not rows."""
    rows = []
    for line in table.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


def test_table_names_jobs_by_the_varied_override_only(client):
    _, children = make_sweep(client, "names", [
        (f"loader.num_workers={n}", metrics(100.0 + n), "FINISHED") for n in range(3)
    ])
    jobs = sweep_jobs(children)
    assert [j.name for j in jobs] == [f"loader.num_workers={n}" for n in range(3)]
    table = sweep_table(jobs)
    header, rule, *rows = table_rows(table)
    assert header == ["#", "job", "status", "samples/s", "val_loss", "data wait", "epoch s", "main peak RSS MB",
                      "tree peak RSS MB"]
    assert all(set(cell) == {"-"} for cell in rule)
    # numbered as Hydra numbers its jobs (no job-number tag here: by start order)
    assert [r[:2] for r in rows] == [[f"#{n}", f"`loader.num_workers={n}`"] for n in range(3)]
    assert [r[5] for r in rows] == ["25.0%"] * 3  # data wait in percent, as the console says it
    assert "+recipe=smoke" not in table  # shared by every job: noise


def test_fastest_is_the_fastest_finished_job_beyond_noise(client):
    _, children = make_sweep(client, "best", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=1", metrics(300.0), "FINISHED"),
        ("loader.num_workers=2", metrics(200.0), "FINISHED"),
    ])
    best = fastest(sweep_jobs(children)).winner
    assert best.name == "loader.num_workers=1"
    assert best.metrics["samples_per_s"] == 300.0


def test_a_failed_job_is_never_best(client):
    _, children = make_sweep(client, "failed", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=1", metrics(900.0), "FAILED"),  # fastest, but it did not finish
        ("loader.num_workers=2", metrics(200.0), "FINISHED"),
    ])
    jobs = sweep_jobs(children)
    best = fastest(jobs).winner
    assert best.name == "loader.num_workers=2" and best.status == "FINISHED"
    assert table_rows(sweep_table(jobs))[3][1:3] == ["`loader.num_workers=1`", "FAILED"]


def test_no_finished_job_means_no_best(client):
    _, children = make_sweep(client, "all-failed", [
        ("loader.num_workers=0", metrics(100.0), "FAILED"),
        ("loader.num_workers=1", metrics(200.0), "KILLED"),
    ])
    assert fastest(sweep_jobs(children)) is None


def test_plot_is_a_png_without_gpu_panel_when_no_job_measured_gpu(client, tmp_path):
    _, children = make_sweep(client, "plot-cpu", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=1", metrics(300.0), "FINISHED"),
        ("loader.num_workers=2", metrics(200.0), "FAILED"),
    ])
    path = sweep_plot(sweep_jobs(children), tmp_path / "sweep.png")
    assert path == tmp_path / "sweep.png"
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG"
    assert len(data) > 10_000  # three panels of bars and labels, not an empty canvas
    width, height, texts = png_facts(path)
    assert width > height > 100
    assert chart_facts(path)[0] == ["samples_per_s", "data_wait_frac", "epoch_time_s", "tree_rss_peak_mb"]
    assert "fastest: job #1 loader.num_workers=1 (300.0 samples/s)" in texts["Title"]


def test_gpu_panel_appears_when_a_job_measured_gpu(client, tmp_path):
    _, children = make_sweep(client, "plot-gpu", [
        ("loader.num_workers=0", metrics(100.0, gpu_util=40.0), "FINISHED"),
        ("loader.num_workers=1", metrics(300.0), "FINISHED"),  # no NVML in this job: a missing bar, not 0
    ])
    cpu_only = [c for c in children if mlflow_name("gpu_util") not in c.data.metrics]
    without = sweep_plot(sweep_jobs(cpu_only), tmp_path / "cpu.png")
    path = sweep_plot(sweep_jobs(children), tmp_path / "gpu.png")
    panels = ["samples_per_s", "data_wait_frac", "epoch_time_s", "tree_rss_peak_mb"]
    assert chart_facts(path)[0] == [*panels[:3], "gpu_util", panels[3]]
    assert chart_facts(without)[0] == panels
    assert png_facts(path)[0] > png_facts(without)[0]  # one panel wider


def test_no_plot_without_metrics(client, tmp_path):
    _, children = make_sweep(client, "no-metrics", [
        ("loader.num_workers=0", {}, "FAILED"),
        ("loader.num_workers=1", {}, "FAILED"),
    ])
    assert sweep_plot(sweep_jobs(children), tmp_path / "a.png") is None
    assert sweep_plot([], tmp_path / "b.png") is None
    assert not list(tmp_path.iterdir())


def end_sweep(client, parent: str):
    """The Hydra callback's end of a sweep whose jobs all ran; returns the parent run."""
    from dlpipe.sweeps.callback import SweepTracking

    callback = SweepTracking()
    callback.client, callback.parent_id = client, parent
    callback._finish(ended_cleanly=True)
    return client.get_run(parent)


def test_sweep_end_logs_table_and_chart_to_the_parent(client, capsys):
    """The Hydra callback's end of sweep, on a real store: both artifacts, the fastest job named
    apart from the best by the objective (val_loss, equal in both jobs: none), FINISHED."""
    parent, _ = make_sweep(client, "callback", [
        ("loader.num_workers=0", metrics(100.0), "FINISHED"),
        ("loader.num_workers=2", metrics(250.0), "FINISHED"),
    ])
    run = end_sweep(client, parent)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["dlpipe.fastest_job"] == "loader.num_workers=2"
    assert "dlpipe.best_job" not in tags and tags["dlpipe.best_verdict"].startswith("jobs #0 and #1 are within")
    assert run.data.metrics == {"sweep/best_samples_per_s": 250.0}
    assert sorted(a.path for a in client.list_artifacts(parent)) == ["sweep_summary.md", "sweep_summary.png"]
    png = client.download_artifacts(parent, "sweep_summary.png")
    assert open(png, "rb").read(4) == b"\x89PNG"
    headline = ("**Best val_loss: indistinguishable (jobs #0 and #1 within noise); "
                "fastest: job #1 loader.num_workers=2 (250.0 samples/s)**")
    assert headline in capsys.readouterr().out
    assert tags["mlflow.note.content"].startswith(headline + "\n\n| #")


def test_report_modules_import_neither_hydra_nor_matplotlib():
    code = ("import sys, dlpipe.sweeps.report, dlpipe.sweeps.chart, dlpipe.sweeps.jobs, dlpipe.sweeps.noise, "
            "dlpipe.sweeps.verdict, dlpipe.sweeps.objective, dlpipe.sweeps.summary; "
            "print(sorted(m for m in ('hydra', 'omegaconf', 'matplotlib', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def fake_run(i: int, override: str, metrics: dict[str, float] | None = None, status: str = "FINISHED",
             params: dict[str, str] | None = None):
    """A Run-like object as MlflowClient.search_runs returns it: what the summary reads, nothing more."""
    return SimpleNamespace(
        info=SimpleNamespace(run_id=f"run{i}", run_name=f"job {i}", status=status, start_time=1000 + i),
        data=SimpleNamespace(metrics=metrics or {}, params=params or {},
                             tags={"dlpipe.overrides": f"{COMMON} {override}"}))


def unfenced(cell: str) -> str:
    """A table cell's code span, as a markdown viewer shows it."""
    fence, text = re.fullmatch(r"(`+)(.*)\1", cell).groups()
    return text[1:-1] if text.startswith(" ") and text.endswith(" ") else text


def test_each_panel_marks_its_own_best_among_finished_jobs(tmp_path):
    """The issue's sweep: the fastest job waited most for data and held the most memory (in its
    workers, not the main process). Each panel marks by its own direction; ties are all marked; a
    failed job's better numbers are never best; a panel where all finished jobs tie marks none.
    Samples/s and epoch time follow the sweep's verdict: two jobs equal as shown are no winner."""
    def m(sps, wait, epoch, cpu, main, tree):
        return {"samples_per_s": sps, "data_wait_frac": wait, "epoch_time_s": epoch, "cpu_util": cpu,
                "rss_peak_mb": main, "tree_rss_peak_mb": tree, "gpu_util": 50.0}
    runs = [
        fake_run(1, "loader.num_workers=0", m(1000.0, 0.10, 12.0, 45.0, 524.0, 519.0)),
        fake_run(2, "loader.num_workers=2", m(1800.0, 0.58, 7.0, 90.0, 519.0, 1314.0)),
        fake_run(3, "loader.num_workers=4", m(1800.04, 0.30, 7.0, 99.0, 530.0, 1400.0)),  # 1800.0 as shown: a tie
        fake_run(4, "loader.num_workers=8", {**m(5000.0, 0.01, 1.0, 10.0, 100.0, 100.0), "gpu_util": 99.0}, "FAILED"),
    ]
    path = sweep_plot(sweep_jobs(runs), tmp_path / "s.png")
    panels, best, _ = chart_facts(path)
    assert panels == ["samples_per_s", "data_wait_frac", "epoch_time_s", "cpu_util", "gpu_util", "tree_rss_peak_mb"]
    assert best == {
        "samples_per_s": "none",  # 1800.04 against 1800.0: within the noise, no green bar
        "data_wait_frac": "0",  # lower is better: the fastest job is the worst here
        "epoch_time_s": "none",  # the fastest's panel seen from the other side
        "cpu_util": "not ranked",
        "gpu_util": "none",  # every finished job 50%: nothing to choose
        "tree_rss_peak_mb": "0",  # the tree: the main process alone would have marked job #1
    }
    assert "fastest: indistinguishable (jobs #1 and #2 within noise)" in png_facts(path)[2]["Title"]


def test_table_keeps_every_row_and_column_whatever_the_names_hold():
    """Pipes, backticks, newlines and very long overrides in names, and jobs that failed before they
    had a run (known only from the parent's failed-job tags): every job is one row of full width."""
    long = "+note=" + "x" * 3000
    runs = [
        fake_run(1, "+note=a|b", metrics(100.0)),
        fake_run(2, "+note=`tick`", metrics(200.0)),
        fake_run(3, long, metrics(300.0)),
        fake_run(4, "+note=crashed", metrics(50.0), "FAILED"),
        fake_run(5, "", metrics(60.0)),  # no override of its own: named by its run name
    ]
    runs[4].info.run_name = "two\nlines"
    failed = {3: f"{COMMON} +note=crashed", 5: f"{COMMON} +note=bad|value", 6: f"{COMMON} +note=never"}
    table = sweep_table(sweep_jobs(runs, failed))
    header, rule, *rows = table_rows(table)
    assert all(len(row) == len(header) == len(rule) for row in rows)
    assert [r[0] for r in rows] == [f"#{n}" for n in range(7)]  # the crashed job counted once
    assert [unfenced(r[1]) for r in rows] == ["+note=a|b", "+note=`tick`", long, "+note=crashed", "two lines",
                                              "+note=bad|value", "+note=never"]
    assert [r[2] for r in rows] == ["FINISHED"] * 3 + ["FAILED", "FINISHED", "FAILED", "FAILED"]
    assert set(rows[5][3:]) == set(rows[6][3:]) == {"-"}
    assert rows[2][3] == "300.0"
    assert "- jobs #5 and #6 failed before they had a run" in table
    # the backticks stay text: the fence is longer than any run of backticks in the name
    assert rows[1][1] == "`` +note=`tick` ``"


def test_jobs_that_ran_the_same_settings_are_named_and_grouped():
    """A sweep over a value dlpipe normalises (pin_memory without CUDA): the name says what ran, and
    jobs whose swept keys ran identically are one configuration measured twice."""
    def run(i, workers, pin, sps):
        params = {"loader.num_workers": str(workers), "loader.pin_memory": "False"}
        if pin:
            params["requested.loader.pin_memory"] = "True"
        return fake_run(i, f"loader.num_workers={workers} loader.pin_memory={str(pin).lower()}", metrics(sps),
                        params=params)
    runs = [run(1, 0, True, 1710.0), run(2, 0, False, 1547.0), run(3, 2, True, 900.0), run(4, 2, False, 950.0)]
    jobs = sweep_jobs(runs)
    assert [j.name for j in jobs] == [
        "loader.num_workers=0 loader.pin_memory=true (ran False)", "loader.num_workers=0 loader.pin_memory=false",
        "loader.num_workers=2 loader.pin_memory=true (ran False)", "loader.num_workers=2 loader.pin_memory=false",
    ]
    table = sweep_table(jobs)
    notes = ["jobs #0 and #1 ran the same settings (loader.num_workers=0 loader.pin_memory=False): "
             "their difference is noise",
             "jobs #2 and #3 ran the same settings (loader.num_workers=2 loader.pin_memory=False): "
             "their difference is noise"]
    assert all(f"- {note}." in table for note in notes)
    assert "`(ran X)`" in table
    # where pin_memory ran as asked, the same sweep is four settings: no name changed, no note
    for r in runs:
        r.data.params.pop("requested.loader.pin_memory", None)
        r.data.params["loader.pin_memory"] = r.data.tags["dlpipe.overrides"].split("=")[-1].title()
    plain = sweep_jobs(runs)
    assert not any("(ran" in j.name for j in plain) and "noise" not in sweep_table(plain)


def test_chart_names_what_ran_and_which_jobs_are_the_same(tmp_path):
    params = [{"loader.pin_memory": "False", "requested.loader.pin_memory": "True"}, {"loader.pin_memory": "False"}]
    runs = [fake_run(i + 1, f"loader.pin_memory={v}", metrics(s), params=p)
            for i, (v, s, p) in enumerate(zip(["true", "false"], [1710.0, 1547.0], params))]
    path = sweep_plot(sweep_jobs(runs), tmp_path / "s.png")
    _, _, same = chart_facts(path)
    assert same == ["jobs #0 and #1 ran the same settings (loader.pin_memory=False): their difference is noise"]
    title = png_facts(path)[2]["Title"]
    # one setting measured twice, 10.5% apart: that is the noise, and no job is ahead of it
    assert "fastest: indistinguishable (jobs #0 and #1 within noise)" in title


def test_sweep_end_lists_jobs_without_a_run_and_survives_long_overrides(client, monkeypatch):
    """Two jobs failed on bad values before they had a run, with overrides so long that the parent's
    `dlpipe.failed_overrides` tag exceeds MLflow's 8000 characters, and MLflow set to refuse such a
    value instead of cutting it: the table has their rows whole and the parent still ends FAILED."""
    from dlpipe.sweeps.callback import FAILED_TAG_PREFIX
    from dlpipe.sweeps.summary import MAX_TAG_CHARS

    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")

    parent, _ = make_sweep(client, "no-run", [("loader.num_workers=0", metrics(100.0), "FINISHED")])
    bad = [f"{COMMON} +note={c * 5000}" for c in "ab"]
    for n, overrides in enumerate(bad, start=1):
        client.set_tag(parent, f"{FAILED_TAG_PREFIX}{n}", overrides)
    run = end_sweep(client, parent)
    assert run.info.status == "FAILED"
    assert run.data.tags["dlpipe.failed_jobs"] == "2"
    assert len(run.data.tags["dlpipe.failed_overrides"]) == MAX_TAG_CHARS
    table = open(client.download_artifacts(parent, "sweep_summary.md")).read()
    rows = table_rows(table)[2:]
    assert [(unfenced(r[1])[:8], r[2]) for r in rows] == [
        ("loader.n", "FINISHED"), ("+note=aa", "FAILED"), ("+note=bb", "FAILED")]
    assert len(unfenced(rows[2][1])) == len("+note=") + 5000  # whole, not cut
