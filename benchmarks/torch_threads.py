"""trainer.torch_threads on compute-bound CPU runs: torch's default intra-op threads against dlpipe's rule.

    python -m benchmarks.torch_threads [--rounds N] [--cases 0,1,2,3] [--epochs N] [--quick] [--out torch_threads.md]

The rule (dlpipe/loader/torch_threads.py) gives the training process the CPU budget less the loader's
workers. On an accelerator that leaves the host's step its CPU (benchmarks/sim_device.py --explain);
here the model runs on the CPU, so the rule must not slow a compute-bound run down in a way that
matters. Each case is the real `dlpipe` command (tracking off, no checkpoints) run twice per round,
A/B in a shuffled order: A with `trainer.torch_threads=` torch's default in this process, B with the
automatic value (the run's log says which). The figure is the run's samples/s over its epochs after the
first (from the summary table), medians over rounds; B/A is the median of per-round ratios.
Where the rule gives torch's default (no workers and the budget equals the CPUs) the pair is an A/A
run: its spread is the noise of the machine.
"""

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/torch_threads.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import finish  # noqa: E402
from benchmarks.options import arguments, checked  # noqa: E402
from dlpipe.machine import hardware  # noqa: E402

# Each case's dataset.size gives epochs of seconds at least with either setting on 2 CPUs (the tabular
# MLP runs at ~10k samples/s: a 1024-row epoch is a tenth of a second, within the noise of a busy box).
CASES = {
    "vision CNN, 0 workers": ["+recipe=vision", "loader.num_workers=0", "dataset.size=1024"],
    "vision CNN, 2 worker processes": ["+recipe=vision", "loader.num_workers=2", "loader.worker_method=process",
                                       "dataset.size=1024"],
    "tabular MLP, 0 workers": ["+recipe=tabular", "dataset.size=16384"],
    "tabular MLP, 2 worker processes": ["+recipe=tabular", "loader.num_workers=2", "loader.worker_method=process",
                                        "dataset.size=16384"],
}
GOAL = 0.95  # the rule may not cost a compute-bound CPU run more than this (B/A, samples/s)
QUIET = ["tracking=none", "checkpoint.enabled=false", "trainer.progress=false"]
DECIDED = re.compile(r"trainer\.torch_threads = (\d+) \((.*)\)")


def samples_per_s(stdout: str) -> float:
    """Mean samples/s of the summary table's epochs after the first."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("epoch ") and "samples/s" in line)
    columns = re.split(r"\s{2,}", lines[at].strip())
    rows = []
    for line in lines[at + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(columns) or not cells[0].isdigit():
            break
        rows.append(float(cells[columns.index("samples/s")]))
    return statistics.mean(rows[1:] or rows)


def run(args_: list[str], workdir: Path) -> tuple[float, str, float]:
    """(samples/s, the torch threads it ran with and why, wall seconds) of one dlpipe run."""
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dlpipe", *args_, *QUIET, f"hydra.run.dir={workdir}"], cwd=workdir.parent,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800,
                       env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    wall = time.perf_counter() - started
    if r.returncode:
        raise RuntimeError(f"dlpipe {' '.join(args_)} exited {r.returncode}: {r.stderr[-2000:]}")
    said = DECIDED.findall(r.stderr + r.stdout)
    return samples_per_s(r.stdout), f"{said[-1][0]} ({said[-1][1]})" if said else "?", wall


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 3, "A/B rounds, each case's two runs in a shuffled order")
    p.add_argument("--epochs", type=int, default=3, help="trainer.epochs, the first left out (default 3)")
    p.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                   help="case numbers, comma-separated (default all: " + "; ".join(
                       f"{i} {name}" for i, name in enumerate(CASES)) + ")")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs, its figures mean nothing")
    args = checked(p, argv, counts=("epochs",))
    if args.epochs < 2:
        p.error(f"--epochs={args.epochs}: must be >= 2 (the first is left out)")
    names = list(CASES)
    try:
        args.chosen = [names[int(i)] for i in args.cases.split(",")]
    except (ValueError, IndexError):
        p.error(f"--cases={args.cases}: numbers from 0 to {len(names) - 1}, comma-separated")
    args.sizes = ["dataset.size=128"] if args.quick else []  # after the case's own: it wins
    if args.quick:
        args.epochs, args.rounds = 2, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    default = torch.get_num_threads()
    arms = {"torch's default": [f"trainer.torch_threads={default}"], "auto rule": []}
    sizes = [*args.sizes, f"trainer.epochs={args.epochs}"]
    figures: dict[tuple[str, str], list[tuple[float, str, float]]] = {}
    order = random.Random(0)
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="torch_threads_") as tmp:
        for i in range(args.rounds):
            todo = [(case, arm) for case in args.chosen for arm in arms]
            order.shuffle(todo)
            for n, (case, arm) in enumerate(todo):
                figures.setdefault((case, arm), []).append(
                    run([*CASES[case], *sizes, *arms[arm]], Path(tmp) / f"r{i}-{n}"))
            load.append(os.getloadavg())
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    budget = hardware.cpu_budget().budget
    lines = ["# torch's intra-op threads on compute-bound CPU runs", "",
             f"{os.cpu_count()} CPUs, dlpipe CPU budget {budget}, torch {torch.__version__} (default intra-op threads "
             f"{default}); {args.epochs} epochs a run (the first left out), {args.rounds} "
             f"rounds, medians; load average (1 min) {' -> '.join(f'{a:.1f}' for a, _, _ in load)} over the rounds.",
             "", "| case | torch's default: threads, samples/s | auto rule: threads (reason) | samples/s | B/A "
             "(min-max) |", "|---|---|---|---|---|"]
    goals = [""]
    for case in args.chosen:
        a, b = figures[(case, "torch's default")], figures[(case, "auto rule")]
        ratios = [y[0] / x[0] for x, y in zip(a, b)]
        ratio = statistics.median(ratios)
        lines.append(f"| {case} | {default}, {statistics.median(x[0] for x in a):.0f} | {b[-1][1]} | "
                     f"{statistics.median(y[0] for y in b):.0f} | {ratio:.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
        goals.append(f"- {case}: auto rule / torch's default {ratio:.3f} (goal >= {GOAL}: "
                     f"{'met' if ratio >= GOAL else 'not met'})")
    return finish("\n".join(lines + goals) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
