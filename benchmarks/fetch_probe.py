"""What the fetch probe measures on real data, against the 50 us per item where workers start to pay.

    python -m benchmarks.fetch_probe --rounds 5 [--out fetch_probe.md]

`dlpipe.loader.probe.item_fetch_seconds` times fetching and collating two batches in the main process;
under `CHEAP_ITEM_S` (50 us) per item the automatic workers go (`dlpipe.loader.fitting.fit_loader_to_data`).
tests/test_probe.py once asserted on real data that in-memory rows come in under it and that the probe
of slow items stops within 0.5 s; those assertions now run on a fake clock, and this script measures:
- in-memory rows: `TabularDataset` (rows of one tensor), where no worker can pay;
- JPEG decode: `SyntheticJPEGDataset` (decode + random resized crop + flip per item), where workers pay;
- slow items: items that sleep `--slow-ms` each, to see the probe stop after about 10 ms.
Each round probes all three (batch `--batch-size`), in an order that rotates between rounds; reported:
medians and min-max of the probe's answer (us per item) and of its own wall time (ms), and how far each
answer lies from the threshold. Goals (the old test's): rows under the threshold, JPEG items above, the
slow probe under 500 ms; whether they were met is printed, never the exit status.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/fetch_probe.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from benchmarks.common import SlowItems, finish, spread  # noqa: E402
from benchmarks.options import arguments, checked  # noqa: E402
from dlpipe.data.tabular import TabularDataset  # noqa: E402
from dlpipe.data.vision import SyntheticJPEGDataset  # noqa: E402
from dlpipe.loader.policy import CHEAP_ITEM_S  # noqa: E402
from dlpipe.loader.probe import item_fetch_seconds  # noqa: E402

SLOW_PROBE_GOAL_S = 0.5  # what the old test allowed a probe of 5 ms items


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 5, "measured rounds, after one warm-up")
    p.add_argument("--batch-size", type=int, default=64, help="the probe's batch size (default 64)")
    p.add_argument("--memory-size", type=int, default=50000, help="rows of the in-memory dataset (default 50000)")
    p.add_argument("--decode-size", type=int, default=256, help="images of the JPEG dataset (default 256)")
    p.add_argument("--image-size", type=int, default=64, help="side of the stored JPEG images (default 64)")
    p.add_argument("--slow-ms", type=float, default=5.0, help="sleep per item of the slow dataset (default 5)")
    return checked(p, argv, counts=("batch_size", "memory_size", "decode_size", "image_size"), positive=("slow_ms",))


def datasets(args) -> dict[str, Dataset]:
    return {
        "in-memory rows": TabularDataset(size=args.memory_size, num_features=32),
        "JPEG decode": SyntheticJPEGDataset(size=args.decode_size, image_size=args.image_size,
                                            crop_size=max(1, args.image_size * 7 // 8)),
        "slow items": SlowItems(1000, args.slow_ms / 1e3),
    }


def probe(dataset, batch_size: int) -> tuple[float, float]:
    """(the probe's answer in seconds per item, the probe's own wall seconds)."""
    started = time.perf_counter()
    per_item = item_fetch_seconds(dataset, batch_size)
    return per_item, time.perf_counter() - started


def measure(args, data: dict[str, Dataset]) -> dict[str, list[tuple[float, float]]]:
    names = list(data)
    for name in names:  # warm-up: first calls of collate and decode
        probe(data[name], args.batch_size)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]  # rotating: drift falls on all of them
        for name in order:
            results[name].append(probe(data[name], args.batch_size))
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(
            f"{name} {results[name][-1][0] * 1e6:.1f} us" for name in names), file=sys.stderr, flush=True)
    return results


def result_lines(results: dict[str, list[tuple[float, float]]]) -> list[str]:
    us = {name: statistics.median(r[0] for r in rows) * 1e6 for name, rows in results.items()}
    slow_s = statistics.median(r[1] for r in results["slow items"])
    threshold = CHEAP_ITEM_S * 1e6
    rows_met = us["in-memory rows"] < threshold
    jpeg_met = us["JPEG decode"] > threshold
    return [
        f"- in-memory rows: {us['in-memory rows']:.1f} us per item (goal < {threshold:.0f} us: "
        f"{'met' if rows_met else 'not met'}, {threshold / us['in-memory rows']:.1f}x under)",
        f"- JPEG decode: {us['JPEG decode']:.1f} us per item (goal > {threshold:.0f} us: "
        f"{'met' if jpeg_met else 'not met'}, {us['JPEG decode'] / threshold:.1f}x over)",
        f"- slow items: the probe took {slow_s * 1e3:.1f} ms (goal < {SLOW_PROBE_GOAL_S * 1e3:.0f} ms: "
        f"{'met' if slow_s < SLOW_PROBE_GOAL_S else 'not met'})",
    ]


def report(args, results: dict[str, list[tuple[float, float]]]) -> str:
    lines = [
        "# fetch probe",
        "",
        f"item_fetch_seconds(dataset, {args.batch_size}) (two batches, stops after 10 ms); in-memory rows: "
        f"{args.memory_size} x 32 features; JPEG decode: {args.decode_size} images of {args.image_size} px; "
        f"slow items: {args.slow_ms:g} ms sleep each. {args.rounds} rounds after 1 warm-up, rotating order; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, Python {platform.python_version()}.",
        "",
        f"| data | us per item median | min-max | / {CHEAP_ITEM_S * 1e6:.0f} us | probe ms median | min-max | "
        "automatic workers |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        per_item = statistics.median(r[0] for r in rows)
        workers = "go (in memory)" if per_item < CHEAP_ITEM_S else "stay"
        lines.append(f"| {name} | " + " | ".join([
            *spread([r[0] * 1e6 for r in rows], "{:.1f}"), f"{per_item / CHEAP_ITEM_S:.2f}",
            *spread([r[1] * 1e3 for r in rows], "{:.1f}"), workers]) + " |")
    return "\n".join([*lines, "", *result_lines(results)]) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    return finish(report(args, measure(args, datasets(args))), args.out)


if __name__ == "__main__":
    sys.exit(main())
