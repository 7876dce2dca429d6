"""The bottleneck verdict and the worker-memory warning, from rules and from real measured runs."""

import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dlpipe.hardware import recommended_workers
from dlpipe.schema import TrainerConfig
from dlpipe.telemetry.sampler import ResourceSampler
from dlpipe.telemetry.verdict import diagnose, more_workers, rss_slope, run_metrics, worker_leak
from dlpipe.training.runner import Trainer


def judge(metrics, workers=0, budget=4, pin=False, device="cpu"):
    return diagnose(metrics, num_workers=workers, cpu_budget=budget, pin_memory=pin, device_type=device)


def test_input_bound_suggests_more_workers_within_budget():
    """A loader-starved epoch names the data wait and a worker count the CPU budget allows."""
    v = judge({"data_wait_frac": 0.6, "cpu_util": 40.0}, workers=0, budget=4)
    assert v.kind == "input-bound" and "60%" in v.evidence
    assert v.advice == f"try loader.num_workers={recommended_workers(4)}"
    assert more_workers(2, 16) == 8 and more_workers(4, 4) == 4 and more_workers(0, 1) == 1


def test_saturated_cpu_is_budget_bound():
    """Waiting on data with the CPU budget already used up: more workers cannot help."""
    v = judge({"data_wait_frac": 0.5, "cpu_util": 95.0}, workers=3, budget=4)
    assert v.kind == "cpu-budget-bound" and "more workers cannot help" in v.advice


def test_host_to_device_only_on_cuda():
    """Blocked copies point at pin_memory on CUDA; the same numbers on CPU are not an H2D problem."""
    slow_copy = {"data_wait_frac": 0.05, "h2d_frac": 0.3}
    assert judge(slow_copy, device="cuda").advice == "set loader.pin_memory=true"
    assert judge(slow_copy, device="cuda", pin=True).kind == "host-to-device-bound"
    assert judge(slow_copy, device="cpu").kind == "compute-bound"


def test_run_metrics_skip_the_warm_up_epoch():
    """The run verdict averages epochs after the first, which carries worker start-up."""
    history = [{"data_wait_frac": 0.9}, {"data_wait_frac": 0.1}, {"data_wait_frac": 0.2}]
    assert run_metrics(history)["data_wait_frac"] == pytest.approx(0.15)
    assert run_metrics(history[:1])["data_wait_frac"] == 0.9


def test_rss_slope_and_leak_rules():
    """Steady growth of persistent workers warns; flat, noisy or non-persistent memory does not."""
    assert rss_slope([100, 110, 120, 130]) == pytest.approx(10.0)
    growing = [{"worker_rss_max_mb": v} for v in (100, 130, 160, 190)]
    assert "30.0 MB per epoch" in worker_leak(growing, persistent_workers=True)
    assert worker_leak(growing, persistent_workers=False) is None
    flat = [{"worker_rss_max_mb": v} for v in (100, 101, 100, 102)]
    assert worker_leak(flat, persistent_workers=True) is None
    assert worker_leak(growing[:2], persistent_workers=True) is None


class SlowItems(Dataset):
    """Loading is slow by construction: the step can only wait for it."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.03)
        return torch.randn(8), i % 2


class SlowModel(nn.Module):
    """Compute is slow by construction: data is in memory and ready at once."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x):
        time.sleep(0.02)
        return self.linear(x)


def train_one(model, loader, sampler=None, epochs=1):
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      TrainerConfig(epochs=epochs, progress=False), sampler=sampler)
    return trainer.fit(loader)


def test_slow_loader_is_input_bound():
    """A loader made slow on purpose: data wait near 1 and an input-bound verdict."""
    [row] = train_one(nn.Linear(8, 2), DataLoader(SlowItems(), batch_size=4))
    assert row["data_wait_frac"] > 0.8
    assert judge(row, workers=0, budget=2).kind == "input-bound"


def test_slow_model_is_compute_bound():
    """A model made slow on purpose: little data wait and a compute-bound verdict."""
    data = TensorDataset(torch.randn(40, 8), torch.randint(0, 2, (40,)))
    [row] = train_one(SlowModel(), DataLoader(data, batch_size=4))
    assert row["data_wait_frac"] < 0.2
    assert judge(row).kind == "compute-bound"


LEAKED: list = []


class LeakyItems(Dataset):
    """Keeps 1 MB per item it serves, in the worker that served it: a leak on purpose."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        LEAKED.append(bytearray(b"x" * 2**20))  # touched, so it is resident
        return torch.randn(8), i % 2


def test_leaking_persistent_workers_are_reported():
    """Real persistent workers that keep memory: the sampler sees it and the warning names the cause."""
    loader = DataLoader(LeakyItems(), batch_size=8, num_workers=2, persistent_workers=True)
    sampler = ResourceSampler(interval_s=0.05, cpu_budget=2).start()
    try:
        history = train_one(nn.Linear(8, 2), loader, sampler=sampler, epochs=4)
    finally:
        sampler.stop()
    sizes = [r["worker_rss_max_mb"] for r in history]
    assert sizes[-1] > sizes[0] + 20  # ~32 MB per worker per epoch kept
    warning = worker_leak(history, persistent_workers=True)
    assert warning and "persistent_workers" in warning and "copy-on-write" in warning
