"""Case study on a GPU machine: PyTorch's default DataLoader settings against dlpipe's automatic ones.

    python -m benchmarks.gpu_loader_case_study --rounds 2 --set dataset.size=20000 --set trainer.epochs=2 --out case.md

It aims to reproduce the published case study behind dlpipe: on a CPU-heavy image pipeline, moving
from PyTorch's defaults to settings derived from the machine raised GPU utilisation from 65% to
89% and cut an epoch from 53 to 37 minutes (1.43x the samples/s).

Each round trains the `vision` recipe (real JPEG decode + augmentation per item) twice, once with
`loader=pytorch` (num_workers=0, no pinning, no prefetch, no persistent workers) and once with
`loader=auto`, through the real CLI in a subprocess:

    python -m dlpipe +recipe=vision loader=<pytorch|auto> trainer.progress=false \
        tracking.uri=sqlite:///<workdir>/m.db tracking.experiment=case-study [--set overrides]

The order alternates between rounds (pytorch-auto, then auto-pytorch), so drift on the machine
falls on both settings. The runs are then read back from the MLflow store. Per run, each metric is
the mean over its epochs (the first epoch includes starting workers, a real cost of each
setting); per setting the table gives the median over rounds, and the ratio auto/pytorch of
samples/s is the median of the per-round ratios. No warm-up round: every run is a fresh process,
and the metrics are measured inside the training loop, after imports, dataset generation and
store creation. GPU utilisation comes from NVML ("n/a" where it was not measured).

Without a CUDA GPU it says so and exits 0; --allow-cpu runs it on the CPU anyway (to test the
script, not to measure the case study). A failed training run exits 1 with the end of its log.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/gpu_loader_case_study.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.options import arguments, checked  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("pytorch", "auto")
EXPERIMENT = "case-study"
METRICS = ("epoch_time_s", "samples_per_s", "data_wait_frac", "gpu_util")
LOADER_PARAMS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")
PUBLISHED = "Published case study: GPU utilisation 65% -> 89%, epoch 53 -> 37 min (1.43x samples/s)"


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 2, "rounds of both settings")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a dlpipe override passed to every run, repeatable (e.g. --set dataset.size=20000)")
    p.add_argument("--workdir", type=Path,
                   help="keep the MLflow store (m.db), Hydra outputs and run logs here "
                        "(default: a temporary directory)")
    p.add_argument("--allow-cpu", action="store_true", help="run without a CUDA GPU (for testing the script)")
    args = checked(p, argv)
    for o in args.overrides:
        if "=" not in o or o.startswith("="):
            p.error(f"--set {o}: expected KEY=VALUE, e.g. --set dataset.size=20000")
    return args


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def train(setting: str, run_name: str, workdir: Path, overrides: list[str]) -> None:
    """One training run through the real CLI; raises SystemExit(1) with its log's end if it fails."""
    cmd = [
        sys.executable, "-m", "dlpipe", "+recipe=vision", f"loader={setting}", "trainer.progress=false",
        f"tracking.uri=sqlite:///{workdir / 'm.db'}", f"tracking.experiment={EXPERIMENT}",
        f"tracking.run_name={run_name}", *overrides,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])  # works from a checkout
    env.pop("DLPIPE_PARENT_RUN_ID", None)  # never attach these runs to an enclosing sweep
    log_path = workdir / f"{run_name}.log"
    start = time.monotonic()
    with log_path.open("w") as log:
        r = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        tail = log_path.read_text().splitlines()[-20:]
        print(f"{run_name}: `{' '.join(cmd[1:])}` exited {r.returncode}; end of its log ({log_path}):",
              *tail, sep="\n", file=sys.stderr)
        raise SystemExit(1)
    print(f"{run_name}: done in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def read_runs(workdir: Path) -> dict[str, dict]:
    """run name -> {metric: mean over epochs or None, 'params': {...}, 'gpu_metrics': tag}."""
    from mlflow import MlflowClient

    from dlpipe.tracking.metric_names import mlflow_name

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'm.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    out = {}
    # newest first: with a reused --workdir, an earlier invocation's runs of the same name are ignored
    for run in client.search_runs([exp.experiment_id], max_results=10000, order_by=["attributes.start_time DESC"]):
        if run.info.run_name in out:
            continue
        row: dict = {}
        for key in METRICS:
            history = client.get_metric_history(run.info.run_id, mlflow_name(key))  # as dlpipe logs it
            row[key] = statistics.fmean(m.value for m in history) if history else None
        row["params"] = {k: run.data.params.get(f"loader.{k}", "?") for k in LOADER_PARAMS}
        row["device"] = run.data.params.get("trainer.device", "?")
        row["gpu_metrics"] = run.data.tags.get("dlpipe.gpu_metrics", "")
        out[run.info.run_name] = row
    return out


def median_range(values: list[float | None], fmt: str) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    text = fmt.format(statistics.median(known))
    return text if len(known) == 1 else f"{text} ({fmt.format(min(known))}-{fmt.format(max(known))})"


def report(args, runs: dict[str, dict]) -> str:
    names = {s: [f"case-{s}-r{i}" for i in range(1, args.rounds + 1)] for s in SETTINGS}
    lines = [
        "# DataLoader case study: loader=pytorch vs loader=auto",
        "",
        f"`{' '.join(['+recipe=vision', *args.overrides])}`, {args.rounds} round(s), settings interleaved; "
        f"per run the mean over epochs, per setting the median over rounds (min-max). {PUBLISHED}.",
        "",
        "| setting | device | workers / pin / prefetch / persistent | epoch s | samples/s | data wait % | gpu % |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        rows = [runs[n] for n in names[s]]
        loader = " / ".join(rows[0]["params"][k] for k in LOADER_PARAMS)
        wait = [None if r["data_wait_frac"] is None else 100 * r["data_wait_frac"] for r in rows]
        lines.append(
            f"| {s} | {rows[0]['device']} | {loader} | {median_range([r['epoch_time_s'] for r in rows], '{:.2f}')} "
            f"| {median_range([r['samples_per_s'] for r in rows], '{:.1f}')} | {median_range(wait, '{:.1f}')} "
            f"| {median_range([r['gpu_util'] for r in rows], '{:.1f}')} |"
        )
    ratios = [runs[a]["samples_per_s"] / runs[p]["samples_per_s"] for p, a in zip(names["pytorch"], names["auto"])]
    lines += ["", f"ratio auto/pytorch of samples/s (median of per-round ratios): {median_range(ratios, '{:.3f}')}"]
    gpu_notes = {runs[n]["gpu_metrics"] for s in SETTINGS for n in names[s]} - {"measured", ""}
    if gpu_notes:
        lines.append(f"gpu metrics: {'; '.join(sorted(gpu_notes))}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.allow_cpu and not cuda_available():
        print("gpu_loader_case_study: no CUDA GPU here (torch.cuda.is_available() is False); "
              "run it on a GPU machine, or pass --allow-cpu to test the script on the CPU")
        return 0
    with tempfile.TemporaryDirectory(prefix="dlpipe-case-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        workdir = workdir.resolve()
        for i in range(1, args.rounds + 1):
            order = SETTINGS if i % 2 else SETTINGS[::-1]
            for setting in order:
                train(setting, f"case-{setting}-r{i}", workdir, args.overrides)
        table = report(args, read_runs(workdir))
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
