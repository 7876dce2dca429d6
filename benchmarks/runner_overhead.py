"""What a training loop framework costs: a plain PyTorch loop (A), dlpipe's runner with tracking
and telemetry on (B), and Lightning's Trainer with logging and checkpointing off (C).

    pip install lightning                     # only for this benchmark; dlpipe does not depend on it
    python -m benchmarks.runner_overhead --rounds 5 [--out runner.md]

The same model (same seed) trains on the same batches for the same number of optimizer steps,
read from one DataLoader over tensors in memory (num_workers=0), on the CPU:
- A: `for x, y in loader: loss = cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()`,
  with accumulation as a hand-written loop does it (loss / k, step every k micro-batches);
- B: `dlpipe.training.runner.Trainer` with an MLflow run (SQLite in a temporary folder) as its metrics sink
  and a running `ResourceSampler`, default log_every (50), no progress bar; timed: building the
  trainer, starting and stopping the sampler and fit() (which writes the metrics at the epoch end).
  The run is kept by a tracking process, as a `dlpipe` job keeps it (`--tracking process`: the loop
  only hands rows to a pipe), or in this process (`--tracking inline`: the loop's thread writes
  SQLite itself, as before 2026-12-06). Creating and ending the MLflow run (and starting the tracking
  process) are per-run constants, reported on their own;
- C: `lightning.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
  enable_model_summary=False)` with a minimal LightningModule; `fit()` is timed whole.
Two models: a small MLP (about 1 ms a step here) and a small CNN; each with accumulation 1 and 4.
One warm-up run of each, then `--rounds` rounds, A, B and C in a rotating order. Reported: steps/s
medians and min-max, and B/A and C/A as medians of per-round ratios. The goal is B/A >= 0.97 on
both models. Without Lightning installed, C is reported as not installed.
"""

import argparse
import functools
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/runner_overhead.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.options import arguments, checked  # noqa: E402
from dlpipe.models.cnn import SmallCNN  # noqa: E402
from dlpipe.models.mlp import MLP  # noqa: E402
from dlpipe.schema import TrainerConfig  # noqa: E402
from dlpipe.telemetry.sampler import ResourceSampler  # noqa: E402
from dlpipe.tracking.run import MlflowRun  # noqa: E402
from dlpipe.tracking.sidecar_run import SidecarRun  # noqa: E402
from dlpipe.training.objective import Objective  # noqa: E402
from dlpipe.training.runner import Trainer  # noqa: E402

GOAL = 0.97
LOSSES = {"dlpipe": "dlpipe's padding-safe cross-entropy", "torch": "torch's mean cross-entropy, as A's"}


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 5, "measured rounds after one warm-up")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per run (default 1000)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per micro-batch (default 64)")
    p.add_argument("--models", default="mlp,cnn", help="which models (default mlp,cnn)")
    p.add_argument("--accumulate", default="1,4", help="accumulation settings (default 1,4)")
    p.add_argument("--tracking", choices=("process", "inline"), default="process",
                   help="where B's MLflow run is kept: a tracking process, as a dlpipe job (default), or this one")
    p.add_argument("--loss", choices=("dlpipe", "torch"), default="dlpipe",
                   help="B's loss: dlpipe's default cross-entropy (padding-safe: a mean over the targets that "
                        "count, 0 for a batch of padding only; default) or A's own, torch's mean cross-entropy "
                        "(loss._target_=torch.nn.CrossEntropyLoss): the runner alone")
    return checked(p, argv, counts=("steps", "batch_size"))


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(in_features=32, num_classes=4, hidden=256, depth=2)
    return SmallCNN(num_classes=4, in_channels=3, width=8)


def make_loader(name: str, batches: int, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    shape = (32,) if name == "mlp" else (3, 32, 32)
    x = torch.randn(batches * batch_size, *shape, generator=g)
    y = torch.randint(0, 4, (batches * batch_size,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def run_plain(model_name: str, loader: DataLoader, steps: int, accumulate: int) -> float:
    model = make_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    done = 0
    for i, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y) / accumulate
        loss.backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
    return done / (time.perf_counter() - start)


RUN_CONSTANTS: list[float] = []  # seconds to create and end the MLflow run, per dlpipe run


def open_run(uri: str, name: str, tracking: str):
    """B's MLflow run: kept by a tracking process (as a dlpipe job keeps it) or in this process."""
    args = dict(uri=uri, experiment="runner-overhead", run_name=name, tags={"dlpipe.role": "benchmark"})
    if tracking == "inline":
        return MlflowRun(**args)
    return SidecarRun.start(uri, 10.0, 0).open(**args)


def run_dlpipe(model_name: str, loader: DataLoader, steps: int, accumulate: int, uri: str,
               tracking: str = "process", loss: str = "dlpipe") -> float:
    """steps/s of Trainer construction, sampler start/stop and fit(), which writes the metrics at
    each epoch end; creating and ending the MLflow run are per-run constants, timed on their own."""
    model = make_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = TrainerConfig(epochs=1, max_steps=steps, accumulate=accumulate, device="cpu", progress=False)
    opened = time.perf_counter()
    run = open_run(uri, f"dlpipe {model_name}", tracking)
    constant = time.perf_counter() - opened
    with run:
        start = time.perf_counter()
        sampler = ResourceSampler(0.5)
        objective = Objective(torch.nn.CrossEntropyLoss()) if loss == "torch" else None
        trainer = Trainer(model, opt, settings, metrics=run, sampler=sampler, objective=objective)
        sampler.start()
        try:
            trainer.fit(loader, None)
        finally:
            sampler.stop()
        elapsed = time.perf_counter() - start
        ending = time.perf_counter()
    RUN_CONSTANTS.append(constant + time.perf_counter() - ending)
    return trainer.step / elapsed


def run_lightning(model_name: str, loader: DataLoader, steps: int, accumulate: int) -> float | None:
    try:
        import lightning as L
    except ImportError:
        return None

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model(model_name)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Module()
    start = time.perf_counter()
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=loader)
    return trainer.global_step / (time.perf_counter() - start)


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rows = []
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="dlpipe-bench-") as tmp:
        uri = f"sqlite:///{Path(tmp) / 'm.db'}"
        MlflowRun(uri, "runner-overhead", "store warm-up", {}).end("FINISHED")  # creates the store: seconds
        for model_name in args.models.split(","):
            for accumulate in (int(a) for a in args.accumulate.split(",")):
                loader = make_loader(model_name, args.steps * accumulate, args.batch_size)
                runners = {
                    "A": functools.partial(run_plain, model_name, loader, args.steps, accumulate),
                    "B": functools.partial(run_dlpipe, model_name, loader, args.steps, accumulate, uri,
                                           args.tracking, args.loss),
                    "C": functools.partial(run_lightning, model_name, loader, args.steps, accumulate),
                }
                for run in runners.values():
                    run()  # warm-up
                results = {k: [] for k in runners}
                order = list(runners)
                for i in range(args.rounds):
                    for key in order[i % 3:] + order[: i % 3]:
                        results[key].append(runners[key]())
                    print(f"{model_name} accumulate {accumulate} round {i + 1}: "
                          + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items() if v[-1] is not None),
                          file=sys.stderr, flush=True)
                a = results["A"]
                b_ratio = [b / x for b, x in zip(results["B"], a)]
                lightning = None not in results["C"]
                c_ratio = [c / x for c, x in zip(results["C"], a)] if lightning else []
                rows.append(f"| {model_name} | {accumulate} | {spread(a, '{:.1f}')} | "
                            f"{spread(results['B'], '{:.1f}')} | "
                            f"{spread(b_ratio, '{:.3f}')} | "
                            + (f"{spread(results['C'], '{:.1f}')} | {spread(c_ratio, '{:.3f}')} |" if lightning
                               else "not installed | - |"))
                met = statistics.median(b_ratio) >= GOAL
                verdicts.append(f"{model_name}, accumulate {accumulate}: B/A {statistics.median(b_ratio):.3f} "
                                f"(goal >= {GOAL}: {'met' if met else 'not met'})")
    lines = [
        "# runner overhead",
        "",
        f"{args.steps} optimizer steps per run, micro-batch {args.batch_size}, {args.rounds} rounds after one warm-up, "
        f"A, B and C in a rotating order; B's MLflow run kept "
        f"{'by a tracking process' if args.tracking == 'process' else 'in the loop process'}; "
        f"B's loss {LOSSES[args.loss]}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}.",
        "",
        "| model | accumulate | A plain loop steps/s | B dlpipe steps/s | B/A | C Lightning steps/s | C/A |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *[f"- {v}" for v in verdicts],
        "",
        "Per dlpipe run, not per step and outside the timed span: creating and ending the MLflow run (SQLite)"
        f"{', and starting its tracking process,' if args.tracking == 'process' else ''} took "
        f"{statistics.median(RUN_CONSTANTS) * 1000:.0f} ms (median of {len(RUN_CONSTANTS)}).",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0  # a number never fails the benchmark


if __name__ == "__main__":
    sys.exit(main())
