"""loader.collate_fn and PadSequences: padded batches of variable-length items, through real loaders,
real workers, the probe, a composed config and the `dlpipe bench` command."""

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import runs_of
from hydra import compose, initialize_config_dir
from torch.utils.data import default_collate

from dlpipe.cli import resolve
from dlpipe.config.paths import conf_dir
from dlpipe.config.resolvers import register_resolvers
from dlpipe.config.store import register_recipes, register_schemas
from dlpipe.config.validation import validate
from dlpipe.data.sequences import TokenSequenceDataset
from dlpipe.errors import ConfigError
from dlpipe.loader.build import ESTIMATE_ITEMS, build_loader, sample_bytes
from dlpipe.loader.collate import PadSequences
from dlpipe.loader.fetch import item_collate
from dlpipe.loader.fitting import build_loaders, fit_loader_to_data
from dlpipe.loader.probe import item_fetch_seconds
from dlpipe.models.transformer import TinyTransformer
from dlpipe.schema import LoaderConfig
from dlpipe.tasks.build import build_data_and_model
from dlpipe.training.batches import batch_samples

PAD = PadSequences()


def ragged(size=64, **kwargs) -> TokenSequenceDataset:
    return TokenSequenceDataset(size=size, seq_len=12, vocab_size=16, min_seq_len=2, **kwargs)


def seq(*values) -> torch.Tensor:
    return torch.tensor(values)


# --- PadSequences on hand-made items --------------------------------------------------------------


def test_tuple_items_pad_inputs_with_zero_targets_with_ignore_index_and_report_lengths():
    items = [(seq(5, 6, 7), seq(6, 7, 8), 1), (seq(9), seq(3), 0)]
    inputs, targets, labels, lengths = PAD(items)
    assert torch.equal(inputs, seq([5, 6, 7], [9, 0, 0])) and inputs.dtype == torch.long
    assert torch.equal(targets, seq([6, 7, 8], [3, -100, -100]))
    assert torch.equal(labels, seq(1, 0))  # a scalar field collates as default_collate does
    assert torch.equal(lengths, seq(3, 1)) and lengths.dtype == torch.long
    # real positions are exactly the items
    for i, (x, y, _) in enumerate(items):
        assert torch.equal(inputs[i, :lengths[i]], x) and torch.equal(targets[i, :lengths[i]], y)


def test_equal_shapes_collate_like_default_collate_and_still_report_lengths():
    items = [(torch.randn(4, 3), 2), (torch.randn(4, 3), 1)]
    inputs, labels, lengths = PAD(items)
    expected = default_collate(items)
    assert torch.equal(inputs, expected[0]) and torch.equal(labels, expected[1])
    assert torch.equal(lengths, seq(4, 4))


def test_feature_sequences_pad_dim_zero_only_with_the_configured_values():
    collate = PadSequences(pad_value=-1.0, target_pad_value=7)
    items = [(np.ones((2, 3), dtype=np.float32), seq(1, 1)), (np.ones((4, 3), dtype=np.float32), seq(2, 2, 2, 2))]
    inputs, targets, lengths = collate(items)
    assert inputs.shape == (2, 4, 3) and inputs.dtype == torch.float32
    assert (inputs[0, 2:] == -1).all() and (inputs[0, :2] == 1).all()
    assert torch.equal(targets[0], seq(1, 1, 7, 7)) and torch.equal(lengths, seq(2, 4))
    with pytest.raises(ValueError, match="element 0 differs beyond dim 0"):
        PAD([(torch.zeros(2, 3), 0), (torch.zeros(2, 4), 0)])


def test_dict_items_get_an_attention_mask_of_the_real_positions():
    items = [{"input_ids": seq(1, 2, 3), "labels": seq(2, 3, 4), "id": 10},
             {"input_ids": seq(4), "labels": seq(5), "id": 11}]
    batch = PAD(items)
    assert list(batch) == ["input_ids", "labels", "id", "attention_mask"]
    assert torch.equal(batch["input_ids"], seq([1, 2, 3], [4, 0, 0]))
    assert torch.equal(batch["labels"], seq([2, 3, 4], [5, -100, -100]))
    assert torch.equal(batch["id"], seq(10, 11))
    mask = batch["attention_mask"]
    assert torch.equal(mask, seq([1, 1, 1], [1, 0, 0])) and mask.dtype == torch.long
    assert torch.equal(batch["input_ids"][mask.bool()], seq(1, 2, 3, 4))


def test_dict_items_with_their_own_mask_and_other_field_names():
    collate = PadSequences(pad_value=99, target_field="target", mask_field="mask")
    items = [{"target": seq(1, 1), "tokens": seq(5, 5), "mask": seq(1, 1)},
             {"target": seq(1), "tokens": seq(6), "mask": seq(1)}]
    batch = collate(items)
    assert torch.equal(batch["tokens"], seq([5, 5], [6, 99]))  # the input field: the first but target and mask
    assert torch.equal(batch["target"], seq([1, 1], [1, -100]))
    assert torch.equal(batch["mask"], seq([1, 1], [1, 0]))  # the item's own mask, padded with 0 not pad_value
    assert torch.equal(collate([{"target": seq(1), "tokens": seq(2)}])["mask"], seq([1]))


def test_unsupported_items_say_what_is_allowed():
    with pytest.raises(TypeError, match="tuples/lists .* or dicts, got Tensor"):
        PAD([seq(1, 2), seq(3)])
    with pytest.raises(TypeError, match="element 0 .* must be a tensor or array with a length"):
        PAD([(1, seq(1)), (2, seq(1, 2))])
    with pytest.raises(TypeError, match="need an input field besides 'labels'"):
        PAD([{"labels": seq(1)}, {"labels": seq(1, 2)}])


def test_pickles_for_spawn_workers():
    collate = PadSequences(pad_value=3, target_field="y")
    assert pickle.loads(pickle.dumps(collate)) == collate


def test_padding_leaves_the_causal_models_loss_on_real_tokens_unchanged():
    """Right padding and -100 targets: the padded batch's loss is the mean over the real tokens only."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=16, seq_len=12, d_model=16, n_heads=2, n_layers=1).eval()
    items = [ragged()[i] for i in range(6)]
    inputs, targets, lengths = PAD(items)
    assert len(set(lengths.tolist())) > 1
    with torch.no_grad():
        logits = model(inputs)
        padded = F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))  # ignore_index=-100 by default
        per_item = [F.cross_entropy(model(x[None])[0], y, reduction="sum") for x, y in items]
        for i, (x, _) in enumerate(items):
            assert torch.allclose(logits[i, :len(x)], model(x[None])[0], atol=1e-5)
    assert torch.allclose(padded, sum(per_item) / lengths.sum(), atol=1e-5)


# --- the loader side: sizes, real workers, the probe ----------------------------------------------


def test_batch_helpers_count_padded_tuples_and_masked_dicts():
    tuple_batch = PAD([ragged()[i] for i in range(5)])
    dict_batch = PAD([ragged(as_dict=True)[i] for i in range(5)])
    assert batch_samples(tuple_batch) == batch_samples(dict_batch) == 5
    assert batch_samples({"text": ["a", "b", "c"], "ids": torch.zeros(3, 2)}) == 3  # strings skipped
    assert sample_bytes([tuple_batch]) == sum(t.nelement() * 8 for t in tuple_batch)
    mask = dict_batch["attention_mask"]
    tokens = dict_batch["input_ids"].nelement()
    assert sample_bytes([dict_batch]) == 2 * tokens * 8 + mask.nelement() * mask.element_size()


def test_the_memory_estimate_collates_a_real_batch_with_a_custom_collate():
    data = ragged(size=64)
    plan = build_loader(data, batch_size=ESTIMATE_ITEMS, num_workers=0, pin_memory=False, prefetch_factor=None,
                        persistent_workers=False, shuffle=False, drop_last=False, timeout=0,
                        multiprocessing_context=None, seed=0, cuda=False, collate_fn=PAD)
    first = next(iter(plan.loader))  # the first ESTIMATE_ITEMS items, padded: what the estimate measured
    assert plan.batch_bytes == sum(t.nelement() * t.element_size() for t in first)
    assert plan.batch_bytes > ESTIMATE_ITEMS * sample_bytes(data) + 8 * ESTIMATE_ITEMS  # not the first item's size
    with pytest.raises(TypeError, match="collate_fn must be callable"):
        build_loader(data, batch_size=4, num_workers=0, pin_memory=False, prefetch_factor=None,
                     persistent_workers=False, shuffle=False, drop_last=False, timeout=0,
                     multiprocessing_context=None, seed=0, cuda=False, collate_fn={"_target_": "x"})


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_two_workers_deliver_every_item_padded(context):
    """Real worker processes (spawn pickles the collate and the dataset) deliver each item once,
    its real positions intact and the rest padded."""
    data = ragged(size=40)
    plan = build_loader(data, batch_size=8, num_workers=2, pin_memory=False, prefetch_factor=2,
                        persistent_workers=False, shuffle=True, drop_last=False, timeout=60,
                        multiprocessing_context=context, seed=0, cuda=False, collate_fn=PAD)
    seen = []
    for inputs, targets, lengths in plan.loader:
        assert inputs.shape[1] == int(lengths.max())  # padded to this batch's longest, not to seq_len
        for x, y, n in zip(inputs, targets, lengths.tolist(), strict=True):
            assert (x[n:] == 0).all() and (y[n:] == -100).all()
            seen.append((x[:n].tolist(), y[:n].tolist()))
    expected = [(x.tolist(), y.tolist()) for x, y in (data[i] for i in range(len(data)))]
    assert sorted(seen) == sorted(expected)


def test_the_probe_collates_ragged_items_with_the_jobs_collate():
    data = ragged(size=256)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        item_fetch_seconds(data, 64)  # what happened before loader.collate_fn existed
    seconds = item_fetch_seconds(data, 64, collate_fn=PAD)
    assert 0 < seconds < float("inf")
    # loader.fitting fits the automatic workers by the probe, with the loader's collate
    auto = {"num_workers": "${auto_workers:}", "prefetch_factor": "${auto_prefetch:${.num_workers}}",
            "persistent_workers": "${auto_persistent:${.num_workers},${trainer.epochs},0}"}
    loader = LoaderConfig(num_workers=2, prefetch_factor=2, persistent_workers=True, batch_size=64,
                          collate_fn={"_target_": "dlpipe.loader.collate.PadSequences"})
    fitted, why = fit_loader_to_data(auto, loader, 3, data)  # before loader.collate_fn: "stack expects ..."
    assert fitted.num_workers in (0, 2) and "loader.persistent_workers" in why


# --- the config and the command -------------------------------------------------------------------


@pytest.fixture(scope="module")
def registered():
    register_resolvers()
    register_schemas()
    register_recipes()


def job(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return validate(resolve(cfg)[1])


def test_build_loaders_uses_the_configured_collate_for_train_and_validation(registered):
    cfg = job("dataset=tokens_ragged", "model=transformer", "loader=padded", "dataset.size=64",
              "loader.batch_size=8", "loader.collate_fn.pad_value=3", "trainer.val_fraction=0.25")
    assert cfg.loader.collate_fn["pad_value"] == 3 and cfg.loader.collate_fn["target_pad_value"] == -100
    train, val, _, _ = build_data_and_model(cfg)
    train_plan, val_plan = build_loaders(cfg, train, val)
    for plan in (train_plan, val_plan):
        assert item_collate(plan.loader) == PadSequences(pad_value=3)
        inputs, targets, lengths = next(iter(plan.loader))
        assert inputs.shape[0] == 8 and lengths.shape == (8,)
        short = int(lengths.argmin())
        if lengths[short] < inputs.shape[1]:
            assert inputs[short, -1] == 3 and targets[short, -1] == -100


def test_a_collate_fn_that_does_not_build_names_the_key(registered):
    cfg = job("dataset=tokens_ragged", "model=transformer", "dataset.size=16",
              "loader.collate_fn={_target_: dlpipe.loader.collate.PadSequences, pad_valu: 1}")
    train, val, _, _ = build_data_and_model(cfg)
    with pytest.raises(ConfigError, match=r"loader\.collate_fn\._target_=dlpipe\.loader\.collate\.PadSequences: "
                                          r"TypeError: .*pad_valu"):
        build_loaders(cfg, train, val)
    cfg = job("dataset=tokens_ragged", "model=transformer", "dataset.size=16", "loader.collate_fn=pad")
    with pytest.raises(ConfigError, match="loader.collate_fn='pad': must be a node with a _target_"):
        build_loaders(cfg, train, val)


def test_bench_measures_the_ragged_recipe(dlpipe, mlflow_store, mlflow_client):
    """`dlpipe bench +recipe=nlp_ragged`: the probe, the loader and the measurement all collate with
    PadSequences, and the run records the collate it measured."""
    r = dlpipe("bench", "+recipe=nlp_ragged", "loader=auto", "loader.collate_fn={_target_: "
               "dlpipe.loader.collate.PadSequences}", "dataset.size=256", "loader.batch_size=16", "bench.batches=4",
               "bench.warmup_batches=1", "trainer.progress=false", f"tracking.uri={mlflow_store}",
               "tracking.experiment=bench-ragged")
    assert r.returncode == 0, r.stderr  # loader=auto: the probe collated ragged items too
    assert "bench: " in r.stdout and "stack expects" not in r.stdout + r.stderr
    [run] = runs_of(mlflow_client, "bench-ragged")
    assert run.info.status == "FINISHED" and run.data.metrics["perf/samples_per_s"] > 0
    assert run.data.params["loader.collate_fn._target_"] == "dlpipe.loader.collate.PadSequences"
    assert int(run.data.params["loader.batch_bytes_est"]) > 0
