"""The logic of benchmarks/sim_device.py on controlled inputs: the simulated device's timeline on a fake
clock (where the host blocks, what counts as busy), the callback's syncs and epoch windows, the
figures' arithmetic and the published case's step time. No timing is asserted on the real clock;
the last test only checks that the script runs at its --quick size."""

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_clock import FakeClock

from benchmarks.sim_device import DeviceSync, EpochWindow, Figures, Measured, SimDevice, case_step, summarise
from dlpipe.loader.search import Candidate

REPO = Path(__file__).resolve().parents[1]


def device(depth: int = 2) -> tuple[SimDevice, FakeClock, list[float]]:
    clock, slept = FakeClock(), []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)

    return SimDevice(depth, clock=clock, sleep=sleep), clock, slept


def test_a_launch_returns_at_once_and_the_device_runs_the_step_after_the_one_before():
    d, clock, slept = device(depth=3)
    start = clock.now
    d.launch(0.020)
    d.launch(0.020)
    assert slept == [] and clock.now == start  # the host went on
    assert d.free_at == pytest.approx(start + 0.040)  # the second step queued behind the first
    clock.advance(0.100)  # the host is late: the device idles until the next launch
    d.launch(0.020)
    assert d.free_at == pytest.approx(start + 0.120)
    assert d.busy_s == pytest.approx(0.060) and d.steps == 3


def test_a_full_launch_queue_blocks_the_host_until_its_oldest_step_ends():
    d, clock, slept = device(depth=2)
    start = clock.now
    d.launch(0.050)
    d.launch(0.050)
    d.launch(0.050)  # two unfinished: wait for the first to end
    assert slept == [pytest.approx(0.050)] and clock.now == pytest.approx(start + 0.050)
    assert d.free_at == pytest.approx(start + 0.150)
    assert d.blocked_s == pytest.approx(0.050)


def test_synchronize_waits_for_the_last_step_and_nothing_when_the_device_is_idle():
    d, clock, slept = device()
    start = clock.now
    d.launch(0.030)
    clock.advance(0.010)
    d.synchronize()
    assert clock.now == pytest.approx(start + 0.030) and slept == [pytest.approx(0.020)]
    d.synchronize()
    assert len(slept) == 1  # idle: no wait


def test_a_host_slower_than_the_device_keeps_it_busy_step_over_host_time():
    d, clock, _ = device()
    start = clock.now
    for _ in range(100):
        clock.advance(0.040)  # the host's fetch and step
        d.launch(0.020)
    d.synchronize()
    assert d.busy_s / (clock.now - start) == pytest.approx(0.020 * 100 / (0.040 * 100 + 0.020))


def test_the_callback_syncs_every_n_steps_and_keeps_each_epochs_window():
    d, clock, slept = device()
    sync = DeviceSync(every=2, clock=clock)
    trainer = SimpleNamespace(model=SimpleNamespace(sim=d))
    sync.on_train_start(trainer)
    start = clock.now
    d.launch(0.010)
    sync.on_step_end(trainer, 1)
    assert slept == []  # not a sync step
    sync.on_step_end(trainer, 2)
    assert clock.now == pytest.approx(start + 0.010)
    clock.advance(0.010)
    d.launch(0.010)
    sync.on_epoch_end(trainer, 1, {})
    [w] = sync.epochs
    assert w.wall_s == pytest.approx(0.030) and w.busy_s == pytest.approx(0.020) and w.blocked_s == pytest.approx(0.020)
    clock.advance(0.020)
    d.launch(0.020)
    sync.on_epoch_end(trainer, 2, {})
    assert sync.epochs[1].wall_s == pytest.approx(0.040) and sync.epochs[1].busy_s == pytest.approx(0.020)


def test_figures_are_over_the_epochs_given_and_time_weighted():
    epochs = [EpochWindow(2.0, 1.0, 0.1), EpochWindow(1.0, 1.0, 0.2)]
    rows = [{"epoch_time_s": 2.0, "data_wait_frac": 0.4, "cpu_main_pct": 10, "cpu_workers_pct": 100,
             "first_batch_s": 0.2},
            {"epoch_time_s": 1.0, "data_wait_frac": 0.1, "cpu_main_pct": 40, "cpu_workers_pct": 130,
             "first_batch_s": 0.1}]
    f = summarise(epochs, rows, samples=300)
    assert f.samples_per_s == pytest.approx(200.0) and f.busy == pytest.approx(2 / 3)
    assert f.data_wait == pytest.approx(0.3) and f.cpu_main == pytest.approx(20) and f.cpu_workers == pytest.approx(110)
    assert f.blocked == pytest.approx(0.1) and f.first_batch == pytest.approx(0.1)
    assert math.isnan(f.main_runq)  # filled in by the run, not from the rows


def figures(busy: float, rate: float = 100.0) -> Figures:
    return Figures(rate, busy, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_the_published_case_is_where_pytorchs_defaults_would_keep_the_device_65_percent_busy():
    pytorch = Candidate(0, None, False, False)
    held = Measured()
    for busy in (0.40, 0.42, 0.38):
        held.add((pytorch, 5.0), figures(busy))  # input-bound: wall per batch 5 / 0.40 = 12.5 ms
    for busy in (0.90, 0.95, 1.0):
        held.add((pytorch, 20.0), figures(busy))
    assert case_step(held, pytorch, [20.0, 5.0]) == pytest.approx(0.65 * 12.5)
    busy_everywhere = Measured()
    busy_everywhere.add((pytorch, 5.0), figures(0.99))
    assert case_step(busy_everywhere, pytorch, [5.0]) is None


def test_ratios_pair_the_rounds_measured_side_by_side():
    m = Measured()
    for a, b in ((100, 50), (90, 60), (120, 40)):
        m.add("a", figures(1.0, a))
        m.add("b", figures(1.0, b))
    assert m.ratios("a", "b") == [2.0, 1.5, 3.0] and m.median("a") == 100


@pytest.mark.integration
def test_the_script_runs_at_its_quick_size(tmp_path):
    out = tmp_path / "sim.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.sim_device", "--quick", "--pipelines", "jpeg",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| 5 | loader=auto |" in text and "### goals" in text and text in r.stdout
