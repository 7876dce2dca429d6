"""How a batch becomes a loss and the metrics' inputs: which part goes to the model, which part is the
target, and how the model's output meets the loss.

Batches are tuples or lists `(input, target, *rest)` (the rest, such as a padding collate's lengths,
is not used), or dicts with fields named by `batch.input` and `batch.target` (`batch.input=null`
calls the model with the whole dict as keyword arguments, the Hugging Face convention). A model may
return a tensor, or a dict or object with `logits` (and `loss`, for `loss=model`).
"""

import torch
from torch import nn

from dlpipe.errors import ConfigError, first_line
from dlpipe.training.batches import batch_samples
from dlpipe.training.losses import CrossEntropy, ModelLoss

CLASSIFICATION, BINARY, REGRESSION, MODEL, CUSTOM = "classification", "binary", "regression", "model", "custom"
_KINDS = ((CrossEntropy, CLASSIFICATION), (nn.CrossEntropyLoss, CLASSIFICATION), (nn.NLLLoss, CLASSIFICATION),
          (nn.BCEWithLogitsLoss, BINARY), (nn.MSELoss, REGRESSION), (nn.L1Loss, REGRESSION),
          (nn.SmoothL1Loss, REGRESSION), (nn.HuberLoss, REGRESSION), (ModelLoss, MODEL))


def kind_of(loss) -> str:
    """What a loss says about the task: it picks the default metrics and how outputs meet targets."""
    return next((kind for cls, kind in _KINDS if isinstance(loss, cls)), CUSTOM)


def predictions(output):
    """The tensor a loss or a metric compares with the target: the output itself, or its logits."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("logits")
    if isinstance(output, (tuple, list)):
        return output[0]
    return getattr(output, "logits", None)


class Objective:
    """A loss function and the batch layout it is fed from (see the module docstring)."""

    def __init__(self, loss=None, input_field: str | None = None, target_field: str | None = None):
        self.loss_fn = loss if loss is not None else CrossEntropy()
        self.kind = kind_of(self.loss_fn)
        # Where the classes are in an output of more than 2 dims: last for dlpipe's CrossEntropy
        # ([B, T, V]), dim 1 for torch's CrossEntropyLoss/NLLLoss ([B, C, d...]).
        self.class_dim = -1 if isinstance(self.loss_fn, CrossEntropy) else 1
        self.input_field, self.target_field = input_field, target_field

    def split(self, batch) -> tuple[tuple, dict, object]:
        """(positional args, keyword args, target) for one batch."""
        if isinstance(batch, (tuple, list)):
            return (batch[0],), {}, batch[1] if len(batch) > 1 else None
        if isinstance(batch, dict):
            target = batch[self.target_field] if self.target_field is not None else None
            if self.input_field is None:
                return (), dict(batch), target
            return (batch[self.input_field],), {}, target
        return (batch,), {}, None

    def forward(self, net, batch):
        """(the model's output, the target) for one batch."""
        args, kwargs, target = self.split(batch)
        return net(*args, **kwargs), target

    def loss(self, output, target) -> torch.Tensor:
        if self.kind == MODEL:
            return self.loss_fn(output, target)
        prediction, target = self._aligned(predictions(output), target)
        return self.loss_fn(prediction, target)

    def metric_inputs(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        """(predictions, target) as torchmetrics takes them: token-level logits flattened, binary
        logits as probabilities, a regression head's [B, 1] matched to a [B] target."""
        prediction, target = self._aligned(predictions(output), target)
        prediction = prediction.float()  # metric states in full precision, whatever autocast produced
        if self.kind == CLASSIFICATION and prediction.dim() > 2:
            prediction = prediction.movedim(self.class_dim, -1)
            return prediction.reshape(-1, prediction.size(-1)), target.reshape(-1)
        if self.kind == BINARY:
            return torch.sigmoid(prediction), target.long()
        return prediction, target

    def samples(self, batch) -> int:
        """Samples in a batch: the length of its target, or of its first tensor."""
        _, _, target = self.split(batch)
        if isinstance(target, torch.Tensor) and target.dim():
            return target.shape[0]
        return batch_samples(batch)

    def _aligned(self, prediction, target):
        if self.kind in (REGRESSION, BINARY) and isinstance(target, torch.Tensor):
            if prediction.dim() == target.dim() + 1 and prediction.shape[-1] == 1:
                prediction = prediction.squeeze(-1)  # a one-output head against a [B] target
            if not target.is_floating_point():
                target = target.float()  # not the prediction's dtype: bf16 would round integer targets
        return prediction, target

    def check(self, model, batch, loss_key: str) -> torch.Tensor:
        """Run one small batch through the model and the loss before training, so a sample the loss
        cannot use is one line naming the field, not a traceback in the first step. `loss_key` names
        the loss in messages (`loss._target_=torch.nn.MSELoss`). Returns the model's predictions
        (their last dimension sizes the default metrics)."""
        if isinstance(batch, dict):
            for key, field in (("batch.input", self.input_field), ("batch.target", self.target_field)):
                if field is not None and field not in batch:
                    raise ConfigError([f"{key}={field}: the batch has no field {field!r} (it has: "
                                       f"{', '.join(map(str, batch))})"])
            if self.kind != MODEL and self.target_field is None:
                raise ConfigError([f"batch.target=null: dict samples (fields: {', '.join(map(str, batch))}) need "
                                   f"batch.target naming the field the loss compares with, or loss=model"])
        with torch.no_grad():
            output, target = self.forward(model, batch)
            if self.kind == CLASSIFICATION and isinstance(target, torch.Tensor) and target.is_floating_point():
                raise ConfigError([f"{loss_key}: the target is {_describe(target)}; cross-entropy needs class "
                                   "indices (int64): for a regression target use loss=mse (or l1, smooth_l1)"])
            if self.kind in (REGRESSION, BINARY) and isinstance(target, torch.Tensor):
                prediction, aligned = self._aligned(predictions(output), target)
                if prediction is not None and prediction.shape != aligned.shape:
                    # the loss would broadcast them against each other and train on nonsense
                    raise ConfigError([f"{loss_key}: the model's output {_describe(prediction)} does not match "
                                       f"the target {_describe(target)}; give the model one output per target value "
                                       "(model.num_classes=1 for a single number)"])
            try:
                self.loss(output, target)
                prediction = predictions(output)
                if self.kind != MODEL:
                    self.metric_inputs(output, target)
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError([f"{loss_key}: {type(e).__name__}: {first_line(e)} (model output "
                                   f"{_describe(predictions(output))}, target {_describe(target)})"]) from e
        return prediction


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__
