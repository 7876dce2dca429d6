"""`dlpipe --help`, `dlpipe COMMAND --help` and `dlpipe --version`, through the real command.

The pages are Hydra help templates (conf/hydra/help/), so Hydra itself lists the groups and recipes;
these tests hold them to what the package ships and to the keys the schema declares.
"""

import dataclasses
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR

from dlpipe.config.paths import conf_dir, recipe_dirs
from dlpipe.config.store import find_recipes
from dlpipe.schema import CHOICES, DlpipeConfig

HYDRA_COMMANDS = tuple(task for task in CHOICES["task"] if task != "train")  # train is the command-less default
COMMANDS = (*HYDRA_COMMANDS, "sync")  # sync is argparse, not a Hydra app
SHARED_SECTIONS = ("== Recipes and config groups ==", "== Common keys ==", "== Flags ==", "Guide: README.md")
# Each page names its command's own keys (or, for plan, what it refrains from).
OWN_WORDS = {"bench": ["bench.warmup_batches", "bench.batches", "bench.mode"],
             "tune": ["bench.repeats", "bench.min_gain", "bench.max_workers", "tuned/loader/tuned.yaml"],
             "eval": ["checkpoint.init_from", "trainer.val_fraction", "val_loss"],
             "plan": ["runs nothing", "writes nothing"]}

# The groups the schema types (dataclasses): a `group.key` in a page must be one of their fields.
TYPED = {f.name: {g.name for g in dataclasses.fields(f.default_factory)}
         for f in dataclasses.fields(DlpipeConfig) if dataclasses.is_dataclass(f.default_factory)}


def named_keys(text: str) -> set[str]:
    return set(re.findall(rf"\b(?:{'|'.join(TYPED)})\.[a-z_]+\b", text))


def unknown_keys(text: str) -> list[str]:
    text = re.sub(r"\S+\.md\b", "", text)  # a docs page (docs/loader.md) is no key
    return sorted(k for k in named_keys(text) if k.split(".")[1] not in TYPED[k.split(".")[0]])


def shipped_groups() -> dict[str, list[str]]:
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in conf_dir().iterdir()
            if d.is_dir() and d.name != "hydra"}


@pytest.mark.parametrize("task", CHOICES["task"])
def test_every_task_has_its_module_and_its_help_page(task):
    """The task list is written once (schema.CHOICES["task"]): each name needs dlpipe.tasks.<name>
    with run(ctx, raw, resolved), and, but for train (`dlpipe --help`), a page of its own."""
    import importlib
    import inspect

    module = importlib.import_module(f"dlpipe.tasks.{task}")
    assert list(inspect.signature(module.run).parameters)[:3] == ["ctx", "raw", "resolved"]
    page = "dlpipe" if task == "train" else task
    assert (conf_dir() / "hydra" / "help" / f"{page}.yaml").is_file()


def test_help_lists_commands_recipes_groups_and_keys(dlpipe):
    r = dlpipe("--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    commands = out.split("== Commands ==")[1].split("==")[0]
    for command in COMMANDS:
        assert re.search(rf"^  {command} +\w", commands, re.M), f"{command} missing from the commands:\n{commands}"
    assert re.search(r"^  \(none\) +train:", commands, re.M)  # training is the command-less default
    recipes = sorted(find_recipes(recipe_dirs()[:1]))
    assert f"recipe: {', '.join(recipes)}\n" in out
    for group, options in shipped_groups().items():
        assert f"{group}: {', '.join(options)}\n" in out
    for key in ("loader.num_workers", "loader.batch_size", "loader.fetch", "loader.worker_method",
                "trainer.epochs", "trainer.devices", "tracking.uri", "checkpoint.resume"):
        assert re.search(rf"^  {re.escape(key)} +\w", out, re.M), f"{key} has no line of its own"
    assert unknown_keys(out) == []
    assert "$MLFLOW_TRACKING_URI" in out  # the template's $$ became one dollar
    assert "dlpipe +recipe=vision loader.num_workers=8" in out  # an example from README's "First run"
    for section in SHARED_SECTIONS:
        assert section in out
    assert "task: train" not in out  # not Hydra's default page, which prints the whole config


@pytest.mark.parametrize("command", HYDRA_COMMANDS)
def test_each_command_has_its_own_page_then_the_shared_one(dlpipe, command):
    r = dlpipe(command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"dlpipe {command}: ")
    assert f"Usage: dlpipe {command} " in r.stdout
    for words in OWN_WORDS[command]:
        assert words in r.stdout
    for section in SHARED_SECTIONS:
        assert section in r.stdout
    assert "== Commands ==" not in r.stdout  # the main page's header is replaced, not added to
    assert unknown_keys(r.stdout) == []


def test_a_command_page_is_composed_by_hydra_with_the_users_options(dlpipe):
    """-h works as --help; --config-dir recipes are listed, and a bad override still fails on one line."""
    r = dlpipe("bench", "-h", "--config-dir", str(TESTS_DIR / "conf"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("dlpipe bench: ") and "tiny_tabular" in r.stdout
    r = dlpipe("eval", "--help", "+recipe=nope")
    assert r.returncode == 2 and "recipe=nope: no such recipe option" in r.stderr


def test_sync_help_describes_the_command(dlpipe):
    r = dlpipe("sync", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: dlpipe sync ")
    assert "Deliver what runs kept while their tracking server was away." in r.stdout
    assert "mlflow_outbox.jsonl" in r.stdout and "exit status:" in r.stdout


@pytest.mark.parametrize("args", [["--version"], ["bench", "--version"]])
def test_version_names_dlpipe_and_its_main_dependencies(dlpipe, args):
    r = dlpipe(*args)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith(f"dlpipe {metadata.version('dlpipe')} (")
    for dist in ("torch", "hydra-core", "mlflow"):
        assert f"{dist} {metadata.version(dist)}" in line
    assert "Hydra" not in line  # not Hydra's own --version


@pytest.mark.parametrize("args", [["frobnicate", "--help"], ["train", "--help"]])
def test_an_unknown_command_is_still_a_bad_override(dlpipe, args):
    r = dlpipe(*args)
    assert r.returncode == 2
    assert f"dlpipe: error: {args[0]}: not a valid override" in r.stderr
    assert r.stdout == ""


@pytest.mark.integration
def test_help_into_a_closed_pipe_reports_no_error(tmp_path):
    """`dlpipe --help | head`: the reader going away is not "cannot write the job's output folder"."""
    proc = subprocess.Popen([sys.executable, "-m", "dlpipe", "--help"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**os.environ, **NO_PHONE_HOME})
    proc.stdout.close()  # before the child has composed anything (that takes it a second or more)
    try:
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert err == ""
