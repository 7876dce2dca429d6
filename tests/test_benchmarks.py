"""Smoke runs of the scripts in benchmarks/ at tiny sizes, so they keep working.

Not performance tests: they check that each script runs, exits 0 and writes its table, never a number.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts dlpipe, mlflow or torchrun: the slow tier

REPO = Path(__file__).resolve().parents[1]
TINY_VISION = ["--set", "dataset.size=64", "--set", "dataset.image_size=32", "--set", "dataset.crop_size=28",
               "--set", "trainer.epochs=1", "--set", "model.width=8"]


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "LOCAL_WORLD"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]


def test_telemetry_overhead_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "telemetry.md"
    r = run(["-m", "benchmarks.telemetry_overhead", "--rounds", "1", "--steps", "20", "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = table_rows(out.read_text())
    assert rows[0] == ["setting", "steps/s median", "steps/s min-max"]
    assert [row[0].split(":")[0].split(" (")[0] for row in rows[2:]] == ["A", "B", "ratio B/A"]
    assert "goal B/A >= 0.98" in out.read_text()
    assert out.read_text() in r.stdout  # the same table is printed


def test_gpu_case_study_runs_on_cpu_when_allowed(tmp_path):
    out = tmp_path / "case.md"
    script = REPO / "benchmarks" / "gpu_loader_case_study.py"
    r = run([str(script), "--allow-cpu", "--rounds", "1", *TINY_VISION, "--out", str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    rows = table_rows(text)
    assert rows[0] == ["setting", "device", "workers / pin / prefetch / persistent", "epoch s", "samples/s",
                       "data wait %", "gpu %"]
    assert [row[0] for row in rows[2:]] == ["pytorch", "auto"]
    assert rows[2][2].startswith("0 / False")  # PyTorch's defaults: no workers, no pinning
    assert all(row[6] == "n/a" for row in rows[2:])  # no GPU measured: said so, never 0%
    assert "ratio auto/pytorch of samples/s" in text


def test_gpu_case_study_refuses_politely_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the script would run the case study")
    r = run([str(REPO / "benchmarks" / "gpu_loader_case_study.py")], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and "no CUDA GPU here" in r.stdout and "--allow-cpu" in r.stdout
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


def test_loader_tuning_runs_and_writes_its_report(tmp_path):
    out = tmp_path / "loader_tuning.md"
    r = run(["-m", "benchmarks.loader_tuning", "--rounds", "1", "--repeats", "1", "--batches", "2", "--warmup", "1",
             "--decode-size", "64", "--image-size", "32", "--memory-size", "512", "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    for pipeline in ("decode", "in-memory"):
        assert f"### {pipeline}:" in text
        assert f"- {pipeline}: automatic " in text
    labels = [row[0].split(":")[0] for row in table_rows(text)
              if row[0].startswith(("best", "automatic", "tuned", "PyTorch", "Lightning"))]
    assert labels == ["best of grid", "automatic (loader=auto)", "tuned (dlpipe tune)", "PyTorch default",
                      "Lightning's suggestion"] * 2
    assert text in r.stdout


def test_runner_overhead_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "runner.md"
    r = run(["-m", "benchmarks.runner_overhead", "--rounds", "1", "--steps", "3", "--models", "mlp,cnn",
             "--accumulate", "1,2", "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = table_rows(out.read_text())
    assert rows[0][:5] == ["model", "accumulate", "A plain loop steps/s", "B dlpipe steps/s", "B/A"]
    assert [(row[0], row[1]) for row in rows[2:]] == [("mlp", "1"), ("mlp", "2"), ("cnn", "1"), ("cnn", "2")]
    assert out.read_text().count("(goal >= 0.97:") == 4


def test_startup_runs_and_reports_what_printing_a_config_imports(tmp_path):
    out = tmp_path / "startup.md"
    r = run(["-m", "benchmarks.startup", "--rounds", "1", "--warmup", "0", "--no-recipe-run", "--out", str(out)],
            cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row[0]: row for row in table_rows(out.read_text())[2:]}
    assert len(rows) == 7 and not [name for name in rows if "+recipe=smoke" in name]
    assert rows["dlpipe --cfg job"][3] == "torch=False mlflow=False"
    assert rows["dlpipe --help"][3] == "torch=False mlflow=False"
    # a tracked run: mlflow is its tracking process's import, not the training process's
    assert rows["dlpipe with MLflow (SQLite): first optimizer step"][3] == "torch=True mlflow=False"
    assert out.read_text().count("- tracking's launch cost, ") == 1


def test_data_wait_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "data_wait.md"
    r = run(["-m", "benchmarks.data_wait", "--rounds", "1", "--items", "8", "--item-ms", "2", "--out", str(out)],
            cwd=REPO)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    rows = table_rows(text)
    assert rows[0][:2] == ["loader", "data_wait_frac median"]
    assert [row[0].split(":")[0] for row in rows[2:]] == ["A", "B"]
    assert "- A: data_wait_frac " in text and "(goal > 0.8: " in text and "- B/A of data_wait_frac: " in text
    assert text in r.stdout


def test_fetch_probe_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "fetch_probe.md"
    r = run(["-m", "benchmarks.fetch_probe", "--rounds", "1", "--memory-size", "512", "--decode-size", "32",
             "--image-size", "32", "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    rows = table_rows(text)
    assert rows[0][:3] == ["data", "us per item median", "min-max"]
    assert [row[0] for row in rows[2:]] == ["in-memory rows", "JPEG decode", "slow items"]
    assert all(row[6] in ("stay", "go (in memory)") for row in rows[2:])
    for goal in ("- in-memory rows: ", "- JPEG decode: ", "- slow items: the probe took "):
        assert goal in text
    assert text in r.stdout


def test_suite_runs_the_chosen_scripts_into_one_report(tmp_path):
    # Two of the fastest scripts at --quick sizes (about 8 s on 2 CPUs); each has its own test above too.
    out = tmp_path / "suite.md"
    r = run(["-m", "benchmarks", "--quick", "--rounds", "1", "--only", "fetch_probe,data_wait",
             "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text in r.stdout  # the same report is printed
    assert "- command: `python -m benchmarks --quick --rounds 1 --only fetch_probe,data_wait" in text
    assert "- git commit: " in text and "- CPU budget: " in text
    rows = table_rows(text)
    assert rows[0] == ["script", "goal", "result", "exit status"]
    summary = {row[0]: row for row in rows[2:4]}
    assert list(summary) == ["data_wait", "fetch_probe"]  # the suite's order, not --only's
    assert all(row[3] == "0" for row in summary.values())
    assert summary["data_wait"][2].startswith("A: data_wait_frac ")
    assert (summary["fetch_probe"][2].startswith("in-memory rows: ")
            and "JPEG decode: " in summary["fetch_probe"][2])
    # Each script's own report under its name, its headings nested below the suite's.
    assert "\n## data_wait\n" in text and "\n### data wait\n" in text
    assert "\n## fetch_probe\n" in text and "\n### fetch probe\n" in text
    assert "`python -m benchmarks.data_wait --rounds 1 --items 8 --item-ms 2`: exit 0" in text
    assert "## startup" not in text and "| runner_overhead |" not in text


def test_suite_rejects_an_unknown_name_in_one_line(tmp_path):
    r = run(["-m", "benchmarks", "--only", "startup,nope"], cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    error = r.stderr.strip().splitlines()[-1]
    assert error.startswith("python -m benchmarks: error: argument --only: no benchmark named 'nope'")
    assert "telemetry_overhead" in error and r.stdout == ""


def test_suite_reports_a_crashed_script_and_goes_on(tmp_path, monkeypatch, capsys):
    from benchmarks import suite

    # Two scripts that crash at once (no such module): the second still runs after the first.
    missing = [suite.Benchmark(name, "none", (), r"^- ") for name in ("no_such_script", "nor_this_one")]
    monkeypatch.setattr(suite, "BENCHMARKS", tuple(missing))
    out = tmp_path / "suite.md"
    assert suite.main(["--out", str(out)]) == 1
    rows = {row[0]: row for row in table_rows(out.read_text())[2:]}
    assert list(rows) == ["no_such_script", "nor_this_one"]
    for name, row in rows.items():
        assert row[3] == "1 (crashed)"
        assert f"No module named benchmarks.{name}" in row[2]  # its last stderr line
    assert "[no_such_script] " in capsys.readouterr().err  # its stderr was passed through


def test_suite_skips_the_gpu_case_study_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the suite would run the case study")
    out = tmp_path / "suite.md"
    r = run(["-m", "benchmarks", "--only", "gpu_loader_case_study", "--out", str(out)], cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = table_rows(out.read_text())
    assert rows[2][0] == "gpu_loader_case_study" and rows[2][3] == "skipped: no CUDA GPU"
    assert "\n## gpu_loader_case_study\n\nskipped: no CUDA GPU" in out.read_text()


def test_fetch_modes_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "fetch_modes.md"
    r = run(["-m", "benchmarks.fetch_modes", "--rounds", "1", "--rows", "256", "--workers", "0",
             "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    rows = table_rows(text)
    assert rows[0] == ["data", "workers", "A samples/s median", "min-max", "B samples/s median", "min-max", "B/A"]
    assert [row[:2] for row in rows[2:]] == [["tabular rows", "0"], ["tokens", "0"]]
    assert "- tabular rows, main process: B/A " in text and "(goal >= 2: " in text
    assert text in r.stdout


def test_loader_backends_runs_and_writes_its_report(tmp_path):
    # A pipeline that gathers whole batches (rows) and one that cannot (JPEG + Python jitter), a grid of 0 and 1
    # worker, tiny sizes: about 8 s on 2 CPUs. The figures mean nothing; the report's structure is checked.
    out = tmp_path / "loader_backends.md"
    r = run(["-m", "benchmarks.loader_backends", "--rounds", "1", "--held-out", "1", "--repeats", "1", "--workers", "1",
             "--rows", "256", "--images", "32", "--image-size", "16", "--python-ops", "64", "--warmup", "1",
             "--pipelines", "rows,jpeg+python", "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text in r.stdout
    # fetch=batch joins the grid only where the dataset gathers: 2 x (0 workers + 1 worker x 4 process + 2 thread)
    assert "### rows: TabularDataset 256 x 32, batch 64" in text and "grid of 14 configs (fetch item and batch" in text
    assert "### jpeg+python: " in text and "grid of 7 configs (fetch item only" in text
    configs = [row for row in table_rows(text) if row[0].startswith(("oracle", "auto", "tune", "PyTorch", "Lightning",
                                                                     "best"))]
    assert [row[0].split(":")[0] for row in configs] == [
        "oracle (best of the grid)", "auto (loader=auto)", "tune (dlpipe tune)", "PyTorch default",
        "Lightning's suggestion", "best process config", "best thread config"] * 2
    for row in configs:
        assert float(row[1]) > 0 and float(row[2]) > 0  # samples/s in the grid's and the held-out rounds
        assert float(row[5]) > 0  # the process tree's peak RSS, in MB
    oracles, pytorch = configs[0::7], configs[3::7]
    assert all(row[4] == "1.000" for row in oracles)
    assert all(row[0] == "PyTorch default: num_workers=0" for row in pytorch)
    lightning = max(1, len(os.sched_getaffinity(0)) - 1)  # Lightning's formula, one device
    assert configs[4][0] == (f"Lightning's suggestion: num_workers={lightning} prefetch_factor=2 "
                             "persistent_workers=false")
    assert "worker_method=thread" in configs[6][0] and "worker_method=thread" not in configs[5][0]
    summary = [row[0] for row in table_rows(text.split("### summary")[1])[2:]]
    assert summary == ["rows", "jpeg+python"]
    for name in ("rows", "jpeg+python"):
        assert f"- {name}: auto " in text and "(goal >= 0.97: " in text and "of the grid (goal <= 0.33: " in text


def test_loader_backends_measures_the_streams_and_the_naive_loader(tmp_path):
    # The two stream pipelines at tiny sizes, their files written under tmp_path: about 6 s on 2 CPUs. A stream's
    # grid has no persistent workers, and these streams read positions, so threads: 0 workers + 1 worker x
    # prefetch 2,4 x process, thread.
    out = tmp_path / "streams.md"
    r = run(["-m", "benchmarks.loader_backends", "--rounds", "1", "--held-out", "1", "--repeats", "1", "--workers", "1",
             "--parquet-rows", "256", "--images", "32", "--image-size", "16", "--shard-size", "16", "--warmup", "1",
             "--naive-workers", "2", "--pipelines", "parquet,jpeg-shards", "--data-dir", str(tmp_path / "data"),
             "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text in r.stdout
    assert "### parquet: SyntheticTabularParquet 256 x 32" in text
    assert "### jpeg-shards: SyntheticJPEGShards 32 images of 16 px in tars of 16" in text
    assert text.count("grid of 5 configs (a stream dealt by stream_share=dlpipe") == 2
    assert text.count("and threads (it reads any position)") == 2
    assert list((tmp_path / "data").iterdir())  # the streams' files went where they were told
    configs = [row for row in table_rows(text) if row[0].startswith(("oracle", "auto", "tune", "PyTorch", "Lightning",
                                                                     "best", "naive"))]
    assert [row[0].split(":")[0] for row in configs] == [
        "oracle (best of the grid)", "auto (loader=auto)", "tune (dlpipe tune)", "PyTorch default",
        "Lightning's suggestion", "best process config", "best thread config",
        "naive (rows delivered, duplicates included)"] * 2
    assert all("persistent_workers=true" not in row[0] for row in configs)
    naive = configs[7::8]
    assert all(row[0].endswith("plain DataLoader(num_workers=2) on the unsharded stream") for row in naive)
    assert all(row[1] == "-" and float(row[2]) > 0 for row in naive)  # measured in the held-out rounds only
    # every row twice with 2 workers that do not share the stream out; dlpipe's loader once
    assert "one epoch delivered 512 rows, 256 of them distinct: 2.0x the epoch's rows delivered: " \
           "1.0 duplicates per row" in text
    assert "one epoch delivered 64 rows, 32 of them distinct: 2.0x" in text
    assert text.count("rows delivered, 256 distinct (1.0x)") == 1 and text.count(" 32 distinct (1.0x)") == 1
    summary = text.split("### summary")[1]
    assert [row[0] for row in table_rows(summary)[2:4]] == ["parquet", "jpeg-shards"]
    assert [row[:4] for row in table_rows(summary)[6:]] == [["parquet", "2", "2.0x", "1.0"],
                                                             ["jpeg-shards", "2", "2.0x", "1.0"]]
    for name in ("parquet", "jpeg-shards"):
        assert f"- {name}: auto " in summary and "(goal >= 0.97: " in summary
