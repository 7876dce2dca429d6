"""Bad input from the user's own files and options, through the real CLI: a YAML file that does not parse
wherever it enters, a broken recipe that only the commands using it see, a group option that is a path,
and the config printed by --cfg / --info without secrets. Each refusal is one line, exit 2, and leaves
nothing behind: no output folder, no MLflow store, no run."""

import pytest
import yaml

from dlpipe.config.paths import conf_dir, recipe_dirs
from dlpipe.config.store import find_recipes
from dlpipe.errors import ConfigError

BROKEN = "trainer:\n  epochs: [1,\n"  # a flow list left open: PyYAML stops at the end of the file
BROKEN_LINE = (":3: expected the node content, but found '<stream end>' (while parsing a flow node); "
               "fix the YAML there (indentation, a missing ':' or a bracket or quote left open)")
TAGGED = "_target_: !!python/object/apply:os.system ['touch pwned']\n"
TAGGED_LINE = (":1: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'; "
               "remove the tag: config files are plain YAML (a class is named by _target_, built by dlpipe)")
RECIPE_HEAD = "# @package _global_\n"


def _refused(r, tmp_path, expected: str, inputs: set[str]) -> None:
    """Exit 2, exactly the one line expected on stderr, nothing on stdout, and nothing made beside the
    test's own inputs: no outputs/ or multirun/ folder, no MLflow store (so no run)."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == f"dlpipe: error: {expected}\n", r.stderr
    assert r.stdout == ""
    assert {p.name for p in tmp_path.iterdir()} == inputs


def _store(tmp_path) -> str:
    return f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"


# (files to write under tmp_path, command-line arguments, environment, the file whose problem is reported,
# the problem after its path)
PLACES = {
    "config-dir group file": ({"mine/dataset/broken.yaml": BROKEN}, ["--config-dir", "mine", "dataset=broken"], {},
                              "mine/dataset/broken.yaml", BROKEN_LINE),
    "config-dir group file with a python tag": ({"mine/dataset/evil.yaml": TAGGED},
                                                ["--config-dir", "mine", "dataset=evil"], {},
                                                "mine/dataset/evil.yaml", TAGGED_LINE),
    "config-dir recipe": ({"mine/recipe/bad.yaml": RECIPE_HEAD + BROKEN}, ["--config-dir", "mine", "+recipe=bad"], {},
                          "mine/recipe/bad.yaml", BROKEN_LINE.replace(":3:", ":4:")),
    "config-dir primary config": ({"mine/main.yaml": "defaults:\n  - config\n  - _self_\n" + BROKEN},
                                  ["--config-dir", "mine", "--config-name", "main"], {}, "mine/main.yaml",
                                  BROKEN_LINE.replace(":3:", ":6:")),
    "DLPIPE_RECIPE_PATH recipe": ({"rp/bad.yaml": RECIPE_HEAD + BROKEN}, ["+recipe=bad"], {"DLPIPE_RECIPE_PATH": "rp"},
                                  "rp/bad.yaml", BROKEN_LINE.replace(":3:", ":4:")),
    "DLPIPE_RECIPE_PATH recipe with a python tag": ({"rp/evil.yaml": RECIPE_HEAD + TAGGED}, ["+recipe=evil"],
                                                    {"DLPIPE_RECIPE_PATH": "rp"}, "rp/evil.yaml",
                                                    TAGGED_LINE.replace(":1:", ":2:")),
    "a recipe another recipe builds on": ({"rp/bad.yaml": RECIPE_HEAD + BROKEN,
                                           "rp/mine.yaml": RECIPE_HEAD + "defaults:\n  - /recipe/bad\n"},
                                          ["+recipe=mine"], {"DLPIPE_RECIPE_PATH": "rp"}, "rp/bad.yaml",
                                          BROKEN_LINE.replace(":3:", ":4:")),
}


@pytest.mark.parametrize("files, args, env, reported, problem", PLACES.values(), ids=PLACES.keys())
def test_a_yaml_file_that_does_not_parse_is_one_line_naming_file_and_line(dlpipe, tmp_path, files, args, env,
                                                                           reported, problem):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    inputs = {p.name for p in tmp_path.iterdir()}
    r = dlpipe(*args, "trainer.epochs=1", _store(tmp_path), env=env)
    _refused(r, tmp_path, f"{tmp_path / reported}{problem}", inputs)
    assert not (tmp_path / "pwned").exists()


def test_a_broken_recipe_fails_only_the_commands_that_use_it(dlpipe, tmp_path):
    """As a broken file under --config-dir does in Hydra: the other recipes compose, train and list it."""
    (tmp_path / "rp").mkdir()
    (tmp_path / "rp" / "bad.yaml").write_text(RECIPE_HEAD + BROKEN)
    env = {"DLPIPE_RECIPE_PATH": "rp"}
    shown = dlpipe("+recipe=tabular", "--cfg", "job", env=env)
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    assert yaml.safe_load(shown.stdout)["model"]["_target_"] == "dlpipe.models.mlp.MLP"
    listed = dlpipe("--help", env=env)
    assert listed.returncode == 0 and "recipe: bad, " in listed.stdout, listed.stdout
    trained = dlpipe("+recipe=smoke", "trainer.epochs=1", "trainer.limit_train_batches=2", "trainer.progress=false",
                     "tracking=none", "hydra.run.dir=run", env=env)
    assert trained.returncode == 0 and "bad.yaml" not in trained.stdout + trained.stderr, trained.stderr
    assert (tmp_path / "run" / "checkpoints" / "epoch-0001.pt").is_file()
    used = dlpipe("+recipe=bad", _store(tmp_path), env=env)
    assert used.returncode == 2 and used.stderr.startswith(f"dlpipe: error: {tmp_path / 'rp' / 'bad.yaml'}:4: ")


X_YAML = "_target_: dlpipe.data.tabular.TabularDataset\n"
DATASETS = ", ".join(sorted(p.stem for p in (conf_dir() / "dataset").glob("*.yaml")))  # the shipped options
RECIPES_AND_MINE = ", ".join(sorted([*find_recipes(recipe_dirs()[:1]), "mine"]))
PATH_OPTIONS = {
    "parent folders": (["dataset=../x"], "dataset=../x: a dataset option is a name, not a path (../x); allowed: "
                       f"{DATASETS}; for a file of your own use --config-dir DIR with it at DIR/dataset/NAME.yaml"),
    "absolute, in a sweep": (["--multirun", "dataset=tabular,{tmp}/x"],
                             "dataset=tabular,{tmp}/x: a dataset option is a name, not a path ({tmp}/x); allowed: "
                             f"{DATASETS}; for a file of your own use --config-dir DIR with it at "
                             "DIR/dataset/NAME.yaml"),
    "a recipe, with --config-dir": (["--config-dir", "{tmp}/mine", "+recipe=../x"],
                                    f"+recipe=../x: a recipe option is a name, not a path (../x); allowed: "
                                    f"{RECIPES_AND_MINE}; for a file of your own use --config-dir DIR with it at "
                                    "DIR/recipe/NAME.yaml"),
}


@pytest.mark.parametrize("args, expected", PATH_OPTIONS.values(), ids=PATH_OPTIONS.keys())
def test_a_group_option_that_is_a_path_is_refused_listing_the_options(dlpipe, tmp_path, args, expected):
    """Hydra joins the option to the group's folder (dataset=../x is conf/x.yaml, dataset=/abs/x that
    file): refused before Hydra reads anything."""
    (tmp_path / "mine" / "recipe").mkdir(parents=True)
    (tmp_path / "mine" / "recipe" / "mine.yaml").write_text(RECIPE_HEAD + "trainer:\n  epochs: 1\n")
    (tmp_path / "x.yaml").write_text(X_YAML)
    r = dlpipe(*[a.replace("{tmp}", str(tmp_path)) for a in args], _store(tmp_path))
    _refused(r, tmp_path, expected.replace("{tmp}", str(tmp_path)), {"mine", "x.yaml"})


def test_init_from_another_models_checkpoint_is_one_line_with_the_count(dlpipe, tmp_path):
    """An MLP's checkpoint into the vision CNN: 26 parameters differ, said in one line with the first few
    of each kind (it was a line per parameter), for training and eval alike; no store, no output folder."""
    first = dlpipe("+recipe=tabular", "trainer.epochs=1", "trainer.limit_train_batches=2", "trainer.progress=false",
                   "tracking=none", "hydra.run.dir=first")
    assert first.returncode == 0, first.stderr
    expected = ("checkpoint.init_from=first/checkpoints: checkpoint first/checkpoints/best.pt does not fit the model, "
                "26 parameters differ: 6 not in the model ('net.0.weight', 'net.0.bias', 'net.2.weight', "
                "... (3 more)); 20 of the model's missing from it ('features.0.0.weight', 'features.0.1.weight', "
                "'features.0.1.bias', ... (17 more)); is it another model's, or did the model config change?")
    for command in ([], ["eval"]):
        r = dlpipe(*command, "+recipe=vision", "checkpoint.init_from=first/checkpoints", "trainer.epochs=1",
                   _store(tmp_path))
        assert r.returncode == 2, r.stderr
        assert [line for line in r.stderr.splitlines() if "dlpipe: error:" in line or "parameter" in line] == [
            f"dlpipe: error: {expected}"], r.stderr
        assert "Traceback" not in r.stderr and {p.name for p in tmp_path.iterdir()} == {"first"}


SWEEP_TYPOS = {
    "a swept group option": (["dataset=tabular,nope"], f"dataset=nope: no such dataset option; available: {DATASETS}"),
    "a swept unknown key": (["model.hiden=3,4"], "model.hiden=3,4: no key 'hiden' in model; did you mean "
                            "model.hidden? allowed: _target_, depth, dropout, hidden, in_features, num_classes"),
}


@pytest.mark.parametrize("args, expected", SWEEP_TYPOS.values(), ids=SWEEP_TYPOS.keys())
def test_a_sweep_with_a_job_that_cannot_compose_makes_nothing(dlpipe, tmp_path, args, expected):
    """Hydra composes a sweep's jobs after its callbacks made the sweep folder and the parent run: every
    job is composed first (config.sweep_check), so a typo in a swept value leaves no folder and no run."""
    r = dlpipe("--multirun", "+recipe=tabular", "optim.lr=0.1,0.2", *args, _store(tmp_path))
    _refused(r, tmp_path, expected, set())


def test_the_sweep_check_expands_jobs_as_hydras_basic_sweeper_does():
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from dlpipe.config.paths import conf_dir
    from dlpipe.config.store import register_schemas
    from dlpipe.config.sweep_check import job_overrides

    register_schemas()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    with open_dict(cfg):  # as a sweeper config's `params:` and the command line would give them
        cfg.hydra.sweeper.params = {"optim.lr": "0.1,0.2"}
        cfg.hydra.overrides.task = ["model=mlp,cnn", "trainer.epochs=1"]
    assert job_overrides(cfg) == [
        ["optim.lr=0.1", "model=mlp", "trainer.epochs=1"], ["optim.lr=0.1", "model=cnn", "trainer.epochs=1"],
        ["optim.lr=0.2", "model=mlp", "trainer.epochs=1"], ["optim.lr=0.2", "model=cnn", "trainer.epochs=1"]]


def test_a_nested_group_option_stays_inside_its_group_and_is_allowed(tmp_path):
    from dlpipe.config.group_options import refuse_paths_as_options

    (tmp_path / "model" / "vision").mkdir(parents=True)
    (tmp_path / "model" / "vision" / "resnet.yaml").write_text("_target_: torch.nn.Identity\n")
    refuse_paths_as_options(["--config-dir", str(tmp_path), "model=vision/resnet"])  # Hydra's own feature
    with pytest.raises(ConfigError, match="a model option is a name, not a path"):
        refuse_paths_as_options(["--config-dir", str(tmp_path), "model=vision/../../x"])
