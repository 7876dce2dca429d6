"""How batches meet the model and the loss (training/objective.py) and the metrics built for them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from user_task import DictDataset, SelfLossClassifier

from dlpipe.errors import ConfigError
from dlpipe.schema import CheckpointConfig, DlpipeConfig
from dlpipe.tasks.build import build_metrics, monitor_mode
from dlpipe.training.losses import CrossEntropy, ModelLoss
from dlpipe.training.objective import Objective


def test_tuples_dicts_and_extra_fields_split_into_model_input_and_target():
    x, y, lengths = torch.randn(4, 3), torch.tensor([0, 1, 1, 0]), torch.tensor([3, 3, 2, 1])
    assert Objective().split((x, y, lengths))[2] is y  # a padding collate's lengths are not the target
    args, kwargs, target = Objective(input_field="x", target_field="y").split({"x": x, "y": y})
    assert args[0] is x and kwargs == {} and target is y
    args, kwargs, target = Objective(ModelLoss(), target_field=None).split({"features": x, "labels": y})
    assert args == () and set(kwargs) == {"features", "labels"} and target is None
    assert Objective().samples({"x": x, "y": y}) == 4 and Objective().samples((x, y)) == 4


def test_token_level_cross_entropy_ignores_padding():
    logits, target = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    target[1, 3:] = -100  # padded positions
    keep = target.reshape(-1) != -100
    expected = F.cross_entropy(logits.reshape(-1, 7)[keep], target.reshape(-1)[keep])
    assert torch.allclose(CrossEntropy()(logits, target), expected)


def test_a_one_output_head_meets_a_regression_target_without_broadcasting():
    """MSELoss on [B, 1] against [B] would broadcast to [B, B]; the objective squeezes the head."""
    output, target = torch.randn(6, 1), torch.randn(6)
    objective = Objective(nn.MSELoss())
    assert torch.allclose(objective.loss(output, target), ((output.squeeze(1) - target) ** 2).mean())
    preds, target2 = objective.metric_inputs(output, target.to(torch.int64))
    assert preds.shape == (6,) and target2.dtype == preds.dtype


def test_a_model_that_computes_its_loss_is_used_as_it_is():
    data = DictDataset(size=8)
    batch = {"features": data.features[:4], "labels": data.labels[:4]}
    model = SelfLossClassifier()
    objective = Objective(ModelLoss(), target_field="labels")
    output, target = objective.forward(model, batch)
    assert torch.equal(objective.loss(output, target), output["loss"])
    with pytest.raises(ValueError, match="without a `loss`"):
        ModelLoss()({"logits": output["logits"]})


def test_samples_the_loss_cannot_use_fail_before_training_naming_the_field():
    data = DictDataset(size=8)
    batch = {"features": data.features[:2], "labels": data.labels[:2]}
    model = nn.Linear(8, 2)
    with pytest.raises(ConfigError, match="batch.target=label: the batch has no field 'label'"):
        Objective(input_field="features", target_field="label").check(model, batch, "loss=cross_entropy")
    with pytest.raises(ConfigError, match="batch.target=null: dict samples"):
        Objective(input_field="features").check(model, batch, "loss=cross_entropy")
    floats = (torch.randn(2, 8), torch.randn(2))
    with pytest.raises(ConfigError, match="needs class indices .*use loss=mse"):
        Objective().check(model, floats, "loss=cross_entropy")
    with pytest.raises(ConfigError, match=r"loss=mse: the model's output \[2, 2\] float32 does not match the "
                                          r"target \[2\] float32; .*model.num_classes=1"):
        Objective(nn.MSELoss()).check(model, (torch.randn(2, 8), torch.randn(2)), "loss=mse")
    def loss_of_mine(output, target):
        return output.mean(dim=5)  # a user's loss that fails on these shapes

    with pytest.raises(ConfigError, match=r"loss=mine: IndexError: .*model output \[2, 2\] float32, target \[2, 3\]"):
        Objective(loss_of_mine).check(model, (torch.randn(2, 8), torch.randn(2, 3)), "loss=mine")
    logits = Objective(input_field="features", target_field="labels").check(model, batch, "loss=cross_entropy")
    assert logits.shape == (2, 2)


def cfg(**checkpoint) -> DlpipeConfig:
    return DlpipeConfig(dataset={}, model={}, optim={}, loss={}, checkpoint=CheckpointConfig(**checkpoint))


def test_default_metrics_follow_the_loss_and_the_monitor_knows_its_direction():
    classification = build_metrics(cfg(), Objective(), torch.zeros(2, 5))
    assert list(classification) == ["accuracy"] and classification["accuracy"].num_classes == 5
    regression = build_metrics(cfg(), Objective(nn.MSELoss()), torch.zeros(2))
    assert list(regression) == ["mse", "mae", "r2"]
    assert build_metrics(cfg(), Objective(ModelLoss()), None) == {}
    assert monitor_mode(cfg(monitor="val_r2"), regression, validates=True) == "max"
    assert monitor_mode(cfg(monitor="val_mae"), regression, validates=True) == "min"
    assert monitor_mode(cfg(monitor="val_loss"), regression, validates=True) == "min"
    assert monitor_mode(cfg(monitor="val_r2", mode="min"), regression, validates=True) == "min"  # the user's word
    with pytest.raises(ConfigError, match="checkpoint.monitor=val_accuracy: this run logs no such validation metric; "
                                          "allowed: val_loss, val_mse, val_mae, val_r2"):
        monitor_mode(cfg(monitor="val_accuracy"), regression, validates=True)
    with pytest.raises(ConfigError, match="direction is unknown"):
        monitor_mode(cfg(monitor="samples_per_s"), regression, validates=True)


def test_padding_only_costs_zero_and_classes_in_dim_1_are_scored_per_position():
    logits = torch.randn(2, 3, 4)
    assert CrossEntropy()(logits, torch.full((2, 3), -100)).item() == 0.0  # not NaN
    objective = Objective(nn.CrossEntropyLoss())  # torch's: classes in dim 1, [B, C, d]
    preds, target = objective.metric_inputs(torch.randn(2, 5, 7), torch.randint(0, 5, (2, 7)))
    assert preds.shape == (14, 5) and target.shape == (14,)
    metrics = build_metrics(cfg(), objective, torch.zeros(2, 5, 7))
    assert metrics["accuracy"].num_classes == 5


def test_integer_regression_targets_are_not_rounded_by_low_precision_outputs():
    output = torch.full((3,), 1000.0, dtype=torch.bfloat16)
    target = torch.tensor([1001, 1003, 999])
    prediction, aligned = Objective(nn.MSELoss()).metric_inputs(output, target)
    assert aligned.dtype == torch.float32 and aligned.tolist() == [1001.0, 1003.0, 999.0]
    assert prediction.dtype == torch.float32
