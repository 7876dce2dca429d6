"""`dlpipe bench` and `dlpipe tune` end to end: real loaders and workers, a real MLflow store."""

import shutil
from pathlib import Path

import yaml
from conftest import TESTS_DIR, runs_of

from dlpipe.tracking.metric_names import dlpipe_names

# A dataset slow by construction (a sleep per item): workers overlap the sleeps, so more of them
# is faster on any machine, 2 CPUs included, and the tuner's choice does not depend on noise.
SLOW = ["--config-dir", str(TESTS_DIR / "conf"), "model=mlp", "model.in_features=4", "dataset=slow",
        "dataset.size=512", "dataset.delay_s=0.004", "loader.batch_size=16", "trainer.progress=false"]
# Feature vectors in memory: workers only add pickling and IPC.
IN_MEMORY = ["+recipe=tabular", "loader=auto", "trainer.progress=false"]


def samples_per_s(stdout: str) -> float:
    [line] = [x for x in stdout.splitlines() if x.startswith("bench: ") and " samples/s" in x]
    return float(line.removeprefix("bench: ").split(" samples/s")[0])


def test_bench_measures_the_configured_loader(dlpipe, mlflow_store, mlflow_client):
    r = dlpipe("bench", *SLOW, "loader.num_workers=2", "bench.batches=6", "bench.warmup_batches=2",
               f"tracking.uri={mlflow_store}", "tracking.experiment=bench-one")
    assert r.returncode == 0, r.stderr
    [line] = [x for x in r.stdout.splitlines() if x.startswith("bench: ")]
    assert "samples/s" in line and "first batch" in line and "per worker" in line
    [run] = runs_of(mlflow_client, "bench-one")
    assert run.info.status == "FINISHED" and run.data.tags["dlpipe.task"] == "bench"
    m = dlpipe_names(run.data.metrics)
    assert m["samples_per_s"] > 0 and m["first_batch_s"] > 0 and m["cpu_per_worker_pct"] >= 0
    assert m["worker_rss_mean_mb"] > 0 and m["tree_rss_peak_mb"] > m["worker_rss_mean_mb"]
    assert run.data.params["loader.num_workers"] == "2"
    assert "epoch 1" not in r.stderr  # no training


def test_bench_sweep_compares_worker_counts(dlpipe, mlflow_store, mlflow_client):
    """The classic `for workers in [0, 2]` loop as a Hydra sweep: one child run each, a table on the parent."""
    r = dlpipe("bench", "--multirun", *SLOW, "loader.num_workers=0,2", "bench.batches=6",
               "bench.warmup_batches=2", f"tracking.uri={mlflow_store}", "tracking.experiment=bench-sweep")
    assert r.returncode == 0, r.stderr
    runs = runs_of(mlflow_client, "bench-sweep")
    [parent] = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2
    assert "first batch s" in r.stdout and "val loss" not in r.stdout  # bench columns only
    by_workers = {c.data.params["loader.num_workers"]: c.data.metrics["perf/samples_per_s"] for c in children}
    assert by_workers["2"] > by_workers["0"]  # two workers overlap the per-item sleeps


def test_the_readme_bench_sweep_runs_every_job_and_records_what_each_loader_got(dlpipe, mlflow_store, mlflow_client):
    """docs/loader.md's `dlpipe bench --multirun ... loader.num_workers=0,... loader.prefetch_factor=2,4` (made
    small): every job runs; the 0-worker jobs record the prefetch_factor their DataLoader got (none)
    beside the one they asked for, and pinning on the CPU is recorded as off, asked on."""
    r = dlpipe("bench", "--multirun", "+recipe=smoke", "dataset.size=64", "trainer.device=cpu",
               "loader.num_workers=0,1", "loader.prefetch_factor=2,4", "loader.pin_memory=true", "bench.batches=2",
               "bench.warmup_batches=1", f"tracking.uri={mlflow_store}", "tracking.experiment=bench-readme")
    assert r.returncode == 0, r.stderr
    children = [x for x in runs_of(mlflow_client, "bench-readme") if "mlflow.parentRunId" in x.data.tags]
    assert sorted(c.info.status for c in children) == ["FINISHED"] * 4
    for child in children:
        p = child.data.params
        asked = child.data.tags["dlpipe.overrides"].split("loader.prefetch_factor=")[1].split()[0]
        if p["loader.num_workers"] == "0":
            assert (p["loader.prefetch_factor"], p["requested.loader.prefetch_factor"]) == ("null", asked)
        else:
            assert p["loader.prefetch_factor"] == asked and "requested.loader.prefetch_factor" not in p
        assert (p["loader.pin_memory"], p["requested.loader.pin_memory"]) == ("False", "True")
        assert p["auto.loader.num_workers"] == f"{p['loader.num_workers']} (user)"  # the source, in a word
        assert p["auto.loader.persistent_workers"] == "False (auto)"
    logged = r.stdout + r.stderr
    assert logged.count("train: loader.prefetch_factor=4 ignored: it needs num_workers > 0") == 1
    assert "loader.num_workers = 0 (user override)" in logged
    assert "set by the user" not in logged


def test_tune_picks_workers_for_slow_items_and_writes_a_config_that_composes(
        dlpipe, tmp_path, mlflow_store, mlflow_client):
    r = dlpipe("tune", *SLOW, "loader.pin_memory=true", "trainer.device=cpu", "bench.batches=6",
               "bench.warmup_batches=2", "bench.repeats=1",
               f"bench.output_dir={tmp_path / 'out'}", "bench.name=fast",
               f"tracking.uri={mlflow_store}", "tracking.experiment=tune-slow")
    assert r.returncode == 0, r.stderr
    written = tmp_path / "out" / "loader" / "fast.yaml"
    text = written.read_text()
    assert text.startswith(f"# dlpipe --config-dir {tmp_path / 'out'} loader=fast\n")
    assert "CPU budget" in text and "/dev/shm" in text
    tuned = yaml.safe_load(text)
    assert tuned["num_workers"] > 1 and tuned["tuned_on"].startswith("cpu_budget=")
    runs = runs_of(mlflow_client, "tune-slow")
    [parent] = [x for x in runs if x.data.tags.get("dlpipe.task") == "tune"]
    trials = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) >= 3 and parent.data.metrics["tune/speedup"] >= 1.0
    assert all("perf/samples_per_s" in t.data.metrics for t in trials)
    # pinning asked for on the CPU: off in every trial (no flip tried without CUDA), and recorded so
    assert (parent.data.params["loader.pin_memory"], parent.data.params["requested.loader.pin_memory"]) == (
        "False", "True")
    assert parent.data.params["auto.loader.pin_memory"] == "True (user)"
    assert {t.data.params["loader.pin_memory"] for t in trials} == {"False"} and tuned["pin_memory"] is False
    # it draws from torch's global RNG (torch.randn per item): no thread trial, none written
    assert {t.data.params["loader.worker_method"] for t in trials} == {"process"} == {tuned["worker_method"]}
    assert tuned["fetch"] == "item"  # a list index is no gather of its items here

    # the file is used with one override, and the lint trusts its measured worker count (Hydra takes
    # one --config-dir: the user's folder holds the test dataset's option beside the tuned loader)
    shutil.copytree(TESTS_DIR / "conf" / "dataset", tmp_path / "out" / "dataset")
    r = dlpipe("--config-dir", str(tmp_path / "out"), *SLOW[2:], "loader=fast", "trainer.epochs=1",
               "trainer.limit_train_batches=3", f"tracking.uri={mlflow_store}", "tracking.experiment=tuned-used")
    assert r.returncode == 0, r.stderr
    [used] = runs_of(mlflow_client, "tuned-used")
    assert used.data.params["loader.num_workers"] == str(tuned["num_workers"])
    assert "above the CPU budget" not in r.stderr + r.stdout


def test_tune_keeps_in_memory_data_in_the_main_process(dlpipe, tmp_path):
    r = dlpipe("tune", *IN_MEMORY, "bench.batches=20", "bench.repeats=3", "tracking=none",
               f"bench.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    tuned = yaml.safe_load(Path(tmp_path, "loader", "tuned.yaml").read_text())
    assert tuned["num_workers"] == 0 and "tuned: num_workers=0" in r.stdout
    # the job's own loader already gathers whole batches (loader.fetch=auto): written as decided
    assert (tuned["fetch"], tuned["worker_method"]) == ("batch", "process")


def test_bench_train_mode_runs_the_training_step(dlpipe):
    """bench.mode=train puts forward, backward and the optimizer step on every batch."""
    fast = dlpipe("bench", *IN_MEMORY, "bench.batches=10", "tracking=none")
    slow = dlpipe("bench", *IN_MEMORY, "bench.batches=10", "bench.mode=train", "model.hidden=1024", "tracking=none")
    assert fast.returncode == 0 and slow.returncode == 0, fast.stderr + slow.stderr
    rate = {name: samples_per_s(r.stdout) for name, r in (("loader", fast), ("train", slow))}
    assert rate["train"] < rate["loader"]  # a 1024-wide MLP step costs far more than indexing a tensor
    assert "(train mode)" in slow.stdout + slow.stderr
