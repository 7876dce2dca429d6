"""tracking.log_model's PyTorch model, the training process's half (tasks.logged_model): the checkpoint's
weights in a copy of the model, what loading its class elsewhere needs, the input example, and a model
that cannot be pickled whole (the run keeps the checkpoint artifact alone)."""

import logging
from pathlib import Path

import torch
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset

import dlpipe
from dlpipe.models.mlp import MLP
from dlpipe.tasks.logged_model import EXPORT_FILE, code_of, export_model, input_example
from dlpipe.training.objective import Objective


def checkpoint_of(model: nn.Module, path: Path, step: int) -> Path:
    torch.save({"model": model.state_dict(), "step": step}, path)
    return path


def test_the_export_holds_the_checkpoints_weights_not_the_models(tmp_path):
    """The file holds a copy of the model with the checkpoint's weights (the best epoch's, not the
    last), two real inputs, and the checkpoint's step; the model itself is left as it was."""
    best = MLP(in_features=4, num_classes=3)
    checkpoint = checkpoint_of(best, tmp_path / "best.pt", step=7)
    model = MLP(in_features=4, num_classes=3)  # the last epoch's weights: other values
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = TensorDataset(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    path, step = export_model(model, checkpoint, Objective(), data, None, tmp_path)
    saved = torch.load(path, weights_only=False)
    assert path.name == EXPORT_FILE and step == 7
    assert all(torch.equal(saved["model"].state_dict()[k], v) for k, v in best.state_dict().items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(saved["example"], data.tensors[0][:2])
    assert saved["code_paths"] == [str(Path(dlpipe.__file__).parent)]


def test_a_model_that_cannot_be_pickled_whole_gets_a_warning_and_no_file(tmp_path, caplog):
    model = MLP(in_features=4, num_classes=3)
    model.activation_of = lambda x: x  # a lambda: pickle refuses it
    checkpoint = checkpoint_of(model, tmp_path / "best.pt", step=1)
    data = TensorDataset(torch.randn(2, 4), torch.tensor([0, 1]))
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        assert export_model(model, checkpoint, Objective(), data, None, tmp_path) is None
    assert "no MLflow PyTorch model (the model cannot be pickled whole" in caplog.text
    assert not (tmp_path / EXPORT_FILE).exists()


def test_where_a_models_class_comes_from():
    """dlpipe's and a local file's classes are copied into the model; an installed distribution's
    is required by name and version; torch always."""
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    assert code_of(MLP(in_features=4, num_classes=2)) == ([str(Path(dlpipe.__file__).parent)], [torch_pin])
    assert code_of(Local()) == ([__file__], [torch_pin])
    assert code_of(torchmetrics.MeanMetric()) == ([], [torch_pin, f"torchmetrics=={torchmetrics.__version__}"])


class Local(nn.Module):
    def forward(self, x):
        return x


def test_an_example_only_for_a_model_of_one_tensor():
    """Dict samples (keyword inputs) give no example, so no signature; a dict with input_field set does."""
    rows = [{"x": torch.ones(3), "y": torch.tensor(1)} for _ in range(4)]
    assert input_example(Objective(target_field="y"), rows) is None
    example = input_example(Objective(input_field="x", target_field="y"), rows)
    assert example.shape == (2, 3)
