"""Hyperparameter search through the real CLI: Hydra's Optuna sweeper (the `hpo` extra) optimises what
each dlpipe job returns, sweep.objective's value at the last epoch, read back from a real MLflow store."""

import importlib.util

import pytest
import yaml
from conftest import runs_of

OPTUNA_MISSING = importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None
# The regression recipe made tiny: a few seconds a trial on 2 CPUs.
TINY_REGRESSION = ["+recipe=regression", "trainer.epochs=2", "dataset.size=512", "trainer.progress=false"]


@pytest.mark.integration
@pytest.mark.skipif(OPTUNA_MISSING, reason="Hydra's Optuna sweeper is not installed: pip install -e '.[hpo]'")
def test_optuna_search_receives_the_objective_the_children_logged(dlpipe, tmp_path, mlflow_store, mlflow_client):
    r = dlpipe("--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.direction=maximize",
               "hydra.sweeper.sampler.seed=0", "hydra.sweep.dir=search", "optim.lr=tag(log,interval(1e-4,1e-1))",
               "sweep.objective=val/r2", *TINY_REGRESSION, f"tracking.uri={mlflow_store}",
               "tracking.experiment=hpo", timeout=600)
    assert r.returncode == 0, r.stderr
    runs = runs_of(mlflow_client, "hpo")
    [parent] = [x for x in runs if x.data.tags.get("dlpipe.role") == "sweep"]
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3 and len(runs) == 4
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["dlpipe.objective"] == "val/r2"
        assert child.data.tags["dlpipe.objective_direction"] == "max"
        assert child.data.params["sweep.objective"] == "val/r2"
    assert len({c.data.params["optim.lr"] for c in children}) == 3
    # What Optuna recorded as the best trial is what the best child logged at its last epoch.
    result = yaml.safe_load((tmp_path / "search" / "optimization_results.yaml").read_text())
    best = max(children, key=lambda c: c.data.metrics["val/r2"])
    assert result["best_value"] == pytest.approx(best.data.metrics["val/r2"], rel=1e-9, abs=0)
    assert result["best_params"]["optim.lr"] == pytest.approx(float(best.data.params["optim.lr"]))
    last_epoch = max(mlflow_client.get_metric_history(best.info.run_id, "val/r2"), key=lambda m: m.step)
    assert last_epoch.value == best.data.metrics["val/r2"]


@pytest.mark.integration
@pytest.mark.parametrize("args, line", [
    (["sweep.objective=val_r2"], "sweep.objective=val_r2: this job does not log it; it logs train_loss, val_loss, "
                                 "val_accuracy or a timing such as samples_per_s"),
    (["sweep.objective=val/loss", "trainer.val_fraction=0"], "sweep.objective=val/loss: this job does not validate"),
])
def test_an_objective_the_job_will_not_log_is_refused_before_anything_is_made(dlpipe, tmp_path, args, line):
    r = dlpipe("+recipe=smoke", *args, f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    assert r.returncode == 2, r.stderr
    [error] = [x for x in r.stderr.splitlines() if x]
    assert error.startswith(f"dlpipe: error: {line}"), error
    assert list(tmp_path.iterdir()) == []  # no output folder, no MLflow store


@pytest.mark.skipif(OPTUNA_MISSING, reason="Hydra's Optuna sweeper is not installed: pip install -e '.[hpo]'")
@pytest.mark.parametrize("args, line", [
    # Optuna's default direction is minimize: r2 is better higher
    (["+recipe=regression", "sweep.objective=val/r2"],
     "hydra.sweeper.direction=minimize: val_r2 is better higher (sweep.direction=max), so the sweeper would seek "
     "the worst trial; set hydra.sweeper.direction=maximize"),
    (["+recipe=smoke", "hydra.sweeper.direction=maximize"],
     "hydra.sweeper.direction=maximize: val_loss is better lower (sweep.direction=min), so the sweeper would seek "
     "the worst trial; set hydra.sweeper.direction=minimize"),
    (["+recipe=smoke", "sweep.objective=val_r2"],
     "sweep.objective=val_r2: this job does not log it; it logs train_loss, val_loss, val_accuracy or a timing"),
], ids=["default-direction", "maximize-a-loss", "not-logged"])
def test_a_search_every_trial_would_refuse_stops_before_its_folder_and_parent_run(dlpipe, tmp_path, args, line):
    """The objective is checked once on the sweep's shared config (tasks.objective_check): before, each
    trial failed on it in turn, after the sweep's folder and parent run were made."""
    r = dlpipe("--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "optim.lr=interval(1e-3,1e-1)",
               *args, f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    assert r.returncode == 2, r.stderr
    [error] = [x for x in r.stderr.splitlines() if x]
    assert error.startswith(f"dlpipe: error: {line}"), error
    assert "epoch 1/" not in r.stdout + r.stderr
    assert list(tmp_path.iterdir()) == []  # no sweep folder, no MLflow store


@pytest.mark.skipif(OPTUNA_MISSING, reason="Hydra's Optuna sweeper is not installed: pip install -e '.[hpo]'")
def test_the_search_check_leaves_what_only_a_built_job_knows_to_the_jobs():
    """A metric of the user's own has its direction from its torchmetrics class, known once built: the
    sweep-wide check passes it to the jobs; the basic sweeper, which ignores what jobs return, is not checked."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from dlpipe.config.paths import conf_dir
    from dlpipe.config.resolvers import register_resolvers
    from dlpipe.config.store import register_recipes, register_schemas
    from dlpipe.tasks.objective_check import objective_problem

    register_resolvers()
    register_schemas()
    register_recipes()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        def problems(*overrides):
            return objective_problem(compose("config", overrides=list(overrides), return_hydra_config=True))

        mine = ["+recipe=smoke", "sweep.objective=val_acc",
                "+metrics.acc._target_=torchmetrics.classification.MulticlassAccuracy", "+metrics.acc.num_classes=10"]
        assert problems("hydra/sweeper=optuna", *mine) == []
        # the same config is checked where its direction is given
        [line] = problems("hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "sweep.direction=min", *mine)
        assert line.startswith("hydra.sweeper.direction=maximize: val_acc is better lower (sweep.direction=min)")
        [line] = problems("hydra/sweeper=optuna", "+recipe=smoke", "sweep.objective=val_acc")
        assert line.startswith("sweep.objective=val_acc: this job does not log it")
        # a search over a key the objective depends on: the defaults say nothing of what the trials log
        r2 = ["hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "+recipe=smoke", "sweep.objective=val_r2"]
        [line] = problems(*r2)
        assert line.startswith("sweep.objective=val_r2: this job does not log it")
        searched = compose("config", overrides=r2, return_hydra_config=True)
        with open_dict(searched):
            searched.hydra.overrides.task.append("loss=choice(mse,l1)")
        assert objective_problem(searched) == []
        in_params = compose("config", overrides=r2, return_hydra_config=True)
        with open_dict(in_params):
            in_params.hydra.sweeper.params = {"loss": "choice(mse,l1)", "optim.lr": "interval(0.001,0.1)"}
        assert objective_problem(in_params) == []
        assert problems("+recipe=smoke", "sweep.objective=val_acc") == []  # the basic sweeper: not its business
