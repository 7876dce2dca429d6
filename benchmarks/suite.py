"""Run the benchmark scripts one after the other and write one markdown report.

    python -m benchmarks [--quick] [--rounds N] [--only NAME[,NAME]] [--out FILE]

Each script runs in its own process (`python -m benchmarks.NAME ... --out TMPFILE`), so one
script's imports, threads and memory do not leak into the next one's figures, and a script that
crashes does not stop the others. The report has a header (date, host, CPU budget, Python and torch
versions, git commit, the exact command), a summary table (script | goal | result | exit status)
and then each script's own report under a `## NAME` heading, with the command that reproduces it.

--quick runs every script at the tiny sizes of tests/test_benchmarks.py (and 1 round unless
--rounds is given): it checks that the suite runs, its figures mean nothing. The GPU case study
runs only where torch sees a CUDA GPU; elsewhere it is reported as skipped.

A number never fails the suite: it exits 0 unless a script crashed (exited non-zero or wrote no
report), then 1, with the script's last stderr line in the summary table.
"""

import argparse
import collections
import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as `python benchmarks/suite.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlpipe.machine import hardware  # noqa: E402  (cheap: no torch, nothing read at import)

REPO = Path(__file__).resolve().parents[1]
STDERR_TAIL = 20  # lines of a crashed script's stderr kept for its section


@dataclass(frozen=True)
class Benchmark:
    name: str  # the module under benchmarks/
    goal: str  # as in benchmarks/README.md
    quick_args: tuple[str, ...]  # tiny sizes, the same as its smoke test
    result: str  # regex matching the lines of the script's report that state its result
    needs_cuda: bool = False


TINY_VISION = ("--set", "dataset.size=64", "--set", "dataset.image_size=32", "--set", "dataset.crop_size=28",
               "--set", "trainer.epochs=1", "--set", "model.width=8")

BENCHMARKS = (
    Benchmark("telemetry_overhead", "B/A >= 0.98 (under 2% overhead)", ("--steps", "20"), r"^goal B/A"),
    Benchmark("loader_tuning", "automatic >= 0.9x, tuned >= 0.97x of the best; tuner cost <= 1/3 of the grid",
              ("--repeats", "1", "--batches", "2", "--warmup", "1", "--decode-size", "64", "--image-size", "32",
               "--memory-size", "512"), r"^- "),
    Benchmark("runner_overhead", "B/A >= 0.97 (dlpipe against a plain loop)",
              ("--steps", "3", "--models", "mlp,cnn", "--accumulate", "1,2"), r"^- "),
    Benchmark("startup", "printing a config imports neither torch nor mlflow", (), r"^- "),
    Benchmark("data_wait", "a slow loader's data_wait_frac > 0.8", ("--items", "8", "--item-ms", "2"), r"^- "),
    Benchmark("fetch_probe", "in-memory rows under 50 us per item, JPEG decode above; a slow probe under 0.5 s",
              ("--memory-size", "512", "--decode-size", "32", "--image-size", "32"), r"^- "),
    Benchmark("fetch_modes", "loader.fetch=batch >= 2x item on tabular rows in the main process",
              ("--rows", "512", "--workers", "0"), r"^- "),
    Benchmark("loader_backends", "auto >= 0.9x and tune >= 0.97x of the oracle (fetch x worker_method x workers x "
              "prefetch x persistence), tune at <= 1/3 of the grid's time; threads, where picked, >= 20% less RSS",
              ("--repeats", "1", "--workers", "1", "--rows", "256", "--images", "32", "--image-size", "16",
               "--python-ops", "64", "--warmup", "1", "--pipelines", "rows,jpeg+python"), r"^- "),
    Benchmark("gpu_loader_case_study", "reproduce the published case study: GPU utilisation 65% -> 89%, "
              "epoch 53 -> 37 min", TINY_VISION, r"^ratio ", needs_cuda=True),
)


@dataclass
class Outcome:
    benchmark: Benchmark
    status: str  # the exit status column: "0", "1 (crashed)", "skipped: ..."
    failed: bool
    result: str  # the result column: the script's result lines, or its last stderr line
    body: str  # the section under the script's heading
    command: str = ""  # the script's own command: run alone, it prints the same section
    seconds: float = 0.0


def benchmark_names(value: str) -> list[str]:
    """--only's value, checked against the suite, in the suite's order."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    known = [b.name for b in BENCHMARKS]
    unknown = [n for n in names if n not in known]
    if not names:
        raise argparse.ArgumentTypeError(f"expected NAME[,NAME], from {','.join(known)}")
    if unknown:
        raise argparse.ArgumentTypeError(f"no benchmark named {' or '.join(map(repr, unknown))}; "
                                         f"choose from {','.join(known)}")
    return [n for n in known if n in names]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, metavar="N",
                   help="rounds passed to every script (default: each script's own; 1 with --quick)")
    p.add_argument("--only", type=benchmark_names, metavar="NAME[,NAME]",
                   help=f"run only these scripts (default: all of {', '.join(b.name for b in BENCHMARKS)})")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, to check that everything runs (figures mean nothing)")
    p.add_argument("--out", type=Path, metavar="FILE", help="also write the report to this file")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds={args.rounds}: must be >= 1")
    if args.out is not None and not args.out.resolve().parent.is_dir():
        # Say so now rather than after minutes of benchmarks.
        p.error(f"--out {args.out}: the folder {args.out.resolve().parent} does not exist")
    if args.rounds is None and args.quick:
        args.rounds = 1
    return args


def cuda_available() -> bool:
    import torch  # only when the GPU case study is selected: importing torch costs seconds

    return torch.cuda.is_available()


def script_args(bench: Benchmark, args: argparse.Namespace) -> list[str]:
    rounds = [] if args.rounds is None else ["--rounds", str(args.rounds)]
    return [*rounds, *(bench.quick_args if args.quick else ())]


def stream_stderr(proc: subprocess.Popen, name: str) -> list[str]:
    """Pass the script's progress through as it comes (a full run takes long), prefixed with its
    name; return its last lines, which say why if it crashed."""
    tail = collections.deque(maxlen=STDERR_TAIL)
    for line in proc.stderr:
        sys.stderr.write(f"[{name}] {line}")
        sys.stderr.flush()
        if line.strip():
            tail.append(line.rstrip("\n"))
    return list(tail)


def result_lines(bench: Benchmark, report: str) -> str:
    found = [line.removeprefix("- ").strip() for line in report.splitlines() if re.match(bench.result, line)]
    return "; ".join(found) or "(no result line found in its report)"


def nest_headings(text: str, top: int = 3) -> str:
    """Shift the script's markdown headings so that its top one becomes level `top`: each script
    starts its report with its own title, which must sit under the suite's `## NAME`."""
    heading = re.compile(r"^(#{1,6}) ", re.MULTILINE)
    levels = [len(m.group(1)) for m in heading.finditer(text)]
    if not levels:
        return text
    shift = top - min(levels)
    return heading.sub(lambda m: "#" * min(len(m.group(1)) + shift, 6) + " ", text)


def run_script(bench: Benchmark, args: argparse.Namespace, tmp: Path) -> Outcome:
    out = tmp / f"{bench.name}.md"
    extra = script_args(bench, args)
    command = shlex.join(["python", "-m", f"benchmarks.{bench.name}", *extra])
    print(f"[suite] running {command}", file=sys.stderr, flush=True)
    start = time.monotonic()
    # The table also goes to the --out file, so stdout is not needed; cwd=REPO so that
    # `-m benchmarks.NAME` resolves wherever the suite was started from.
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{bench.name}", *extra, "--out", str(out)], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail = stream_stderr(proc, bench.name)
    code = proc.wait()
    seconds = time.monotonic() - start
    report = out.read_text() if out.exists() else ""
    if code == 0 and report.strip():
        return Outcome(bench, "0", False, result_lines(bench, report), nest_headings(report), command, seconds)
    last = tail[-1] if tail else "(nothing on stderr)"
    if code == 0:
        last = "exited 0 without writing its report"
    body = "End of its stderr:\n\n```\n" + "\n".join(tail) + "\n```\n"
    return Outcome(bench, f"{code} (crashed)", True, last, body, command, seconds)


def skipped(bench: Benchmark) -> Outcome:
    reason = "skipped: no CUDA GPU"
    return Outcome(bench, reason, False, "-", f"{reason} (torch.cuda.is_available() is False).\n")


def cpu_line() -> str:
    # dlpipe's budget (affinity, cgroup quota, Slurm) is what its automatic settings were derived from;
    # os.cpu_count() is what the scripts' own headers print.
    return f"{hardware.cpu_budget().budget} (dlpipe.machine.hardware.cpu_budget; os.cpu_count() {os.cpu_count()})"


def git_commit() -> str:
    try:
        r = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown (no git)"
    return r.stdout.strip() if r.returncode == 0 else "unknown (not a git checkout)"


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")  # without importing torch: seconds saved
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def escape_cell(text: str) -> str:
    return text.replace("|", "\\|")


def header(argv: list[str], quick: bool) -> list[str]:
    lines = [
        "# dlpipe benchmarks",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- host: {socket.gethostname()} ({platform.platform()})",
        f"- CPU budget: {cpu_line()}",
        f"- Python {platform.python_version()}, torch {torch_version()}",
        f"- git commit: {git_commit()}",
        f"- command: `{shlex.join(['python', '-m', 'benchmarks', *argv])}`",
    ]
    if quick:
        lines.append("- --quick: tiny sizes, to check that the scripts run; the figures below mean nothing")
    return lines


def summary(outcomes: list[Outcome]) -> list[str]:
    return [
        "| script | goal | result | exit status |",
        "|---|---|---|---|",
        *[f"| {o.benchmark.name} | {escape_cell(o.benchmark.goal)} | {escape_cell(o.result)} | {o.status} |"
          for o in outcomes],
    ]


def section(o: Outcome) -> list[str]:
    lines = [f"## {o.benchmark.name}", ""]
    if o.command:
        lines += [f"`{o.command}`: exit {o.status}, {o.seconds:.0f} s.", ""]
    return lines + [o.body.rstrip("\n")]


def render(argv: list[str], quick: bool, outcomes: list[Outcome]) -> str:
    lines = header(argv, quick) + [""] + summary(outcomes)
    for o in outcomes:
        lines += [""] + section(o)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    chosen = [b for b in BENCHMARKS if args.only is None or b.name in args.only]
    gpu = any(b.needs_cuda for b in chosen) and cuda_available()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="dlpipe-suite-") as tmp:
        for bench in chosen:
            outcomes.append(skipped(bench) if bench.needs_cuda and not gpu else run_script(bench, args, Path(tmp)))
    report = render(argv, args.quick, outcomes)
    print(report, end="")
    if args.out:
        args.out.write_text(report)
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
