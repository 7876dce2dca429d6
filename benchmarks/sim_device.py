"""A simulated accelerator: how busy loader=auto keeps a device that runs asynchronously, as CUDA does.

    python -m benchmarks.sim_device [--rounds N] [--quick] [--out sim_device.md]

The device stand-in (`SimDevice`) keeps a timeline instead of a thread: the host launches a step of
`--steps-ms` milliseconds and goes on; the step starts when the device is free (or at once) and ends
that long after. The host blocks only where a real run syncs:
- the launch queue is full: `--queue-depth` steps are unfinished (CUDA's launch queue lets the host run
  a step or two ahead of a CNN's hundreds of kernels);
- every `--sync-every` optimizer steps, as dlpipe's runner does on CUDA (telemetry.cuda_sync_every; the
  loss read for logging every trainer.log_every steps falls on the same steps by default);
- at the end of every epoch.
Blocking is a sleep until the device's timeline says the awaited step ends: no thread, no GIL, no
CPU used by the "device", and a run on a fake clock is exact (tests/test_benchmarks_sim_device.py).
Device busy share = device-executing seconds / wall seconds of the epochs measured.

The training step is dlpipe's own runner (`dlpipe.training.runner.Trainer`) with a model
(`SimStep`) whose forward launches the step on the device, then computes a linear head on the pooled
batch, so the loss, backward and optimizer step are real and the runner's host time per step counts;
the syncs are a callback (`DeviceSync`), since the runner syncs only a CUDA device itself.

With `--device cuda` the device is the GPU (`CudaDevice`): each step runs matrix products sized to the
step time (calibrated at start), its busy time read from CUDA events; the runner then syncs itself.

Pipelines: the vision recipe's dataset (`SyntheticJPEGDataset` with its random resized crop and flip,
64 px JPEGs cropped to 56, batch 64) and the same items plus loader_backends' pure-Python jitter, which
holds the GIL (`jpeg+python`). Loaders: PyTorch's defaults (0 workers), Lightning's suggested worker
count, loader=auto as dlpipe decides it here (loader_backends.automatic: the CPU budget, then fitted to
the data), `dlpipe tune`'s pick (loader_backends.tune: the search on the loader alone, tune's default
bench.mode) and the best of a grid (loader_backends.grid). Each config trains `--epochs` epochs; the
first (worker start-up) is left out.

Rounds: `--rounds` rounds over the whole grid (every config at every step time, shuffled order) pick
the grid's best per step time; then `--held-out` rounds measure only the configs compared, and give the
table's figures (medians; the ratios are medians of per-round ratios). Then the published case
(65% -> 89% GPU utilisation): the step time at which PyTorch's defaults keep the device 65% busy,
found from the held-out rounds' 0-worker rate, with PyTorch's defaults, loader=auto and the grid's
best config at the nearest step time measured again there.

Goals (printed as met or not, never the exit status): loader=auto >= 0.95 busy wherever the grid's best
reaches 0.95, and >= 0.97x the grid's best samples/s.
"""

import argparse
import collections
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

if not __package__:  # run as `python benchmarks/sim_device.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import finish  # noqa: E402
from benchmarks.loader_backends import PythonAugmented, automatic, grid, lightning_workers, tune  # noqa: E402
from benchmarks.options import arguments, checked, worker_counts  # noqa: E402
from dlpipe.data.vision import SyntheticJPEGDataset  # noqa: E402
from dlpipe.loader import torch_threads  # noqa: E402
from dlpipe.loader.build import build_loader  # noqa: E402
from dlpipe.loader.faults import NamedErrors  # noqa: E402
from dlpipe.loader.search import Candidate, measure_candidate  # noqa: E402
from dlpipe.loader.threads import fetch_cpu_seconds  # noqa: E402
from dlpipe.machine import hardware  # noqa: E402
from dlpipe.schema import BenchConfig, LoaderConfig, TrainerConfig  # noqa: E402
from dlpipe.tasks.tune import dataset_options  # noqa: E402
from dlpipe.telemetry.sampler import ResourceSampler  # noqa: E402
from dlpipe.training.callbacks import Callback, Callbacks  # noqa: E402
from dlpipe.training.runner import Trainer  # noqa: E402

log = logging.getLogger(__name__)


class SimDevice:
    """An accelerator that runs asynchronously and uses no CPU: a timeline of launched steps.

    `launch(seconds)` queues a step and returns at once: it starts when the device is free and runs
    `seconds`. The host blocks (sleeps until the timeline says so) only when `depth` launched steps
    are unfinished (the launch queue is full) and in `synchronize()`. `busy_s` sums the seconds of
    every step launched, so after a synchronize() it is what the device has executed. `clock` and
    `sleep` are seams for a fake clock."""

    def __init__(self, depth: int = 2, clock=time.perf_counter, sleep=time.sleep):
        if depth < 1:
            raise ValueError(f"depth={depth}: must be >= 1")
        self.depth, self.clock, self.sleep = depth, clock, sleep
        self.free_at = 0.0  # when the last launched step ends
        self.unfinished: collections.deque[float] = collections.deque()  # end times of launched steps
        self.busy_s = 0.0  # seconds of device work launched
        self.blocked_s = 0.0  # host seconds spent waiting for the device (queue full or synchronize)
        self.steps = 0

    def launch(self, seconds: float) -> None:
        now = self._retire(self.clock())
        if len(self.unfinished) >= self.depth:  # the queue is full: wait until the oldest of them ends
            now = self._retire(self._wait_until(self.unfinished[len(self.unfinished) - self.depth]))
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.unfinished.append(self.free_at)
        self.busy_s += seconds
        self.steps += 1

    def synchronize(self) -> None:
        """Block until every launched step has ended (torch.cuda.synchronize)."""
        self._wait_until(self.free_at)
        self.unfinished.clear()

    def _retire(self, now: float) -> float:
        while self.unfinished and self.unfinished[0] <= now:
            self.unfinished.popleft()
        return now

    def _wait_until(self, t: float) -> float:
        now = self.clock()
        if t <= now:
            return now
        self.sleep(t - now)
        after = self.clock()
        self.blocked_s += after - now
        return after


class CudaDevice:
    """The same interface on a real GPU: a step is `products` matrix products on the current stream,
    sized at start so that a step takes about its seconds; its device time is read from CUDA events
    at synchronize(), so busy_s counts what the GPU executed. Needs torch.cuda.is_available()."""

    def __init__(self, side: int = 4096, device: str = "cuda"):
        self.device = torch.device(device)
        self.a = torch.randn(side, side, device=self.device)
        self.b = torch.randn(side, side, device=self.device)
        self.c = torch.empty(side, side, device=self.device)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.busy_s, self.blocked_s, self.steps = 0.0, 0.0, 0
        self.product_s = self._calibrate()

    def _calibrate(self, products: int = 50) -> float:
        for _ in range(5):  # warm-up: cuBLAS picks its kernel
            torch.mm(self.a, self.b, out=self.c)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(products):
            torch.mm(self.a, self.b, out=self.c)
        end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end) / 1e3 / products

    def launch(self, seconds: float) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(max(1, round(seconds / self.product_s))):
            torch.mm(self.a, self.b, out=self.c)
        end.record()
        self.events.append((start, end))
        self.steps += 1

    def synchronize(self) -> None:
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        self.blocked_s += time.perf_counter() - started
        self.busy_s += sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        self.events.clear()


class SimStep(nn.Module):
    """A model whose forward launches a `step_ms` step on its device (a SimDevice unless given) and
    returns a linear head on the batch's per-channel means: the loss, backward and optimizer step
    are real and cheap, the "accelerator's" work is the device's. Instantiable from a dlpipe config:

        python -m dlpipe +recipe=vision model=custom model._target_=benchmarks.sim_device.SimStep \\
            +model.step_ms=20 +callbacks.device_sync._target_=benchmarks.sim_device.DeviceSync
    """

    def __init__(self, step_ms: float = 20.0, num_classes: int = 10, in_channels: int = 3, queue_depth: int = 2,
                 device=None):
        super().__init__()
        self.step_s = step_ms / 1e3
        self.sim = device if device is not None else SimDevice(queue_depth)
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.sim.launch(self.step_s)  # enqueued: the host goes on, as after a CUDA kernel launch
        return self.head(images.mean(dim=(2, 3)))


class SleepStep(nn.Module):
    """The old stand-in for an accelerator: the forward sleeps `step_ms` in the host's own thread
    (synchronous: the host cannot fetch meanwhile), then the same linear head as SimStep."""

    def __init__(self, step_ms: float = 20.0, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        self.step_s = step_ms / 1e3
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        time.sleep(self.step_s)
        return self.head(images.mean(dim=(2, 3)))


@dataclass
class EpochWindow:
    wall_s: float
    busy_s: float
    blocked_s: float


class DeviceSync(Callback):
    """Syncs the model's device where a real run would (every `every` optimizer steps, 0: never; and
    at every epoch's end) and keeps each epoch's wall and device-busy seconds, from the end of the
    previous epoch's sync to the end of its own. Logs the busy share per epoch."""

    def __init__(self, every: int = 25, clock=time.perf_counter):
        self.every, self.clock = every, clock
        self.epochs: list[EpochWindow] = []
        self._mark = (0.0, 0.0, 0.0)

    @staticmethod
    def device(trainer):
        return trainer.model.sim

    def on_train_start(self, trainer) -> None:
        d = self.device(trainer)
        d.synchronize()
        self._mark = (self.clock(), d.busy_s, d.blocked_s)

    def on_step_end(self, trainer, step: int) -> None:
        if self.every and step % self.every == 0:
            self.device(trainer).synchronize()  # CPU-GPU sync point, as the runner's cuda_sync_every

    def on_epoch_end(self, trainer, epoch: int, metrics: dict[str, float]) -> None:
        d = self.device(trainer)
        d.synchronize()  # the epoch's device work belongs to its time, as the runner does on CUDA
        now, busy, blocked = self.clock(), d.busy_s, d.blocked_s
        w = EpochWindow(now - self._mark[0], busy - self._mark[1], blocked - self._mark[2])
        self.epochs.append(w)
        self._mark = (now, busy, blocked)
        log.info("epoch %d: device busy %.1f%% (%.2f of %.2f s), host blocked on the device %.2f s",
                 epoch, 100 * w.busy_s / w.wall_s if w.wall_s else math.nan, w.busy_s, w.wall_s, w.blocked_s)


GOALS = {"busy": 0.95, "rate": 0.97}
PIPELINES = ("jpeg", "jpeg+python")
PUBLISHED = (0.65, 0.89)  # GPU utilisation before and after the published DataLoader fix
BATCH = 64  # the vision recipe's loader.batch_size (LoaderConfig's default)


@dataclass
class Figures:
    """One training run of a config at a step time, over its measured epochs (the first left out)."""

    samples_per_s: float
    busy: float  # device-executing seconds / wall seconds
    data_wait: float  # the runner's data_wait_frac over the same epochs (time-weighted)
    cpu_main: float  # percent of one core: the main process (thread workers' fetching not included)
    cpu_workers: float  # percent of one core: all workers
    blocked: float  # share of the wall the host spent blocked on the device
    first_batch: float  # share of the wall spent waiting for each epoch's first batch (in data_wait too)
    # Run-queue waits over the whole run (all epochs), as shares of its wall: seconds the main process's
    # threads and the workers were runnable but waited for a CPU (/proc/PID/task/*/schedstat, summed
    # over threads and processes), and the machine's CPU pressure (/proc/pressure/cpu "some"); nan where
    # /proc does not say.
    main_runq: float = math.nan
    workers_runq: float = math.nan
    pressure: float = math.nan


@dataclass
class Measured:
    """Figures per (config, step ms), one per round."""

    runs: dict = field(default_factory=dict)

    def add(self, key, f: Figures) -> None:
        self.runs.setdefault(key, []).append(f)

    def median(self, key, what: str = "samples_per_s") -> float:
        return statistics.median(getattr(f, what) for f in self.runs[key])

    def ratios(self, key, base, what: str = "samples_per_s") -> list[float]:
        """Per-round ratios key / base: round i of each (they were measured side by side)."""
        return [getattr(a, what) / getattr(b, what) for a, b in zip(self.runs[key], self.runs[base])]


def summarise(epochs: list[EpochWindow], rows: list[dict], samples: int) -> Figures:
    """Figures of the epochs given (their training rows beside them)."""
    wall = sum(w.wall_s for w in epochs)
    seconds = [r["epoch_time_s"] for r in rows]
    weighted = lambda key: sum(r.get(key, math.nan) * s for r, s in zip(rows, seconds)) / sum(seconds)  # noqa: E731
    return Figures(samples * len(epochs) / wall, sum(w.busy_s for w in epochs) / wall, weighted("data_wait_frac"),
                   weighted("cpu_main_pct"), weighted("cpu_workers_pct"), sum(w.blocked_s for w in epochs) / wall,
                   sum(r["first_batch_s"] for r in rows) / wall)


def train(c: Candidate, dataset, step_ms: float, args, sampler: ResourceSampler, threads: int | None = None) -> Figures:
    """`args.epochs` epochs of dlpipe's runner on `c`'s loader with a SimStep model; the figures of the
    epochs after the first. `threads`: the main process's torch intra-op threads for this run (None:
    torch's own choice, one per CPU)."""
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        return _train(c, dataset, step_ms, args, sampler)
    finally:
        torch.set_num_threads(default_threads)


def _train(c: Candidate, dataset, step_ms: float, args, sampler: ResourceSampler) -> Figures:
    cuda = args.device == "cuda"
    settings = {**c.settings(), "pin_memory": cuda and c.num_workers > 0}  # loader=auto pins on a GPU
    loader = build_loader(dataset, batch_size=BATCH, shuffle=True, drop_last=False, timeout=0.0,
                          multiprocessing_context=None, seed=0, cuda=cuda, role="train", **settings).loader
    torch.manual_seed(0)
    model = SimStep(step_ms, device=CudaDevice() if cuda else SimDevice(args.queue_depth))
    sync = DeviceSync(0 if cuda else args.sync_every)  # on CUDA the runner syncs itself
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      TrainerConfig(epochs=args.epochs, device="cuda" if cuda else "cpu", progress=False),
                      sampler=sampler, callbacks=Callbacks({"device_sync": sync}), cuda_sync_every=args.sync_every)
    sampler.window()  # the first epoch's CPU starts here
    before, started = waits(), time.perf_counter()
    try:
        rows = trainer.fit(loader)
        after, wall = waits(), time.perf_counter() - started  # before shutdown: the workers are still there
    finally:
        shutdown = getattr(loader, "shutdown", None)
        if shutdown is not None:
            shutdown()  # persistent workers end here, before the next config starts its own
    figures = summarise(sync.epochs[1:], rows[1:], len(dataset))
    # a worker started during the run has all its wait in `after`; a non-persistent one that ended is not counted
    figures.main_runq, figures.workers_runq, figures.pressure = ((a - b) / wall for a, b in zip(after, before))
    return figures


def run_delay(pid: int | str) -> float:
    """Seconds the threads of process `pid` have been runnable but waiting for a CPU (schedstat's second field)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(task.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def waits() -> tuple[float, float, float]:
    """(this process's run-queue wait, its descendants', the machine's CPU pressure "some" total), in
    seconds since each started; nan where /proc does not say."""
    import psutil

    try:
        pressure = float(Path("/proc/pressure/cpu").read_text().split("total=")[1].split()[0]) / 1e6
    except (OSError, IndexError, ValueError):
        pressure = math.nan
    if not Path(f"/proc/{os.getpid()}/task").is_dir():
        return math.nan, math.nan, pressure
    children = psutil.Process().children(recursive=True)
    return run_delay("self"), sum(run_delay(c.pid) for c in children), pressure


def build(name: str, args):
    """The vision recipe's training items (conf/dataset/vision.yaml: 64 px JPEGs, random resized crop
    to 56 and flip), wrapped as training wraps its split; jpeg+python adds loader_backends' jitter."""
    jpeg = SyntheticJPEGDataset(size=args.images, image_size=64, crop_size=56, num_classes=10, augment=True, seed=0)
    what = f"the vision recipe's SyntheticJPEGDataset, {args.images} images of 64 px, random resized crop 56 + flip"
    if name == "jpeg":
        return NamedErrors(jpeg), what
    return NamedErrors(PythonAugmented(jpeg, args.python_ops)), f"{what}, Python jitter on {args.python_ops} values"


def measure_rounds(run, measured: Measured, todo: list[tuple], rounds: int, order: random.Random, what: str) -> None:
    """Every (config, step ms) once per round, each round in a new shuffled order."""
    for i in range(rounds):
        keys = list(todo)
        order.shuffle(keys)
        for key in keys:
            measured.add(key, run(*key))
        print(f"{what} round {i + 1}/{rounds} done", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 1, "rounds over the whole grid, choosing its best config per step time")
    p.add_argument("--held-out", type=int, default=3,
                   help="rounds measuring only the configs compared again; the table's figures are theirs (default 3)")
    p.add_argument("--steps-ms", default="5,20,50", help="device step times in ms, comma-separated (default 5,20,50)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per training run, the first left out (default 3)")
    p.add_argument("--images", type=int, default=1280,
                   help="training images (default 1280: 20 batches of 64, 10 a worker at 2 workers, so loader=auto "
                        "keeps them)")
    p.add_argument("--python-ops", type=int, default=1024, help="values jpeg+python's jitter touches (default 1024)")
    p.add_argument("--workers", default="1,2,3", help="the grid's worker counts besides 0 (default 1,2,3)")
    p.add_argument("--queue-depth", type=int, default=2, help="steps the host may run ahead of the device (default 2)")
    p.add_argument("--sync-every", type=int, default=25,
                   help="optimizer steps between syncs (default 25, telemetry.cuda_sync_every)")
    p.add_argument("--repeats", type=int, default=BenchConfig.repeats,
                   help=f"tune's measurements per candidate (default {BenchConfig.repeats})")
    p.add_argument("--pipelines", default=",".join(PIPELINES), help=f"some of {','.join(PIPELINES)} (default all)")
    p.add_argument("--no-case", dest="case", action="store_false",
                   help="leave out the published case's row (65%% busy with PyTorch's defaults)")
    p.add_argument("--device", default="sim", choices=("sim", "cuda"),
                   help="sim: the simulated device (default); cuda: the GPU, steps of matrix products")
    p.add_argument("--explain", action="store_true",
                   help="instead of the comparison: where loader=auto's data wait goes at --explain-ms on the jpeg "
                        "pipeline (2 processes, prefetch 2, persistent, and auto's own pick; torch's intra-op threads "
                        "in the main process as torch sets them, and as trainer.torch_threads's rule sets them), "
                        "--held-out rounds")
    p.add_argument("--explain-ms", type=float, default=20.0, help="the step time --explain measures at (default 20)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs, its figures mean nothing")
    args = checked(p, argv, counts=("held_out", "epochs", "images", "python_ops", "queue_depth", "repeats"),
                   non_negative=("sync_every",))
    if args.epochs < 2:
        p.error(f"--epochs={args.epochs}: must be >= 2 (the first is left out)")
    try:
        args.steps = [float(s) for s in args.steps_ms.split(",")]
    except ValueError:
        p.error(f"--steps-ms={args.steps_ms}: comma-separated milliseconds, e.g. 5,20,50")
    if any(s <= 0 for s in args.steps):
        p.error(f"--steps-ms={args.steps_ms}: every step time must be > 0")
    args.worker_counts = worker_counts(p, args.workers, 1, "1,2,3,4")
    args.chosen = [n.strip() for n in args.pipelines.split(",") if n.strip()]
    unknown = [n for n in args.chosen if n not in PIPELINES]
    if unknown or not args.chosen:
        p.error(f"--pipelines={args.pipelines}: choose from {','.join(PIPELINES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device=cuda: torch.cuda.is_available() is False")
    if args.quick:
        args.images, args.python_ops, args.worker_counts, args.repeats = 128, 64, [1, 2], 1
        args.held_out, args.steps = min(args.held_out, 1), [2.0, 5.0]
    return args


def oracle(measured: Measured, configs: list[Candidate], step: float) -> Candidate:
    """The grid's best at a step time, on the grid's rounds."""
    return max(configs, key=lambda c: measured.median((c, step)))


def run_pipeline(name: str, args, budget: int, sampler: ResourceSampler) -> tuple[list[str], dict]:
    dataset, what = build(name, args)
    started = time.perf_counter()
    auto, reasons, _ = automatic(dataset, BATCH, budget)
    auto_s = time.perf_counter() - started
    per_epoch = math.ceil(len(dataset) / BATCH)
    settings = {"batch_size": BATCH, "shuffle": True, "drop_last": False, "timeout": 0.0,
                "multiprocessing_context": None, "collate_fn": None}
    batches, warmup = math.ceil(1.1 * per_epoch), 4  # loader_backends' measurement: across an epoch boundary

    def loader_alone(c: Candidate, repeats: int):
        return measure_candidate(c, dataset, settings, batches, warmup, repeats, seed=0, cuda=False, sampler=sampler)

    cfg = SimpleNamespace(loader=LoaderConfig(batch_size=BATCH), trainer=SimpleNamespace(epochs=args.epochs))
    options = dataset_options(cfg, dataset)
    tuned, search, tune_s = tune(loader_alone, auto, dataset, BATCH, args, budget, cfg, options, crosses=True)
    configs = grid(options["gathers"], args.worker_counts)
    pytorch, lightning = Candidate(0, None, False, False), Candidate(lightning_workers(), 2, False, False)
    picks = {"pytorch": pytorch, "lightning": lightning, "auto": auto, "tune": tuned}
    extras = [c for c in dict.fromkeys(picks.values()) if c not in configs]
    order = random.Random(0)

    def run(c: Candidate, step: float) -> Figures:
        return train(c, dataset, step, args, sampler)

    grid_runs = Measured()
    measure_rounds(run, grid_runs, [(c, s) for c in configs + extras for s in args.steps], args.rounds, order,
                   f"{name}: grid")
    best = {s: oracle(grid_runs, configs, s) for s in args.steps}
    held = Measured()
    todo = list(dict.fromkeys((c, s) for s in args.steps for c in (best[s], *picks.values())))
    measure_rounds(run, held, todo, args.held_out, order, f"{name}: held-out")
    case = case_row(run, held, picks, best, args, order, name) if args.case else None
    facts = {"what": what, "auto_s": auto_s, "reasons": reasons, "tune_s": tune_s, "search": search,
             "grid": len(configs), "per_epoch": per_epoch}
    return report_pipeline(name, args, held, picks, best, case, facts)


def case_step(held: Measured, pytorch: Candidate, steps: list[float]) -> float | None:
    """The step time at which PyTorch's defaults keep the device 65% busy: from the shortest step time
    where they leave it idle, whose wall per batch is the main process's fetch plus its host work
    (the device overlaps them): 0.65 of it. None where they keep it busy everywhere."""
    for s in sorted(steps):
        busy = held.median((pytorch, s), "busy")
        if busy < PUBLISHED[0]:
            return PUBLISHED[0] * s / busy
    return None


def case_row(run, held: Measured, picks: dict, best: dict, args, order: random.Random, name: str):
    """PyTorch's defaults, loader=auto and the grid's best at the nearest step time, measured side by
    side at the step time where the defaults give the published 65%."""
    step = case_step(held, picks["pytorch"], args.steps)
    if step is None:
        return None
    step = round(step, 1)
    nearest = min(args.steps, key=lambda s: abs(s - step))
    chosen = {"pytorch": picks["pytorch"], "auto": picks["auto"], "best": best[nearest]}
    measured = Measured()
    measure_rounds(run, measured, [(c, step) for c in dict.fromkeys(chosen.values())], args.held_out, order,
                   f"{name}: published case at {step:g} ms")
    return {"step": step, "nearest": nearest, "chosen": chosen, "measured": measured}


LABELS = (("pytorch", "PyTorch's defaults"), ("lightning", "Lightning's suggestion"), ("auto", "loader=auto"),
          ("tune", "dlpipe tune's pick"), ("best", "the grid's best"))


def cells(held: Measured, key, base) -> str:
    """busy | samples/s | / the grid's best (median of per-round ratios) | data wait | CPU main / workers."""
    ratios = held.ratios(key, base)
    return (f"{held.median(key, 'busy'):.3f} | {held.median(key):.0f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}) | {100 * held.median(key, 'data_wait'):.1f}% | "
            f"{held.median(key, 'cpu_main'):.0f} / {held.median(key, 'cpu_workers'):.0f}")


def report_pipeline(name: str, args, held: Measured, picks: dict, best: dict, case, facts: dict):
    lines = [f"### {name}: {facts['what']}, batch {BATCH}", "",
             f"{facts['per_epoch']} batches an epoch, {args.epochs} epochs a run (the first left out); grid of "
             f"{facts['grid']} configs; figures from {args.held_out} held-out round(s), medians.", "",
             "| step ms | loader | config | device busy | samples/s | / grid's best | data wait (runner) "
             "| CPU % main / workers |", "|---|---|---|---|---|---|---|---|"]
    results = {}
    for s in args.steps:
        chosen = {**picks, "best": best[s]}
        for key, label in LABELS:
            c = chosen[key]
            lines.append(f"| {s:g} | {label} | {c.label()} | {cells(held, (c, s), (best[s], s))} |")
        results[s] = {k: (held.median((c, s), "busy"), statistics.median(held.ratios((c, s), (best[s], s))))
                      for k, c in chosen.items()}
    search = facts["search"]
    trials = "; ".join(f"{t.candidate.label()}: {t.skipped or ' '.join(f'{v:.0f}' for v in t.runs)} samples/s"
                       for t in search.trials.values())
    lines += ["", f"auto decided in {facts['auto_s']:.2f} s: "
              + "; ".join(f"{k}={v}" for k, v in facts["reasons"].items()) + ".",
              f"tune (the loader alone, tune's default bench.mode): {len(search.trials)} candidates in "
              f"{facts['tune_s']:.1f} s: {trials}.", ""]
    if case is not None:
        m, chosen, step = case["measured"], case["chosen"], case["step"]
        lines += [f"The published case (GPU utilisation {PUBLISHED[0]:.0%} -> {PUBLISHED[1]:.0%}): at a {step:g} ms "
                  f"step PyTorch's defaults keep the device about {PUBLISHED[0]:.0%} busy:", "",
                  "| step ms | loader | config | device busy | samples/s | / PyTorch's defaults | data wait (runner) "
                  "| CPU % main / workers |", "|---|---|---|---|---|---|---|---|"]
        for key, label in (("pytorch", "PyTorch's defaults"), ("auto", "loader=auto"),
                           ("best", f"the grid's best at {case['nearest']:g} ms")):
            c = chosen[key]
            lines.append(f"| {step:g} | {label} | {c.label()} | "
                         f"{cells(m, (c, step), (chosen['pytorch'], step))} |")
        lines.append("")
    return lines, {"name": name, "results": results, "case": case}


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def goals(r: dict) -> list[str]:
    out = []
    for s, figures in r["results"].items():
        busy, rate = figures["auto"]
        best_busy = figures["best"][0]
        busy_goal = (f"busy {busy:.3f} (goal >= {GOALS['busy']} where the grid's best reaches it, {best_busy:.3f}: "
                     f"{met(busy >= GOALS['busy'])})" if best_busy >= GOALS["busy"]
                     else f"busy {busy:.3f} (the grid's best reaches {best_busy:.3f}: no busy goal)")
        out.append(f"- {r['name']} at {s:g} ms: loader=auto {busy_goal}; {rate:.3f}x the grid's best samples/s "
                   f"(goal >= {GOALS['rate']}: {met(rate >= GOALS['rate'])})")
    case = r["case"]
    if case is not None:
        m, c = case["measured"], case["chosen"]
        before, after = (m.median((c[k], case["step"]), "busy") for k in ("pytorch", "auto"))
        out.append(f"- {r['name']}, the published case: at {case['step']:g} ms device busy {before:.0%} with "
                   f"PyTorch's defaults -> {after:.0%} with loader=auto (published: "
                   f"{PUBLISHED[0]:.0%} -> {PUBLISHED[1]:.0%})")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = hardware.cpu_budget().budget
    sampler = ResourceSampler(0.5, budget, thread_cpu=fetch_cpu_seconds).start()
    device = (f"CUDA ({torch.cuda.get_device_name()}), steps of matrix products" if args.device == "cuda" else
              f"simulated: the host runs up to {args.queue_depth} steps ahead")
    report = ["# simulated device: how busy the loader keeps an accelerator", "",
              f"{platform.machine()}, {os.cpu_count()} CPUs, dlpipe CPU budget {budget}, torch {torch.__version__}, "
              f"Python {platform.python_version()}, load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} at "
              f"start; device {device}, a sync every {args.sync_every} optimizer steps and at every epoch's end; "
              f"dlpipe's runner, {args.rounds} grid round(s) then {args.held_out} held-out round(s), shuffled.", ""]
    try:
        if args.explain:
            report += explain(args, budget, sampler)
            sections = []
        else:
            sections = [run_pipeline(name, args, budget, sampler) for name in args.chosen]
    finally:
        sampler.stop()
    report += [line for lines, _ in sections for line in lines]
    if sections:
        report += ["### goals", "", *[line for _, r in sections for line in goals(r)], ""]
    report += [f"Load average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}."]
    return finish("\n".join(report) + "\n", args.out)



def explain(args, budget: int, sampler: ResourceSampler) -> list[str]:
    """Where the data wait goes at one step time: the same loaders with the main process's torch
    threads as torch sets them and as trainer.torch_threads's rule sets them (dlpipe.loader.torch_threads),
    side by side, with run-queue waits and CPU pressure."""
    dataset, what = build("jpeg", args)
    auto, _, _ = automatic(dataset, BATCH, budget)
    issue = Candidate(2, 2, True, False)  # loader=auto as issue 32 saw it: 2 processes, prefetch 2, persistent
    default = torch.get_num_threads()
    # trainer.torch_threads as dlpipe decides it for each loader on an accelerator (the simulated device is one)
    rule = torch_threads.rule_for(budget, "cuda")
    runs = {(c, t): None for c in dict.fromkeys((issue, auto))
            for t in dict.fromkeys((default, rule(c.num_workers, c.worker_method).value))}
    measured = Measured()
    step = args.explain_ms

    def run(c: Candidate, threads: int) -> Figures:
        return train(c, dataset, step, args, sampler, threads)

    measure_rounds(run, measured, list(runs), args.held_out, random.Random(0), "explain")
    said = {c: rule(c.num_workers, c.worker_method) for c, _ in runs}
    lines = [f"### where the data wait goes: {what}, batch {BATCH}, a {step:g} ms step", "",
             f"{math.ceil(len(dataset) / BATCH)} batches an epoch, {args.epochs} epochs a run (the first left out; "
             f"the run-queue columns cover every epoch); {args.held_out} rounds, medians. Run-queue and pressure "
             "columns are seconds per wall second: the main process's threads and the workers waiting, runnable, "
             "for a CPU (/proc/PID/task/*/schedstat), and the machine's CPU pressure (/proc/pressure/cpu, some). "
             "Torch threads: torch's default, and trainer.torch_threads's automatic value for the loader ("
             + "; ".join(f"{c.label()}: {d.value}, {d.reason}" for c, d in said.items()) + ").",
             "", "| loader | torch threads (main) | device busy | samples/s | data wait (runner) "
             "| of it, first batches | host blocked on device | CPU % main / workers | run queue main / workers "
             "| CPU pressure |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, threads in runs:
        m = lambda what, key=(c, threads): measured.median(key, what)  # noqa: E731
        which = " ".join(w for w, t in (("(torch's default)", default), ("(auto rule)", said[c].value))
                         if t == threads)
        lines.append(f"| {c.label()} | {threads} {which} | {m('busy'):.3f} | {m('samples_per_s'):.0f} | "
                     f"{100 * m('data_wait'):.1f}% | {100 * m('first_batch'):.1f}% | {100 * m('blocked'):.1f}% | "
                     f"{m('cpu_main'):.0f} / {m('cpu_workers'):.0f} | {m('main_runq'):.2f} / {m('workers_runq'):.2f} "
                     f"| {m('pressure'):.2f} |")
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
