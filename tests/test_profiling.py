"""StepProfiler and AllocationSnapshot with the real torch.profiler and tracemalloc on CPU."""

import json
import logging
import tracemalloc
from pathlib import Path

import torch

from dlpipe.telemetry.profiling import AllocationSnapshot, StepProfiler


def train(profiler: StepProfiler, steps: int) -> None:
    """A few real optimizer steps of a small linear model, one profiler step per micro-batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    profiler.start()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        profiler.step()


def test_profiler_writes_table_and_trace(tmp_path):
    out = tmp_path / "profile"
    prof = StepProfiler(out, steps=3, wait=1)
    assert prof.enabled
    train(prof, 8)
    files = prof.finish()
    assert files == [out / "profile_table.txt", out / "profile_trace.json"]
    table = files[0].read_text()
    assert "aten::addmm" in table  # nn.Linear's forward on CPU
    trace = json.loads(files[1].read_text())
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]


def test_profiler_files_exist_when_window_completes(tmp_path):
    # wait + warm-up + active = 5 micro-steps; the files are written on the 5th step() call,
    # before finish(), so a long run after the window still has them.
    prof = StepProfiler(tmp_path, steps=3, wait=1)
    train(prof, 5)
    assert (tmp_path / "profile_table.txt").exists() and (tmp_path / "profile_trace.json").exists()
    prof.step()  # after the window: a no-op, the profiler is already closed
    assert len(prof.finish()) == 2


def test_profiler_disabled_does_nothing(tmp_path):
    out = tmp_path / "profile"
    prof = StepProfiler(out, steps=0)
    assert prof.enabled is False
    assert prof._prof is None  # no torch.profiler object at all
    train(prof, 3)
    assert prof.finish() == []
    assert not out.exists()


def test_profiler_window_never_reached_warns(tmp_path, caplog):
    prof = StepProfiler(tmp_path, steps=3, wait=5)
    with caplog.at_level(logging.WARNING, logger="dlpipe.telemetry.profiling"):
        train(prof, 2)
        assert prof.finish() == []
    assert "profile window (wait=5, steps=3) was never reached: the run had only 2 micro-steps" in caplog.text
    assert not list(tmp_path.iterdir())


def test_profiler_run_ending_inside_window_writes_what_it_had(tmp_path):
    prof = StepProfiler(tmp_path, steps=3, wait=1)
    train(prof, 3)  # wait, warm-up, one active step: stopped inside the window
    files = prof.finish()
    assert [f.name for f in files] == ["profile_table.txt", "profile_trace.json"]
    assert "aten::addmm" in files[0].read_text()


def test_profiler_finish_twice(tmp_path, caplog):
    prof = StepProfiler(tmp_path, steps=2, wait=0)
    train(prof, 6)
    first = prof.finish()
    assert first and prof.finish() == first
    short = StepProfiler(tmp_path / "short", steps=2, wait=4)
    train(short, 1)
    with caplog.at_level(logging.WARNING, logger="dlpipe.telemetry.profiling"):
        assert short.finish() == [] and short.finish() == []
    assert caplog.text.count("was never reached") == 1  # warned once, not per call


def make_strings() -> list[str]:
    return [f"item-{i}" for i in range(200_000)]


def test_allocation_snapshot_names_the_allocating_line(tmp_path):
    assert not tracemalloc.is_tracing()
    snap = AllocationSnapshot(tmp_path / "mem", enabled=True, top=10)
    snap.start()
    kept = make_strings()
    files = snap.finish()
    assert files == [tmp_path / "mem" / "tracemalloc_top.txt"]
    lines = files[0].read_text().splitlines()
    assert 0 < len(lines) <= 10
    assert any(Path(__file__).name in line and "KiB" in line for line in lines)
    assert not tracemalloc.is_tracing()
    assert snap.finish() == files
    del kept


def test_allocation_snapshot_disabled(tmp_path):
    snap = AllocationSnapshot(tmp_path / "mem", enabled=False)
    snap.start()
    assert not tracemalloc.is_tracing()
    assert snap.finish() == []
    assert not (tmp_path / "mem").exists()
