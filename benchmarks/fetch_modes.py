"""loader.fetch: item by item (A) against one gather per batch (B), through dlpipe's own build_loader.

    python -m benchmarks.fetch_modes --rounds 5 [--workers 0,2] [--out fetch_modes.md]

Two in-memory pipelines where `loader.fetch=auto` chooses batch: tabular rows (`TabularDataset`,
32 float features) and fixed-length tokens (`TokenSequenceDataset`). For each pipeline and worker
count, A and B run interleaved (the order alternates between rounds), each a full pass over the data
after one untimed pass; reported: samples/s medians and min-max, and B/A. Goal: B/A >= 2 on tabular
rows in the main process (measured by hand before this was built: 521k vs 195k samples/s, 2.7x);
whether it was met is printed, never the exit status.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/fetch_modes.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import finish, spread  # noqa: E402
from benchmarks.options import arguments, checked, worker_counts  # noqa: E402
from dlpipe.data.sequences import TokenSequenceDataset  # noqa: E402
from dlpipe.data.tabular import TabularDataset  # noqa: E402
from dlpipe.loader.build import build_loader  # noqa: E402

GOAL = 2.0


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 5, "measured rounds of A and B, after one warm-up")
    p.add_argument("--rows", type=int, default=50000, help="items of each dataset (default 50000)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--workers", default="0,2", help="worker counts, comma-separated (default 0,2)")
    args = checked(p, argv, counts=("rows", "batch_size"))
    args.worker_counts = worker_counts(p, args.workers, 0, "0,2")
    return args


def samples_per_s(dataset, fetch: str, workers: int, batch_size: int) -> float:
    """One timed pass over `dataset` after an untimed one (worker start-up, first calls)."""
    plan = build_loader(dataset, batch_size=batch_size, num_workers=workers, pin_memory=False,
                        prefetch_factor=2 if workers else None, persistent_workers=workers > 0, shuffle=True,
                        drop_last=False, timeout=0.0, multiprocessing_context=None, seed=0, cuda=False, fetch=fetch)
    assert plan.fetch == fetch, f"{type(dataset).__name__} did not fetch by {fetch}"
    for _ in plan.loader:
        pass
    started, samples = time.perf_counter(), 0
    for batch in plan.loader:
        samples += len(batch[0])
    seconds = time.perf_counter() - started
    plan.loader.shutdown()
    return samples / seconds


def measure(args) -> dict[tuple[str, int], dict[str, list[float]]]:
    data = {"tabular rows": TabularDataset(size=args.rows, num_features=32),
            "tokens": TokenSequenceDataset(size=args.rows, seq_len=64, vocab_size=128)}
    results = {(name, w): {"item": [], "batch": []} for name in data for w in args.worker_counts}
    for i in range(args.rounds):
        for (name, workers), rates in results.items():
            for fetch in (("item", "batch") if i % 2 == 0 else ("batch", "item")):
                rates[fetch].append(samples_per_s(data[name], fetch, workers, args.batch_size))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return results


def report(args, results) -> str:
    lines = ["# fetch modes", "",
             f"build_loader over {args.rows} items, batch {args.batch_size}, shuffled, one untimed pass then one "
             f"timed; A = loader.fetch=item, B = loader.fetch=batch; {args.rounds} rounds, order alternating; "
             f"torch {torch.__version__}, {os.cpu_count()} CPUs, Python {platform.python_version()}.", "",
             "| data | workers | A samples/s median | min-max | B samples/s median | min-max | B/A |",
             "|---|---|---|---|---|---|---|"]
    for (name, workers), rates in results.items():
        ratio = statistics.median(rates["batch"]) / statistics.median(rates["item"])
        lines.append(f"| {name} | {workers} | " + " | ".join([*spread(rates["item"], "{:.0f}"),
                                                            *spread(rates["batch"], "{:.0f}"), f"{ratio:.2f}"]) + " |")
    main = results.get(("tabular rows", 0))
    if main:
        ratio = statistics.median(main["batch"]) / statistics.median(main["item"])
        lines += ["", f"- tabular rows, main process: B/A {ratio:.2f} (goal >= {GOAL:g}: "
                      f"{'met' if ratio >= GOAL else 'not met'})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    return finish(report(args, measure(args)), args.out)


if __name__ == "__main__":
    sys.exit(main())
