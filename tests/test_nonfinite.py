"""trainer.on_nonfinite: a nan or inf training loss stops the run (naming the step, the loss and the
likely cause), skips the optimizer step, or warns. In-process runs on data with one poisoned batch
at a known optimizer step, plus one CLI run whose learning rate blows the weights up."""

import logging

import pytest
import torch
from conftest import runs_of
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dlpipe.schema import TrainerConfig
from dlpipe.training.nonfinite import NonFiniteLoss
from dlpipe.training.runner import Trainer

BATCH = 4


def poisoned(batches: int, bad_batch: int | None) -> TensorDataset:
    """`batches` batches of BATCH samples; one input of batch `bad_batch` (from 1) is nan."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches * BATCH, 5, generator=g)
    y = torch.randint(0, 3, (batches * BATCH,), generator=g)
    if bad_batch is not None:
        x[(bad_batch - 1) * BATCH + 1, 2] = float("nan")
    return TensorDataset(x, y)


class Sink:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))

    def flush(self):
        return None


def train(data: TensorDataset, lr: float = 0.1, epochs: int = 1, **settings) -> tuple[Trainer, Sink]:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=lr),
                      TrainerConfig(epochs=epochs, progress=False, grad_clip=0.0, **settings), metrics=Sink())
    trainer.fit(DataLoader(data, batch_size=BATCH, shuffle=False))
    return trainer, trainer.metrics


def test_stop_names_the_first_bad_step_at_the_next_log_step():
    """Bad data in optimizer step 6 (log_every=4): the run stops at the log step 8, naming step 6,
    the nan loss and bad data or the learning rate as the cause, without logging step 8's loss."""
    with pytest.raises(NonFiniteLoss) as caught:
        train(poisoned(10, bad_batch=6), log_every=4)
    message = str(caught.value)
    assert "non-finite training loss (nan) at optimizer step 6:" in message
    assert "nan/inf inputs or targets" in message and "trainer.on_nonfinite=stop" in message
    assert "\n" not in message


@pytest.mark.parametrize("log_every", [50, 10**9])
def test_stop_at_the_end_of_an_epoch_between_log_steps(log_every):
    """With no log step after the bad one, the epoch's end is where the run stops, still naming it,
    and the epoch is never scored. log_every=10**9 ("never") keeps at most MAX_MARKS sums on the device."""
    from dlpipe.training.nonfinite import MAX_MARKS

    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      TrainerConfig(epochs=1, progress=False, grad_clip=0.0, log_every=log_every), metrics=Sink())
    assert trainer.guard._marks.numel() == min(log_every, MAX_MARKS)
    with pytest.raises(NonFiniteLoss, match=r"at optimizer step 9: likely"):
        trainer.fit(DataLoader(poisoned(10, bad_batch=9), batch_size=BATCH, shuffle=False))
    assert trainer.history == [] and not any("train_loss" in metrics for metrics, _ in trainer.metrics.calls)


def test_a_bad_first_step_blames_the_data():
    with pytest.raises(NonFiniteLoss, match=r"\(nan\) at optimizer step 1: likely bad data"):
        train(poisoned(4, bad_batch=1), log_every=2)


def test_an_infinite_learning_rate_is_named_as_the_cause():
    """lr=inf: step 1's loss is finite, the update makes the weights non-finite, step 2's loss is not."""
    with pytest.raises(NonFiniteLoss, match=r"at optimizer step 2: likely the learning rate is too high \(lr=inf\)"):
        train(poisoned(6, bad_batch=None), lr=float("inf"), log_every=3)


def test_skip_step_drops_the_bad_step_and_trains_as_if_its_batch_were_absent():
    """skip_step: the poisoned step's update and loss are left out (plain SGD: the weights equal a run
    without that batch), the step still counts, and skipped_steps says so."""
    skipping, sink = train(poisoned(10, bad_batch=6), epochs=2, log_every=5, on_nonfinite="skip_step")
    clean = poisoned(10, bad_batch=None)
    keep = [i for i in range(len(clean)) if not 5 * BATCH <= i < 6 * BATCH]
    reference, _ = train(TensorDataset(*(t[keep] for t in clean.tensors)), epochs=2, log_every=5)
    for a, b in zip(skipping.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)
    assert skipping.step == 20 and skipping.guard.skipped == 2  # the batch is bad in both epochs
    assert [row["skipped_steps"] for row in skipping.history] == [1.0, 2.0]
    for got, want in zip(skipping.history, reference.history):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
    step_losses = [values["train_loss_step"] for values, _ in sink.calls if "train_loss_step" in values]
    assert len(step_losses) == 4 and all(v == v for v in step_losses)  # no nan leaks into train_loss_step


@pytest.mark.parametrize("bad_batch, counted", [(None, 0), (6, 1)])
def test_fp16_gradscaler_skips_are_its_own_a_nonfinite_loss_still_counts(bad_batch, counted):
    """amp=fp16 (autocast on the CPU here) with a loss scale so large that the scaled gradients
    overflow: GradScaler skips those steps and lowers its scale on its own, with finite losses, and
    skip_step counts none of them; a non-finite loss is still skipped and counted."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      TrainerConfig(epochs=1, progress=False, grad_clip=0.0, amp="fp16", on_nonfinite="skip_step"))
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    trainer.fit(DataLoader(poisoned(10, bad_batch), batch_size=BATCH, shuffle=False))
    assert trainer.scaler.get_scale() < 2.0**127  # the scaler skipped overflowing steps itself
    assert trainer.guard.skipped == counted and trainer.history[0]["skipped_steps"] == counted


def test_warn_goes_on_and_says_so_once(caplog):
    """warn: training finishes (with a nan loss from then on) and one warning names the first bad step."""
    with caplog.at_level(logging.WARNING, logger="dlpipe.training.nonfinite"):
        trainer, _ = train(poisoned(10, bad_batch=3), epochs=2, log_every=2, on_nonfinite="warn")
    assert len(trainer.history) == 2 and trainer.history[-1]["train_loss"] != trainer.history[-1]["train_loss"]
    [record] = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert "at optimizer step 3:" in record.getMessage() and "on_nonfinite=warn" in record.getMessage()


def test_cli_exploding_learning_rate_ends_the_run_failed_with_one_line(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """A learning rate that overflows the weights: exit 2, one `dlpipe: error:` line naming the step,
    the loss and the cause, and the MLflow run FAILED with that reason."""
    r = dlpipe("+recipe=tabular", "dataset.size=256", "trainer.epochs=1", "loader.num_workers=0",
               "loader.batch_size=32", "optim.lr=1e30", "trainer.progress=false", "trainer.log_every=2",
               f"hydra.run.dir={tmp_path / 'run'}", f"tracking.uri={mlflow_store}", "tracking.experiment=nonfinite")
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlpipe: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "non-finite training loss" in errors[0] and "at optimizer step 2:" in errors[0]
    assert "learning rate is too high (lr=1e+30)" in errors[0]
    [run] = runs_of(mlflow_client, "nonfinite")
    assert run.info.status == "FAILED"
    assert "NonFiniteLoss: non-finite training loss" in run.data.tags["dlpipe.end_reason"]
