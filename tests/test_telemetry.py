"""Telemetry: the epoch clock (data wait vs compute), the resource sampler thread, the summary table.

No assertion here depends on how fast the machine is: timings are only compared with each other
or with the sleeps that produced them (a sleep lasts at least its duration).
"""

import re
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dlpipe.console import summary_table
from dlpipe.machine import gpu
from dlpipe.telemetry.sampler import EpochClock, ResourceSampler

# --- EpochClock -----------------------------------------------------------------------------------


def run_clock(data_s: float, compute_s: float, steps: int = 6, batch: int = 4) -> EpochClock:
    clock = EpochClock()
    for _ in range(steps):
        time.sleep(data_s)  # waiting for the loader
        clock.waited()
        time.sleep(compute_s)  # forward/backward
        clock.stepped(batch)
    return clock


def test_data_wait_share_follows_where_the_time_goes():
    """A loop that mostly waits for data has a larger data_wait_frac than one that mostly computes; both in [0, 1]."""
    data_bound = run_clock(data_s=0.02, compute_s=0.001).summary()
    compute_bound = run_clock(data_s=0.001, compute_s=0.02).summary()
    for s in (data_bound, compute_bound):
        assert 0.0 <= s["data_wait_frac"] <= 1.0
        assert s["data_wait_s"] <= s["epoch_time_s"]
    assert data_bound["data_wait_frac"] > compute_bound["data_wait_frac"]


def test_epoch_summary_rates_first_batch_and_step_percentiles():
    """samples_per_s is samples / epoch_time_s; first_batch_s is the first wait; p50 <= p95."""
    clock = run_clock(data_s=0.01, compute_s=0.002, steps=5, batch=3)
    # a slow first batch (worker start-up) is recorded as such
    assert clock.samples == 15 and clock.batches == 5
    s = clock.summary()
    assert s["samples_per_s"] == pytest.approx(15 / s["epoch_time_s"], rel=1e-12)
    assert 0.01 <= s["first_batch_s"] <= s["data_wait_s"]
    assert s["first_batch_s"] < s["data_wait_s"]  # later waits count too
    assert 0.0 < s["step_time_p50_ms"] <= s["step_time_p95_ms"]
    samples_per_s, wait_frac = clock.rates()
    assert samples_per_s > 0 and 0.0 <= wait_frac <= 1.0


def test_empty_and_single_step_epochs_summarise_without_percentiles():
    """An epoch with no batch reports first_batch_s 0 and no percentiles; one step is too few for percentiles."""
    s = EpochClock().summary()
    assert s["first_batch_s"] == 0.0 and s["samples_per_s"] == 0.0
    assert "step_time_p50_ms" not in s
    s = run_clock(data_s=0.0, compute_s=0.0, steps=1).summary()
    assert "step_time_p50_ms" not in s and "step_time_p95_ms" not in s


# --- ResourceSampler ------------------------------------------------------------------------------


class BusyDataset(Dataset):
    """CPU-bound items: a pure-Python loop per item, like a decode/augment pipeline.

    Each item is the CPU time its worker spent making it, measured inside the worker.
    """

    def __init__(self, n: int = 24, clock=time.process_time):
        self.n, self.clock = n, clock  # time.thread_time for thread workers: a process's time holds every thread's

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t0 = self.clock()
        total = 0
        for k in range(400_000):
            total += k * k % 7
        return torch.tensor([self.clock() - t0])


def sampler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "dlpipe-sampler"}


def nvml_works() -> bool:
    try:
        gpu.Nvml.open().close()
    except gpu.NvmlUnavailable:
        return False
    return True


def test_sampler_reports_cpu_memory_and_workers_of_a_real_loader():
    """While 2 real workers do CPU work the sampler sees them alive with RSS and CPU time; stop() ends its thread."""
    before = sampler_threads()
    sampler = ResourceSampler(interval_s=0.05, cpu_budget=2).start()
    assert sampler.gpu_status == "not requested"
    ours = sampler_threads() - before
    assert len(ours) == 1 and all(t.is_alive() for t in ours)
    try:
        loader = DataLoader(BusyDataset(), batch_size=1, num_workers=2)
        during = None
        for i, _ in enumerate(loader):
            if i == len(loader) // 2:
                during = sampler.window()  # first half; takes a sample now, while the workers live
        after = sampler.window()  # second half
    finally:
        sampler.stop()
    assert all(not t.is_alive() for t in ours)

    for w in (during, after):
        assert {"cpu_util", "rss_mb", "workers_rss_mb", "rss_peak_mb", "workers_alive"} <= set(w)
        assert w["rss_mb"] > 0 and w["rss_peak_mb"] >= w["rss_mb"]
        assert w["cpu_util"] >= 0
        assert "gpu_util" not in w
    assert during["workers_alive"] > 0 and during["workers_rss_mb"] > 0
    assert after["cpu_workers_pct"] > 0  # the workers burned CPU during the second half
    # per-worker figures are the totals shared out over the workers alive
    assert during["worker_rss_mean_mb"] == pytest.approx(during["workers_rss_mb"] / during["workers_alive"])
    assert during["worker_rss_mean_mb"] > 0
    assert during["cpu_per_worker_pct"] == pytest.approx(during["cpu_workers_pct"] / during["workers_alive"])


# CPU times tick at 10 ms: the children times (user, system) read at each end of a window may each
# be a tick short, and the window's span and the test's wall clock differ by a few ms.
TICK_SLACK_S = 0.05


def run_epoch(loader, sampler) -> tuple[dict[str, float], float, float]:
    """One pass over a fresh iterator, then sampler.window(): (window, wall s, worker CPU s the items measured)."""
    t0 = time.monotonic()
    items_cpu = sum(float(x.sum()) for x in loader)  # non-persistent workers are joined when this ends
    w = sampler.window()
    return w, time.monotonic() - t0, items_cpu


def test_short_lived_workers_cpu_is_counted_in_every_epoch():
    """Non-persistent workers live one epoch; each epoch reports at least the CPU the workers measured themselves."""
    loader = DataLoader(BusyDataset(24), batch_size=1, num_workers=2, persistent_workers=False)
    sampler = ResourceSampler(interval_s=0.1, cpu_budget=2).start()
    try:
        sampler.window()  # start the first epoch's window here, as the runner does at an epoch boundary
        epochs = [run_epoch(loader, sampler) for _ in range(2)]
    finally:
        sampler.stop()
    for w, wall, items_cpu in epochs:
        assert w["cpu_workers_pct"] > 0
        # the workers' whole lives fall inside the window: their CPU is at least what __getitem__ measured
        assert w["cpu_workers_pct"] / 100 * wall >= items_cpu - TICK_SLACK_S


def fixtures_children() -> int:
    """Children the sampler counts as workers before the test starts any: under xdist a session fixture
    of another test (the Slurm cluster's daemons) may have started some. Counted by a sampler, so the
    ones it leaves out (multiprocessing's resource tracker) are left out here too."""
    sampler = ResourceSampler(interval_s=60.0, cpu_budget=2).start()
    try:
        return int(sampler.window()["workers_alive"])
    finally:
        sampler.stop()


def test_workers_that_exit_between_two_samples_still_count():
    """With no thread sample during the epoch, the workers' CPU comes from this process's reaped-children times."""
    before = fixtures_children()
    loader = DataLoader(BusyDataset(8), batch_size=1, num_workers=2, persistent_workers=False)
    sampler = ResourceSampler(interval_s=5.0, cpu_budget=2).start()
    try:
        w, wall, items_cpu = run_epoch(loader, sampler)
    finally:
        sampler.stop()
    assert w["workers_alive"] == before  # the only sample in the window came after the workers were joined
    assert w["cpu_workers_pct"] > 0
    assert w["cpu_workers_pct"] / 100 * wall >= items_cpu - TICK_SLACK_S


def test_thread_workers_cpu_is_the_workers_not_the_main_process():
    """Thread workers burn CPU inside this process: the window counts it as the workers' (at least
    what the items measured), and the main process's share is what is left (it only waits here)."""
    from torch.utils.data import Subset

    from dlpipe.loader.build import build_loader
    from dlpipe.loader.faults import NamedErrors
    from dlpipe.loader.threads import fetch_cpu_seconds

    dataset = BusyDataset(24, clock=time.thread_time)
    loader = build_loader(NamedErrors(Subset(dataset, range(len(dataset)))), batch_size=1, num_workers=2,
                          pin_memory=False, prefetch_factor=2, persistent_workers=False, shuffle=False,
                          drop_last=False, timeout=0.0, multiprocessing_context=None, seed=0, cuda=False,
                          worker_method="thread").loader
    assert loader.worker_method == "thread"
    before = fixtures_children()
    sampler = ResourceSampler(interval_s=0.1, cpu_budget=2, thread_cpu=fetch_cpu_seconds).start()
    try:
        sampler.window()
        w, wall, items_cpu = run_epoch(loader, sampler)
    finally:
        sampler.stop()
    assert w["workers_alive"] == before  # no worker process: the threads are this process's
    workers_cpu, main_cpu = (w[key] / 100 * max(wall, 0.1) for key in ("cpu_workers_pct", "cpu_main_pct"))
    assert workers_cpu >= items_cpu - TICK_SLACK_S
    assert main_cpu < items_cpu / 2  # without the threads' count, all of it would be here


def test_windows_a_few_ms_long_stay_within_what_the_processes_can_use():
    """window() right after window(), while workers compute, keeps cpu_util in [0, 100 x processes]: no tick spike."""
    workers = 2
    loader = DataLoader(BusyDataset(), batch_size=1, num_workers=workers, persistent_workers=True)
    sampler = ResourceSampler(interval_s=0.05, cpu_budget=1).start()
    tiny = []
    try:
        for _ in loader:
            sampler.window()  # closes the window that holds this batch's wait
            tiny.append(sampler.window())  # a window a few ms long; the workers are still prefetching
    finally:
        sampler.stop()
    for w in tiny:
        # each process runs one busy thread, so the tree cannot use more than one CPU per process
        assert 0.0 <= w["cpu_util"] <= 100.0 * (1 + workers)
        assert w["cpu_main_pct"] >= 0.0 and w["cpu_workers_pct"] >= 0.0


@pytest.mark.skipif(nvml_works(), reason="a working NVIDIA driver is present")
def test_sampler_without_a_driver_says_gpu_not_available_and_reports_no_gpu_metrics():
    """Asking for a GPU without an NVIDIA driver gives gpu_status 'not available: ...' and no gpu_util, never 0%."""
    sampler = ResourceSampler(interval_s=0.05, cpu_budget=1, gpu_index=0)
    try:
        sampler.start()
        assert sampler.gpu_status.startswith("not available")
        w = sampler.window()
    finally:
        sampler.stop()
    assert "gpu_util" not in w and "gpu_mem_used_mb" not in w
    assert w["rss_mb"] > 0


# --- summary table --------------------------------------------------------------------------------


def parse_table(text: str) -> list[list[str]]:
    """Cells of a summary_table, cut at the columns the dashed rule under the header marks."""
    lines = text.splitlines()
    spans = [m.span() for m in re.finditer(r"-+", lines[1])]
    assert "".join(lines[1].split()) == "-" * sum(e - s for s, e in spans)
    return [[line[s:e].strip() for s, e in spans] for i, line in enumerate(lines) if i != 1]


def test_summary_table_omits_empty_columns_and_marks_missing_cells():
    """Columns no row has are left out; a row missing a shown metric gets '-' in that cell."""
    rows = [
        {"epoch": 1.0, "train_loss": 0.5, "samples_per_s": 1234.56},
        {"epoch": 2.0, "train_loss": 0.25, "val_loss": 0.75, "samples_per_s": 1500.0},
    ]
    cells = parse_table(summary_table(rows))
    assert cells[0] == ["epoch", "train loss", "val loss", "samples/s"]
    assert cells[1][0] == "1" and cells[2][0] == "2"
    assert cells[1][2] == "-"
    assert float(cells[2][2]) == pytest.approx(0.75)
    assert [float(r[1]) for r in cells[1:]] == pytest.approx([0.5, 0.25])
    assert [float(r[3]) for r in cells[1:]] == pytest.approx([1234.6, 1500.0])
    for absent in ("val acc", "gpu %", "cpu %", "peak rss MB", "data wait", "epoch s"):
        assert absent not in cells[0]


def test_summary_table_shows_every_user_metric_and_one_unit_for_data_wait():
    """A metric of `metrics` (`metrics.acc=...` is logged as `val_acc`) gets its column after the
    losses, whatever its name; data wait is a percentage with one decimal; a peak says so."""
    rows = [
        {"epoch": 1.0, "train_loss": 0.5, "val_loss": 0.4, "val_acc": 0.8125, "val_f1": 0.75, "samples_per_s": 90.0,
         "data_wait_frac": 0.04012, "rss_peak_mb": 550.4},
        {"epoch": 2.0, "train_loss": 0.3, "val_loss": 0.2, "val_acc": 0.9375, "val_mae": 1234.5, "samples_per_s": 95.0,
         "data_wait_frac": 0.1, "rss_peak_mb": 561.0},
    ]
    cells = parse_table(summary_table(rows))
    assert cells[0] == ["epoch", "train loss", "val loss", "val acc", "val f1", "val mae", "samples/s", "data wait",
                        "peak rss MB"]
    assert [r[3:6] for r in cells[1:]] == [["0.8125", "0.7500", "-"], ["0.9375", "-", "1234.5000"]]
    assert [r[7] for r in cells[1:]] == ["4.0%", "10.0%"]
    # beside the built-in accuracy, a metric named acc is titled by its key
    assert parse_table(summary_table([{"val_accuracy": 0.5, "val_acc": 0.5}]))[0] == ["val acc", "val_acc"]


def test_multiprocessing_helpers_are_not_counted_as_workers():
    """The resource tracker (started by spawn/forkserver loaders, alive as long as this process) is
    a child of ours but no DataLoader worker. In a process of its own: a test worker's process may hold
    children of other tests (a server, processes still exiting), which are no helpers either."""
    import subprocess
    import sys

    code = """
from multiprocessing import resource_tracker
import psutil
from dlpipe.telemetry.sampler import ResourceSampler
resource_tracker.ensure_running()
assert len(psutil.Process().children()) == 1, psutil.Process().children()  # the tracker, and only it
sampler = ResourceSampler(interval_s=5.0, cpu_budget=2).start()
try:
    print(int(sampler.window()["workers_alive"]))
finally:
    sampler.stop()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0"]
