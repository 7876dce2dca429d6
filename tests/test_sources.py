"""Where each value came from (user override, recipe, config option, automatic), composed by Hydra's
compose API as the CLI composes it; and the effective loader values every task records and says."""

import logging
import re

import pytest
from fake_clock import install
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from test_probe import ClockedItems

from dlpipe.cli import resolve
from dlpipe.config import decisions
from dlpipe.config.paths import conf_dir
from dlpipe.config.resolvers import register_resolvers
from dlpipe.config.sources import Origin
from dlpipe.config.store import register_recipes, register_schemas
from dlpipe.loader import decisions as loader_decisions
from dlpipe.loader.fitting import fit_loader_to_data
from dlpipe.schema import LoaderConfig
from dlpipe.tasks.preflight import JobContext


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_resolvers()
    register_schemas()
    register_recipes()


def composed(*overrides: str, config_dir=None) -> tuple[dict, dict, JobContext]:
    """(raw, resolved, the job's context) as the CLI makes them: Hydra's choices and overrides."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    with open_dict(cfg):
        del cfg["hydra"]  # the job's config, as the task function gets it
    raw, resolved = resolve(cfg)
    ctx = JobContext(output_dir=None, overrides=list(overrides), recipe=choices.get("recipe"), multirun=False,
                     config_dir=config_dir, choices=choices)
    return raw, resolved, ctx


@pytest.mark.parametrize("overrides, key, expected", [
    (["+recipe=tabular"], "loader.num_workers", "0 (config option loader=in_memory, chosen by recipe tabular)"),
    (["+recipe=tabular", "loader.num_workers=8"], "loader.num_workers", "8 (user override)"),
    (["loader=in_memory"], "loader.num_workers", "0 (config option loader=in_memory, chosen by the user)"),
    (["loader=pytorch"], "loader.pin_memory",
     "False (config option loader=pytorch, chosen by the user, which keeps the schema's default)"),
    (["+recipe=tabular", "loader=auto", "trainer.device=cpu"], "trainer.device", "cpu (user override)"),
    (["+recipe=tabular", "loader=auto"], "loader.num_workers", "(auto: CPU budget"),
    (["+recipe=nlp_ragged"], "loader.num_workers", "0 (config option loader=padded, chosen by recipe nlp_ragged)"),
])
def test_each_value_says_where_it_came_from(overrides, key, expected):
    raw, resolved, ctx = composed(*overrides)
    said = decisions.explain(raw, resolved, ctx.origin)
    if expected.startswith("("):  # automatic: the reason depends on this machine
        assert said[key].startswith(f"{resolved['loader']['num_workers']} {expected}"), said[key]
    else:
        assert said[key] == expected
    assert not any("set by the user" in line for line in said.values())


def test_recipe_keys_and_the_default_option_are_named():
    """A key the recipe sets itself is the recipe's; an option nobody picked is the default one."""
    _, _, ctx = composed("+recipe=smoke")
    assert ctx.origin.source("loader.batch_size", 32) == "recipe smoke"
    assert ctx.origin.source("loader.timeout", 0.0) == ("config option loader=auto, chosen by recipe smoke, "
                                                         "which keeps the schema's default")
    _, _, plain = composed()
    assert plain.origin.source("optim.lr", 0.001) == "config option optim=adamw, chosen by default"


def test_a_config_dir_option_and_recipe_are_config_option_and_recipe(tmp_path):
    """--config-dir DIR: DIR/loader/NAME.yaml is a config option (named with its folder), and
    DIR/recipe/NAME.yaml a recipe whose defaults list picks options."""
    (tmp_path / "loader").mkdir()
    (tmp_path / "loader" / "mine.yaml").write_text("num_workers: 1\n")
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "own.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /loader: mine\nloader:\n  batch_size: 8\n")
    origin = Origin(("+recipe=own",), {"recipe": "own", "loader": "mine"}, str(tmp_path))
    assert origin.source("loader.num_workers", 1) == (f"config option loader=mine from --config-dir {tmp_path}, "
                                                      "chosen by recipe own")
    assert origin.source("loader.batch_size", 8) == "recipe own"
    assert origin.source("loader.num_workers", "${auto_workers:}") == "auto"
    by_user = Origin(("loader=mine",), {"loader": "mine"}, str(tmp_path))
    assert by_user.source("loader.num_workers", 1).endswith("chosen by the user")


@pytest.mark.parametrize("include", ["/recipe/tabular", "{/recipe: tabular}"])
def test_a_recipe_built_on_another_credits_the_one_that_set_the_value(tmp_path, include):
    """A user recipe that includes the shipped tabular recipe: tabular picked loader=in_memory and set
    trainer.epochs, the user's recipe set the batch size on top."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(
        f"# @package _global_\ndefaults:\n  - {include}\n  - _self_\nloader:\n  batch_size: 8\n")
    origin = Origin(("+recipe=mine",), {"recipe": "mine", "loader": "in_memory"}, str(tmp_path))
    assert origin.source("loader.num_workers", 0) == "config option loader=in_memory, chosen by recipe tabular"
    assert origin.source("trainer.epochs", 5) == "recipe tabular"
    assert origin.source("loader.batch_size", 8) == "recipe mine"


def test_prefetch_follows_workers_fitted_to_the_data(monkeypatch):
    """When the fit to the data drops the workers, the automatic prefetch_factor goes with them, and
    its reason says so (not the reason of the 2 it had). Items cost 5 us each on a fake clock."""
    clock = install(monkeypatch)
    raw = {"num_workers": "${auto_workers:}", "prefetch_factor": "${auto_prefetch:${.num_workers}}",
           "persistent_workers": False}
    loader = LoaderConfig(num_workers=2, prefetch_factor=2, batch_size=16)
    fitted, reasons = fit_loader_to_data(raw, loader, 3, ClockedItems(clock, item_s=5e-6))
    assert fitted.num_workers == 0 and fitted.prefetch_factor is None
    assert reasons["loader.prefetch_factor"] == f"None (auto: {loader_decisions.prefetch(0).reason})"
    assert reasons["loader.num_workers"].startswith("0 (auto: items take 5.0 us each")


# --- one normalisation in every task --------------------------------------------------------------

ASKED = ["+recipe=smoke", "dataset.size=64", "trainer.device=cpu", "tracking=none", "loader.num_workers=0",
         "loader.prefetch_factor=4", "loader.persistent_workers=true", "loader.timeout=5",
         "loader.multiprocessing_context=spawn", "loader.pin_memory=true", "loader.worker_method=thread"]
EFFECTIVE = {"loader.pin_memory": "False", "loader.prefetch_factor": "null", "loader.persistent_workers": "False",
             "loader.timeout": "0.0", "loader.multiprocessing_context": "null", "loader.worker_method": "process"}
REQUESTED = {"requested.loader.pin_memory": "True", "requested.loader.prefetch_factor": "4",
             "requested.loader.persistent_workers": "True", "requested.loader.timeout": "5.0",
             "requested.loader.multiprocessing_context": "spawn", "requested.loader.worker_method": "thread"}
NOTES = {"loader.worker_method=thread ignored: num_workers=0 (the main process fetches)",
         "loader.prefetch_factor=4 ignored: it needs num_workers > 0",
         "loader.persistent_workers=true ignored: there are no workers to keep (num_workers=0)",
         "loader.multiprocessing_context=spawn ignored: num_workers=0",
         "loader.timeout=5.0 ignored: it bounds the wait for a worker's batch (num_workers=0)"}


def train_job(ctx, raw, resolved):
    from dlpipe.tasks.preflight import preflight
    from dlpipe.tasks.train_job import build_job
    from dlpipe.training.distributed import SINGLE

    cfg, decided = preflight(raw, resolved, "train", ctx)
    job = build_job(ctx, raw, cfg, decided, SINGLE)
    job.close()
    return job.params


def measured_job(ctx, raw, resolved):
    """bench's and tune's parent params come from their measured loader's plan."""
    from dlpipe.tasks.measurement import prepare_measurement
    from dlpipe.tasks.params import loader_params

    return loader_params(prepare_measurement(ctx, raw, {**resolved, "task": "bench"}).plan)


def tune_trial(ctx, raw, resolved):
    """The params of tune's first trial, the job's own loader: what its DataLoader got."""
    from dlpipe.loader.fitting import loader_settings
    from dlpipe.tasks.measurement import prepare_measurement
    from dlpipe.tasks.tune import start_candidate, trial_params

    job = prepare_measurement(ctx, raw, {**resolved, "task": "tune"})
    return trial_params(start_candidate(job.plan), loader_settings(job.cfg.loader), cuda=False)


def planned(ctx, raw, resolved, capsys):
    """`dlpipe plan`'s DataLoader line and its dropped notes, read back as params."""
    from dlpipe.tasks import plan

    plan.run(ctx, raw, resolved)
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("DataLoader (train")]
    params = {}
    for key, value, asked in re.findall(r"(\w+)=(\S+)(?: \(asked (\S+)\))?", line.partition(": ")[2]):
        params[f"loader.{key}"] = "null" if value == "None" else value
        if asked:
            params[f"requested.loader.{key}"] = "null" if asked == "None" else asked
    notes = [x.removeprefix("dropped: ") for x in out.splitlines() if x.startswith("dropped: ")]
    return params, notes


@pytest.mark.parametrize("task", ["train", "bench and tune", "tune trial", "plan"])
def test_every_task_normalises_the_loader_the_same_way(task, tmp_path, caplog, capsys):
    """One request that PyTorch would refuse or ignore at 0 workers on the CPU: every task records the
    same effective values with the same requested ones beside them, and says the same notes."""
    raw, resolved, ctx = composed(*ASKED)
    ctx = JobContext(tmp_path, ctx.overrides, ctx.recipe, False, choices=ctx.choices)
    caplog.set_level(logging.WARNING, logger="dlpipe")
    if task == "plan":
        params, notes = planned(ctx, raw, resolved, capsys)
    else:
        build = {"train": train_job, "bench and tune": measured_job, "tune trial": tune_trial}[task]
        params = build(ctx, raw, resolved)
        notes = [r.getMessage() for r in caplog.records if " ignored: " in r.getMessage()]
    assert {k: params[k] for k in EFFECTIVE} == EFFECTIVE
    requested = {k: v for k, v in params.items() if k.startswith("requested.")}
    if task == "tune trial":  # the tuner starts from what the DataLoader got: it asks pinning only with CUDA
        assert requested == {k: REQUESTED[k] for k in ("requested.loader.timeout",
                                                       "requested.loader.multiprocessing_context")}
        return
    assert requested == REQUESTED
    assert {note.partition(": ")[2] for note in notes} == NOTES
    assert len(notes) == len(NOTES)  # each said once, for every loader it applies to


def test_a_resume_of_an_unchanged_config_reports_no_change(tmp_path, mlflow_store, mlflow_client):
    """The effective values replace the config's under the same keys; a resume compares those keys, so
    the same request on the same machine (pinning asked for on the CPU) is no change."""
    from dlpipe.tasks.preflight import preflight
    from dlpipe.tasks.train import resume_comparisons
    from dlpipe.tasks.train_job import build_job
    from dlpipe.tracking.run import MlflowRun
    from dlpipe.training.distributed import SINGLE

    raw, resolved, ctx = composed(*ASKED)
    ctx = JobContext(tmp_path, ctx.overrides, ctx.recipe, False, choices=ctx.choices)
    jobs = []
    for _ in range(2):  # the first attempt, then the resume's: built afresh from the same config
        cfg, decided = preflight(raw, resolved, "train", ctx)
        jobs.append(build_job(ctx, raw, cfg, decided, SINGLE))
        jobs[-1].close()
    with MlflowRun(mlflow_store, "unchanged-resume", "r", {}) as first:
        first.log_params(jobs[0].params, compared=resume_comparisons(jobs[0].config_flat))
    with MlflowRun(mlflow_store, "unchanged-resume", "r", {}, resume_run_id=first.run_id) as again:
        assert again.resumed
        again.log_params(jobs[1].params, compared=resume_comparisons(jobs[1].config_flat))
    stored = mlflow_client.get_run(first.run_id).data
    assert "dlpipe.resumed_changed_params" not in stored.tags and "dlpipe.resumed_loader_changes" not in stored.tags
    assert stored.params["loader.pin_memory"] == "False" and stored.params["requested.loader.pin_memory"] == "True"
