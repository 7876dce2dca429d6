"""Tasks beyond the built-in classifiers, through the real `dlpipe` command and a real MLflow store:
a regression, a user's dict samples with a model that computes its own loss, and the one-line
refusals of samples a loss cannot use."""

import json

import pytest
from conftest import epoch_history, runs_of

from dlpipe.config.targets import check_target
from dlpipe.tracking.metric_names import dlpipe_names

QUIET = ["trainer.progress=false"]


def test_a_regression_trains_to_r2_above_0_9_and_keeps_the_best_by_it(tmp_path, dlpipe, mlflow_store, mlflow_client):
    r = dlpipe("+recipe=regression", *QUIET, "dataset.size=2048", "hydra.run.dir=run",
               f"tracking.uri={mlflow_store}", "tracking.experiment=regression")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "regression")
    metrics = dlpipe_names(run.data.metrics)
    assert run.info.status == "FINISHED" and metrics["val_r2"] > 0.9, metrics
    assert {"val_mse", "val_mae", "val_loss"} <= set(metrics) and "val_accuracy" not in metrics
    assert metrics["val_mse"] < metrics["val_mae"] < 1.0
    best = json.loads((tmp_path / "run" / "checkpoints" / "best.json").read_text())
    r2 = [m.value for m in mlflow_client.get_metric_history(run.info.run_id, "val/r2")]
    assert best["monitor"] == "val_r2" and best["value"] == max(r2)  # higher is better, from the metric itself
    assert run.data.params["loss._target_"] == "torch.nn.MSELoss"


def write_user_configs(root):
    (root / "dataset").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "dataset" / "dicts.yaml").write_text("_target_: user_task.DictDataset\nsize: 512\nnum_features: 8\n")
    (root / "model" / "selfloss.yaml").write_text("_target_: user_task.SelfLossClassifier\nnum_features: 8\n")


def test_dict_samples_and_a_model_that_computes_its_own_loss(tmp_path, dlpipe, mlflow_store, mlflow_client):
    """Hugging Face style: the whole dict goes to the model, which returns its loss with the logits;
    a torchmetrics metric from the command line scores the logits against `labels`."""
    write_user_configs(tmp_path / "mine")
    r = dlpipe("--config-dir", str(tmp_path / "mine"), "dataset=dicts", "model=selfloss", "loss=model",
               "batch.target=labels", "loader=in_memory", "loader.batch_size=32", "trainer.epochs=3", *QUIET,
               "+metrics.accuracy._target_=torchmetrics.classification.MulticlassAccuracy",
               "+metrics.accuracy.num_classes=2", "checkpoint.monitor=val/accuracy",  # as MLflow names it
               f"tracking.uri={mlflow_store}", "tracking.experiment=dicts")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "dicts")
    assert run.info.status == "FINISHED"
    assert run.data.metrics["val/accuracy"] > 0.9, run.data.metrics
    assert run.data.params["checkpoint.monitor"] == "val_accuracy"  # dlpipe's name, as the log said
    assert "checkpoint.monitor=val/accuracy: MLflow's name of val_accuracy" in r.stdout
    losses = [loss for _, loss in epoch_history(mlflow_client, run.info.run_id, "train/loss")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the model's own loss is what was minimised


def test_samples_the_loss_cannot_use_are_one_line_before_anything_starts(tmp_path, dlpipe, mlflow_store,
                                                                         mlflow_client):
    write_user_configs(tmp_path / "mine")
    cases = [
        (["+recipe=tabular", "loss=mse"],
         "loss._target_=torch.nn.MSELoss: the model's output [2, 4] float32 does not match the target [2] int64"),
        (["--config-dir", str(tmp_path / "mine"), "dataset=dicts", "model=selfloss", "batch.target=label"],
         "batch.target=label: the batch has no field 'label' (it has: features, labels)"),
        (["+recipe=regression", "checkpoint.monitor=val_accuracy"],
         "checkpoint.monitor=val_accuracy: this run logs no such validation metric; "
         "allowed: val_loss, val_mse, val_mae, val_r2"),
    ]
    for args, expected in cases:
        r = dlpipe(*args, *QUIET, "dataset.size=64", "hydra.run.dir=out", f"tracking.uri={mlflow_store}",
                   "tracking.experiment=refused")
        errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error:")]
        assert r.returncode == 2 and len(errors) == 1 and expected in errors[0], r.stderr
        assert "Traceback" not in r.stderr
        assert not (tmp_path / "out").exists()  # nothing left behind
    assert runs_of(mlflow_client, "refused") == []


def test_any_target_hydra_accepts_with_only_the_keys_given(tmp_path, dlpipe, mlflow_store, mlflow_client):
    """model=custom / dataset=custom start from nothing but the _target_, which may name a factory
    (Class.method) as third-party models often need."""
    r = dlpipe("model=custom", "model._target_=user_task.SelfLossClassifier.from_width", "+model.num_features=8",
               "+model.width=32", "dataset=custom", "dataset._target_=user_task.DictDataset", "+dataset.size=256",
               "loss=model", "batch.target=labels", "loader=in_memory", "trainer.epochs=1", *QUIET,
               f"tracking.uri={mlflow_store}", "tracking.experiment=factory")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "factory")
    assert run.info.status == "FINISHED"
    assert run.data.params["model._target_"] == "user_task.SelfLossClassifier.from_width"
    assert int(run.data.params["model.parameters"]) == 8 * 32 + 32 + 32 * 2 + 2  # the factory's width, not 16


IMPORT_FAILURES = [
    ("user_broken.Net", "cannot be imported (importing user_broken raised RuntimeError: this extension was "
                        "built for another torch)"),
    ("user_missing_dependency.Net", "cannot be imported (importing user_missing_dependency failed: No module "
                                    "named 'dlpipe_test_package_that_is_not_installed')"),
    ("not_a_package_here.Net", "cannot be imported (no module named 'not_a_package_here': is its package "
                               "installed in this environment?)"),
    ("user_task.SelfLossClassifier.nope", "cannot be imported (user_task.SelfLossClassifier has no attribute "
                                          "'nope')"),
]


@pytest.mark.parametrize("target, expected", IMPORT_FAILURES)
def test_every_kind_of_import_failure_is_one_line(target, expected):
    """What the module raised, its missing dependency, a missing package, a missing attribute: one line each
    (the tests folder is on sys.path here as it is for the CLI runs through PYTHONPATH)."""
    assert check_target("model", {"_target_": target}) == [f"model._target_={target}: {expected}"]


def test_an_import_failure_from_the_cli_is_one_line_and_leaves_nothing(tmp_path, dlpipe, mlflow_store, mlflow_client):
    target, expected = IMPORT_FAILURES[0]  # the others take the same path from validation to the CLI
    r = dlpipe("+recipe=tabular", "model=custom", f"model._target_={target}", *QUIET, "hydra.run.dir=out",
               f"tracking.uri={mlflow_store}", "tracking.experiment=imports")
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error:")]
    assert r.returncode == 2 and errors == [f"dlpipe: error: model._target_={target}: {expected}"], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
    r = dlpipe("+recipe=tabular", "model._target_=user_task.SelfLossClassifier", *QUIET, "hydra.run.dir=out")
    assert r.returncode == 2 and "start from model=custom" in r.stderr  # the mlp option's keys do not fit
    assert runs_of(mlflow_client, "imports") == []


def test_eval_reproduces_the_saved_epoch_and_init_from_fine_tunes(tmp_path, dlpipe, mlflow_store, mlflow_client):
    """Scoring a run's epoch checkpoint gives that epoch's validation numbers; a new run started from
    the run's checkpoints folder (its best.pt) begins where the first one ended."""
    common = ["+recipe=tabular", "dataset.size=1024", *QUIET, f"tracking.uri={mlflow_store}"]
    r = dlpipe(*common, "trainer.epochs=2", "hydra.run.dir=first", "tracking.experiment=eval-train")
    assert r.returncode == 0, r.stderr
    [trained] = runs_of(mlflow_client, "eval-train")
    r = dlpipe("eval", *common, "checkpoint.init_from=first/checkpoints/epoch-0002.pt", "hydra.run.dir=scored",
               "tracking.experiment=eval-score")
    assert r.returncode == 0, r.stderr
    [scored] = runs_of(mlflow_client, "eval-score")
    assert scored.info.status == "FINISHED" and scored.data.tags["dlpipe.task"] == "eval"
    for key in ("val/loss", "val/accuracy"):
        [at_epoch_2] = [v for epoch, v in epoch_history(mlflow_client, trained.info.run_id, key) if epoch == 2]
        assert abs(scored.data.metrics[key] - at_epoch_2) < 1e-6, key
    assert f"eval: val_loss {scored.data.metrics['val/loss']:.4f}" in r.stdout

    r = dlpipe(*common, "trainer.epochs=1", "checkpoint.init_from=first/checkpoints", "hydra.run.dir=tuned",
               "tracking.experiment=eval-finetune")
    assert r.returncode == 0, r.stderr
    [tuned] = runs_of(mlflow_client, "eval-finetune")
    assert tuned.data.tags["dlpipe.init_from"].endswith("first/checkpoints/best.pt")
    [(_, first_epoch)] = epoch_history(mlflow_client, trained.info.run_id, "train/loss")[:1]
    assert tuned.data.metrics["train/loss"] < first_epoch  # started from trained weights, not from scratch


def test_eval_needs_weights_that_exist(tmp_path, dlpipe):
    for args, expected in [
        ([], "checkpoint.init_from=null: dlpipe eval scores saved weights"),
        (["checkpoint.init_from=nowhere/best.pt"], "checkpoint.init_from=nowhere/best.pt: no such file or folder"),
    ]:
        r = dlpipe("eval", "+recipe=tabular", "dataset.size=256", "tracking=none", "hydra.run.dir=out", *args)
        errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error:")]
        assert r.returncode == 2 and len(errors) == 1 and expected in errors[0], r.stderr
        assert not (tmp_path / "out").exists()


def test_early_stopping_ends_a_run_whose_metric_stops_improving(dlpipe, mlflow_store, mlflow_client):
    r = dlpipe("+recipe=tabular", "dataset.size=512", "optim.lr=1e-9", "trainer.epochs=10", *QUIET,
               "trainer.early_stopping.monitor=val/loss", "trainer.early_stopping.patience=2",  # MLflow's name
               "trainer.early_stopping.min_delta=0.001", f"tracking.uri={mlflow_store}", "tracking.experiment=early")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "early")
    assert run.info.status == "FINISHED"
    assert run.data.tags["dlpipe.stopped_early"].startswith("early stopping: val_loss did not improve by more than "
                                                            "0.001 for 2 epochs")
    assert len(mlflow_client.get_metric_history(run.info.run_id, "val/loss")) == 3  # best, then 2 without gain
    assert "training ended early: early stopping: val_loss" in r.stdout  # the log (Hydra logs to stdout)


def test_a_user_callback_sees_every_hook_and_may_stop_training(tmp_path, dlpipe, mlflow_store, mlflow_client):
    record = tmp_path / "hooks.txt"
    r = dlpipe("+recipe=tabular", "dataset.size=1024", "loader.batch_size=64", "trainer.epochs=3", *QUIET,
               "+callbacks.stopper._target_=user_task.StopAfterSteps", "+callbacks.stopper.steps=20",
               f"+callbacks.stopper.record={record}", f"tracking.uri={mlflow_store}", "tracking.experiment=hooks")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "hooks")
    # 921 training samples in batches of 64: 15 steps an epoch, so step 20 is in epoch 2
    assert run.info.status == "FINISHED" and run.data.tags["dlpipe.optimizer_steps"] == "20"
    assert run.data.tags["dlpipe.stopped_early"] == "StopAfterSteps: 20 steps"
    assert record.read_text().splitlines() == ["train_start", "epoch_end 1 ['cpu_main_pct']",
                                               "epoch_end 2 ['cpu_main_pct']", "train_end 2"]


def test_a_failing_callback_fails_the_run_with_its_message(dlpipe, mlflow_store, mlflow_client):
    r = dlpipe("+recipe=tabular", "dataset.size=256", "trainer.epochs=2", *QUIET,
               "+callbacks.crash._target_=user_task.Crashes", f"tracking.uri={mlflow_store}",
               "tracking.experiment=crash")
    expected = "callbacks.crash.on_epoch_end: KeyError: 'val_f1'"
    assert r.returncode == 2 and f"dlpipe: error: {expected}" in r.stderr and "Traceback" not in r.stderr
    [run] = runs_of(mlflow_client, "crash")
    assert run.info.status == "FAILED" and expected in run.data.tags["dlpipe.end_reason"]


def test_compiled_training_runs_and_matches_the_tags(dlpipe, mlflow_store, mlflow_client):
    """trainer.compile=true goes through torch.compile (CPU inductor here) and trains."""
    r = dlpipe("+recipe=tabular", "dataset.size=256", "trainer.epochs=1", "trainer.compile=true", *QUIET,
               f"tracking.uri={mlflow_store}", "tracking.experiment=compiled", timeout=400)
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "compiled")
    assert run.info.status == "FINISHED" and run.data.params["trainer.compile"] == "True"
    assert run.data.metrics["train/loss"] > 0
    # the console says why the first step is slow, before it starts, and what it cost
    compiling = r.stdout.index("compiling the model with torch.compile (first steps are slow)")
    assert compiling < r.stdout.index("first compiled step (forward and backward) took ")


def test_eval_of_a_whole_test_set_scores_it_without_augmentation(tmp_path, dlpipe):
    """trainer.val_fraction=0 scores the whole dataset, as validation would: the same numbers twice,
    although the vision dataset augments every training item at random."""
    r = dlpipe("+recipe=smoke", *QUIET, "trainer.epochs=1", "trainer.limit_train_batches=2", "tracking=none",
               "hydra.run.dir=first")
    assert r.returncode == 0, r.stderr
    lines = []
    for out in ("a", "b"):
        r = dlpipe("eval", "+recipe=smoke", "trainer.val_fraction=0", "dataset.size=64", "tracking=none",
                   "checkpoint.init_from=first/checkpoints", f"hydra.run.dir={out}")
        assert r.returncode == 0, r.stderr
        [line] = [x for x in r.stdout.splitlines() if x.startswith("eval: ")]
        assert "64 samples of the whole dataset" in line
        lines.append(line.split(" (")[0])
    assert lines[0] == lines[1]


def test_a_lazy_modules_import_failure_is_one_line(monkeypatch):
    """Packages like transformers import their classes on attribute access; whatever that raises is
    reported in one line too."""
    import sys
    import types


    lazy = types.ModuleType("lazy_models")

    def __getattr__(name):
        raise RuntimeError(f"Failed to import lazy_models.{name} because of:\nNo module named 'tokenizers'")

    lazy.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, "lazy_models", lazy)
    assert check_target("model", {"_target_": "lazy_models.Bert"}) == [
        "model._target_=lazy_models.Bert: cannot be imported (lazy_models.Bert raised RuntimeError: Failed to "
        "import lazy_models.Bert because of:)"]
