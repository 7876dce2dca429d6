"""Loader backends: loader=auto, `dlpipe tune`, PyTorch's default and Lightning's suggestion against
the best of an exhaustive grid over fetch x worker_method x num_workers x prefetch x persistence.

    python -m benchmarks.loader_backends --rounds 3 [--out loader_backends.md]

Seven pipelines, the map datasets wrapped in NamedErrors as training wraps its split (a stream is not:
its loader names its failures):
- rows: `TabularDataset`, 50,000 x 32 floats, batch 64 (in memory: a gather per batch is possible);
- tokens: `TokenSequenceDataset`, fixed-length sequences, batch 64 (the same);
- jpeg: `SyntheticJPEGDataset(augment=False)`, decode and centre crop, batch 32 (PIL releases the GIL);
- jpeg+python: the same items, then a brightness/contrast jitter written as a pure-Python loop over the
  crop's values (holds the GIL), drawn from `dlpipe.sample_rng.sample_generator()`;
- jpeg-large: `SyntheticJPEGDataset(augment=False)` at 224 px (ImageNet's size), batch 32: decode
  releases the GIL for longer, and each batch is 13 MB to pickle through /dev/shm;
- parquet: `SyntheticTabularParquet` rows (32 floats, row groups of `--row-group`, a shuffle window of
  `--shuffle-buffer` rows), a stream, batch 64;
- jpeg-shards: `SyntheticJPEGShards(augment=False)`, the jpeg pipeline's images as webdataset tars of
  `--shard-size`, a stream, batch 32.
The streams' files are written once under `--data-dir` (named by their arguments, reused after).

Per pipeline:
1. auto: the settings loader=auto gives here (`recommended_workers` of the CPU budget, then
   `dlpipe.loader.fitting.fit_loader_to_data` with fetch=auto and worker_method=auto, as a job runs it;
   on a stream that is `fit_stream`, and every measurement deals the stream as the job would,
   `loader.stream_share` as `dlpipe tune` decides it for candidates with workers);
2. tune: `dlpipe.loader.search.Search` from auto, its evaluate() as `dlpipe tune`'s (memory guard,
   `measure_candidate` with bench.repeats measurements and a resource sampler), no MLflow; its wall time;
3. the grid: fetch (batch only where `find_gather` finds a gather) x num_workers 0 and `--workers` x
   worker_method process (prefetch 2,4 x persistent true,false) and thread (prefetch 2,4), plus auto's
   and tune's picks where outside it; on a stream, item fetch and processes not persistent only (its
   set_epoch reaches only workers started anew), threads where it reads positions (`dlpipe tune`'s
   dataset_options and automatic_persistence). Every round measures every config once, in a new
   shuffled order; figures are medians over rounds, and every ratio is between medians of this one run. A measurement
   runs `--measure-epochs` of the pipeline's epoch after the warm-up, so it crosses an epoch boundary
   (where non-persistent workers restart). Peak RSS is the whole process tree's (main + workers,
   psutil, dlpipe's ResourceSampler; shared pages count once per process).
4. held-out rounds (`--held-out`): the configs the report compares (the oracle, the picks, the best
   process and thread configs), chosen on the grid's rounds, measured again, interleaved. The ratios
   are these rounds': the best of 25-50 noisy grid medians is flattered by the luck that made it the
   best (on the JPEG pipelines a config's own rounds spread 2x), and would understate every pick.
5. on a stream, also the naive loader: a plain `DataLoader(num_workers=--naive-workers)` over the same
   stream read front to back by every worker (no get_worker_info, no dealing), measured in the held-out
   rounds; one epoch of it, and one of dlpipe's loader at as many workers, count the rows delivered
   against the distinct rows: the naive loader's samples/s counts every row once per worker.
Goals (printed as met or not, never the exit status): auto >= 0.9x the oracle, tune >= 0.97x at <= 1/3
of the grid's time (the grid at tune's measurements per config), and where auto or tune picks thread
workers, their peak RSS >= 20% below the best process config's.
"""

import argparse
import hashlib
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

if not __package__:  # run as `python benchmarks/loader_backends.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402

from benchmarks.common import finish  # noqa: E402
from benchmarks.options import arguments, checked, worker_counts  # noqa: E402
from dlpipe.loader import decisions as loader_decisions  # noqa: E402
from dlpipe.loader.build import batch_bytes, build_loader, stream_batch_bytes  # noqa: E402
from dlpipe.loader.faults import NamedErrors  # noqa: E402
from dlpipe.loader.fitting import fit_loader_to_data  # noqa: E402
from dlpipe.loader.measure import measure as measure_loader  # noqa: E402
from dlpipe.loader.search import Candidate, Search, Trial, measure_candidate, memory_guard  # noqa: E402
from dlpipe.loader.streams import is_stream  # noqa: E402
from dlpipe.loader.threads import fetch_cpu_seconds  # noqa: E402
from dlpipe.machine import hardware  # noqa: E402
from dlpipe.sample_rng import sample_generator  # noqa: E402
from dlpipe.schema import BenchConfig, LoaderConfig  # noqa: E402
from dlpipe.tasks.tune import automatic_persistence, dataset_options, share_among_workers  # noqa: E402
from dlpipe.telemetry.sampler import ResourceSampler  # noqa: E402

GOALS = {"auto": 0.9, "tune": 0.97, "cost": 1 / 3, "thread_rss": 0.8}
EPOCHS = 3  # what the automatic persistence decision is told the run trains for
PIPELINES = ("rows", "tokens", "jpeg", "jpeg+python", "jpeg-large", "parquet", "jpeg-shards")
STREAMS = ("parquet", "jpeg-shards")
# conf/loader/auto.yaml's values before interpolation: what fit_loader_to_data reads to tell automatic from set.
AUTO_RAW = {"num_workers": "${auto_workers:}", "pin_memory": "${cuda_available:}",
            "prefetch_factor": "${auto_prefetch:${.num_workers}}",
            "persistent_workers": "${auto_persistent:${.num_workers},${trainer.epochs},0}",
            "fetch": "auto", "worker_method": "auto"}


def lightning_workers(devices: int = 1) -> int:
    # Lightning 2.x's suggested_max_num_workers (lightning/fabric/utilities/data.py), the count its
    # _worker_check (trainer/connectors/data_connector.py) names in "Consider increasing num_workers":
    return max(1, len(os.sched_getaffinity(0)) // devices - 1)


class PythonAugmented(Dataset):
    """A dataset's image, then a brightness/contrast jitter over up to `ops` of its values in a
    pure-Python loop (it holds the GIL), its two draws from the sample's own generator."""

    def __init__(self, dataset: Dataset, ops: int):
        self.dataset, self.ops = dataset, ops

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image, label = self.dataset[index]
        gain, bias = (torch.rand(2, generator=sample_generator()) * 0.4 - 0.2).tolist()
        flat = image.view(-1)
        n = min(self.ops, flat.numel())
        flat[:n] = torch.tensor([min(max(v * (1 + gain) + bias, -3.0), 3.0) for v in flat[:n].tolist()])
        return image, label


class FrontToBack(IterableDataset):
    """A ShardedStream's items read front to back, shard after shard, by whoever iterates it: a stream
    that does not share itself out (no get_worker_info()), as a first IterableDataset is often written.
    It reads with the stream's own reader (pyarrow row groups, tar members), so an item costs what
    the stream's costs and only the dealing differs."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        for shard, rows in enumerate(self.stream.shard_rows):
            for record in self.stream.read_rows(shard, np.arange(rows)):
                yield self.stream.build(record)


@dataclass(frozen=True)
class Naive(Candidate):
    """The naive loader as a config of the held-out rounds: PyTorch's DataLoader with `num_workers`
    over FrontToBack(stream). A class of its own, so it never equals the grid's configs."""

    def label(self) -> str:
        return f"plain DataLoader(num_workers={self.num_workers}) on the unsharded stream"


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 3, "rounds over the whole grid")
    p.add_argument("--held-out", type=int, default=5,
                   help="rounds measuring only the oracle, the picks and the best process and thread configs "
                        "again after the grid's rounds chose them; the report's ratios are theirs (default 5)")
    p.add_argument("--repeats", type=int, default=BenchConfig.repeats,
                   help=f"tune's measurements per candidate (default {BenchConfig.repeats}, bench.repeats)")
    p.add_argument("--measure-epochs", type=float, default=1.1,
                   help="batches measured per measurement, in epochs of the pipeline (default 1.1)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up batches per measurement (default 4)")
    p.add_argument("--workers", default="1,2,3,4", help="the grid's worker counts besides 0 (default 1,2,3,4)")
    p.add_argument("--rows", type=int, default=50000, help="rows of 32 floats (default 50000)")
    p.add_argument("--tokens", type=int, default=8192, help="token sequences of 64 (default 8192)")
    p.add_argument("--images", type=int, default=640, help="JPEG images (default 640: 20 batches of 32)")
    p.add_argument("--image-size", type=int, default=48, help="stored JPEG side in pixels (default 48)")
    p.add_argument("--large-images", type=int, default=320,
                   help="224 px JPEG images of jpeg-large (default 320: 10 batches of 32)")
    p.add_argument("--python-ops", type=int, default=1024,
                   help="values the Python jitter touches per item (default 1024)")
    p.add_argument("--parquet-rows", type=int, default=50000,
                   help="rows of 32 floats of the parquet stream (default 50000)")
    p.add_argument("--row-group", type=int, default=512, help="rows per parquet row group (default 512)")
    p.add_argument("--shard-size", type=int, default=128, help="images per tar of jpeg-shards (default 128)")
    p.add_argument("--shuffle-buffer", type=int, default=1024,
                   help="the streams' shuffle window, rows or samples (default 1024)")
    p.add_argument("--naive-workers", type=int, default=2,
                   help="workers of the plain DataLoader over the unsharded stream (default 2)")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "dlpipe-loader-backends",
                   help="where the streams' files are written once and reused (default: "
                        "$TMPDIR/dlpipe-loader-backends)")
    p.add_argument("--pipelines", default=",".join(PIPELINES), help=f"some of {','.join(PIPELINES)} (default all)")
    p.add_argument("--sample-interval", type=float, default=0.1, help="RSS sampling interval in s (default 0.1)")
    p.epilog = next(part for part in __doc__.split("\n\n") if part.startswith("Seven pipelines"))
    args = checked(p, argv, counts=("held_out", "repeats", "warmup", "rows", "tokens", "images", "image_size",
                                    "python_ops", "large_images", "parquet_rows", "row_group", "shard_size",
                                    "naive_workers"),
                   positive=("measure_epochs", "sample_interval"), non_negative=("shuffle_buffer",))
    # sorted and unique, 0 left out: the grid always has 0 workers
    args.worker_counts = sorted(set(worker_counts(p, args.workers, 1, "1,2,3,4")))
    args.chosen = [n.strip() for n in args.pipelines.split(",") if n.strip()]
    if not args.chosen or set(args.chosen) - set(PIPELINES):
        p.error(f"--pipelines={args.pipelines}: choose from {','.join(PIPELINES)}")
    return args


def build(name: str, args) -> tuple[Dataset, int, str]:
    """(the pipeline's dataset wrapped as training wraps it, batch size, description)."""
    if name in STREAMS:
        return build_stream(name, args)
    from dlpipe.data.sequences import TokenSequenceDataset
    from dlpipe.data.tabular import TabularDataset
    from dlpipe.data.vision import SyntheticJPEGDataset

    if name == "jpeg-large":
        large = SyntheticJPEGDataset(size=args.large_images, image_size=224, crop_size=186, augment=False)
        return NamedErrors(large), 32, f"SyntheticJPEGDataset {args.large_images} images of 224 px, centre crop 186"
    crop = max(args.image_size * 5 // 6, 1)
    if name == "rows":
        return NamedErrors(TabularDataset(size=args.rows, num_features=32)), 64, f"TabularDataset {args.rows} x 32"
    if name == "tokens":
        return NamedErrors(TokenSequenceDataset(size=args.tokens, seq_len=64)), 64, \
            f"TokenSequenceDataset {args.tokens} x 64 tokens"
    jpeg = SyntheticJPEGDataset(size=args.images, image_size=args.image_size, crop_size=crop, augment=False)
    what = f"SyntheticJPEGDataset {args.images} images of {args.image_size} px, centre crop {crop}"
    if name == "jpeg":
        return NamedErrors(jpeg), 32, what
    return NamedErrors(PythonAugmented(jpeg, args.python_ops)), 32, f"{what}, Python jitter on {args.python_ops} values"


def build_stream(name: str, args) -> tuple[IterableDataset, int, str]:
    """A stream pipeline, its files written under --data-dir the first time; unwrapped, as training
    leaves a stream (dlpipe.tasks.build)."""
    from dlpipe.data.parquet import SyntheticTabularParquet
    from dlpipe.data.tar_shards import SyntheticJPEGShards

    window = f"shuffle window {args.shuffle_buffer}"
    if name == "parquet":
        files = max(1, min(4, args.parquet_rows // args.row_group))  # 4 files, as dataset=tabular_parquet
        stream = SyntheticTabularParquet(str(args.data_dir / "parquet"), size=args.parquet_rows, num_features=32,
                                         files_count=files, row_group_size=args.row_group,
                                         shuffle_buffer=args.shuffle_buffer)
        return stream, 64, (f"SyntheticTabularParquet {args.parquet_rows} x 32 in {files} files, row groups of "
                            f"{args.row_group}, {window}")
    crop = max(args.image_size * 5 // 6, 1)
    stream = SyntheticJPEGShards(str(args.data_dir / "jpeg-shards"), size=args.images, image_size=args.image_size,
                                 crop_size=crop, augment=False, shard_size=args.shard_size,
                                 shuffle_buffer=args.shuffle_buffer)
    return stream, 32, (f"SyntheticJPEGShards {args.images} images of {args.image_size} px in tars of "
                        f"{args.shard_size}, centre crop {crop}, {window}")


def epoch_rows(dataset) -> int:
    """Samples an epoch: a ShardedStream counts its rows."""
    return dataset.num_rows if is_stream(dataset) else len(dataset)


def grid(gathers: bool, worker_counts: list[int], stream: bool = False, threads: bool = True) -> list[Candidate]:
    """The exhaustive grid; a stream's has no persistent workers (set_epoch reaches only workers started
    anew), and threads only where they apply (`threads`: a stream that reads positions, dealt by dlpipe)."""
    out = []
    keeps = (False,) if stream else (True, False)
    for fetch in ("item", "batch") if gathers else ("item",):
        out.append(Candidate(0, None, False, False, fetch))
        for n in worker_counts:
            out += [Candidate(n, p, keep, False, fetch, "process") for p in (2, 4) for keep in keeps]
            if threads:
                out += [Candidate(n, p, False, False, fetch, "thread") for p in (2, 4)]
    return out


def automatic(dataset, batch: int, budget: int) -> tuple[Candidate, dict[str, str], LoaderConfig]:
    """loader=auto here: the resolvers' values, then fitted to the built data like a job's (a stream's
    by fit_stream). Returns the config, the reasons and the fitted loader settings."""
    workers = hardware.recommended_workers(budget)
    persistent = loader_decisions.persistent(workers, EPOCHS, epoch_rows(dataset), batch).value
    asked = LoaderConfig(batch_size=batch, num_workers=workers,
                         prefetch_factor=loader_decisions.prefetch(workers).value,
                         persistent_workers=persistent, fetch="auto", worker_method="auto")
    fitted, reasons = fit_loader_to_data(AUTO_RAW, asked, EPOCHS, dataset)
    n = fitted.num_workers
    return Candidate(n, fitted.prefetch_factor if n else None, fitted.persistent_workers, False, fitted.fetch,
                     fitted.worker_method), reasons, fitted


@dataclass
class Run:
    """One pipeline's measurements: per config, samples/s, seconds and tree peak RSS MB per round."""

    rates: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    rss: dict = field(default_factory=dict)

    def add(self, c: Candidate, trial: Trial, seconds: float) -> None:
        self.rates.setdefault(c, []).append(trial.runs[0])
        self.seconds.setdefault(c, []).append(seconds)
        self.rss.setdefault(c, []).append(trial.metrics.get("tree_rss_peak_mb", math.nan))

    def median(self, c: Candidate) -> float:
        return statistics.median(self.rates[c])


def run_pipeline(name: str, args, budget: int, sampler: ResourceSampler) -> tuple[list[str], dict]:
    dataset, batch, what = build(name, args)
    stream = is_stream(dataset)
    per_epoch = math.ceil(epoch_rows(dataset) / batch)
    batches = max(1, math.ceil(args.measure_epochs * per_epoch))
    settings = {"batch_size": batch, "shuffle": True, "drop_last": False, "timeout": 0.0,
                "multiprocessing_context": None, "collate_fn": None}

    def measure(c: Candidate, repeats: int) -> Trial:
        if isinstance(c, Naive):
            return measure_naive(c, dataset, batch, batches, args.warmup, sampler)
        return measure_candidate(c, dataset, settings, batches, args.warmup, repeats, seed=0, cuda=False,
                                 sampler=sampler)

    started = time.perf_counter()
    auto, reasons, fitted = automatic(dataset, batch, budget)
    auto_s = time.perf_counter() - started
    if stream:  # read in its own order, and dealt to the workers as `dlpipe tune` deals it to its candidates
        settings.update(shuffle=False, stream_share=share_among_workers(fitted, dataset))
    # the stream's share as tune's candidates get it: threads apply only to a stream dlpipe deals
    cfg = SimpleNamespace(loader=LoaderConfig(batch_size=batch, stream_share=settings.get("stream_share", "auto")),
                          trainer=SimpleNamespace(epochs=EPOCHS))
    options = dataset_options(cfg, dataset)
    tuned, search, tune_s = tune(measure, auto, dataset, batch, args, budget, cfg, options,
                                 crosses=args.warmup + batches > per_epoch)
    configs = grid(options["gathers"], args.worker_counts, stream, not stream or options["tune_threads"])
    pytorch, lightning = Candidate(0, None, False, False), Candidate(lightning_workers(), 2, False, False)
    extras = [c for c in dict.fromkeys((auto, tuned, pytorch, lightning)) if c not in configs]
    order = random.Random(0)
    run = measure_rounds(measure, configs + extras, args.rounds, order, f"{name}: grid")
    picks = {"auto": auto, "tune": tuned, "pytorch": pytorch, "lightning": lightning}
    chosen = finalists(run, configs, picks)
    if stream:
        chosen["naive"] = Naive(args.naive_workers, 2, False, False)
    held = measure_rounds(measure, list(dict.fromkeys(chosen.values())), args.held_out, order, f"{name}: held-out")
    head = (f"### {name}: {what}, batch {batch}",
            f"{per_epoch} batches an epoch; {batches} measured after {args.warmup} warm-up; grid of {len(configs)} "
            f"configs ({grid_note(options, stream, settings.get('stream_share'))}).")
    facts = {"auto_s": auto_s, "tune_s": tune_s, "search": search, "reasons": reasons, "repeats": args.repeats}
    if stream:
        facts["epochs"] = count_epochs(dataset, settings, args.naive_workers)
    return report_pipeline(name, head, run, held, configs, chosen, facts)


def grid_note(options: dict, stream: bool, share: str | None) -> str:
    """What the grid leaves out, and why."""
    if stream:
        threads = ("process workers started anew each epoch, and threads (it reads any position)"
                   if options["tune_threads"] else "process workers started anew each epoch; no threads")
        return f"a stream dealt by stream_share={share}: fetch item, {threads}; tune tries no whole-batch fetch"
    return (f"fetch {'item and batch' if options['gathers'] else 'item only: no gather equals its collate'}"
            f"; tune {'may try threads' if options['tune_threads'] else 'never tries threads: global RNG draws'}")


def naive_loader(stream, batch: int, workers: int) -> DataLoader:
    """PyTorch's DataLoader as a first stream loader is often written: num_workers=N over a stream that
    does not share itself out, so each worker yields the whole stream."""
    return DataLoader(FrontToBack(stream), batch_size=batch, num_workers=workers,
                      prefetch_factor=2 if workers else None)


def measure_naive(c: Naive, stream, batch: int, batches: int, warmup: int, sampler) -> Trial:
    """The naive loader measured as measure_candidate measures a config (one measurement): samples/s
    as delivered, duplicates included."""
    m = measure_loader(naive_loader(stream, batch, c.num_workers), batches, warmup, sampler)
    return Trial(c, runs=[m.samples_per_s], metrics=m.metrics())


def delivered(loader) -> tuple[int, int]:
    """(rows one epoch of `loader` delivers, distinct rows among them): a row is known by its input's
    bytes and its label, whichever process built it."""
    seen, total = set(), 0
    try:
        for inputs, labels in loader:
            flat = inputs.reshape(len(inputs), -1).numpy()
            seen.update((hashlib.blake2b(row.tobytes(), digest_size=16).digest(), label)
                        for row, label in zip(flat, labels.tolist()))
            total += len(inputs)
    finally:
        shutdown = getattr(loader, "shutdown", None)  # dlpipe's loader: its workers end here
        if shutdown is not None:
            shutdown()
    return total, len(seen)


def count_epochs(stream, settings: dict, workers: int) -> dict[str, tuple[int, int]]:
    """(delivered, distinct) rows of one epoch of the naive loader and of dlpipe's at as many workers."""
    dealt = Candidate(workers, 2, False, False).settings()
    dlpipe = build_loader(stream, **{**settings, **dealt}, seed=0, cuda=False, role="tune").loader
    return {"naive": delivered(naive_loader(stream, settings["batch_size"], workers)), "dlpipe": delivered(dlpipe)}


def measure_rounds(measure, configs: list[Candidate], rounds: int, order: random.Random, what: str) -> Run:
    """Every config measured once per round, each round in a new shuffled order."""
    run = Run()
    for i in range(rounds):
        todo = list(configs)
        order.shuffle(todo)
        for c in todo:
            t = time.perf_counter()
            trial = measure(c, 1)
            run.add(c, trial, time.perf_counter() - t)
        print(f"{what} round {i + 1}/{rounds} done", file=sys.stderr, flush=True)
    return run


def finalists(run: Run, configs: list[Candidate], picks: dict) -> dict[str, Candidate]:
    """The configs the report compares, chosen on the grid's rounds: the oracle (the grid's best median),
    the best process and thread configs, and the picks (auto, tune, PyTorch, Lightning)."""
    processes = [c for c in configs if c.num_workers and c.worker_method == "process"]
    threads = [c for c in configs if c.num_workers and c.worker_method == "thread"]
    chosen = {"oracle": max(configs, key=run.median), **picks}
    if processes:
        chosen["best_process"] = max(processes, key=run.median)
    if threads:
        chosen["best_thread"] = max(threads, key=run.median)
    return chosen


def tune(measure, start: Candidate, dataset, batch: int, args, budget: int, cfg, options: dict, crosses: bool):
    """`dlpipe tune`'s search from `start`, its evaluate() as tune's evaluator (without MLflow and the
    measurements journal). Returns (the winner, the search, its wall seconds)."""
    # what tune's memory guard is given: the job's plan.batch_bytes (a stream's from its first items)
    bytes_per_batch = stream_batch_bytes(dataset, batch) if is_stream(dataset) else batch_bytes(dataset, batch)
    worker_rss = [0.0]  # the largest per-worker RSS so far, for the memory guard

    def evaluate(c: Candidate) -> Trial:
        why = memory_guard(c, bytes_per_batch, hardware.shm_free_bytes(), hardware.memory_available_bytes(),
                           worker_rss[0])
        if why:
            return Trial(c, skipped=why)
        trial = measure(c, args.repeats)
        worker_rss[0] = max(worker_rss[0], trial.metrics.get("worker_rss_mean_mb", 0.0) * 2**20)
        return trial

    started = time.perf_counter()
    search = Search(evaluate, BenchConfig.min_gain, budget + max(2, budget // 2),
                    tune_persistent=crosses and EPOCHS > 1, tune_pin=False,
                    seed_workers=hardware.recommended_workers(budget),
                    persist=automatic_persistence({"loader": AUTO_RAW}, cfg, dataset), **options)
    best = search.run(start)
    return best, search, time.perf_counter() - started


def report_pipeline(name: str, head: tuple[str, str], run: Run, held: Run, configs: list[Candidate],
                    chosen: dict[str, Candidate], facts: dict) -> tuple[list[str], dict]:
    """The pipeline's section and its figures for the goals and the summary. Every ratio and RSS is
    from the held-out rounds: a config chosen as the best of many noisy grid medians is, on the
    grid's own figures, flattered by the noise that chose it (its max-of-N luck); measured again it is not."""
    labels = [("oracle", "oracle (best of the grid)"), ("auto", "auto (loader=auto)"), ("tune", "tune (dlpipe tune)"),
              ("pytorch", "PyTorch default"), ("lightning", "Lightning's suggestion"),
              ("best_process", "best process config"), ("best_thread", "best thread config"),
              ("naive", "naive (rows delivered, duplicates included)")]
    oracle = chosen["oracle"]
    rss = {c: statistics.median(v) for c, v in held.rss.items()}
    lines = [head[0], "", head[1], "",
             "| config | grid median | held-out median | held-out min-max | / oracle (held-out) | peak RSS MB (tree) |",
             "|---|---|---|---|---|---|"]
    for key, label in labels:
        c = chosen.get(key)
        if c is None:
            if key != "naive":  # a map dataset has no naive row: nothing to say
                lines.append(f"| {label}: none in the grid | - | - | - | - | - |")
            continue
        v = held.rates[c]
        grid_median = f"{run.median(c):.0f}" if c in run.rates else "-"  # the naive loader: held-out rounds only
        lines.append(f"| {label}: {c.label()} | {grid_median} | {held.median(c):.0f} | {min(v):.0f}-{max(v):.0f} "
                     f"| {held.median(c) / held.median(oracle):.3f} | {rss[c]:.0f} |")
    grid_pass = sum(statistics.median(run.seconds[c]) for c in configs)
    grid_cost = grid_pass * facts["repeats"]
    measured = sum(sum(run.seconds[c]) for c in configs)
    lines += ["", *notes(facts, grid_pass, measured)]
    naive = None
    if "naive" in chosen:
        naive = duplicates(chosen["naive"], facts["epochs"], held.median(chosen["naive"]) / held.median(oracle))
        lines.append(naive["line"])
    lines.append("")
    picks = ("auto", "tune", "pytorch", "lightning")
    ratio = {k: held.median(chosen[k]) / held.median(oracle) for k in picks}
    grid_ratio = {k: run.median(chosen[k]) / run.median(oracle) for k in picks}
    best_process, best_thread = chosen.get("best_process"), chosen.get("best_thread")
    thread_rss = {k: rss[chosen[k]] / rss[best_process] for k in ("auto", "tune")
                  if chosen[k].worker_method == "thread" and best_process}
    result = {"name": name, "oracle": oracle.label(), "ratio": ratio, "grid_ratio": grid_ratio,
              "cost": facts["tune_s"] / grid_cost, "thread_rss": thread_rss,
              "best_rss": (rss[best_thread] if best_thread else math.nan,
                           rss[best_process] if best_process else math.nan),
              "picks": {k: chosen[k].label() for k in picks}, "naive": naive}
    return lines, result


def duplicates(naive: Naive, epochs: dict[str, tuple[int, int]], ratio: float) -> dict:
    """What one epoch of the naive loader delivered against the distinct rows, and its speed once
    the duplicates are left out."""
    sent, distinct = epochs["naive"]
    dealt, dealt_distinct = epochs["dlpipe"]
    times = sent / distinct
    line = (f"naive: {naive.label()}: one epoch delivered {sent} rows, {distinct} of them distinct: "
            f"{times:.1f}x the epoch's rows delivered: {times - 1:.1f} duplicates per row. Its held-out samples/s "
            f"({ratio:.3f}x the oracle) counts each duplicate; in distinct rows it is {ratio / times:.3f}x. dlpipe's "
            f"loader at {naive.num_workers} workers on the same stream: {dealt} rows delivered, {dealt_distinct} "
            f"distinct ({dealt / dealt_distinct:.1f}x).")
    return {"line": line, "workers": naive.num_workers, "times": times, "ratio": ratio,
            "distinct_ratio": ratio / times, "dlpipe_times": dealt / dealt_distinct}


def notes(facts: dict, grid_pass: float, measured: float) -> list[str]:
    """How auto decided, what tune tried and what it cost against the grid."""
    search, repeats, tune_s = facts["search"], facts["repeats"], facts["tune_s"]
    cost = tune_s / (grid_pass * repeats)
    trials = "; ".join(f"{t.candidate.label()}: {t.skipped or ' '.join(f'{v:.0f}' for v in t.runs)} samples/s, "
                       f"{t.metrics.get('tree_rss_peak_mb', 0):.0f} MB" for t in search.trials.values())
    return [f"auto decided in {facts['auto_s']:.2f} s: " + "; ".join(f"{k}={v}" for k, v in facts["reasons"].items())
            + ".",
            f"tune: {len(search.trials)} candidates x {repeats} measurements in {tune_s:.1f} s; the grid: "
            f"{grid_pass:.1f} s a pass, {grid_pass * repeats:.1f} s at tune's {repeats} measurements per config "
            f"(tune / grid {cost:.2f}); all rounds of the grid in this run: {measured:.1f} s.",
            f"tune's trials (threshold {search.threshold:.2f}, from the noise of the start's repeats): {trials}."]


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def verdict(r: dict) -> str:
    a, t, cost = r["ratio"]["auto"], r["ratio"]["tune"], r["cost"]
    threads = "; ".join(f"{k} picked threads at {v:.2f}x the best process config's RSS (goal <= "
                        f"{GOALS['thread_rss']}: {met(v <= GOALS['thread_rss'])})" for k, v in r["thread_rss"].items())
    return (f"{r['name']}: auto {a:.3f} (goal >= {GOALS['auto']}: {met(a >= GOALS['auto'])}), tune {t:.3f} "
            f"(goal >= {GOALS['tune']}: {met(t >= GOALS['tune'])}), tune cost {cost:.2f} of the grid (goal <= 0.33: "
            f"{met(cost <= GOALS['cost'])}); " + (threads or "threads picked by neither auto nor tune (no RSS goal)"))


def summary(results: list[dict]) -> list[str]:
    lines = ["Ratios to the oracle from the held-out rounds (the grid's own rounds in brackets).", "",
             "| pipeline | oracle | auto / oracle | tune / oracle | PyTorch default / oracle | Lightning / oracle "
             "| tune time / grid | peak RSS MB, best thread / best process config |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        q, g = r["ratio"], r["grid_ratio"]
        cells = " | ".join(f"{q[k]:.3f} ({g[k]:.3f})" for k in ("auto", "tune", "pytorch", "lightning"))
        thread_rss, process_rss = ("-" if math.isnan(v) else f"{v:.0f}" for v in r["best_rss"])  # a stream: no threads
        lines.append(f"| {r['name']} | {r['oracle']} | {cells} | {r['cost']:.2f} | {thread_rss} / {process_rss} |")
    naive = [r for r in results if r["naive"]]
    if naive:
        lines += ["", "The naive loader on the unsharded streams (held-out rounds):", "",
                  "| pipeline | workers | rows delivered / distinct, one epoch | duplicates per row "
                  "| samples/s as delivered / oracle | distinct rows/s / oracle | dlpipe's delivered / distinct |",
                  "|---|---|---|---|---|---|---|"]
        for r in naive:
            n = r["naive"]
            lines.append(f"| {r['name']} | {n['workers']} | {n['times']:.1f}x | {n['times'] - 1:.1f} | "
                         f"{n['ratio']:.3f} | {n['distinct_ratio']:.3f} | {n['dlpipe_times']:.1f}x |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = hardware.cpu_budget().budget
    sampler = ResourceSampler(args.sample_interval, budget, thread_cpu=fetch_cpu_seconds).start()
    report = ["# loader backends", "",
              f"{platform.machine()}, {os.cpu_count()} CPUs, dlpipe CPU budget {budget}, torch {torch.__version__}, "
              f"Python {platform.python_version()}; {args.rounds} rounds over every config in a shuffled order, "
              f"then {args.held_out} held-out rounds over the configs compared, medians; tune {args.repeats} "
              f"measurements per candidate; auto decided for {EPOCHS} epochs. Configs "
              "fetch item by item unless they say fetch=batch.", ""]
    results = []
    try:
        for name in args.chosen:
            lines, result = run_pipeline(name, args, budget, sampler)
            report += lines
            results.append(result)
    finally:
        sampler.stop()
    report += ["### summary", "", *summary(results), "", "Goals:", "", *[f"- {verdict(r)}" for r in results]]
    return finish("\n".join(report) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
