"""What a newcomer meets first: a model sized from their own data, and a line naming the fix for a
null in_features that cannot be filled, a recipe without its package line and an interpolation that
does not resolve. In-process, through Hydra's compose API and the command's own functions."""

import logging

import pytest
import torch
from omegaconf import OmegaConf
from test_config import make, registered  # noqa: F401 (registered: the resolvers, schema and recipes, autouse)
from torch.utils.data import Dataset

from dlpipe.cli import resolve
from dlpipe.config.composition_errors import one_line
from dlpipe.config.validation import validate
from dlpipe.data.tabular import TabularDataset
from dlpipe.errors import ConfigError
from dlpipe.tasks.build import build_data_and_model


class Rows(Dataset):
    """(features [4], label) items of the tabular dataset, with num_classes but no num_features."""

    num_classes = 2

    def __init__(self, size: int = 32):
        table = TabularDataset(size=size, num_features=4, num_classes=2)
        self.x, self.y = table.features, table.labels

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class DictRows(Rows):
    """The same rows as Hugging Face style dicts, the features under `features`, 6 of them."""

    def __init__(self, size: int = 32):
        super().__init__(size)
        self.x = torch.cat([self.x, self.x[:, :2]], dim=1)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}


class Jittered(Rows):
    """Rows with random jitter drawn from torch's global generator at every fetch, as augmentation does."""

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), self.y[i]


class Scalars(Rows):
    """Items whose input is a plain number: nothing to size a model's input from."""

    def __getitem__(self, i):
        return float(self.x[i, 0]), int(self.y[i])


def built(*overrides: str):
    """(train split, model) of a job composed from `overrides`, as `dlpipe` builds them."""
    _, resolved = resolve(make(*overrides))
    train, _, net, _ = build_data_and_model(validate(resolved))
    return train, net


def first_linear(net) -> torch.nn.Linear:
    return next(m for m in net.modules() if isinstance(m, torch.nn.Linear))


OWN = ["dataset=custom", "model=mlp", "trainer.device=cpu"]


def test_the_mlp_takes_in_features_from_the_first_items_input(caplog):
    caplog.set_level(logging.INFO, logger="dlpipe")
    train, net = built(*OWN, f"dataset._target_={__name__}.Rows")
    assert first_linear(net).in_features == 4
    assert net(torch.stack([train[0][0], train[1][0]])).shape == (2, 2)  # and num_classes from the dataset
    assert "model.in_features = 4 (the last dimension of dataset item 0's input, shape [4])" in caplog.messages
    assert "model.num_classes = 2 (the dataset's num_classes)" in caplog.messages


def test_dict_items_size_the_model_from_the_field_batch_input_names(caplog):
    caplog.set_level(logging.INFO, logger="dlpipe")
    _, net = built(*OWN, f"dataset._target_={__name__}.DictRows", "batch.input=features", "batch.target=labels")
    assert first_linear(net).in_features == 6
    assert "model.in_features = 6 (the last dimension of dataset item 0's input, shape [6])" in caplog.messages


def test_a_null_in_features_comes_from_the_datasets_num_features(caplog):
    caplog.set_level(logging.INFO, logger="dlpipe")
    _, net = built("dataset=tabular", "dataset.size=32", "dataset.num_features=7", "model=mlp",
                   "model.in_features=null", "trainer.device=cpu")
    assert first_linear(net).in_features == 7
    assert "model.in_features = 7 (the dataset's num_features)" in caplog.messages


def test_reading_item_0_leaves_the_random_streams_as_they_were():
    """The run draws the same numbers whether in_features was read from the data or given."""
    torch.manual_seed(3)
    built(*OWN, f"dataset._target_={__name__}.Jittered")  # building seeds nothing itself
    after = torch.rand(1)
    torch.manual_seed(3)
    built(*OWN, f"dataset._target_={__name__}.Jittered", "model.in_features=4")
    assert torch.equal(after, torch.rand(1))


def test_an_in_features_that_cannot_be_filled_is_one_line_naming_the_key_and_the_fix():
    with pytest.raises(ConfigError) as caught:
        built(*OWN, f"dataset._target_={__name__}.Scalars")
    assert caught.value.problems == [
        "model.in_features=null: Scalars has no num_features and item 0's input is a float, not a feature tensor; "
        "set model.in_features to the length of one input vector (or give the dataset a num_features attribute)"]


def problem(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve(make("+recipe=smoke", *overrides))
    [line] = caught.value.problems
    return line


def test_a_missing_key_names_the_key_holding_it_not_the_first_key_that_refers_to_it():
    # loader.persistent_workers reads ${trainer.epochs}: OmegaConf fails there first
    assert problem("trainer.epochs=${dataset.nope}") == (
        "trainer.epochs=${dataset.nope}: no key dataset.nope in the config; name an existing key, or set "
        "trainer.epochs to a plain value")


def test_a_near_miss_names_the_key_it_probably_meant():
    assert problem("trainer.epochs=${dataset.sise}") == (
        "trainer.epochs=${dataset.sise}: no key dataset.sise in the config; write ${dataset.size}, or set "
        "trainer.epochs to a plain value")


def test_an_unset_environment_variable_says_to_export_it_or_give_a_default(monkeypatch):
    monkeypatch.delenv("DLPIPE_TEST_UNSET", raising=False)
    assert problem("+dataset.token=${oc.env:DLPIPE_TEST_UNSET}") == (
        "dataset.token=${oc.env:DLPIPE_TEST_UNSET}: environment variable DLPIPE_TEST_UNSET is not set; export "
        "DLPIPE_TEST_UNSET=..., or give a default: ${oc.env:DLPIPE_TEST_UNSET,DEFAULT}")


def test_a_resolver_failure_keeps_its_reason_and_names_the_fix():
    line = problem('loader.batch_size=${oc.decode:"[1"}')
    assert line.startswith('loader.batch_size=${oc.decode:"[1"}: GrammarParseError raised while resolving')
    assert line.endswith("; fix the interpolation or set loader.batch_size to a plain value")


def test_the_printed_config_names_the_override_too(monkeypatch):
    """`dlpipe ... --cfg job --resolve`: Hydra resolves the config itself (OmegaConf.resolve), and its
    error carries no key; the command's line names the override holding the interpolation."""
    monkeypatch.delenv("DLPIPE_TEST_UNSET", raising=False)
    for override, expected in [
        ("trainer.epochs=${dataset.nope}", "trainer.epochs=${dataset.nope}: no key dataset.nope in the config; "
                                           "name an existing key, or set trainer.epochs to a plain value"),
        ("model.width=${oc.env:DLPIPE_TEST_UNSET}", "model.width=${oc.env:DLPIPE_TEST_UNSET}: environment "
                                                    "variable DLPIPE_TEST_UNSET is not set; export"),
    ]:
        argv = ["+recipe=smoke", override, "--cfg", "job", "--resolve"]
        cfg = make(*argv[:2])
        with pytest.raises(Exception) as caught:
            OmegaConf.resolve(cfg)
        assert one_line(caught.value, argv).startswith(expected)


RECIPE_BODY = "defaults:\n  - override /model: mlp\n  - override /dataset: tabular\ntrainer:\n  epochs: 3\n"


def composed_with_config_dir(folder, name: str):
    """Compose `+recipe=NAME` with `folder` searched as `--config-dir folder` adds it: (config, None),
    or (None, the command's line for the failure)."""
    argv = ["--config-dir", str(folder), f"+recipe={name}"]
    try:
        return make(argv[2], f"hydra.searchpath=[file://{folder}]"), None
    except Exception as e:  # what the command catches and prints as one line
        return None, one_line(e, argv)


@pytest.mark.parametrize("header", ["", "# dlpipe +recipe=mine\n# @package _global_\n", "# @package _group_\n"],
                         ids=["no package line", "package line after a comment", "another package"])
def test_a_config_dir_recipe_without_its_package_line_names_the_file_and_the_fix(tmp_path, header):
    (tmp_path / "recipe").mkdir()
    path = tmp_path / "recipe" / "mine.yaml"
    path.write_text(header + RECIPE_BODY)
    cfg, line = composed_with_config_dir(tmp_path, "mine")
    assert cfg is None and line == (f"recipe {path}: does not start with `# @package _global_`, so Hydra puts its "
                                    "keys under recipe.; add `# @package _global_` as line 1")


def test_a_config_dir_recipe_with_its_package_line_composes_and_its_other_mistakes_keep_their_line(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\n# dlpipe +recipe=mine\n" + RECIPE_BODY)
    cfg, line = composed_with_config_dir(tmp_path, "mine")
    assert line is None and cfg.trainer.epochs == 3 and cfg.model._target_ == "dlpipe.models.mlp.MLP"
    (tmp_path / "recipe" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  epohcs: 3\n")
    _, line = composed_with_config_dir(tmp_path, "typo")
    assert "'epohcs' not in 'TrainerConfig'" in line and "@package" not in line  # Hydra's own words, unchanged
