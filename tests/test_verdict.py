"""The bottleneck verdict and the worker-memory warning, from rules and from real measured runs."""

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
from fake_clock import install
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dlpipe.judging.advice import Evidence
from dlpipe.judging.journal import MIN_GAIN, Journal, Observation, effective
from dlpipe.judging.verdict import diagnose, more_workers, rss_slope, run_metrics, worker_leak
from dlpipe.loader import policy
from dlpipe.machine.hardware import recommended_workers
from dlpipe.schema import TrainerConfig
from dlpipe.telemetry.sampler import ResourceSampler
from dlpipe.training.runner import Trainer


def judge(metrics, workers=0, budget=4, pin=False, device="cpu", evidence=None, prefetch=None, warm=True):
    return diagnose(metrics, num_workers=workers, cpu_budget=budget, pin_memory=pin, device_type=device,
                    prefetch_factor=prefetch, persistent_workers=False, evidence=evidence, warm=warm)


def epoch(wait_frac, item_wait_s=1e-3, samples=1000, **extra):
    """An epoch's metrics, consistent with each other: `samples` items, each waited for `item_wait_s`,
    and the wait `wait_frac` of the epoch."""
    wait_s = item_wait_s * samples
    seconds = wait_s / wait_frac if wait_frac else samples * 1e-3
    return {"data_wait_frac": wait_frac, "data_wait_s": wait_s if wait_frac else 0.0, "epoch_time_s": seconds,
            "samples_per_s": samples / seconds, **extra}


def probed(seconds_per_item):
    return Evidence(item_fetch_s=seconds_per_item)


def test_input_bound_suggests_more_workers_within_budget():
    """A loader-starved epoch of costly items names the data wait, a worker count the CPU budget allows,
    and the gain to expect with what it is estimated from."""
    v = judge(epoch(0.6, cpu_util=40.0), workers=0, budget=4)
    assert v.kind == "input-bound" and "60.0%" in v.evidence
    assert v.advice == f"try loader.num_workers={recommended_workers(4)}"
    assert v.change == f"loader.num_workers={recommended_workers(4)}" and not v.measured
    assert v.gain == pytest.approx(1 / 0.4) and "expected about 2.50x samples/s" in v.line()
    assert more_workers(2, 16) == 8 and more_workers(4, 4) == 4 and more_workers(0, 1) == 1


def test_gain_of_more_workers_is_bounded_by_the_other_work():
    """0 -> 3 workers on items of 1 ms with 0.25 ms of other work per item: the loader's 1/3 ms per item
    then limits the epoch, 1.25 / (1/3) = 3.75x, under the wait's own bound of 5x."""
    v = judge(epoch(0.8, item_wait_s=1e-3), workers=0, budget=4)
    assert v.change == "loader.num_workers=3" and v.gain == pytest.approx(1.25 / (1 / 3))


def test_saturated_cpu_is_budget_bound():
    """Waiting on data with the CPU budget already used up: more workers cannot help."""
    v = judge(epoch(0.5, cpu_util=95.0), workers=3, budget=4, evidence=probed(1e-3))
    assert v.kind == "cpu-budget-bound" and "more workers cannot help" in v.advice and v.change is None


def test_host_to_device_only_on_cuda():
    """Blocked copies point at pin_memory on CUDA; the same numbers on CPU are not an H2D problem."""
    slow_copy = {"data_wait_frac": 0.05, "h2d_frac": 0.3}
    v = judge(slow_copy, device="cuda")
    assert v.advice == "try loader.pin_memory=true" and v.gain == pytest.approx(1 / 0.7)
    assert judge(slow_copy, device="cuda", pin=True).kind == "host-to-device-bound"
    assert judge(slow_copy, device="cpu").kind == "compute-bound"


def test_cheap_items_without_workers_never_get_more_workers():
    """The issue's case: data in memory (5 us an item, measured by the epoch itself with no workers) and
    still 28% waiting: workers cannot pay for their hand-over, so the advice is about fetching."""
    v = judge(epoch(0.28, item_wait_s=5e-6), workers=0, budget=2)
    assert v.kind == "input-bound" and v.change is None and "num_workers" not in v.advice
    assert "5.0 us each" in v.evidence and "more workers cannot help" in v.evidence
    assert "loader.batch_size" in v.advice and "__getitems__" in v.advice
    assert v.gain == pytest.approx(1 / 0.72) and "this epoch's data wait" in v.basis
    assert "(expected up to 1.39x samples/s" in v.line()  # a hard bound: the wait cannot shrink below 0


def test_cheap_items_with_workers_go_back_to_the_main_process():
    """Workers handing over items the probe fetches in 5 us: the main process is faster."""
    v = judge(epoch(0.5, item_wait_s=50e-6), workers=2, budget=2, evidence=probed(5e-6))
    assert v.change == "loader.num_workers=0" and "probe" in v.evidence
    assert v.gain == pytest.approx(100e-6 / (50e-6 + 5e-6))  # total per item over other work + fetch


def journal(*rows, mode="loader"):
    """{mode: Journal} from (num_workers, samples/s) rows of a bench run."""
    observations = tuple(Observation(effective({"num_workers": w, "prefetch_factor": None,
                                                "persistent_workers": False, "pin_memory": False}),
                                     rate, "dlpipe bench", "2026-12-03 10:00") for w, rate in rows)
    return {mode: Journal(observations)}


def test_a_worker_count_measured_slower_is_never_advised():
    """The sweep's case: 2 workers measured slower than none for this job, so the rules' suggestion of
    2 workers is withheld, naming the measurement."""
    evidence = Evidence(journals=journal((0, 1793.0), (2, 1075.0)))
    v = judge(epoch(0.6), workers=0, budget=2, evidence=evidence)
    assert v.kind == "input-bound" and v.change is None and "try" not in v.advice
    assert "loader.num_workers=2 is no answer here" in v.advice and "1075 samples/s" in v.advice


def test_thread_workers_and_whole_batches_are_judged_by_their_own_measurements():
    """A tune of thread workers measured prefetch 4 no faster than 2: a run with those threads is not
    told to try it (the acceptance test's case: the journal was read as if processes ran); the same
    rows say nothing of process workers, which still get the rule's suggestion. A run that already
    gathers whole batches is not told to make its dataset gather."""
    rows = tuple(Observation(effective({"num_workers": 2, "worker_method": "thread", "prefetch_factor": p}),
                             rate, "dlpipe tune", "2026-12-05 14:00") for p, rate in ((2, 6411.7), (4, 6328.0)))
    evidence = Evidence(journals={"loader": Journal(rows)})

    def verdict(method):
        return diagnose(epoch(0.6, cpu_util=40.0), num_workers=2, cpu_budget=2, pin_memory=False, device_type="cpu",
                        prefetch_factor=2, worker_method=method, evidence=evidence)

    threads = verdict("thread")
    assert threads.change is None and "loader.prefetch_factor=4 is no answer here" in threads.advice, threads.line()
    assert "6328 samples/s" in threads.advice
    assert verdict("process").change == "loader.prefetch_factor=4"
    cheap = dict(num_workers=0, cpu_budget=2, pin_memory=False, device_type="cpu")
    assert "__getitems__" in diagnose(epoch(0.28, item_wait_s=5e-6), **cheap).advice
    batched = diagnose(epoch(0.28, item_wait_s=5e-6), fetch="batch", **cheap).advice
    assert "loader.batch_size" in batched and "__getitems__" not in batched


def test_a_worker_count_measured_faster_is_advised_with_the_measured_gain():
    evidence = Evidence(journals=journal((0, 1000.0), (2, 1500.0)))
    v = judge(epoch(0.6), workers=0, budget=2, evidence=evidence)
    assert v.change == "loader.num_workers=2" and v.measured and v.gain == pytest.approx(1.5)
    assert "expected 1.50x samples/s: dlpipe bench/tune measured num_workers=2" in v.line()


def test_the_run_itself_stands_for_the_current_settings_against_earlier_runs():
    """Epoch-mode journal lines are earlier training runs; the run's own samples/s is the comparison."""
    evidence = Evidence(journals=journal((2, 900.0), mode="epoch"))
    v = judge(epoch(0.6, samples=1000), workers=0, budget=2, evidence=evidence)  # 1000 / 1.667 s = 600/s
    assert v.change == "loader.num_workers=2" and v.gain == pytest.approx(1.5)
    slower = Evidence(journals=journal((2, 500.0), mode="epoch"))
    assert judge(epoch(0.6, samples=1000), workers=0, budget=2, evidence=slower).change is None


def test_any_mode_that_measured_it_slower_withholds_it():
    """A bench of the loader alone found 2 workers faster, a training run found them slower: not advised."""
    evidence = Evidence(journals={**journal((0, 1000.0), (2, 2000.0)), **journal((2, 100.0), mode="epoch")})
    assert judge(epoch(0.6), workers=0, budget=2, evidence=evidence).change is None


def test_a_measurement_of_other_settings_never_stands_for_the_change():
    """Pinning measured faster only with 2 workers says nothing about pinning at 0 workers, where it
    was measured slower; a prefetch measured with other persistence says nothing either."""
    def observed(workers, pin, rate, prefetch=None, persistent=False):
        settings = {"num_workers": workers, "pin_memory": pin, "prefetch_factor": prefetch,
                    "persistent_workers": persistent}
        return Observation(effective(settings), rate, "dlpipe bench", "t")

    pins = Journal((observed(0, False, 1000.0), observed(0, True, 900.0), observed(2, True, 2000.0)))
    v = judge({"data_wait_frac": 0.05, "h2d_frac": 0.3}, device="cuda", evidence=Evidence(journals={"loader": pins}))
    assert v.change is None and "pinning is no answer here" in v.evidence and "900 samples/s" in v.evidence
    prefetches = Journal((observed(2, False, 1000.0, 2, True), observed(2, False, 5000.0, 4, False)))
    v = judge(epoch(0.5, cpu_util=50.0), workers=2, budget=2, prefetch=2, evidence=Evidence(
        item_fetch_s=1e-3, journals={"loader": prefetches}))
    assert v.change == "loader.prefetch_factor=4" and not v.measured  # persistence differed: not a measurement of it


def test_an_epoch_with_start_up_is_not_compared_with_earlier_runs():
    """Earlier runs' lines leave their first epoch out; a first epoch (worker start-up in it) is not
    compared with them, while the journal's own figure for the current settings still is."""
    earlier = Evidence(journals=journal((0, 1000.0), (2, 1010.0), (3, 850.0), mode="epoch"))
    first = judge(epoch(0.6, samples=1000), workers=2, budget=3, evidence=earlier, warm=False)  # 600/s, start-up in
    assert first.change is None  # 3 workers ran at 850 against 1010 for 2 workers: withheld, not "1.42x"
    assert "850 samples/s" in first.advice and "1010 with the current settings" in first.advice
    cold = judge(epoch(0.6, samples=1000), workers=0, budget=2, evidence=journal_of((2, 700.0)), warm=False)
    assert cold.change == "loader.num_workers=2" and not cold.measured  # 700 vs this cold epoch's 600: no figure
    warm = judge(epoch(0.6, samples=1000), workers=0, budget=2, evidence=journal_of((2, 700.0)))
    assert warm.measured and warm.gain == pytest.approx(700 / 600)


def journal_of(*rows):
    return Evidence(journals=journal(*rows, mode="epoch"))


def test_pinning_measured_no_faster_is_not_advised():
    rows = [Observation(effective({"num_workers": 0, "pin_memory": pin}), rate, "dlpipe bench", "t")
            for pin, rate in ((False, 1000.0), (True, 1010.0))]
    v = judge({"data_wait_frac": 0.05, "h2d_frac": 0.3}, device="cuda",
              evidence=Evidence(journals={"loader": Journal(tuple(rows))}))
    assert v.kind == "host-to-device-bound" and v.change is None and "send less data" in v.advice


@pytest.mark.parametrize("threshold, below, at", [
    ("INPUT_BOUND", dict(wait=0.1999), dict(wait=0.20)),
    ("CPU_SATURATED", dict(wait=0.5, cpu=84.99), dict(wait=0.5, cpu=85.0)),
    ("H2D_BOUND", dict(h2d=0.1499), dict(h2d=0.15)),
    ("CHEAP_ITEM_S", dict(wait=0.5, item=49.99e-6), dict(wait=0.5, item=50e-6)),
])
def test_verdict_boundaries(threshold, below, at):
    """Each threshold: just under it and exactly at it give different verdicts, the documented way."""
    def verdict(wait=0.05, cpu=None, h2d=0.0, item=1e-3):
        metrics = epoch(wait, item_wait_s=item, h2d_frac=h2d, **({} if cpu is None else {"cpu_util": cpu}))
        workers = 2 if cpu is not None else 0
        return judge(metrics, workers=workers, budget=4, device="cuda", evidence=probed(item))

    under, on = verdict(**below), verdict(**at)
    expected = {"INPUT_BOUND": ("compute-bound", "input-bound"),
                "CPU_SATURATED": ("input-bound", "cpu-budget-bound"),
                "H2D_BOUND": ("compute-bound", "host-to-device-bound")}
    if threshold == "CHEAP_ITEM_S":  # under: in memory, no workers advised; at: workers may pay
        assert (under.change, on.change) == (None, "loader.num_workers=3")
    else:
        assert (under.kind, on.kind) == expected[threshold]


def test_min_gain_boundary():
    """A measured gain counts from MIN_GAIN (3%) up: 1.0299x is noise, 1.0301x is advised."""
    def change(rate):
        evidence = Evidence(journals=journal((0, 1000.0), (2, rate)))
        return judge(epoch(0.6), workers=0, budget=2, evidence=evidence).change

    assert MIN_GAIN == 0.03
    assert (change(1029.9), change(1030.1)) == (None, "loader.num_workers=2")


GRID_COSTS = (2e-6, 20e-6, 49e-6, 60e-6, 400e-6, 5e-3)


@pytest.mark.parametrize("measured", ["none", "more is slower", "more is faster", "fewer is slower"])
def test_no_advice_contradicts_a_measurement(measured):
    """Over a grid of epochs (workers, budget, wait, CPU, item cost) and journals, every piece of advice
    names a setting no measurement found slower, never more workers for items under CHEAP_ITEM_S,
    never past the CPU budget, and always with its expected gain (at least 1x) and evidence."""
    checked = 0
    for workers, budget, wait, cpu, cost in itertools.product((0, 1, 2, 4), (1, 2, 4, 8), (0.1, 0.3, 0.7),
                                                               (None, 50.0, 95.0), GRID_COSTS):
        rates = {"none": {}, "more is slower": {w: 500.0 if w > workers else 1000.0 for w in range(9)},
                 "more is faster": {w: 1000.0 * (1 + w) for w in range(9)},
                 "fewer is slower": {w: 500.0 if w < workers else 1000.0 for w in range(9)}}[measured]
        evidence = Evidence(item_fetch_s=cost, journals=journal(*rates.items()) if rates else {})
        metrics = epoch(wait, item_wait_s=cost if workers == 0 else 2 * cost,
                        **({} if cpu is None else {"cpu_util": cpu}))
        v = judge(metrics, workers=workers, budget=budget, evidence=evidence)
        assert v.kind == "compute-bound" or (v.gain >= 1.0 and v.basis and "expected" in v.line())
        if v.change is None:
            continue
        checked += 1
        key, _, value = v.change.partition("=")
        assert v.advice == f"try {v.change}" and v.gain >= 1.0 and v.basis
        if key == "loader.num_workers":
            target = int(value)
            assert target <= max(budget, workers)
            if target > workers:
                assert cost >= policy.CHEAP_ITEM_S, (workers, budget, wait, cpu, cost)
            if rates:
                assert rates[target] >= (1 + MIN_GAIN) * rates[workers], (workers, budget, wait, cost, v.line())
                assert v.measured and v.gain == pytest.approx(rates[target] / rates[workers])
    assert checked > 0


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
    """Loading is slow by construction (30 ms an item on the test's clock): the step can only wait."""

    def __init__(self, clock):
        self.clock = clock

    def __len__(self):
        return 24

    def __getitem__(self, i):
        self.clock.advance(0.03)
        return torch.randn(8), i % 2


class SlowModel(nn.Module):
    """Compute is slow by construction (20 ms a batch on the test's clock); data is ready at once."""

    def __init__(self, clock):
        super().__init__()
        self.linear, self.clock = nn.Linear(8, 2), clock

    def forward(self, x):
        self.clock.advance(0.02)
        return self.linear(x)


def train_one(model, loader, sampler=None, epochs=1):
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      TrainerConfig(epochs=epochs, progress=False), sampler=sampler)
    return trainer.fit(loader)


def test_slow_loader_is_input_bound(monkeypatch):
    """A real Trainer on a loader that spends all of the epoch's (test clock) time: every second waits
    on data, the verdict is input-bound and advises workers for these 30 ms items, with the gain the
    epoch allows. (Measured on the real clock: benchmarks/data_wait.py.)"""
    [row] = train_one(nn.Linear(8, 2), DataLoader(SlowItems(install(monkeypatch)), batch_size=4))
    assert row["data_wait_s"] == pytest.approx(24 * 0.03) and row["data_wait_frac"] == pytest.approx(1.0)
    v = judge(row, workers=0, budget=2)
    assert v.kind == "input-bound" and v.change == "loader.num_workers=2"
    assert v.gain == pytest.approx(2.0)  # 2 workers at best halve the 30 ms per item; nothing else takes time


def test_slow_model_is_compute_bound(monkeypatch):
    """A model that spends all of the epoch's (test clock) time: no data wait, compute-bound."""
    data = TensorDataset(torch.randn(40, 8), torch.randint(0, 2, (40,)))
    [row] = train_one(SlowModel(install(monkeypatch)), DataLoader(data, batch_size=4))
    assert row["data_wait_frac"] == 0.0 and row["epoch_time_s"] == pytest.approx(10 * 0.02)
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


SLOW_JOB = ["dataset=custom", "dataset._target_=faulty_data.SlowDataset", "+dataset.size=96", "+dataset.delay_s=0.008",
            "model=mlp", "model.in_features=4", "model.num_classes=2", "loader.batch_size=8", "trainer.epochs=2",
            "trainer.progress=false", "tracking=none", "checkpoint.enabled=false"]


def test_bench_measurements_steer_the_training_verdict_end_to_end(tmp_path, dlpipe):
    """`dlpipe bench` at 0 and 2 workers files both measurements; a training run at 0 workers on these
    8 ms items (slow enough to stay input-bound when a loaded machine slows the step) is input-bound and
    advises 2 workers only if the bench measured them faster, with the bench's ratio as the expected
    gain, else names the bench and withholds it. Then the run files its own measurement for the next one."""
    journal = Path(os.environ["XDG_CACHE_HOME"]) / "dlpipe" / "measurements.jsonl"
    plan = dlpipe("plan", *SLOW_JOB, "loader.num_workers=0")
    assert plan.returncode == 0 and f"measured: nothing yet for this job in {journal}" in plan.stdout
    for workers in (0, 2):
        r = dlpipe("bench", *SLOW_JOB, f"loader.num_workers={workers}", "bench.batches=6", "bench.warmup_batches=2")
        assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(x["mode"], x["source"], x["settings"]["num_workers"]) for x in lines] == [
        ("loader", "dlpipe bench", 0), ("loader", "dlpipe bench", 2)]
    zero, two = (x["samples_per_s"] for x in lines)
    plan = dlpipe("plan", *SLOW_JOB, "loader.num_workers=0").stdout  # the evidence the run's advice will see
    assert f"measured (dlpipe bench/tune): num_workers=0: {zero:.0f} samples/s (dlpipe bench, " in plan
    assert f"measured (dlpipe bench/tune): num_workers=2 prefetch_factor=2 persistent_workers=false: {two:.0f}" in plan

    r = dlpipe(*SLOW_JOB, "loader.num_workers=0")
    assert r.returncode == 0, r.stderr
    [verdict] = [line for line in r.stdout.splitlines() if line.startswith("bottleneck:")]
    assert verdict.startswith("bottleneck: input-bound: data wait")
    if two >= (1 + MIN_GAIN) * zero:
        assert f"try loader.num_workers=2 (expected {two / zero:.2f}x samples/s: dlpipe bench/tune measured" in verdict
    else:
        assert "loader.num_workers=2 is no answer here (dlpipe bench/tune measured num_workers=2" in verdict
        assert "try loader.num_workers" not in verdict
    mine = json.loads(journal.read_text().splitlines()[-1])
    assert (mine["mode"], mine["source"], mine["settings"]["num_workers"]) == ("epoch", "training run", 0)
    assert mine["job"] == lines[0]["job"]  # the same job, whatever the task that measured it

