"""Learning-rate schedules: the closed form of warm-up + decay, stepping per optimizer step or per
epoch in the real loop, exact resumption, and the same through the CLI with a real SIGTERM and a
real MLflow store."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import runs_of
from torch.utils.data import DataLoader, TensorDataset

from dlpipe.schema import TrainerConfig
from dlpipe.stop import StopTraining
from dlpipe.training.accumulation import epoch_batches, optimizer_steps
from dlpipe.training.rng import seed_everything
from dlpipe.training.runner import Trainer
from dlpipe.training.schedule import Schedule, schedule_length, warmup_cosine, warmup_linear


def closed_form(k: int, lr: float, warmup: int, total: int, ratio: float, shape: str = "cosine") -> float:
    """The lr of optimizer step k (counted from 1), written out as docs/configuration.md states it."""
    if k <= warmup:
        return lr * k / (warmup + 1)
    progress = (k - 1 - warmup) / (total - 1 - warmup)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if shape == "cosine" else 1 - progress
    return lr * (ratio + (1 - ratio) * decay)


class RecordingSink:
    def __init__(self):
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))

    def flush(self):
        pass

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, m[name]) for m, step in self.calls if name in m]


class LrRecordingSGD(torch.optim.SGD):
    """SGD that records each group's lr at every step: what the update really used."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.used: list[list[float]] = []

    def step(self, closure=None):
        self.used.append([g["lr"] for g in self.param_groups])
        return super().step(closure)


def data(n: int = 20) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("shape, build", [("cosine", warmup_cosine), ("linear", warmup_linear)])
def test_warmup_decay_follows_the_closed_form_in_the_loop(shape, build):
    """20 samples, batch 4, accumulate 2: 3 optimizer steps an epoch (the last window is partial),
    4 epochs = 12 steps. The lr every step used, and logged, is the formula's, first and last included;
    each parameter group follows its own lr."""
    net, loader = model(), DataLoader(data(), batch_size=4)
    optimizer = LrRecordingSGD([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.02}], lr=0.1)
    settings = TrainerConfig(epochs=4, accumulate=2, log_every=1, progress=False)
    per_epoch = optimizer_steps(epoch_batches(loader, settings.limit_train_batches), settings.accumulate)
    total = schedule_length(settings, per_epoch, "step")
    assert (per_epoch, total) == (3, 12)
    schedule = Schedule(build(optimizer, total_steps=total, warmup_steps=3, min_lr_ratio=0.1), "step")
    sink = RecordingSink()
    Trainer(net, optimizer, settings, metrics=sink, schedule=schedule).fit(loader)

    for group, base in enumerate((0.1, 0.02)):
        expected = [closed_form(k, base, 3, 12, 0.1, shape) for k in range(1, 13)]
        assert [used[group] for used in optimizer.used] == pytest.approx(expected, rel=1e-12, abs=0)
        assert sink.series(f"lr/group_{group}") == list(enumerate((used[group] for used in optimizer.used), 1))
    assert optimizer.used[0][0] == pytest.approx(0.1 / 4)  # first step: small, not 0
    assert optimizer.used[3][0] == pytest.approx(0.1)  # right after warm-up: the optimizer's lr
    assert optimizer.used[-1][0] == pytest.approx(0.1 * 0.1)  # last step: min_lr_ratio x lr
    # each epoch's lr is its last step's, on the epoch axis
    assert [v for _, v in sink.series("epoch_lr/group_0")] == [optimizer.used[i][0] for i in (2, 5, 8, 11)]
    assert [s for s, _ in sink.series("grad_norm")] == list(range(1, 13))


def test_epoch_interval_steps_after_each_epoch_and_max_steps_caps_the_span():
    net, loader = model(), DataLoader(data(), batch_size=4)
    optimizer = LrRecordingSGD(net.parameters(), lr=0.1)
    schedule = Schedule(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "epoch")
    sink = RecordingSink()
    Trainer(net, optimizer, TrainerConfig(epochs=3, log_every=5, progress=False), metrics=sink,
            schedule=schedule).fit(loader)
    assert [used[0] for used in optimizer.used] == [0.1] * 5 + [0.05] * 5 + [0.025] * 5
    assert sink.series("epoch_lr") == [(5, 0.1), (10, 0.05), (15, 0.025)]  # at each epoch's last step
    assert sink.series("epoch") == [(5, 1.0), (5, 1.0), (10, 2.0), (10, 2.0), (15, 3.0), (15, 3.0)]  # step log, epoch
    assert sink.series("lr") == [(5, 0.1), (10, 0.05), (15, 0.025)]
    # the span: optimizer steps (or epochs) of the whole run, capped by max_steps
    capped = TrainerConfig(epochs=3, max_steps=7)
    assert schedule_length(capped, 5, "step") == 7 and schedule_length(capped, 5, "epoch") == 2
    assert schedule_length(TrainerConfig(epochs=3), None, "step") is None  # no length: not derivable


def stoppable(schedule_of, stop_after: int | None = None, epochs: int = 3):
    """A run whose model asks the trainer to stop after `stop_after` forwards (what the job's signal
    handler does), with dropout and shuffling so that resuming must restore every random state."""
    seed_everything(7)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    loader = DataLoader(data(48), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    optimizer = LrRecordingSGD(net.parameters(), lr=0.1)
    sink = RecordingSink()
    trainer = Trainer(net, optimizer, TrainerConfig(epochs=epochs, accumulate=2, log_every=1, progress=False),
                      metrics=sink, schedule=schedule_of(optimizer))
    calls = [0]

    def count(module, args):
        calls[0] += 1
        if calls[0] == stop_after:
            trainer.stop.signal = "SIGTERM"

    net.register_forward_pre_hook(count)
    return trainer, loader, optimizer, sink


SCHEDULES = {
    "cosine per step": lambda opt: Schedule(warmup_cosine(opt, total_steps=18, warmup_steps=4), "step"),
    "StepLR per epoch": lambda opt: Schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "epoch"),
    "OneCycleLR per step": lambda opt: Schedule(torch.optim.lr_scheduler.OneCycleLR(opt, 0.3, total_steps=18), "step"),
}


@pytest.mark.parametrize("schedule_of", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_stop_mid_epoch_or_between_epochs_then_resume_continues_the_schedule_exactly(schedule_of):
    straight, loader, used, _ = stoppable(schedule_of)
    straight.fit(loader)

    # mid-epoch: forward 17 is epoch 2's 5th micro-batch; it stops at the end of that window
    first, loader1, used1, _ = stoppable(schedule_of, stop_after=17)
    with pytest.raises(StopTraining):
        first.fit(loader1)
    state = first.state_dict(loader1.generator)
    assert state["batches_done"] == 6 and state["scheduler"] is not None
    second, loader2, used2, _ = stoppable(schedule_of)
    second.load_state_dict(state, loader2.generator)
    second.fit(loader2)
    assert used1.used + used2.used == used.used  # every optimizer step, with the lr of the straight run
    for a, b in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)

    # between epochs: 1 epoch, then the same run continued to 3 (epochs is allowed to change)
    short, loader3, used3, _ = stoppable(schedule_of, epochs=1)
    short.fit(loader3)
    rest, loader4, used4, _ = stoppable(schedule_of)
    rest.load_state_dict(short.state_dict(loader3.generator), loader4.generator)
    rest.fit(loader4)
    assert used3.used + used4.used == used.used
    assert [r["epoch_lr"] for r in rest.history] == [r["epoch_lr"] for r in straight.history]


def test_checkpoints_without_a_schedule_still_load(caplog):
    """A checkpoint from before schedules (no "scheduler" key) loads with or without a schedule."""
    trainer, loader, _, _ = stoppable(lambda opt: None, epochs=1)
    trainer.fit(loader)
    old = trainer.state_dict(loader.generator)
    del old["scheduler"]
    plain, loader1, _, _ = stoppable(lambda opt: None)
    plain.load_state_dict(old, loader1.generator)
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        scheduled, loader2, _, _ = stoppable(SCHEDULES["cosine per step"])
        scheduled.load_state_dict(old, loader2.generator)
    assert "holds no learning-rate schedule" in caplog.text
    scheduled.fit(loader2)
    assert scheduled.step == 18


def test_a_longer_resumed_run_stretches_cosine_to_its_new_length():
    """The warm-up shapes save no span (a partial, not state): a run resumed with more epochs
    continues at its step on the curve its own config derives."""
    short = torch.optim.SGD(model().parameters(), lr=0.1)
    schedule = warmup_cosine(short, total_steps=12, warmup_steps=2)
    for _ in range(6):
        short.step()
        schedule.step()
    longer = torch.optim.SGD(model().parameters(), lr=0.1)
    stretched = warmup_cosine(longer, total_steps=24, warmup_steps=2)
    longer.load_state_dict(short.state_dict())
    stretched.load_state_dict(schedule.state_dict())
    stretched.step()
    assert longer.param_groups[0]["lr"] == pytest.approx(closed_form(8, 0.1, 2, 24, 0.0), rel=1e-12)


def test_onecycle_refuses_a_resume_that_would_step_past_its_end():
    """OneCycleLR keeps its span in its state and raises past it: a longer resumed run is one line."""
    from dlpipe.errors import ConfigError

    short, loader, _, _ = stoppable(SCHEDULES["OneCycleLR per step"], epochs=1)
    short.fit(loader)
    longer, loader1, _, _ = stoppable(lambda opt: Schedule(torch.optim.lr_scheduler.OneCycleLR(opt, 0.3, 30), "step"))
    with pytest.raises(ConfigError, match=r"scheduler.total_steps=30: the checkpoint's OneCycleLR spans 18 steps"):
        longer.load_state_dict(short.state_dict(loader.generator), loader1.generator)


@pytest.mark.parametrize("grad_clip", [0.0, 10.0])
def test_fp16_grad_norm_is_of_the_unscaled_gradients(grad_clip):
    """With fp16's GradScaler (loss x 65536) the logged norm is the true one, measured (grad_clip=0)
    or returned by the clipping. The scaler works the same on the CPU, so this runs everywhere."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ds = data(8)
    net = model().to(device)
    sink = RecordingSink()
    settings = TrainerConfig(epochs=1, log_every=1, grad_clip=grad_clip, progress=False, device=device, amp="fp16")
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.0), settings, metrics=sink)
    assert trainer.scaler.is_enabled() and trainer.scaler.get_scale() > 1000
    trainer.fit(DataLoader(ds, batch_size=8))
    x, y = (t.to(device) for t in ds.tensors)
    net.zero_grad()
    with torch.autocast(device, dtype=torch.float16):
        loss = F.cross_entropy(net(x), y)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in net.parameters()])).item()
    [(_, logged)] = sink.series("grad_norm")
    assert norm < grad_clip or grad_clip == 0  # the clip does not change what is compared here
    assert logged == pytest.approx(norm, rel=1e-3)


# --- through the CLI --------------------------------------------------------------------------------

TINY = ["--config-dir", "{tests}/conf", "dataset=signals_itself", "model=mlp", "model.hidden=8", "model.depth=1",
        "loader=in_memory", "loader.batch_size=16", "trainer.accumulate=2", "trainer.epochs=3", "trainer.log_every=1",
        "trainer.grad_clip=0", "trainer.deterministic=true", "trainer.progress=false", "optim=sgd",
        "scheduler=cosine", "scheduler.warmup_steps=3", "scheduler.min_lr_ratio=0.1"]


def cli(tests_dir, *extra: str) -> list[str]:
    return [a.replace("{tests}", str(tests_dir)) for a in TINY] + list(extra)


def lr_history(client, run) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/lr"))


def test_cli_cosine_run_logs_the_formula_at_every_step(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """108 training samples, batch 16, accumulate 2: 4 optimizer steps an epoch, 12 in 3 epochs; the
    run's `lr` follows the formula. (A SIGTERM resume of a cosine run logging the same lr history:
    tests/test_resume.py::test_sigterm_mid_epoch_then_resume_logs_every_number_of_a_straight_run.)"""
    from conftest import TESTS_DIR

    r = dlpipe(*cli(TESTS_DIR, "dataset.at=-1", f"hydra.run.dir={tmp_path / 'straight'}",
                    f"tracking.uri={mlflow_store}", "tracking.experiment=schedule-straight"))
    assert r.returncode == 0, r.stderr
    [run_a] = runs_of(mlflow_client, "schedule-straight")
    history_a = lr_history(mlflow_client, run_a)
    assert [k for k, _ in history_a] == list(range(1, 13))
    assert [v for _, v in history_a] == pytest.approx([closed_form(k, 0.05, 3, 12, 0.1) for k in range(1, 13)],
                                                     rel=1e-12, abs=0)
    norms = mlflow_client.get_metric_history(run_a.info.run_id, "train/grad_norm")
    assert [m.step for m in norms] == list(range(1, 13))
    # one step axis: each epoch's values at its last optimizer step
    assert [m.step for m in mlflow_client.get_metric_history(run_a.info.run_id, "train/epoch_lr")] == [4, 8, 12]


def test_a_plateau_schedule_halves_the_lr_when_the_monitored_metric_stalls():
    """scheduler=plateau: ReduceLROnPlateau steps once an epoch on the metric it monitors."""
    from dlpipe.training.schedule import Schedule

    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=1)
    schedule = Schedule(plateau, "epoch", monitor="val_loss")
    used = [schedule.end_epoch(optimizer, {"val_loss": v})[0] for v in (1.0, 0.9, 0.95, 0.95, 0.95)]
    assert used == [1.0, 1.0, 1.0, 1.0, 0.5]  # 2 epochs past the best (patience 1): halved after the 4th
    assert optimizer.param_groups[0]["lr"] == 0.5
