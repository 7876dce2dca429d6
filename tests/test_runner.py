"""The training loop (dlpipe.training.runner.Trainer) driven directly with small in-memory datasets.

Every model here has no batch statistics and no dropout, so a sample's gradient does not depend on
the rest of its batch and updates can be compared against a hand-computed reference.
"""

import copy
import math
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from dlpipe.models.mlp import MLP
from dlpipe.schema import TrainerConfig
from dlpipe.stop import StopTraining
from dlpipe.training.losses import CrossEntropy
from dlpipe.training.objective import Objective
from dlpipe.training.rng import seed_everything
from dlpipe.training.runner import Trainer

IN, CLASSES = 6, 3


def make_dataset(n: int, seed: int = 0, scale: float = 1.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g) * scale
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(in_features=IN, num_classes=CLASSES, hidden=8, depth=1)


def make_trainer(model, lr: float = 0.1, optimizer=None, **settings) -> Trainer:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    metrics = settings.pop("metrics", None)
    empty_cache = settings.pop("empty_cache", None)
    settings = TrainerConfig(**{"epochs": 1, "progress": False, **settings})
    accuracy = MulticlassAccuracy(num_classes=CLASSES, average="micro")  # what the job builds for cross-entropy
    return Trainer(model, optimizer, settings, metrics=metrics, empty_cache=empty_cache,
                   val_metrics={"accuracy": accuracy})


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same_params(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-6) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=atol, rtol=0), (x - y).abs().max()


def reference_sgd(model: nn.Module, ds: TensorDataset, windows: list[tuple[int, int]], lr: float) -> list[torch.Tensor]:
    """Plain SGD by hand: one backward per window over its concatenated samples (mean loss)."""
    ref = copy.deepcopy(model)
    x, y = ds.tensors
    for start, end in windows:
        ref.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x[start:end]), y[start:end]).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= lr * p.grad
    return params(ref)


class CountingSGD(torch.optim.SGD):
    """SGD that records, at every step, the total gradient norm it was handed."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grad_norms: list[float] = []

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.grad_norms.append(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item())
        return super().step(closure)


class BatchRecorder(nn.Linear):
    """A linear classifier that records the batch sizes it sees in train and in eval mode."""

    def __init__(self):
        super().__init__(IN, CLASSES)
        self.train_batches: list[int] = []
        self.eval_batches: list[int] = []
        self.out_dtypes: list[torch.dtype] = []

    def forward(self, x):
        (self.train_batches if self.training else self.eval_batches).append(x.shape[0])
        out = super().forward(x)
        self.out_dtypes.append(out.dtype)
        return out


class RecordingSink:
    def __init__(self):
        self.calls: list[tuple[dict[str, float], int]] = []

        self.flushes: list[int] = []  # len(calls) at each flush

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))

    def flush(self):
        self.flushes.append(len(self.calls))


# --- gradient accumulation ------------------------------------------------------------------------


def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_b():
    """accumulate=4 with batch b gives the same parameters as accumulate=1 with batch 4*b."""
    k, b = 4, 3
    ds = make_dataset(k * b * 4)
    results = []
    for accumulate, batch_size in ((k, b), (1, k * b)):
        model = make_model()
        trainer = make_trainer(model, accumulate=accumulate)
        trainer.fit(DataLoader(ds, batch_size=batch_size, shuffle=False))
        assert trainer.step == 4
        results.append(params(model))
    start = params(make_model())
    assert not torch.allclose(results[0][0], start[0])  # the model did move
    assert_same_params(results[0], results[1])


def test_last_partial_window_updates_with_the_mean_of_its_samples():
    """10 micro-batches with accumulate=4 make 3 steps (4,4,2); the last is the mean over its 2 batches."""
    b, lr = 3, 0.1
    ds = make_dataset(10 * b)
    model = make_model()
    expected = reference_sgd(model, ds, [(0, 4 * b), (4 * b, 8 * b), (8 * b, 10 * b)], lr)
    optimizer = CountingSGD(model.parameters(), lr=lr)
    trainer = make_trainer(model, optimizer=optimizer, accumulate=4)
    trainer.fit(DataLoader(ds, batch_size=b, shuffle=False))
    assert trainer.step == 3
    assert len(optimizer.grad_norms) == 3
    assert_same_params(params(model), expected)


@pytest.mark.parametrize("accumulate, windows", [(4, [(0, 16), (16, 22)]), (3, [(0, 12), (12, 22)])])
def test_short_last_batch_updates_with_the_mean_over_the_window_samples(accumulate, windows):
    """22 samples in batches of 4 (last batch 2, drop_last=False): each update is the mean over its window's samples."""
    lr = 0.1
    ds = make_dataset(22)
    model = make_model()
    expected = reference_sgd(model, ds, windows, lr)
    trainer = make_trainer(model, lr=lr, accumulate=accumulate)
    trainer.fit(DataLoader(ds, batch_size=4, shuffle=False, drop_last=False))
    assert trainer.step == len(windows)
    assert_same_params(params(model), expected)


def test_partial_window_with_a_batch_sampler_loader_updates_with_the_mean():
    """A loader with a batch sampler (batch_size None): the last partial window is still the mean of its samples."""
    b, lr = 4, 0.1
    ds = make_dataset(10 * b)
    loader = DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), batch_size=b, drop_last=False), batch_size=None)
    assert loader.batch_size is None
    model = make_model()
    expected = reference_sgd(model, ds, [(0, 4 * b), (4 * b, 8 * b), (8 * b, 10 * b)], lr)
    trainer = make_trainer(model, lr=lr, accumulate=4)
    trainer.fit(loader)
    assert trainer.step == 3
    assert_same_params(params(model), expected)


class Unsized:
    """A loader with no length and no batch_size: the epoch ends when its iterator does."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


def reference_windows(model: nn.Module, ds: TensorDataset, windows: list[tuple[int, int]], lr: float):
    """reference_sgd, plus the epoch's train_loss: each window's mean loss before its update,
    weighted by its samples."""
    ref = copy.deepcopy(model)
    x, y = ds.tensors
    weighted = 0.0
    for start, end in windows:
        ref.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ref(x[start:end]), y[start:end])
        weighted += loss.item() * (end - start)
        loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= lr * p.grad
    return params(ref), weighted / (windows[-1][1] - windows[0][0])


@pytest.mark.parametrize("sized", [True, False], ids=["len", "no-len"])
@pytest.mark.parametrize("n, windows", [
    (26, [(0, 12), (12, 24), (24, 26)]),  # 7 batches (6 x 4 + 2): the last window is the short batch alone
    (30, [(0, 12), (12, 24), (24, 30)]),  # 8 batches (7 x 4 + 2): the last window is a batch of 4 and one of 2
])
def test_train_epoch_accumulating_3_over_a_ragged_epoch_is_sgd_on_each_windows_samples(n, windows, sized):
    """accumulate=3 over a batch count that is not a multiple of 3, last batch short: every epoch's
    updates are full-batch SGD on each window's samples, the partial window does not leak into the
    next epoch, and train_loss is the mean over the epoch's samples. Without a length the end of the
    epoch is found by the loader running out, so that partial window steps after the loop."""
    lr = 0.1
    ds = make_dataset(n)
    model = make_model()
    expected, loss1 = reference_windows(model, ds, windows, lr)
    ref_model = make_model()
    for p, q in zip(ref_model.parameters(), expected):
        p.data.copy_(q)
    expected, loss2 = reference_windows(ref_model, ds, windows, lr)  # epoch 2 starts from epoch 1's result
    trainer = make_trainer(model, lr=lr, accumulate=3, epochs=2)
    loader = DataLoader(ds, batch_size=4, shuffle=False, drop_last=False)
    loader = loader if sized else Unsized(loader)
    first = trainer.train_epoch(loader, 1)
    assert trainer.step == len(windows)
    second = trainer.train_epoch(loader, 2)
    assert trainer.step == 2 * len(windows)
    assert_same_params(params(model), expected)
    assert first["train_loss"] == pytest.approx(loss1, rel=1e-5)
    assert second["train_loss"] == pytest.approx(loss2, rel=1e-5)
    assert trainer.stop.at_batch is None


# --- step counting and limits ---------------------------------------------------------------------


def test_step_counts_optimizer_steps_not_micro_batches():
    """trainer.step counts optimizer steps: 5 micro-batches with accumulate=2 make 3 steps per epoch."""
    model = make_model()
    optimizer = CountingSGD(model.parameters(), lr=0.1)
    trainer = make_trainer(model, optimizer=optimizer, accumulate=2, epochs=3)
    history = trainer.fit(DataLoader(make_dataset(20), batch_size=4))
    assert len(history) == 3
    assert trainer.step == len(optimizer.grad_norms) == 9


def test_max_steps_stops_training_across_epochs():
    """max_steps=7 with 5 steps per epoch stops in the middle of epoch 2, after exactly 7 steps."""
    model = BatchRecorder()
    optimizer = CountingSGD(model.parameters(), lr=0.1)
    trainer = make_trainer(model, optimizer=optimizer, epochs=5, max_steps=7)
    history = trainer.fit(DataLoader(make_dataset(20), batch_size=4))
    assert trainer.step == len(optimizer.grad_norms) == 7
    assert [row["epoch"] for row in history] == [1.0, 2.0]
    assert len(model.train_batches) == 7


def test_limit_train_batches_limits_micro_batches_per_epoch():
    """limit_train_batches=3 trains on 3 of the 5 micro-batches in each epoch."""
    model = BatchRecorder()
    trainer = make_trainer(model, epochs=2, limit_train_batches=3)
    trainer.fit(DataLoader(make_dataset(20), batch_size=4))
    assert len(model.train_batches) == 6
    assert trainer.step == 6


def test_limit_val_batches_zero_skips_validation_and_positive_limits_it():
    """limit_val_batches=0 runs no validation (no val metrics); limit_val_batches=2 runs 2 batches."""
    train, val = make_dataset(8), make_dataset(20, seed=1)
    model = BatchRecorder()
    trainer = make_trainer(model, limit_val_batches=0)
    history = trainer.fit(DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))
    assert model.eval_batches == []
    assert "val_loss" not in history[0] and "val_accuracy" not in history[0]

    model = BatchRecorder()
    trainer = make_trainer(model, limit_val_batches=2)
    history = trainer.fit(DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))
    assert model.eval_batches == [4, 4]
    assert "val_loss" in history[0]


# --- periodic work: cache clearing, clipping, metrics ---------------------------------------------


def test_empty_cache_runs_every_n_optimizer_steps():
    """empty_cache_every=3 calls empty_cache on steps 3, 6, 9; empty_cache_every=0 never calls it."""

    def steps_with_empty_cache(every: int) -> list[int]:
        calls: list[int] = []
        trainer = make_trainer(make_model(), empty_cache_every=every, empty_cache=lambda: calls.append(trainer.step))
        trainer.fit(DataLoader(make_dataset(40), batch_size=4))  # 10 steps
        assert trainer.step == 10
        return calls

    assert steps_with_empty_cache(3) == [3, 6, 9]
    assert steps_with_empty_cache(0) == []


def test_grad_clip_bounds_the_gradient_norm_the_optimizer_sees():
    """With grad_clip=c the optimizer sees a total grad norm <= c; without clipping it is larger than c."""
    clip = 0.5
    ds = make_dataset(8, scale=100.0)  # large inputs: large gradients
    norms = {}
    for grad_clip in (0.0, clip):
        model = make_model()
        optimizer = CountingSGD(model.parameters(), lr=0.0)
        make_trainer(model, optimizer=optimizer, grad_clip=grad_clip).fit(DataLoader(ds, batch_size=8))
        norms[grad_clip] = optimizer.grad_norms
    assert len(norms[clip]) == len(norms[0.0]) == 1
    assert norms[0.0][0] > clip
    assert norms[clip][0] <= clip * (1 + 1e-5)


def test_metric_sink_gets_epoch_metrics_and_train_loss_step_every_log_every_steps():
    """The sink gets each epoch's metrics, `epoch` among them, at the epoch's last optimizer step, and
    train_loss_step, lr, grad_norm and epoch at steps log_every, 2*log_every, ...: one step axis."""
    train, val = make_dataset(24), make_dataset(10, seed=1)
    model = make_model()
    sink = RecordingSink()
    # lr=0: the model never changes, so every loss has a hand-computed reference
    trainer = make_trainer(model, lr=0.0, epochs=2, log_every=2, metrics=sink)
    trainer.fit(DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))  # 6 steps per epoch

    step_calls = [(m, s) for m, s in sink.calls if "train_loss_step" in m]
    epoch_calls = [(m, s) for m, s in sink.calls if "train_loss_step" not in m]
    assert [s for _, s in step_calls] == [2, 4, 6, 8, 10, 12]
    assert [(s, m["epoch"]) for m, s in epoch_calls] == [(6, 1.0), (12, 2.0)]
    assert all(set(m) == {"train_loss_step", "lr", "grad_norm", "epoch"} for m, _ in step_calls)
    assert [m["epoch"] for m, _ in step_calls] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    # one flush per epoch, right after that epoch's metrics: never inside a training step
    epoch_positions = [i + 1 for i, (m, _) in enumerate(sink.calls) if "train_loss_step" not in m]
    assert sink.flushes == epoch_positions

    x, y = train.tensors
    vx, vy = val.tensors
    with torch.no_grad():
        per_sample = F.cross_entropy(model(x), y, reduction="none")
        val_logits = model(vx)
    for i, (m, _) in enumerate(step_calls[:3]):  # epoch 1: samples 8i..8i+7 since the previous log
        assert m["train_loss_step"] == pytest.approx(per_sample[8 * i : 8 * i + 8].mean().item(), rel=1e-5)
        # the logged step's own gradient (batch 2i+1: samples 8i+4..8i+7), measured without clipping
        model.zero_grad()
        F.cross_entropy(model(x[8 * i + 4 : 8 * i + 8]), y[8 * i + 4 : 8 * i + 8]).backward()
        norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        assert m["grad_norm"] == pytest.approx(norm.item(), rel=1e-5) and m["lr"] == 0.0

    required = {"epoch_time_s", "samples_per_s", "data_wait_frac", "train_loss", "val_loss", "val_accuracy",
                "epoch_lr"}
    for m, _ in epoch_calls:
        assert required <= set(m)
        assert m["train_loss"] == pytest.approx(per_sample.mean().item(), rel=1e-5)
        assert m["val_loss"] == pytest.approx(F.cross_entropy(val_logits, vy).item(), rel=1e-5)
        assert m["val_accuracy"] == pytest.approx((val_logits.argmax(-1) == vy).float().mean().item())
        assert 0.0 <= m["data_wait_frac"] <= 1.0
        assert m["samples_per_s"] == pytest.approx(len(train) / m["epoch_time_s"], rel=1e-3)


# --- losses, seeding, precision, interrupts -------------------------------------------------------


def test_token_level_loss_and_accuracy_count_every_token():
    """[B, T, V] logits: the loss is the mean cross-entropy over all B*T tokens, accuracy counts tokens."""
    from torchmetrics.classification import MulticlassAccuracy

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 7, generator=g)
    target = torch.randint(0, 7, (4, 5), generator=g)
    objective = Objective(CrossEntropy())
    loss = objective.loss(logits, target)
    assert loss.item() == pytest.approx(F.cross_entropy(logits.transpose(1, 2), target).item(), rel=1e-6)
    accuracy = MulticlassAccuracy(num_classes=7, average="micro")
    accuracy.update(*objective.metric_inputs(logits, target))
    correct = sum(int(logits[b, t].argmax() == target[b, t]) for b in range(4) for t in range(5))
    assert accuracy.compute().item() == pytest.approx(correct / 20)


def _seeded_run(seed: int) -> list[torch.Tensor]:
    seed_everything(seed)
    model = MLP(in_features=IN, num_classes=CLASSES, hidden=8, depth=1)
    loader = DataLoader(make_dataset(32), batch_size=4, shuffle=True)  # order from the global torch RNG
    make_trainer(model, epochs=2).fit(loader)
    return params(model)


def test_seed_everything_makes_runs_bitwise_identical():
    """The same seed gives bitwise identical parameters after training; a different seed does not."""
    a, b, c = _seeded_run(11), _seeded_run(11), _seeded_run(12)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_seed_everything_seeds_python_and_numpy():
    """seed_everything also fixes Python's `random` and NumPy's global generator."""
    draws = []
    for seed in (5, 5, 6):
        seed_everything(seed)
        draws.append((random.random(), float(np.random.rand()), torch.rand(()).item()))
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def test_bf16_autocast_on_cpu_trains_with_finite_losses():
    """amp='bf16' runs the forward pass under CPU bf16 autocast and yields finite train and val losses."""
    model = BatchRecorder()
    history = make_trainer(model, amp="bf16", epochs=2).fit(
        DataLoader(make_dataset(16), batch_size=4), DataLoader(make_dataset(8, seed=1), batch_size=4)
    )
    assert torch.bfloat16 in model.out_dtypes
    assert model.weight.dtype == torch.float32  # master weights stay fp32
    for row in history:
        assert math.isfinite(row["train_loss"]) and math.isfinite(row["val_loss"])


class InterruptAt(Dataset):
    def __init__(self, n: int, at: int):
        self.data, self.at = make_dataset(n), at

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == self.at:
            raise KeyboardInterrupt
        return self.data[i]


def test_keyboard_interrupt_in_the_data_propagates_out_of_fit():
    """A KeyboardInterrupt raised while loading a batch leaves fit() (it is not swallowed)."""
    model = BatchRecorder()
    trainer = make_trainer(model, epochs=2)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(DataLoader(InterruptAt(16, at=9), batch_size=4))
    assert model.train_batches == [4, 4]  # batches before the interrupt were trained on
    assert trainer.history == []


# --- stop and resume ------------------------------------------------------------------------------


class NoisyItems(torch.utils.data.Dataset):
    """Items drawn from the main process's torch RNG (num_workers=0): resuming must restore it."""

    def __init__(self, n: int = 48):
        self.x = torch.randn(n, 6, generator=torch.Generator().manual_seed(3))
        self.y = torch.arange(n) % 3

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


class StopAfter(torch.nn.Module):
    """Dropout (RNG in the step itself) plus a hook that asks the trainer to stop after N forwards."""

    def __init__(self, stop_after: int | None = None):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
        )
        self.stop_after, self.calls, self.trainer = stop_after, 0, None

    def forward(self, x):
        self.calls += 1
        if self.stop_after is not None and self.calls == self.stop_after and self.trainer is not None:
            self.trainer.stop.signal = "SIGTERM"  # what the job's signal handler does
        return self.net(x)


def build_stoppable(stop_after=None, log_every: int = 50, epochs: int = 3):
    seed_everything(11)
    model = StopAfter(stop_after)
    generator = torch.Generator().manual_seed(5)
    loader = DataLoader(NoisyItems(), batch_size=4, shuffle=True, generator=generator)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01),
                      TrainerConfig(epochs=epochs, accumulate=2, progress=False, log_every=log_every))
    model.trainer = trainer
    return trainer, loader


def test_stop_mid_epoch_then_resume_matches_an_uninterrupted_run():
    """Stop requested mid-epoch: it stops at an optimizer step, and state_dict + resume reproduce a straight run."""
    straight, loader = build_stoppable()
    straight.fit(loader)

    first, loader1 = build_stoppable(stop_after=17)  # epoch 2, micro-batch 5 (12 per epoch)
    with pytest.raises(StopTraining):
        first.fit(loader1)
    state = first.state_dict(loader1.generator)
    assert state["epoch"] == 1 and state["batches_done"] == 6  # rounded up to the next optimizer step
    assert state["step"] == 6 + 3

    second, loader2 = build_stoppable()
    second.load_state_dict(state, loader2.generator)
    second.fit(loader2)
    assert second.step == straight.step
    for a, b in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


# Per-attempt measurements: what a resumed epoch measures of its own part only.
TIMINGS = {"epoch_time_s", "samples_per_s", "data_wait_s", "data_wait_frac", "first_batch_s", "h2d_s", "h2d_frac",
           "step_time_p50_ms", "step_time_p95_ms"}


def logged(sink: RecordingSink) -> list[tuple[int, dict[str, float]]]:
    return [(step, {k: v for k, v in values.items() if k not in TIMINGS}) for values, step in sink.calls]


def test_stop_mid_epoch_then_resume_logs_what_an_uninterrupted_run_logs():
    """Every logged number but the timings, step by step and epoch by epoch, is bitwise the straight
    run's: train_loss of the interrupted epoch (its sum and samples before the stop are in the
    checkpoint) and the train_loss_step whose window spans the stop and an epoch boundary."""
    straight, loader = build_stoppable(log_every=4)  # 6 steps an epoch: logs at 4, 8, 12... across epochs
    straight.metrics = sink_a = RecordingSink()
    straight.fit(loader)

    first, loader1 = build_stoppable(stop_after=17, log_every=4)  # stops in epoch 2 at step 9, inside 9..12
    first.metrics = sink_b = RecordingSink()
    with pytest.raises(StopTraining):
        first.fit(loader1)
    state = first.state_dict(loader1.generator)
    assert state["epoch_loss"]["samples"] == 6 * 4 and state["step_log"]["samples"] == 2 * 4
    second, loader2 = build_stoppable(log_every=4)
    second.load_state_dict(state, loader2.generator)
    second.metrics = sink_b
    second.fit(loader2)
    assert logged(sink_b) == logged(sink_a)
    assert [step for values, step in sink_a.calls if "train_loss_step" in values] == [4, 8, 12, 16]
    assert [row["train_loss"] for row in second.history] == [row["train_loss"] for row in straight.history]


def test_resume_after_a_finished_epoch_keeps_the_step_log_window_that_spans_it():
    """An epoch's checkpoint holds the loss and samples since the last train_loss_step: the log of
    step 8 (window 5..8, across the epoch boundary at step 6) is the straight run's."""
    straight, loader = build_stoppable(log_every=4)
    straight.metrics = sink_a = RecordingSink()
    straight.fit(loader)

    first, loader1 = build_stoppable(log_every=4, epochs=1)
    first.metrics = sink_b = RecordingSink()
    first.fit(loader1)
    state = first.state_dict(loader1.generator)
    assert state["step_log"]["samples"] == 2 * 2 * 4 and state["epoch_loss"] is None
    second, loader2 = build_stoppable(log_every=4)
    second.load_state_dict(state, loader2.generator)
    second.metrics = sink_b
    second.fit(loader2)
    assert logged(sink_b) == logged(sink_a)


class DyingLoader:
    """Yields `batches`, then fails the way a DataLoader does when a worker is killed; with
    `signal`, the stop request arrives just before (the same signal reached the workers)."""

    def __init__(self, batches, trainer: Trainer, signal: str | None, error: str):
        self.batches, self.trainer, self.signal, self.error = batches, trainer, signal, error

    def __len__(self):
        return len(self.batches) + 2  # the epoch was meant to go on

    def __iter__(self):
        yield from self.batches
        if self.signal is not None:
            self.trainer.stop.signal = self.signal
        raise RuntimeError(self.error)


WORKER_KILLED = "DataLoader worker (pid(s) 4242) exited unexpectedly"


def dying(accumulate: int, batches: int, signal: str | None = "SIGTERM", error: str = WORKER_KILLED):
    """A trainer (lr 0.1) and a DyingLoader over `batches` batches of 4 from make_dataset(4 * batches)."""
    model = make_model()
    trainer = make_trainer(model, accumulate=accumulate, epochs=2)
    x, y = make_dataset(4 * batches).tensors
    loader = DyingLoader([(x[i : i + 4], y[i : i + 4]) for i in range(0, 4 * batches, 4)], trainer, signal, error)
    return trainer, loader


def test_workers_dying_of_the_stop_signal_at_an_optimizer_step_stop_there():
    """Workers killed by the stop signal right after an optimizer step: the epoch stops at that step,
    resumable mid-epoch (batches_done), and fit raises StopTraining."""
    trainer, loader = dying(accumulate=2, batches=4)
    with pytest.raises(StopTraining, match="SIGTERM"):
        trainer.fit(loader)
    assert trainer.step == 2
    assert trainer.stop.at_batch == 4
    assert trainer.history == []
    assert trainer.state_dict()["batches_done"] == 4


def test_workers_dying_of_the_stop_signal_mid_window_stop_without_a_step():
    """Killed in the middle of an accumulation window: no update from the half window, and no
    mid-epoch resume point (at_batch None: the last finished epoch is where a resume starts)."""
    expected = reference_sgd(make_model(), make_dataset(12), [(0, 8)], lr=0.1)  # the one full window only
    trainer, loader = dying(accumulate=2, batches=3)
    with pytest.raises(StopTraining, match="SIGTERM"):
        trainer.train_epoch(loader, 1)
    assert trainer.step == 1
    assert trainer.stop.at_batch is None
    assert trainer.state_dict()["batches_done"] == 0
    assert_same_params(params(trainer.model), expected)


@pytest.mark.parametrize("signal, error", [(None, WORKER_KILLED), ("SIGTERM", "CUDA error: out of memory")])
def test_loader_errors_propagate_unless_workers_died_of_a_stop(signal, error):
    """Dead workers without a stop request, or another RuntimeError during a stop: training fails."""
    trainer, loader = dying(accumulate=2, batches=4, signal=signal, error=error)
    with pytest.raises(RuntimeError, match=re.escape(error)):
        trainer.fit(loader)
    assert trainer.step == 2


class EpochSampler(torch.utils.data.Sampler):
    """A sampler whose order depends on the epoch (like DistributedSampler): reversed on odd epochs."""

    def __init__(self, n: int):
        self.n, self.epoch, self.orders = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        order = list(range(self.n))[:: -1 if self.epoch % 2 else 1]
        self.orders.append((self.epoch, order))
        return iter(order)


def test_sampler_gets_the_epoch_before_the_epoch_is_iterated_and_profiler_steps_per_micro_batch():
    """set_epoch(epoch) comes before iter(loader); the profiler steps once per micro-batch, not per optimizer step."""

    class Profiler:
        steps = 0

        def step(self):
            self.steps += 1

    sampler, profiler = EpochSampler(12), Profiler()
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      TrainerConfig(epochs=2, accumulate=2, progress=False), profiler=profiler)
    trainer.fit(DataLoader(make_dataset(12), batch_size=4, sampler=sampler))  # 3 micro-batches, 2 steps per epoch
    assert sampler.orders == [(1, list(range(11, -1, -1))), (2, list(range(12)))]
    assert profiler.steps == 6
    assert trainer.step == 4
