"""data_wait_frac is data-wait seconds over epoch seconds: checked on the rows the real Trainer logs.

Time here is a fake clock that moves only when the test says so: the loader's __next__ advances it by a
known wait, the model's forward by a known compute time, validation and the end of the epoch (where
non-persistent workers are joined) by their own amounts. Every figure is then exact, and each wrong
denominator (step time, wall time with validation, the first batch left out) gives a different number.
The amounts are powers of two, so the sums are exact in floating point.
"""

import pytest
import torch
from fake_clock import FakeClock, install
from torch import nn

from dlpipe.schema import TrainerConfig
from dlpipe.training.runner import Trainer

START_S = 2.0  # the first batch: worker start-up before it
WAIT_S = 0.25  # every batch: waiting for the loader
COMPUTE_S = 0.5  # every micro-step: forward and backward
JOIN_S = 1.0  # the end of the epoch: joining non-persistent workers (after the last batch)
VALIDATE_S = 8.0  # each validation batch: outside the training epoch
BATCHES = 4


class TimedLoader:
    """A loader without a length (the Trainer reads it to its StopIteration, where the join happens):
    the first batch costs START_S more, each batch WAIT_S, the end JOIN_S."""

    def __init__(self, clock: FakeClock, batches: int = BATCHES, join_s: float = JOIN_S):
        self.clock, self.batches, self.join_s = clock, batches, join_s

    def __iter__(self):
        self.clock.advance(START_S)
        for _ in range(self.batches):
            self.clock.advance(WAIT_S)
            yield torch.randn(4, 8), torch.randint(0, 2, (4,))
        self.clock.advance(self.join_s)


class ValLoader:
    def __init__(self, clock: FakeClock):
        self.clock = clock

    def __iter__(self):
        for _ in range(2):
            self.clock.advance(VALIDATE_S)
            yield torch.randn(4, 8), torch.randint(0, 2, (4,))


class TimedModel(nn.Module):
    """Costs COMPUTE_S per training forward and nothing in eval (validation time is in ValLoader)."""

    def __init__(self, clock: FakeClock):
        super().__init__()
        self.clock = clock
        self.linear = nn.Linear(8, 2)

    def forward(self, x):
        if self.training:
            self.clock.advance(COMPUTE_S)
        return self.linear(x)


class Rows:
    """The metrics sink: what the Trainer logs, per epoch."""

    def __init__(self):
        self.logged: list[dict[str, float]] = []

    def log_metrics(self, metrics, step):
        if "epoch_time_s" in metrics:  # the epoch's row, not the per-step train_loss_step and lr
            self.logged.append(dict(metrics))

    def flush(self):
        return None


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """Every perf_counter() the loop and its epoch clock read (EpochClock's start included) is the fake one."""
    return install(monkeypatch)


def fit(clock: FakeClock, epochs: int = 2, accumulate: int = 1, **loader) -> list[dict[str, float]]:
    model = TimedModel(clock)
    sink = Rows()
    settings = TrainerConfig(epochs=epochs, device="cpu", progress=False, accumulate=accumulate, log_every=1)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), settings, metrics=sink).fit(
        TimedLoader(clock, **loader), ValLoader(clock))
    return sink.logged


def test_data_wait_frac_is_data_wait_over_the_epoch_time(clock):
    """Each logged epoch: data_wait_s is every wait including the first batch's start-up, epoch_time_s is
    the whole training pass to the end of its loader (not the steps alone, not validation), and
    data_wait_frac is exactly their quotient."""
    rows = fit(clock)
    assert len(rows) == 2
    wait = START_S + BATCHES * WAIT_S
    epoch = wait + BATCHES * COMPUTE_S + JOIN_S
    for row in rows:  # the second epoch starts its own clock: earlier epochs and validation are not in it
        assert row["data_wait_s"] == pytest.approx(wait, rel=1e-12)
        assert row["epoch_time_s"] == pytest.approx(epoch, rel=1e-12)
        assert row["data_wait_frac"] == pytest.approx(row["data_wait_s"] / row["epoch_time_s"], rel=1e-12)
        assert row["data_wait_frac"] == pytest.approx(3 / 6, rel=1e-12)
        assert row["first_batch_s"] == pytest.approx(START_S + WAIT_S, rel=1e-12)
        assert row["samples_per_s"] == pytest.approx(BATCHES * 4 / epoch, rel=1e-12)


@pytest.mark.parametrize("join_s, expected", [(0.0, 3 / 5), (5.0, 3 / 10)])
def test_time_after_the_last_step_counts_in_the_epoch_not_in_the_wait(clock, join_s, expected):
    """Only the end of the epoch changes: the wait stays, the epoch grows, the share falls. A share
    taken over the step times would not move at all."""
    [row] = fit(clock, epochs=1, join_s=join_s)
    assert row["data_wait_s"] == pytest.approx(START_S + BATCHES * WAIT_S, rel=1e-12)
    assert row["data_wait_frac"] == pytest.approx(expected, rel=1e-12)
    assert row["data_wait_frac"] == pytest.approx(row["data_wait_s"] / row["epoch_time_s"], rel=1e-12)


def test_accumulation_does_not_change_what_counts_as_waiting(clock):
    """With accumulation every micro-batch is still waited for and computed: the same figures."""
    [row] = fit(clock, epochs=1, accumulate=2)
    assert row["data_wait_frac"] == pytest.approx(3 / 6, rel=1e-12)
    assert row["data_wait_frac"] == pytest.approx(row["data_wait_s"] / row["epoch_time_s"], rel=1e-12)
