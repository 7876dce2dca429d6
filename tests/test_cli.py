"""End to end through the real `dlpipe` command (Hydra CLI in a subprocess) and a real MLflow store."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import NO_PHONE_HOME, TESTS_DIR, runs_of

from dlpipe.config.paths import recipe_dirs
from dlpipe.config.store import find_recipes

FAST = ["+recipe=smoke", "trainer.progress=false"]
# The shipped recipes as the CLI lists them (sorted, comma-separated), so adding one touches no test here.
SHIPPED_RECIPES = ", ".join(sorted(find_recipes(recipe_dirs()[:1])))
# The user's own config folder (--config-dir) adds dataset options; the MLP takes num_classes from the dataset.
# (argparse wants the option before the overrides.)
FAULTY = ["--config-dir", str(TESTS_DIR / "conf"), "trainer.progress=false", "model=mlp", "model.in_features=4"]
# As MLflow shows them: one chart section per prefix (dlpipe.tracking.metric_names)
EPOCH_METRICS = {"perf/epoch_time_s", "perf/samples_per_s", "loader/data_wait_frac", "train/loss", "val/loss",
                 "val/accuracy", "resources/cpu_util", "resources/rss_mb", "loader/first_batch_s", "epoch"}


def test_smoke_run_is_recorded_in_mlflow(dlpipe, mlflow_store, mlflow_client):
    """A default run trains and leaves one FINISHED run with per-epoch metrics, params, tags, config artifact."""
    r = dlpipe(*FAST, f"tracking.uri={mlflow_store}", "tracking.experiment=smoke",
               env={"MLFLOW_TAGS": '{"team": "vision", "ticket": 42}', "USER": "ada", "LOGNAME": "ada",
                    "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "true", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"})
    assert r.returncode == 0, r.stderr
    assert "train loss" in r.stdout  # the end-of-run summary table
    [run] = runs_of(mlflow_client, "smoke")
    assert run.info.status == "FINISHED"
    assert EPOCH_METRICS <= set(run.data.metrics)
    sections = {k.partition("/")[0] for k in run.data.metrics if k != "epoch"}
    # contention/ where this kernel gives its figures (PSI, schedstat, /proc/stat)
    # (system/: MLflow's own system metrics alone, which this run turns on)
    assert {"train", "val", "perf", "loader", "resources", "system"} <= sections <= {
        "train", "val", "perf", "loader", "resources", "system", "contention"}, sections
    # One step axis, the optimizer step: an epoch's values at its last step, `epoch` beside them.
    epoch_ends = sorted(m.step for m in mlflow_client.get_metric_history(run.info.run_id, "perf/samples_per_s"))
    epochs = {m.step: m.value for m in mlflow_client.get_metric_history(run.info.run_id, "epoch")}
    steps = [m.step for m in mlflow_client.get_metric_history(run.info.run_id, "train/loss_step")]
    assert len(epoch_ends) == 2 and 0 < epoch_ends[0] < epoch_ends[1] == max(steps)
    assert [epochs[s] for s in epoch_ends] == [1.0, 2.0]
    assert all(epochs[s] == (1.0 if s <= epoch_ends[0] else 2.0) for s in steps)  # the step log's epoch too
    assert "resources/gpu_util" not in run.data.metrics or run.data.params["gpu.count"] != "0"  # never a fake 0%
    # MLflow's own system metrics, opted into with MLflow's variable, beside dlpipe's
    assert run.data.params["tracking.system_metrics"] == "True"
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    p = run.data.params
    assert p["loader.num_workers"].isdigit() and p["cpu.budget"].isdigit()
    assert p["auto.loader.num_workers"] == p["loader.num_workers"] + " (auto)"  # a word: whole in the UI's tables
    assert run.data.tags["dlpipe.auto.loader.num_workers"].startswith(p["loader.num_workers"] + " (auto: CPU budget")
    assert p["dataset._target_"] == "dlpipe.data.vision.SyntheticJPEGDataset"
    assert run.data.tags["dlpipe.recipe"] == "smoke"
    # MLflow's run context, as mlflow.start_run records it, and the user's MLFLOW_TAGS (HF's convention)
    assert {k: run.data.tags[k] for k in ("mlflow.user", "mlflow.source.type", "mlflow.source.name", "team",
                                          "ticket")} == {"mlflow.user": "ada", "mlflow.source.type": "LOCAL",
                                                         "mlflow.source.name": "dlpipe", "team": "vision",
                                                         "ticket": "42"}
    # the experiment opens on MLflow 3's model-training view, not its GenAI overview
    assert mlflow_client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    assert run.data.tags["dlpipe.verdict"] in {"input-bound", "cpu-budget-bound", "host-to-device-bound",
                                               "compute-bound"}
    assert f"bottleneck: {run.data.tags['dlpipe.verdict']}" in r.stdout
    assert {"loader/worker_rss_max_mb", "loader/shm_used_mb", "perf/step_time_p95_ms"} <= set(run.data.metrics)
    assert "trainer.progress=false" in run.data.tags["dlpipe.overrides"]
    # the dataset as the run's input, once per split it fed (the UI's "Datasets used")
    inputs = mlflow_client.get_run(run.info.run_id).inputs.dataset_inputs
    assert sorted(i.tags[0].value for i in inputs) == ["train", "validation"]
    assert {(i.dataset.name, i.dataset.source_type, i.dataset.source) for i in inputs} == {
        ("SyntheticJPEGDataset", "code", '{"tags": {"dlpipe.dataset": "dlpipe.data.vision.SyntheticJPEGDataset"}}')}
    artifacts = [a.path for a in mlflow_client.list_artifacts(run.info.run_id, "config")]
    assert artifacts == ["config/resolved.yaml"]
    text = mlflow_client.download_artifacts(run.info.run_id, "config/resolved.yaml")
    assert "${" not in open(text).read()  # resolved, unlike Hydra's .hydra/config.yaml


def test_profiler_and_allocation_snapshot_are_artifacts(dlpipe, mlflow_store, mlflow_client):
    """telemetry.profile_steps and telemetry.tracemalloc store their tables and trace with the run."""
    r = dlpipe(*FAST, "trainer.epochs=1", "telemetry.profile_steps=2", "telemetry.profile_wait=1",
               "telemetry.tracemalloc=true", f"tracking.uri={mlflow_store}", "tracking.experiment=profile")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "profile")
    names = sorted(a.path for a in mlflow_client.list_artifacts(run.info.run_id, "profile"))
    assert names == ["profile/profile_table.txt", "profile/profile_trace.json", "profile/tracemalloc_top.txt"]
    table = open(mlflow_client.download_artifacts(run.info.run_id, "profile/profile_table.txt")).read()
    assert "aten::" in table


def test_multirun_makes_parent_with_child_runs(dlpipe, mlflow_store, mlflow_client):
    """A 2-job sweep is one parent run with two children linked by mlflow.parentRunId, plus a summary."""
    r = dlpipe("--multirun", *FAST, "loader.num_workers=0,1", "trainer.epochs=1",
               f"tracking.uri={mlflow_store}", "tracking.experiment=sweep")
    assert r.returncode == 0, r.stderr
    runs = runs_of(mlflow_client, "sweep")
    [parent] = [x for x in runs if x.data.tags.get("dlpipe.role") == "sweep"]
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and len(runs) == 3
    assert sorted(c.data.params["loader.num_workers"] for c in children) == ["0", "1"]
    # short names that say what differs, as the UI's run list shows them
    assert parent.info.run_name == "num_workers=0,1 (sweep smoke)"
    assert sorted(c.info.run_name for c in children) == ["0", "1"]  # values only: the parent names the keys
    assert all(c.info.status == "FINISHED" for c in children)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["dlpipe.jobs"] == "2"
    tags = parent.data.tags
    assert tags["dlpipe.objective_of_sweep"].startswith("val_loss (min, from ")
    # a best and a fastest job are named only beyond the sweep's noise; the verdicts say either way
    assert {"dlpipe.best_verdict", "dlpipe.fastest_verdict"} <= set(tags)
    named = {tags[k] for k in ("dlpipe.best_job", "dlpipe.fastest_job") if k in tags}
    assert named <= {"loader.num_workers=0", "loader.num_workers=1"}
    # its own section of the UI's charts: a metric for each job named
    assert set(parent.data.metrics) == {m for m, k in (("sweep/best_val_loss", "dlpipe.best_job"),
                                                       ("sweep/best_samples_per_s", "dlpipe.fastest_job")) if k in tags}
    artifacts = {a.path for a in mlflow_client.list_artifacts(parent.info.run_id)}
    assert {"sweep_summary.md", "sweep_summary.png"} <= artifacts
    summary = open(mlflow_client.download_artifacts(parent.info.run_id, "sweep_summary.md")).read()
    assert "loader.num_workers=0" in summary and "loader.num_workers=1" in summary
    assert "sweep summary (2 runs" in r.stdout
    # where to look, once for the sweep (its jobs leave it to the parent), after the summary
    looks = [line for line in r.stdout.splitlines() if line.startswith("MLflow UI: ")]
    assert looks == [r.stdout.splitlines()[-1]]
    assert f"/#/experiments/{parent.info.experiment_id}/runs?workflowType=machine_learning" in looks[0]
    # the descriptions the UI shows: the parent's comparison with its headline first, each child's verdict
    note = tags["mlflow.note.content"]
    assert note.startswith("**Best val_loss: ") and note == summary.rstrip("\n")
    for child in children:
        assert child.data.tags["mlflow.note.content"] == f"**Bottleneck:** {child.data.tags['dlpipe.verdict_detail']}"


def test_sweep_with_a_bad_job_runs_the_others_and_fails(dlpipe, mlflow_store, mlflow_client):
    """One bad job does not stop the sweep; the sweep exits 1 and its parent run ends FAILED, not RUNNING."""
    r = dlpipe("--multirun", *FAST, "trainer.epochs=1", "loader.num_workers=-1,0",
               f"tracking.uri={mlflow_store}", "tracking.experiment=mixed")
    assert r.returncode == 1
    assert "dlpipe: error: loader.num_workers=-1: must be >= 0" in r.stderr
    assert "Traceback" not in r.stderr  # a user mistake, reported compactly by Hydra too
    runs = runs_of(mlflow_client, "mixed")
    [parent] = [x for x in runs if x.data.tags.get("dlpipe.role") == "sweep"]
    [child] = [x for x in runs if x is not parent]
    assert child.info.status == "FINISHED" and child.data.params["loader.num_workers"] == "0"
    assert parent.info.status == "FAILED"
    assert parent.data.tags["dlpipe.failed_jobs"] == "1"
    assert "loader.num_workers=-1" in parent.data.tags["dlpipe.failed_overrides"]
    summary = open(mlflow_client.download_artifacts(parent.info.run_id, "sweep_summary.md")).read()
    assert re.search(r"\| `loader.num_workers=-1` +\| FAILED +\| - ", summary)  # no run of its own, still a row


# The bad-input table: every way a user can get the command line wrong, one row each. "{tmp}" is the
# test's folder. Each must exit 2 with exactly one line naming the key or value and what is allowed.
# What is pure logic (Hydra's composition, the resolvers, validation: what the command does first) is
# checked in-process; BAD_INPUT_CLI runs the real command once per distinct path to the error line.
BAD_INPUT = [
    (["+loader.num_workerz=2"], "loader.num_workerz: no such key; did you mean loader.num_workers?"),
    (["+trainer.epochs=3"], "+trainer.epochs=3: trainer.epochs already exists; drop the +"),
    (["dataset.sizee=9"], "dataset.sizee=9: no key 'sizee' in dataset; did you mean dataset.size?"),
    (["+dataset.colour=red"], "dataset.colour: not a parameter of dlpipe.data.vision.SyntheticJPEGDataset"),
    (["loader.batch_size=abc"],
     "loader.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer; allowed: an integer"),
    (["loader.prefetch_factor=two"], "loader.prefetch_factor=two: Value 'two' of type 'str' could not be converted "
                                     "to Integer; allowed: an integer or null"),
    (["loader.worker_method=null"],
     "loader.worker_method=null: field 'loader.worker_method' is not Optional; allowed: auto, process, thread"),
    (["trainer.deterministic=maybe"], "trainer.deterministic=maybe: Value 'maybe' is not a valid bool (type str); "
                                      "allowed: true or false"),
    (["loader=fast"], "loader=fast: no such loader option; available: auto, in_memory, padded, pytorch"),
    (["loader.fetch=batches"], "loader.fetch=batches: allowed: auto, item, batch"),
    (["trainer.devices=0"], "trainer.devices=0: must be >= 1 (processes on this node, one per GPU)"),
    (["model=nope"], "model=nope: no such model option; available: cnn, custom, mlp, transformer"),
    (["loader.batch_size=0"], "loader.batch_size=0: must be >= 1"),
    (["trainer.accumulate=0"], "trainer.accumulate=0: must be >= 1"),
    (["loader.prefetch_factor=0"], "loader.prefetch_factor=0: must be >= 1"),
    (["trainer.amp=fp8"], "trainer.amp=fp8: allowed: off, bf16, fp16"),
    (["dataset._target_=nopkg.Data"], "dataset._target_=nopkg.Data: cannot be imported"),
    (["trainer.device=cuda:x"], "trainer.device=cuda:x: allowed: cpu, cuda, cuda:N, mps"),
    (["bench.mode=fast"], "bench.mode=fast: allowed: loader, train"),
    (["scheduler=cosine", "scheduler.interval=hour"], "scheduler.interval=hour: allowed: step (after every optimizer"),
    (["scheduler=cosine", "scheduler.warmup_steps=-1"], "scheduler.warmup_steps=-1: must be >= 0"),
    (["scheduler=step", "scheduler._target_=torch.optim.lr_scheduler.Nope"],
     "scheduler._target_=torch.optim.lr_scheduler.Nope: cannot be imported"),
    (["+scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"],
     "scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau: it steps on a metric (step(metrics)); name it "
     "with scheduler.monitor=val_loss"),
    (["scheduler=plateau", "scheduler.interval=step"], "scheduler.interval=step: a schedule that steps on a metric"),
    (["scheduler=cosine", "+scheduler.monitor=val_loss"], "scheduler.monitor=val_loss: dlpipe.training.schedule"),
    (["task=nope"], "task=nope: allowed: train, bench, tune"),
]

BAD_INPUT_CLI = [
    (["loader.num_workerz=2"],  # Hydra's own error, made one line
     "loader.num_workerz=2: no key 'num_workerz' in loader; did you mean loader.num_workers?"),
    (["loader.batch_size=["], "loader.batch_size=[: not a valid override"),  # the override grammar
    (["+recipe=nope"], f"recipe=nope: no such recipe option; available: {SHIPPED_RECIPES}"),
    (["model.width=${oc.env:DLPIPE_TEST_UNSET}"],
     "model.width=${oc.env:DLPIPE_TEST_UNSET}: environment variable DLPIPE_TEST_UNSET is not set"),
    (["loader.num_workers=-1"], "loader.num_workers=-1: must be >= 0"),  # validation
    (["dataset.crop_size=99"], "crop_size"),  # the dataset's own check, when it is built
    (["trainer.device=mps"], "trainer.device=mps: this torch build or machine has no MPS device"),
    (["loader.fetch=batch"],  # vision augments per item: its gather cannot equal the per-item batches
     "loader.fetch=batch: SyntheticJPEGDataset cannot gather a batch equal to its per-item collate"),
    (["loader.batch_size=1000", "loader.drop_last=true"],  # the split, once the data is known
     "loader.batch_size=1000 with loader.drop_last=true: the training split has"),
    (["dataset=image_folder", "dataset.root={tmp}/nope", "model=cnn"], "does not exist"),
    (["dataset=image_folder", "dataset.root={tmp}/empty", "model=cnn"], "{tmp}/empty"),
    (["tracking.uri=http://127.0.0.1:9"], "tracking.uri=http://127.0.0.1:9: 127.0.0.1:9: Connection refused"),
    (["tracking.log_model=all"], "tracking.log_model=all: allowed: none, best, last"),
    (["tracking.log_model=last", "checkpoint.enabled=false"],
     "tracking.log_model=last: logs a checkpoint, and checkpoint.enabled=false writes none"),
]


def with_recipe(args: list[str]) -> list[str]:
    """The smoke recipe first (it sets the dataset keys the rows change), unless a row picks its own."""
    return args if args[0].startswith(("+recipe", "dataset=")) else ["+recipe=smoke", *args]


@pytest.mark.parametrize("args, expected", BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_is_one_problem_naming_key_and_value(args, expected):
    """What the command does first, in-process: compose, resolve, validate; Hydra's errors as one line."""
    from hydra import compose, initialize_config_dir

    from dlpipe.cli import resolve
    from dlpipe.config.composition_errors import one_line
    from dlpipe.config.paths import conf_dir
    from dlpipe.config.resolvers import register_resolvers
    from dlpipe.config.store import register_recipes, register_schemas
    from dlpipe.config.validation import validate
    from dlpipe.errors import ConfigError

    register_resolvers()
    register_schemas()
    register_recipes()
    overrides = with_recipe(args)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            _, resolved = resolve(compose("config", overrides=overrides))
        validate(resolved, cpu_budget=2)
    except ConfigError as e:
        problems = e.problems
    except Exception as e:  # Hydra's composition errors: the command prints one_line of them
        problems = [one_line(e, overrides)]
    else:
        problems = []
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("args, expected", BAD_INPUT_CLI, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_fails_before_tracking(dlpipe, tmp_path, mlflow_store, mlflow_client, args, expected):
    """Exit 2 with one line naming key and value, no traceback, no MLflow run, no half-made output dir."""
    (tmp_path / "empty").mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    expected = expected.replace("{tmp}", str(tmp_path))
    exp = "bad-" + re.sub(r"[^A-Za-z0-9_.-]", "_", " ".join(args))[:80]
    tracking = [] if args[0].startswith("tracking.uri") else [f"tracking.uri={mlflow_store}"]
    r = dlpipe(*with_recipe(args), "trainer.progress=false", *tracking, f"tracking.experiment={exp}")
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error: ")]
    assert len(errors) == 1 and expected in errors[0], r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip() == errors[0], r.stderr
    assert runs_of(mlflow_client, exp) == []
    assert not (tmp_path / "outputs").exists()  # no half-made run directory either


@pytest.mark.parametrize("value, expected", [("team=vision", "not JSON"), ('["a"]', "must be a JSON object")])
def test_malformed_mlflow_tags_fail_before_anything_starts(dlpipe, tmp_path, value, expected):
    """MLFLOW_TAGS (HF Trainer's convention) is checked with the config: one line naming the variable
    and its value, exit 2, no store created, no output folder."""
    store = tmp_path / "fresh.db"
    r = dlpipe(*FAST, f"tracking.uri=sqlite:///{store}", env={"MLFLOW_TAGS": value})
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error: ")]
    assert errors == [line for line in r.stderr.splitlines() if line.strip()], r.stderr
    assert len(errors) == 1 and f"MLFLOW_TAGS={value!r} (environment variable): {expected}" in errors[0]
    assert not store.exists() and not (tmp_path / "outputs").exists()


def test_mlflow_run_id_continues_a_given_run(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """MLFLOW_RUN_ID (HF Trainer's convention): the job logs into that run; a run the store does not
    hold, one in another experiment, or a sweep is one line and exit 2 before anything is built."""
    exp = mlflow_client.create_experiment("given-run")
    given = mlflow_client.create_run(exp, run_name="made elsewhere").info.run_id
    mlflow_client.set_terminated(given, "FINISHED")
    deleted = mlflow_client.create_run(exp).info.run_id
    mlflow_client.delete_run(deleted)
    track = [f"tracking.uri={mlflow_store}", "tracking.experiment=given-run"]
    r = dlpipe(*FAST, "trainer.epochs=1", *track, env={"MLFLOW_RUN_ID": given})
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "given-run")
    assert run.info.run_id == given and run.info.status == "FINISHED" and "perf/samples_per_s" in run.data.metrics
    for args, env, expected in [
        ((*FAST, *track), {"MLFLOW_RUN_ID": "0" * 32}, f"MLFLOW_RUN_ID={'0' * 32} (environment variable): no such run"),
        ((*FAST, *track), {"MLFLOW_RUN_ID": deleted}, f"MLFLOW_RUN_ID={deleted} (environment variable): the run is "
                                                      "deleted"),
        ((*FAST, f"tracking.uri={mlflow_store}", "tracking.experiment=other"), {"MLFLOW_RUN_ID": given},
         "the run is in experiment 'given-run', not tracking.experiment=other; set tracking.experiment=given-run"),
        (("--multirun", *FAST, "trainer.epochs=1,2", *track), {"MLFLOW_RUN_ID": given},
         f"MLFLOW_RUN_ID={given} (environment variable): continues one training run; unset it for --multirun"),
    ]:
        r = dlpipe(*args, env=env)
        errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error: ")]
        assert r.returncode in (1, 2) and errors and expected in errors[0], r.stderr
        assert "Traceback" not in r.stderr
    assert len(runs_of(mlflow_client, "given-run")) == 1 and runs_of(mlflow_client, "other") == []


@pytest.mark.parametrize("which, expected", [("best", "best.pt"), ("last", "epoch-0002.pt")])
def test_log_model_stores_the_checkpoint_with_the_run(dlpipe, tmp_path, mlflow_store, mlflow_client, which, expected):
    """tracking.log_model=best|last: the run's artifact checkpoints/ holds that checkpoint, byte for byte,
    and the run's logged model (an MLflow PyTorch model, in the run's experiment, at the checkpoint's
    step) loads with mlflow.pytorch.load_model holding its weights, with the signature of its input."""
    import mlflow
    import torch

    r = dlpipe(*FAST, "trainer.epochs=2", f"tracking.log_model={which}", f"hydra.run.dir={tmp_path / 'run'}",
               f"tracking.uri={mlflow_store}", f"tracking.experiment=log-model-{which}")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, f"log-model-{which}")
    assert [a.path for a in mlflow_client.list_artifacts(run.info.run_id, "checkpoints")] == [f"checkpoints/{expected}"]
    checkpoint = tmp_path / "run" / "checkpoints" / expected
    stored = mlflow_client.download_artifacts(run.info.run_id, f"checkpoints/{expected}", str(tmp_path))
    assert open(stored, "rb").read() == checkpoint.read_bytes()
    [output] = run.outputs.model_outputs
    state = torch.load(checkpoint, weights_only=True)
    logged = mlflow_client.get_logged_model(output.model_id)
    assert (logged.status, logged.experiment_id, logged.source_run_id) == ("READY", run.info.experiment_id,
                                                                         run.info.run_id)
    assert output.step == state["step"]
    mlflow.set_tracking_uri(mlflow_store)
    loaded = mlflow.pytorch.load_model(f"models:/{output.model_id}")
    assert loaded.state_dict().keys() == state["model"].keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state["model"].items())
    signature = mlflow.models.get_model_info(f"models:/{output.model_id}").signature
    assert tuple(signature.inputs.to_dict()[0]["tensor-spec"]["shape"]) == (-1, 3, 28, 28)  # the smoke crops
    assert not (tmp_path / "run" / "mlflow_model.pt").exists()  # handed over, then removed


def test_all_problems_reported_together(dlpipe):
    """Several bad values are collected into one error, one line each."""
    r = dlpipe(*FAST, "tracking=none", "loader.num_workers=-2", "loader.batch_size=0", "trainer.epochs=0")
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error: ")]
    assert len(errors) == 3, r.stderr


def test_missing_image_folder_is_a_clear_error(dlpipe, tmp_path):
    """dataset=image_folder names the missing folder; without a root it says the key is mandatory."""
    r = dlpipe("dataset=image_folder", "tracking=none", f"dataset.root={tmp_path / 'nope'}")
    assert r.returncode == 2 and "does not exist" in r.stderr and str(tmp_path / "nope") in r.stderr
    r = dlpipe("dataset=image_folder", "tracking=none")
    assert r.returncode == 2 and "dataset.root" in r.stderr


@pytest.mark.parametrize("method, where", [("process", "DataLoader worker process"),
                                           ("thread", "a DataLoader worker thread")])
def test_corrupt_image_in_a_worker_fails_the_run_with_one_line(dlpipe, tmp_path, mlflow_store, mlflow_client,
                                                               method, where):
    """A bad file met by a worker process or thread: one line naming the file and the worker, no worker
    traceback, run FAILED."""
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "images" / cls).mkdir(parents=True)
        for i in range(8):
            Image.new("RGB", (40, 40), (40 * i, 90, 200 if cls == "a" else 20)).save(
                tmp_path / "images" / cls / f"{i}.png")
    bad = tmp_path / "images" / "b" / "3.png"
    bad.write_bytes(b"not a png at all")
    r = dlpipe("dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.image_size=32",
               "dataset.crop_size=28", "loader.num_workers=2", f"loader.worker_method={method}", "loader.batch_size=4",
               "trainer.epochs=1", "trainer.progress=false", "trainer.val_fraction=0", f"tracking.uri={mlflow_store}",
               f"tracking.experiment=corrupt-{method}")
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error: ")]
    assert len(errors) == 1 and str(bad) in errors[0] and where in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    [run] = runs_of(mlflow_client, f"corrupt-{method}")
    assert run.info.status == "FAILED" and str(bad) in run.data.tags["dlpipe.end_reason"]


def test_out_of_memory_suggests_smaller_batch_with_accumulation(dlpipe, mlflow_store, mlflow_client):
    """A CUDA OOM (its exception type, raised on CPU) ends FAILED with one line keeping the effective batch."""
    r = dlpipe("--config-dir", str(TESTS_DIR / "conf"), "model=oom", "dataset=tabular", "dataset.size=512",
               "loader=in_memory", "loader.batch_size=64", "trainer.accumulate=2", "trainer.progress=false",
               f"tracking.uri={mlflow_store}", "tracking.experiment=oom")
    assert r.returncode == 2, r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.startswith("dlpipe: error: ")]
    assert "CUDA out of memory" in line and "try loader.batch_size=32 trainer.accumulate=4" in line
    assert "effective batch of 128" in line and "Traceback" not in r.stderr
    [run] = runs_of(mlflow_client, "oom")
    assert run.info.status == "FAILED" and "loader.batch_size=32" in run.data.tags["dlpipe.end_reason"]


def test_broken_user_recipe_names_the_file(dlpipe, tmp_path):
    """A recipe file that is not valid YAML is reported by path and line, without a traceback, by the
    commands that use it; the others do not see it (tests/test_bad_input.py has the rest)."""
    mine = tmp_path / "recipes"
    mine.mkdir()
    (mine / "broken.yaml").write_text("trainer: [epochs: 1\n")
    r = dlpipe("--cfg", "job", env={"DLPIPE_RECIPE_PATH": str(mine)})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = dlpipe("+recipe=broken", "--cfg", "job", env={"DLPIPE_RECIPE_PATH": str(mine)})
    assert r.returncode == 2 and r.stderr.startswith(f"dlpipe: error: {mine / 'broken.yaml'}:2: "), r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_half_a_distributed_environment_is_refused(dlpipe):
    """WORLD_SIZE without the rest of torchrun's variables: one line saying how to launch, no traceback."""
    r = dlpipe(*FAST, "tracking=none", env={"WORLD_SIZE": "2"})
    assert r.returncode == 2, r.stderr
    assert "dlpipe: error: rank 0: WORLD_SIZE=2 without RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in r.stderr
    assert "torchrun --nproc_per_node=2 -m dlpipe" in r.stderr and "Traceback" not in r.stderr


def test_cfg_job_resolve_shows_final_values(dlpipe):
    """--cfg job --resolve prints concrete numbers for every automatic value."""
    r = dlpipe("+recipe=vision", "--cfg", "job", "--resolve")
    assert r.returncode == 0, r.stderr
    assert "${" not in r.stdout
    assert "num_workers: " in r.stdout and "device: cpu" in r.stdout


def test_tracking_none_writes_no_store(dlpipe, tmp_path):
    """tracking=none trains without creating an MLflow store."""
    r = dlpipe(*FAST, "tracking=none", "trainer.epochs=1")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_default_store_is_sqlite_in_working_dir(dlpipe, tmp_path):
    """Without a URI, runs land in ./mlflow.db where `mlflow ui` looks for them."""
    r = dlpipe(*FAST, "trainer.epochs=1")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mlflow.db").exists()


def test_exception_mid_training_ends_run_failed(dlpipe, mlflow_store, mlflow_client):
    """An exception in a dataset item ends the run FAILED with the reason tagged, never RUNNING."""
    r = dlpipe(*FAULTY, "dataset=exploding", "loader.num_workers=0",
               f"tracking.uri={mlflow_store}", "tracking.experiment=explode")
    assert r.returncode != 0
    [run] = runs_of(mlflow_client, "explode")
    assert run.info.status == "FAILED"
    assert "sample 40 is corrupt" in run.data.tags["dlpipe.end_reason"]
    [line] = [x for x in r.stderr.splitlines() if x.startswith("dlpipe: error: ")]
    assert line.startswith("dlpipe: error: dataset item 40: RuntimeError: sample 40 is corrupt")


@pytest.mark.parametrize(
    "dataset, extra, expected",
    [
        ("dying", ["loader.num_workers=2"], "usually the out-of-memory killer or a full /dev/shm"),
        ("hanging", ["loader.num_workers=1", "loader.timeout=2"],
         "loader.timeout=2.0: no batch arrived from the workers in 2.0 s"),
    ],
)
def test_worker_faults_fail_the_run_with_the_likely_cause(dlpipe, mlflow_store, mlflow_client, dataset, extra,
                                                          expected):
    """A killed worker or a hung one ends the run FAILED with one line saying what to try."""
    exp = f"worker-{dataset}"
    r = dlpipe(*FAULTY, f"dataset={dataset}", "trainer.val_fraction=0", *extra,
               f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}", timeout=120)
    assert r.returncode == 2, r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.startswith("dlpipe: error: ")]
    assert expected in line
    [run] = runs_of(mlflow_client, exp)
    assert run.info.status == "FAILED" and expected in run.data.tags["dlpipe.end_reason"]


def start_slow_run(tmp_path, mlflow_store, exp: str, *extra: str, new_session: bool = False) -> subprocess.Popen:
    """A training run over a slow dataset (about 0.2 s a batch), in tmp_path/run (in a process
    group of its own with `new_session`, so a test can signal the whole group)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(TESTS_DIR)
    env.update(NO_PHONE_HOME)
    return subprocess.Popen(
        [sys.executable, "-m", "dlpipe", *FAULTY, "dataset=slow", "dataset.size=600", "dataset.delay_s=0.003",
         "loader.num_workers=0", "trainer.epochs=2", "trainer.val_fraction=0", f"hydra.run.dir={tmp_path / 'run'}",
         f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}", *extra],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=new_session,
    )


def signal_when_training(proc, mlflow_client, exp: str, sig, group: bool = False) -> tuple[int, str, str]:
    """Wait until the run is RUNNING and a batch or two in, send `sig` to the process (or its whole
    group, workers included): (exit code, stdout, stderr)."""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = runs_of(mlflow_client, exp)
            if runs and runs[0].info.status == "RUNNING":
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.3)
        time.sleep(1.0)  # into the training loop
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.integration
@pytest.mark.parametrize("sig, code, reason", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM"),
                                               (signal.SIGUSR1, 143, "SIGUSR1")])
def test_signal_checkpoints_and_ends_run_killed(tmp_path, mlflow_store, mlflow_client, sig, code, reason):
    """A stop signal: checkpoint at the next optimizer step, run KILLED with the reason, exit 130/143."""
    exp = f"signal-{sig.name}"
    code_seen, out, err = signal_when_training(start_slow_run(tmp_path, mlflow_store, exp), mlflow_client, exp, sig)
    assert code_seen == code, err
    [run] = runs_of(mlflow_client, exp)
    assert run.info.status == "KILLED", err
    assert reason in run.data.tags["dlpipe.end_reason"]
    [ckpt] = sorted((tmp_path / "run" / "checkpoints").glob("epoch-*.pt"))
    state = torch.load(ckpt, weights_only=True)
    assert state["epoch"] == 0 and state["batches_done"] >= 1 and state["step"] == state["batches_done"]
    # The hint names the output folder: Hydra's default one is new on every launch.
    assert f"{ckpt}; resume with: dlpipe " in out + err and f"hydra.run.dir={tmp_path / 'run'}" in out + err
    assert "Traceback" not in err


# Each start method once; SIGTERM and SIGUSR1 take one path in the workers (stop.STOP_SIGNALS), so
# they are spread over the start methods rather than multiplied with them.
@pytest.mark.integration
@pytest.mark.parametrize("context, sig", [("fork", signal.SIGUSR1), ("spawn", signal.SIGTERM),
                                          ("forkserver", signal.SIGTERM)])
def test_signal_to_the_whole_group_spares_the_workers(tmp_path, mlflow_store, mlflow_client, context, sig):
    """scancel and `kill -PGID` signal the workers too: they must not die before the main process
    has stopped cleanly (spawned workers even while they start), so the run still ends KILLED."""
    exp = f"group-{context}-{sig.name}"
    proc = start_slow_run(tmp_path, mlflow_store, exp, "loader.num_workers=2",
                          f"loader.multiprocessing_context={context}", new_session=True)
    code, out, err = signal_when_training(proc, mlflow_client, exp, sig, group=True)
    assert code == 143, err
    [run] = runs_of(mlflow_client, exp)
    assert run.info.status == "KILLED" and sig.name in run.data.tags["dlpipe.end_reason"], err
    assert "killed by signal" not in err and "Traceback" not in err
    assert list((tmp_path / "run" / "checkpoints").glob("epoch-*.pt"))


@pytest.mark.parametrize("recipe", ["vision", "nlp", "nlp_ragged", "tabular", "smoke", "tabular_parquet",
                                    "vision_shards"])
def test_every_recipe_runs_end_to_end(dlpipe, recipe):
    """Each shipped recipe composes, builds and trains (cut to a few batches)."""
    r = dlpipe(f"+recipe={recipe}", "tracking=none", "trainer.epochs=1", "trainer.limit_train_batches=3",
               "trainer.limit_val_batches=2", "trainer.progress=false")
    assert r.returncode == 0, r.stderr
    assert "val loss" in r.stdout


def test_user_recipe_folder_from_environment(dlpipe, tmp_path):
    """A recipe in a $DLPIPE_RECIPE_PATH folder is usable as +recipe=NAME without touching the package."""
    mine = tmp_path / "my_recipes"
    mine.mkdir()
    (mine / "mine.yaml").write_text(
        "# @package _global_\n# dlpipe +recipe=mine\ndefaults:\n  - override /dataset: tabular\n"
        "  - override /model: mlp\n  - override /loader: in_memory\ntrainer:\n  epochs: 1\n"
    )
    r = dlpipe("+recipe=mine", "--cfg", "job", env={"DLPIPE_RECIPE_PATH": str(mine)})
    assert r.returncode == 0, r.stderr
    assert "TabularDataset" in r.stdout and "epochs: 1" in r.stdout
    r = dlpipe("+recipe=mine", "--cfg", "job", env={"DLPIPE_RECIPE_PATH": str(tmp_path / "missing")})
    assert r.returncode == 2 and "DLPIPE_RECIPE_PATH" in r.stderr


def test_user_recipe_from_config_dir(dlpipe):
    """Hydra's --config-dir adds recipes from DIR/recipe/ beside the shipped ones, and they train."""
    r = dlpipe("--config-dir", str(TESTS_DIR / "conf"), "+recipe=tiny_tabular", "tracking=none",
               "trainer.progress=false")
    assert r.returncode == 0, r.stderr
    assert "val loss" in r.stdout
    r = dlpipe("--config-dir", str(TESTS_DIR / "conf"), "+recipe=nope", "tracking=none")
    assert "tiny_tabular" in r.stderr and "vision" in r.stderr  # both sources are listed


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["+recipe=vision", "--cfg", "job"], ["--version"],
                                  ["bench", "--help"], ["sync", "--help"]])
def test_printing_the_config_imports_neither_torch_nor_mlflow(tmp_path, args):
    """Printing a config, the help or the version must not pay for torch (seconds) or mlflow."""
    probe = ("import atexit, sys; atexit.register(lambda: print('IMPORTED', sorted(m for m in ('torch', 'mlflow') "
             "if m in sys.modules))); sys.argv = ['dlpipe'] + sys.argv[1:]; from dlpipe.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **NO_PHONE_HOME}, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "IMPORTED []"


def test_help_lists_groups_and_recipes(dlpipe):
    """--help shows every config group, recipes included."""
    r = dlpipe("--help")
    assert r.returncode == 0
    assert f"recipe: {SHIPPED_RECIPES}" in r.stdout
    assert "loader: auto, in_memory, padded, pytorch" in r.stdout


def test_subcommands_keep_overrides_together_with_options_after_them(dlpipe):
    """`dlpipe bench a=1 --cfg job`: the added task=bench must not land after --cfg's value,
    where Hydra's parser rejects a second run of overrides."""
    from dlpipe.cli import with_overrides

    assert with_overrides(["dlpipe", "a=1", "--cfg", "job"], ["t=1"]) == ["dlpipe", "a=1", "t=1", "--cfg", "job"]
    assert with_overrides(["dlpipe", "--config-dir=d", "--cfg", "job"], ["t=1"]) == [
        "dlpipe", "--config-dir=d", "--cfg", "job", "t=1"]
    r = dlpipe("bench", "+recipe=tabular", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "task: bench" in r.stdout
