"""The automatic loader config and `dlpipe tune`'s result against the best of an exhaustive grid.

    python -m benchmarks.loader_tuning --rounds 5 [--out loader_tuning.md]

Two pipelines, chosen because they want opposite settings:
- decode: `SyntheticJPEGDataset` (JPEG decode + random resized crop + flip per item), CPU-heavy;
- in-memory: `TabularDataset` (feature vectors in one tensor), where workers only add IPC.

For each pipeline:
1. the tuner (`dlpipe.loader.search.Search` with `measure_candidate`, exactly what `dlpipe tune` runs,
   without MLflow) searches from the automatic config; its wall time is the tuner's cost;
2. the exhaustive grid: num_workers over the ladder up to the CPU budget + 2, x prefetch_factor
   {1, 2, 4} x persistent_workers {false, true}, plus num_workers=0, plus the automatic and the
   tuned config if they are not in it. Every config is measured once per round, `--rounds`
   rounds, in a new shuffled order each round (interleaved: drift on a shared machine falls on all
   of them); a config's figure is its median samples/s;
3. ratios from those medians: automatic / best of grid (goal >= 0.9), tuned / best of grid (goal
   >= 0.97), and for reference PyTorch's default (num_workers=0) and Lightning's suggested worker
   count (usable CPUs // devices - 1) / best of grid; and the tuner's cost against the grid's at
   the same measurements per config as the tuner (`--repeats`), from the grid's measured time
   (goal <= 1/3).
Goals are printed as met or not; they never change the exit status.
"""

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/loader_tuning.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.options import arguments, checked  # noqa: E402
from dlpipe.config import decisions  # noqa: E402
from dlpipe.loader import decisions as loader_decisions
from dlpipe.loader.probe import item_fetch_seconds  # noqa: E402
from dlpipe.loader.search import LADDER, Candidate, Search, measure_candidate  # noqa: E402
from dlpipe.machine import hardware  # noqa: E402

GOALS = {"auto": 0.9, "tuned": 0.97, "cost": 1 / 3}
EPOCHS = 3  # what the automatic persistent_workers decision is told the run will train for


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 5, "measured rounds of the whole grid")
    p.add_argument("--repeats", type=int, default=3, help="the tuner's measurements per candidate (default 3)")
    p.add_argument("--batches", type=int, default=50,
                   help="batches per measurement, after warm-up (default 50, as dlpipe tune)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up batches per measurement (default 4)")
    p.add_argument("--decode-size", type=int, default=1024, help="images in the decode pipeline (default 1024)")
    p.add_argument("--image-size", type=int, default=160, help="stored JPEG side in pixels (default 160)")
    p.add_argument("--memory-size", type=int, default=32768, help="rows in the in-memory pipeline (default 32768)")
    p.add_argument("--pipelines", default="decode,in-memory", help="which pipelines to run (default both)")
    return checked(p, argv, counts=("repeats", "batches", "warmup", "decode_size", "image_size", "memory_size"))


def pipelines(args):
    from dlpipe.data.tabular import TabularDataset
    from dlpipe.data.vision import SyntheticJPEGDataset

    wanted = set(args.pipelines.split(","))
    if "decode" in wanted:
        crop = max(args.image_size * 4 // 5, 8)
        yield "decode", SyntheticJPEGDataset(size=args.decode_size, image_size=args.image_size, crop_size=crop), 32
    if "in-memory" in wanted:
        yield "in-memory", TabularDataset(size=args.memory_size), 256


def automatic(dataset, batch: int) -> Candidate:
    """What loader=auto resolves to here: the resolvers' decisions, then the workers fitted to the
    data (`dlpipe.loader.fitting.fit_loader_to_data`: none when items are cheap to fetch in-process)."""
    workers = loader_decisions.workers_for_data(decisions.workers().value, item_fetch_seconds(dataset, batch)).value
    return Candidate(workers, loader_decisions.prefetch(workers).value,
                     loader_decisions.persistent(workers, EPOCHS, len(dataset), batch).value,
                     decisions.cuda_available().value)


def lightning_suggestion(pin: bool) -> Candidate:
    """The worker count Lightning's warning suggests: usable CPUs // devices - 1 (one device here)."""
    workers = max(len(os.sched_getaffinity(0)) - 1, 0)
    return Candidate(workers, 2 if workers else None, False, pin)


def grid(budget: int, pin: bool) -> list[Candidate]:
    out = [Candidate(0, None, False, pin)]
    for n in (n for n in LADDER if 1 <= n <= budget + 2):
        out += [Candidate(n, p, persistent, pin) for p in (1, 2, 4) for persistent in (False, True)]
    return out


def run_pipeline(name: str, dataset, batch: int, args, budget: int) -> tuple[list[str], dict[str, float]]:
    settings = {"batch_size": batch, "shuffle": True, "drop_last": False, "timeout": 0.0,
                "multiprocessing_context": None}

    def measure(c: Candidate, repeats: int):
        return measure_candidate(c, dataset, settings, args.batches, args.warmup, repeats, seed=0, cuda=False)

    auto = automatic(dataset, batch)
    started = time.perf_counter()
    search = Search(lambda c: measure(c, args.repeats), min_gain=0.03, max_workers=budget + max(2, budget // 2),
                    tune_persistent=args.warmup + args.batches > len(dataset) // batch, tune_pin=False,
                    seed_workers=hardware.recommended_workers(budget))
    tuned = search.run(auto)
    tuner_s = time.perf_counter() - started

    configs = grid(budget, auto.pin_memory)
    for extra in (auto, tuned, lightning_suggestion(auto.pin_memory)):
        if extra not in configs:
            configs.append(extra)
    figures: dict[Candidate, list[float]] = {c: [] for c in configs}
    seconds: dict[Candidate, list[float]] = {c: [] for c in configs}
    order = random.Random(0)
    for _ in range(args.rounds):
        order.shuffle(configs)
        for c in configs:
            t = time.perf_counter()
            figures[c].append(measure(c, 1).runs[0])
            seconds[c].append(time.perf_counter() - t)
    median = {c: statistics.median(v) for c, v in figures.items()}
    grid_only = [c for c in configs if c in set(grid(budget, auto.pin_memory))]
    best = max(grid_only, key=median.get)
    grid_cost = sum(statistics.median(seconds[c]) for c in grid_only) * args.repeats
    result = {"auto": median[auto] / median[best], "tuned": median[tuned] / median[best], "cost": tuner_s / grid_cost}
    lines = [
        f"### {name}: {type(dataset).__name__}, {len(dataset)} items, batch {batch}",
        "",
        "| config | samples/s median | min-max | / best of grid |",
        "|---|---|---|---|",
    ]
    pytorch_default = Candidate(0, None, False, False)
    lightning = lightning_suggestion(auto.pin_memory)
    for label, c in (("best of grid", best), ("automatic (loader=auto)", auto), ("tuned (dlpipe tune)", tuned),
                     ("PyTorch default", pytorch_default), ("Lightning's suggestion", lightning)):
        v = figures[c]
        lines.append(f"| {label}: {c.label()} | {median[c]:.1f} | {min(v):.1f}-{max(v):.1f} | "
                     f"{median[c] / median[best]:.3f} |")
    lines += [
        "",
        f"Tuner: {len(search.trials)} candidates x {args.repeats} measurements in {tuner_s:.1f} s; the grid of "
        f"{len(grid_only)} configs at the same {args.repeats} measurements each: {grid_cost:.1f} s "
        f"(cost ratio {result['cost']:.2f}).",
        "",
    ]
    return lines, result


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = hardware.cpu_budget().budget
    report = [
        "## Loader: automatic and tuned config against the best of an exhaustive grid",
        "",
        f"Machine: {platform.machine()}, CPU budget {budget}, Python {platform.python_version()}; "
        f"{args.rounds} interleaved rounds, {args.batches} batches per measurement after {args.warmup} warm-up.",
        "",
    ]
    verdicts = []
    for name, dataset, batch in pipelines(args):
        lines, result = run_pipeline(name, dataset, batch, args, budget)
        report += lines
        verdicts.append(
            f"{name}: automatic {result['auto']:.3f} "
            f"(goal >= {GOALS['auto']}: {'met' if result['auto'] >= GOALS['auto'] else 'not met'}), "
            f"tuned {result['tuned']:.3f} "
            f"(goal >= {GOALS['tuned']}: {'met' if result['tuned'] >= GOALS['tuned'] else 'not met'}), "
            f"tuner cost {result['cost']:.2f} of the grid "
            f"(goal <= 0.33: {'met' if result['cost'] <= GOALS['cost'] else 'not met'})"
        )
    report += ["Goals:", ""] + [f"- {v}" for v in verdicts]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
