"""The names MLflow shows: metrics grouped by prefix, one chart section each, and dlpipe's own names
back from them (tracking/metric_names.py); run names that say what differs (tracking/run_names.py);
the dataset as a run input (tracking/dataset_input.py); short `auto.*` params (tasks/params.py)."""

import pytest
from test_sources import composed, registered  # noqa: F401 - registered: the configs compose

from dlpipe.config.decisions import explain
from dlpipe.sweeps.callback import swept_keys
from dlpipe.tasks.fit_checks import TELEMETRY_METRICS
from dlpipe.tasks.params import auto_params, auto_tags
from dlpipe.tracking.dataset_input import describe, log_inputs, mlflow_inputs
from dlpipe.tracking.metric_names import dlpipe_name, mlflow_name
from dlpipe.tracking.run_names import job_name, sweep_name


@pytest.mark.parametrize("name, shown", [
    ("train_loss", "train/loss"), ("train_loss_step", "train/loss_step"), ("val_loss", "val/loss"),
    ("val_r2", "val/r2"), ("lr", "train/lr"), ("lr/group_1", "train/lr_group_1"),
    ("epoch_lr/group_0", "train/epoch_lr_group_0"), ("grad_norm", "train/grad_norm"),
    ("samples_per_s", "perf/samples_per_s"), ("data_wait_frac", "loader/data_wait_frac"),
    ("cpu_util", "resources/cpu_util"), ("rss_peak_mb", "resources/rss_peak_mb"), ("epoch", "epoch"),
    ("my_callbacks_metric", "my_callbacks_metric"),
])
def test_names_are_grouped_by_prefix_and_read_back(name, shown):
    assert mlflow_name(name) == shown and dlpipe_name(shown) == name


def test_every_epoch_metric_has_a_section_and_mlflows_own_stay_apart():
    assert all("/" in mlflow_name(name) for name in TELEMETRY_METRICS)
    # none under system/: MLflow's UI charts that prefix against wall-clock time, as its own
    assert not any(mlflow_name(name).startswith("system/") for name in TELEMETRY_METRICS)
    # MLflow's system metrics (MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING) share system/ under their own names
    assert dlpipe_name("system/cpu_utilization_percentage") == "system/cpu_utilization_percentage"
    assert mlflow_name("system/cpu_utilization_percentage") == "system/cpu_utilization_percentage"


def test_run_names_say_what_differs_in_a_few_characters():
    swept = swept_keys(["loader.num_workers=0,2", "+loader.pin_memory=true,false", "trainer.epochs=2",
                        "model=cnn,mlp", "trainer.progress=false"])
    assert swept == ["loader.num_workers", "loader.pin_memory", "model"]
    job = ["loader.num_workers=2", "+loader.pin_memory=true", "trainer.epochs=2", "model=mlp",
           "trainer.progress=false"]
    # a sweep's job: its values only, in the parent's order (the parent's name names the keys)
    assert job_name("smoke", job, swept) == "2 true mlp"
    assert sweep_name("smoke", ["loader.num_workers=0,2", "+loader.pin_memory=true,false", "model=cnn,mlp"],
                      swept) == "num_workers=0,2 pin_memory=true,false model=cnn,mlp (sweep smoke)"
    # a run of its own: recipe and overrides, less the noise; keys that end alike stay whole; secrets masked
    assert job_name("vision", ["trainer.epochs=3", "model.width=8", "dataset.width=8", "trainer.progress=false",
                               "tracking.uri=http://u:pw@host", "+dataset.api_key=SECRET"]) == \
        "vision epochs=3 model.width=8 dataset.width=8 api_key=***"
    assert job_name("smoke", ["+dataset.token=SECRET", "optim.lr=0.1"], ["dataset.token", "optim.lr"]) == "*** 0.1"


def test_a_run_name_says_the_value_that_ran_where_dlpipe_ran_another():
    """The job's params hold `requested.<key>` where dlpipe changed a value (pin_memory without CUDA)."""
    ran = {"loader.pin_memory": "False", "requested.loader.pin_memory": "True", "loader.num_workers": "0"}
    swept = ["loader.num_workers", "loader.pin_memory"]
    assert job_name("smoke", ["loader.num_workers=0", "loader.pin_memory=true"], swept, ran) == "0 true->false"
    assert job_name("smoke", ["loader.num_workers=0", "loader.pin_memory=false"], swept,
                    {"loader.pin_memory": "False", "loader.num_workers": "0"}) == "0 false"
    assert job_name("smoke", ["loader.pin_memory=true"], None, ran) == "smoke pin_memory=true->false"
    # as Hydra hands the values of `loader.pin_memory=false,true` to the sweep's jobs
    assert job_name("smoke", ["loader.num_workers=0", "loader.pin_memory=True"], swept, ran) == "0 true->false"


def test_run_names_hold_no_class_paths_and_no_long_floats():
    target = "+metrics.acc._target_=torchmetrics.classification.MulticlassAccuracy"
    assert job_name("bert", ["trainer.epochs=2", target]) == "bert epochs=2 acc=MulticlassAccuracy"
    assert "torchmetrics" not in job_name("bert", ["+metrics.acc={_target_:torchmetrics.Accuracy,num_classes:3}"])
    swept = ["metrics.acc._target_", "optim.lr"]
    assert sweep_name("bert", ["metrics.acc._target_=a.b.F1Score,a.b.Accuracy", "optim.lr=0.1,0.01"], swept) == \
        "acc=F1Score,Accuracy lr=0.1,0.01 (sweep bert)"
    assert sweep_name("bert", ["hydra.sweeper.n_trials=3"], []) == "sweep bert"  # nothing swept on the command line
    # a value sampled by a search (Hydra's Optuna sweeper) is shown to 4 significant digits; ints as given
    assert job_name("bert", ["metrics.acc._target_=a.b.F1Score", "optim.lr=0.0031622776601683794"], swept) == \
        "F1Score 0.003162"
    assert job_name("tabular", ["dataset.size=100000000", "optim.lr=1e-3"]) == "tabular size=100000000 lr=1e-3"


def test_a_dataset_in_a_folder_is_a_local_source_and_its_digest_follows_its_config(tmp_path):
    config = {"_target_": "dlpipe.data.vision.ImageFolderDataset", "root": str(tmp_path), "api_token": "SECRET"}
    described = describe(config, {"train": 90, "validation": 10})
    [train, val] = mlflow_inputs(described)
    assert (train.dataset.name, train.dataset.source_type) == ("ImageFolderDataset", "local")
    assert str(tmp_path) in train.dataset.source and "SECRET" not in str(described)
    assert [i.tags[0].value for i in (train, val)] == ["train", "validation"]
    assert (train.dataset.profile, val.dataset.profile) == ('{"samples": 90}', '{"samples": 10}')
    # each split a dataset of its own (MLflow keeps one input per dataset and run)
    assert train.dataset.digest != val.dataset.digest
    digest = described["splits"]["train"]["digest"]
    assert describe(config, {"train": 90})["splits"]["train"]["digest"] == digest  # same data, same settings
    assert describe({**config, "image_size": 64}, {"train": 90})["splits"]["train"]["digest"] != digest


def test_a_run_that_loses_the_stores_dataset_race_still_logs_its_input(tmp_path):
    """Two jobs of a parallel sweep log one dataset into one experiment: MLflow's store looks it up,
    misses it, and the other job inserts it before this one writes. The store refuses the second
    insert on its unique key; log_inputs writes again and links the winner's dataset."""
    from mlflow import MlflowClient
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("race")
    winner, loser, dlpipe_loser = (client.create_run(experiment).info.run_id for _ in range(3))

    def race(described, write) -> None:
        """write() while the winner logs the same dataset between write's lookup and its insert."""
        event.listen(Session, "before_flush",
                     lambda *args: client.log_inputs(winner, datasets=mlflow_inputs(described)), once=True)
        write()

    first = describe({"_target_": "dlpipe.data.tabular.Tabular", "size": 512}, {"train": 512})
    with pytest.raises(Exception, match="UNIQUE constraint failed: datasets"):  # what MLflow alone does
        race(first, lambda: client.log_inputs(loser, datasets=mlflow_inputs(first)))
    second = describe({"_target_": "dlpipe.data.tabular.Tabular", "size": 256}, {"train": 256})
    race(second, lambda: log_inputs(client, dlpipe_loser, second))

    logged = {run: [i.dataset.digest for i in client.get_run(run).inputs.dataset_inputs]
              for run in (winner, loser, dlpipe_loser)}
    [first_digest, second_digest] = (d["splits"]["train"]["digest"] for d in (first, second))
    assert (sorted(logged[winner]), logged[loser], logged[dlpipe_loser]) == (
        sorted([first_digest, second_digest]), [], [second_digest])


def test_monitors_may_be_named_as_mlflow_shows_them(caplog):
    """checkpoint, early-stopping and scheduler monitors given by MLflow's names are dlpipe's names
    from then on (the log says so); dlpipe's own names and None are left as they are."""
    import logging
    from types import SimpleNamespace

    from dlpipe.tasks.preflight import accept_mlflow_names

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(monitor="val/accuracy"),
                          trainer=SimpleNamespace(early_stopping=SimpleNamespace(monitor=None)),
                          scheduler={"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "monitor": "val/loss"})
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        accept_mlflow_names(cfg)
    assert (cfg.checkpoint.monitor, cfg.trainer.early_stopping.monitor, cfg.scheduler["monitor"]) == (
        "val_accuracy", None, "val_loss")
    assert "scheduler.monitor=val/loss: MLflow's name of val_loss" in caplog.text
    caplog.clear()
    accept_mlflow_names(cfg)  # dlpipe's names: nothing to say
    assert cfg.checkpoint.monitor == "val_accuracy" and caplog.text == ""


@pytest.mark.parametrize("overrides, key, param", [
    (["+recipe=tabular", "loader.num_workers=8"], "loader.num_workers", "8 (user)"),
    (["+recipe=tabular"], "loader.num_workers", "0 (option)"),
    (["+recipe=smoke"], "loader.batch_size", None),  # not hardware-aware: no auto.* param
    (["loader=pytorch"], "loader.pin_memory", "False (option)"),
    (["+recipe=tabular", "loader=auto", "trainer.device=cpu"], "trainer.device", "cpu (user)"),
])
def test_auto_params_are_short_and_their_explanations_are_tags(overrides, key, param):
    """What the compare view's first choices show: `VALUE (SOURCE)`; the sentence is the tag
    `dlpipe.auto.KEY`, as the log words it."""
    raw, resolved, ctx = composed(*overrides)
    said = explain(raw, resolved, ctx.origin)
    params, tags = auto_params(said), auto_tags(said)
    assert params.get(f"auto.{key}") == param
    assert tags.get(f"dlpipe.auto.{key}") == said.get(key)
    assert set(params) == {f"auto.{k}" for k in said} and set(tags) == {f"dlpipe.auto.{k}" for k in said}
    assert all(len(v) <= 16 for v in params.values()), params  # whole in the UI's columns
    budget = resolved["loader"]["num_workers"]
    if "loader=auto" in overrides:  # automatic here: the value and one word; the reason in the tag only
        assert params["auto.loader.num_workers"] == f"{budget} (auto)"
        assert tags["dlpipe.auto.loader.num_workers"].startswith(f"{budget} (auto: CPU budget")
