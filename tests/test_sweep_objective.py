"""sweep.objective: what a training job returns to Hydra's sweepers. Name resolution (dlpipe's and
MLflow's names), direction, the refusals (config alone, then the built validation metrics, then the
sweeper's own direction) and the tags, on configs composed as the CLI composes them."""

from types import SimpleNamespace

import pytest
import torch
import torchmetrics
from conftest import runs_of
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dlpipe.config.objective import (
    BASIC_SWEEPER,
    DEFAULT_METRICS,
    Sweeper,
    SweepObjective,
    check_sweeper,
    choose_objective,
    settle,
)
from dlpipe.config.paths import conf_dir
from dlpipe.config.resolvers import register_resolvers
from dlpipe.config.store import register_recipes, register_schemas
from dlpipe.config.validation import validate
from dlpipe.errors import ConfigError
from dlpipe.tasks.build import build_metrics, build_objective
from dlpipe.tasks.preflight import accept_mlflow_names
from dlpipe.tasks.tracking_run import objective_tags
from dlpipe.tasks.train import sweep_objective
from dlpipe.training.objective import Objective

OPTUNA = Sweeper("hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper", "minimize")
LOGGED = ("it logs train_loss, val_loss, val_accuracy or a timing such as samples_per_s, epoch_time_s, data_wait_frac "
          "(by these names or MLflow's: train/loss, perf/samples_per_s)")


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_resolvers()
    register_schemas()
    register_recipes()


def job(*overrides: str, recipe: str = "smoke"):
    """(typed config, resolved dict) as the CLI makes them before a job is built."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"+recipe={recipe}", *overrides])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    typed = validate(resolved, cpu_budget=2)
    accept_mlflow_names(typed)
    return typed, resolved


def chosen(*overrides: str, recipe: str = "smoke") -> SweepObjective | None:
    return sweep_objective(job(*overrides, recipe=recipe)[0])


@pytest.mark.parametrize("overrides, recipe, metric, direction", [
    ((), "smoke", "val_loss", "min"),  # checkpoint.monitor's metric
    ((), "regression", "val_r2", "max"),  # the recipe monitors val_r2: a default metric of regression
    (("sweep.objective=val/accuracy",), "smoke", "val_accuracy", "max"),  # MLflow's name
    (("sweep.objective=train/loss",), "smoke", "train_loss", "min"),
    (("sweep.objective=perf/samples_per_s",), "smoke", "samples_per_s", "max"),
    (("sweep.objective=epoch_time_s",), "smoke", "epoch_time_s", "min"),
    (("sweep.objective=loader/data_wait_frac",), "smoke", "data_wait_frac", "min"),
    (("sweep.objective=val_mae",), "regression", "val_mae", "min"),
    (("sweep.objective=val_loss", "sweep.direction=max"), "smoke", "val_loss", "max"),  # overridden
    (("sweep.objective=cpu_util", "sweep.direction=max"), "smoke", "cpu_util", "max"),
    (("checkpoint.monitor=samples_per_s", "checkpoint.mode=max"), "smoke", "samples_per_s", "max"),  # the monitor's
])
def test_the_objective_and_its_direction_from_the_config(overrides, recipe, metric, direction):
    objective = chosen(*overrides, recipe=recipe)
    assert (objective.metric, objective.direction) == (metric, direction)
    assert objective.given == any(o.startswith("sweep.objective=") for o in overrides)


def test_a_user_metric_takes_its_direction_from_torchmetrics_once_built():
    cfg, resolved = job("+metrics.acc._target_=torchmetrics.classification.MulticlassAccuracy",
                        "+metrics.acc.num_classes=10", "+metrics.err._target_=torchmetrics.MeanAbsoluteError",
                        "sweep.objective=val/acc")
    objective = sweep_objective(cfg)
    assert (objective.metric, objective.direction, objective.named) == ("val_acc", None, "val/acc")
    built = {"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=10),
             "err": torchmetrics.MeanAbsoluteError()}
    assert settle(objective, built, validating=True).direction == "max"
    lower = SweepObjective("val_err", None, True, "val_err")
    assert settle(lower, built, validating=True).direction == "min"


def test_a_metric_that_does_not_say_its_direction_is_refused_under_auto():
    class Plain(torchmetrics.Metric):  # no higher_is_better
        def update(self, *args):
            pass

        def compute(self):
            return torch.tensor(0.0)

    objective = SweepObjective("val_mine", None, True, "val/mine")
    with pytest.raises(ConfigError) as e:
        settle(objective, {"mine": Plain()}, validating=True)
    assert e.value.problems == ["sweep.objective=val/mine with sweep.direction=auto: Plain does not say whether "
                                "higher is better; set sweep.direction=min or sweep.direction=max"]


@pytest.mark.parametrize("overrides, line", [
    (("sweep.objective=val_r2",), f"sweep.objective=val_r2: this job does not log it; {LOGGED}"),
    (("sweep.objective=val/r2",), f"sweep.objective=val/r2: this job does not log it; {LOGGED}"),
    (("sweep.objective=val_acuracy",), f"sweep.objective=val_acuracy: this job does not log it; {LOGGED}; "
                                       "did you mean val_accuracy?"),
    (("sweep.objective=val_loss", "trainer.val_fraction=0"),
     "sweep.objective=val_loss: this job does not validate (trainer.val_fraction=0 without a val_dataset, or "
     "trainer.limit_val_batches=0), so it logs no val_ metric; it logs train_loss or a timing such as samples_per_s, "
     "epoch_time_s, data_wait_frac (by these names or MLflow's: train/loss, perf/samples_per_s); did you mean "
     "train_loss?"),
    (("sweep.objective=val/accuracy", "trainer.limit_val_batches=0"), "sweep.objective=val/accuracy: this job does "
     "not validate"),
    (("sweep.objective=val_accuracy", "metrics={}"), "sweep.objective=val_accuracy: this job does not log it; it logs "
     "train_loss, val_loss or a timing"),
    (("sweep.objective=samples",), "sweep.objective=samples: this job does not log it"),
    (("sweep.objective=cpu_util",), "sweep.objective=cpu_util with sweep.direction=auto: whether more of it is "
                                    "better is yours to say; set sweep.direction=min or sweep.direction=max"),
    (("sweep.direction=up",), "sweep.direction=up: allowed: auto, min, max"),
    (("+sweep.objectiv=val_loss",), "sweep.objectiv: no such key; did you mean sweep.objective? allowed: direction, "
                                    "objective"),
])
def test_an_objective_the_job_will_not_log_is_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as e:
        chosen(*overrides)
    [problem] = e.value.problems
    assert problem.startswith(line), problem


def test_the_default_is_dropped_where_the_run_does_not_log_it_unless_a_sweeper_reads_it():
    cfg, resolved = job("trainer.val_fraction=0")
    assert sweep_objective(cfg) is None  # a single run (or the basic sweeper) returns nothing
    basic = Sweeper(BASIC_SWEEPER)
    assert choose_objective(cfg, set(), "classification", basic) is None
    with pytest.raises(ConfigError) as e:
        choose_objective(cfg, set(), "classification", OPTUNA)
    assert e.value.problems[0].startswith(
        "sweep.objective=null: the sweeper optimises what each job returns, and the default, checkpoint.monitor="
        "val_loss, this job does not validate")
    # ... and once built: a validation split that came out empty
    defaulted = SweepObjective("val_loss", "min", False, "val_loss")
    assert settle(defaulted, {}, validating=False) is None
    with pytest.raises(ConfigError, match=r"^sweep.objective=null: checkpoint.monitor=val_loss: this job has no "):
        settle(defaulted, {}, validating=False, sweeper=OPTUNA)
    given = SweepObjective("val_loss", "min", True, "val/loss")
    with pytest.raises(ConfigError, match=r"^sweep.objective=val/loss: this job has no validation split; it logs "
                                          r"train_loss or"):
        settle(given, {}, validating=False)


class Direction:
    """As Hydra's Optuna sweeper config holds its default (an enum member with a name)."""

    name = "minimize"


@pytest.mark.parametrize("given, direction, problem", [
    ("minimize", "min", None),
    ("maximize", "max", None),
    (Direction(), "min", None),
    (None, "max", None),  # a sweeper without a direction of its own
    ("minimize", "max", "hydra.sweeper.direction=minimize: val_r2 is better higher (sweep.direction=max), so the "
                        "sweeper would seek the worst trial; set hydra.sweeper.direction=maximize"),
    (Direction(), "max", "hydra.sweeper.direction=minimize: val_r2 is better higher"),
    ("maximize", "min", "hydra.sweeper.direction=maximize: val_r2 is better lower (sweep.direction=min), so the "
                        "sweeper would seek the worst trial; set hydra.sweeper.direction=minimize"),
    (["minimize", "maximize"], "min", "hydra.sweeper.direction=[minimize,maximize]: dlpipe returns one objective "
                                      "(sweep.objective=val_r2); give one direction"),
])
def test_the_sweepers_own_direction_must_agree(given, direction, problem):
    objective = SweepObjective("val_r2", direction, True, "val_r2")
    if problem is None:
        check_sweeper(objective, Sweeper(OPTUNA.target, given))
        return
    with pytest.raises(ConfigError) as e:
        check_sweeper(objective, Sweeper(OPTUNA.target, given))
    assert e.value.problems[0].startswith(problem)


def test_a_direction_known_from_the_config_is_checked_against_the_sweeper_before_anything_is_built():
    cfg, _ = job(recipe="regression")
    with pytest.raises(ConfigError, match="hydra.sweeper.direction=minimize: val_r2 is better higher"):
        choose_objective(cfg, set(), "regression", OPTUNA)


def test_the_value_returned_is_the_last_epochs(caplog):
    objective = SweepObjective("val_r2", "max", True, "val_r2")
    history = [{"epoch": 1, "val_r2": 0.9}, {"epoch": 2, "val_r2": 0.5}]  # the best epoch was the first
    assert objective.value(history) == 0.5
    assert objective.value(history[:1]) == 0.9  # stopped early after one epoch: its last
    assert objective.value([{"epoch": 1, "train_loss": 1.0}]) is None
    assert "sweep.objective=val_r2: the last epoch logged no value of it" in caplog.text


@pytest.mark.parametrize("metric, direction, tags", [
    ("val_acc", "max", {"dlpipe.objective": "val/acc", "dlpipe.objective_direction": "max"}),
    ("samples_per_s", "max", {"dlpipe.objective": "perf/samples_per_s", "dlpipe.objective_direction": "max"}),
    ("train_loss", "min", {"dlpipe.objective": "train/loss", "dlpipe.objective_direction": "min"}),
])
def test_the_tags_name_the_metric_as_mlflow_shows_it(metric, direction, tags):
    assert objective_tags(SweepObjective(metric, direction, True)) == tags
    assert objective_tags(None) == {}


@pytest.mark.parametrize("loss, prediction", [
    ("cross_entropy", torch.zeros(2, 10)), ("bce_with_logits", torch.zeros(2)), ("mse", torch.zeros(2)),
    ("l1", torch.zeros(2)), ("model", torch.zeros(2)),
])
def test_the_default_metrics_table_is_what_build_metrics_builds(loss, prediction):
    """DEFAULT_METRICS (the config layer's, which builds nothing) against tasks.build.build_metrics."""
    cfg, _ = job(f"loss={loss}")
    objective = build_objective(cfg)
    assert isinstance(objective, Objective)
    built = build_metrics(SimpleNamespace(metrics=None), objective, prediction)
    expected = DEFAULT_METRICS.get(objective.kind, {})
    assert {name: "max" if m.higher_is_better else "min" for name, m in built.items()} == expected


@pytest.mark.integration
def test_a_sweep_without_an_objective_ranks_by_the_monitored_metric_in_its_decided_direction(
        dlpipe, mlflow_store, mlflow_client):
    """The regression recipe monitors val_r2 with checkpoint.mode=auto and sets no sweep.objective: each
    job tags the monitored metric as its objective with the direction auto decided (max: R2Score is
    better higher), and the sweep ranks by it, saying where it came from; not by val_loss, which the
    jobs log too."""
    r = dlpipe("--multirun", "+recipe=regression", "trainer.epochs=1", "dataset.size=256", "trainer.progress=false",
               "optim.lr=0.01,0.001", f"tracking.uri={mlflow_store}", "tracking.experiment=monitored", timeout=300)
    assert r.returncode == 0, r.stderr
    runs = runs_of(mlflow_client, "monitored")
    [parent] = [x for x in runs if x.data.tags.get("dlpipe.role") == "sweep"]
    children = [x for x in runs if x is not parent]
    assert len(children) == 2
    for child in children:
        tags = child.data.tags
        assert (tags["dlpipe.objective"], tags["dlpipe.objective_direction"]) == ("val/r2", "max")
        assert child.data.params["checkpoint.mode"] == "auto"  # what the run was given; the tag, what it decided
    assert parent.data.tags["dlpipe.objective_of_sweep"] == "val_r2 (max, from checkpoint.monitor)"
