"""Start-up cost: whole-process times of the dlpipe command against a minimal Hydra app and a
plain PyTorch script.

    python -m benchmarks.startup --rounds 5 [--out startup.md]

Each case is a fresh `python` process, timed from launch to exit; cases run in a rotating order
each round (interleaved), medians and min-max reported:
- `dlpipe --help` and `dlpipe --cfg job` against the same two commands of a minimal Hydra app
  (one `@hydra.main` function and a two-key config): what dlpipe adds to printing a config. Each
  dlpipe process also reports whether torch or mlflow was imported (printing a config must not;
  a tracked run imports mlflow only in its tracking process);
- to the first optimizer step: `dlpipe +recipe=tabular` stopped after one optimizer step, without
  and with tracking (SQLite), against a plain script that imports torch, builds the same MLP and
  data, and takes one step. Both then exit, so these include interpreter teardown;
- the whole `dlpipe +recipe=smoke` run (real JPEG decode, 2 epochs), without and with tracking.
  The store exists (the warm-up round made it): tracking's launch cost is the difference, which
  the tracking process (dlpipe/tracking/sidecar.py) keeps under 1 s by importing mlflow and
  opening the store while the job is built.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/startup.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.options import arguments, checked  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

MINIMAL_APP = '''
import hydra
from omegaconf import OmegaConf

@hydra.main(config_path=None, config_name="cfg", version_base="1.3")
def main(cfg):
    print(OmegaConf.to_yaml(cfg))

if __name__ == "__main__":
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="cfg", node={"lr": 0.001, "batch_size": 64})
    main()
'''

PLAIN_STEP = '''
import torch
import torch.nn.functional as F
from dlpipe.data.tabular import TabularDataset
from dlpipe.models.mlp import MLP
data = TabularDataset(size=8192)
loader = torch.utils.data.DataLoader(data, batch_size=256, shuffle=True)
model = MLP(in_features=32, num_classes=4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = next(iter(loader))
F.cross_entropy(model(x), y).backward()
opt.step()
'''

# Imported modules at exit, for the config-printing cases and a tracked run.
PROBE = ("import atexit, sys; atexit.register(lambda: print('IMPORTED torch=%s mlflow=%s' % "
         "('torch' in sys.modules, 'mlflow' in sys.modules), file=sys.stderr)); "
         "sys.argv = ['dlpipe'] + sys.argv[1:]; from dlpipe.cli import main; main()")

SMOKE = ["+recipe=smoke", "trainer.progress=false"]
ONE_STEP = ["+recipe=tabular", "trainer.max_steps=1", "trainer.val_fraction=0", "checkpoint.enabled=false",
            "trainer.progress=false"]


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, 5, "measured rounds after the warm-up")
    p.add_argument("--warmup", type=int, default=1, choices=(0, 1),
                   help="a warm-up round first: page cache, the SQLite store's creation (default 1; 0: a smoke test)")
    p.add_argument("--no-recipe-run", action="store_true",
                   help="leave out the whole +recipe=smoke runs (the slowest pair; the suite's smoke test does)")
    return checked(p, argv)


def cases(tmp: Path, recipe_run: bool = True) -> dict[str, list[str]]:
    app = tmp / "minimal_app.py"
    app.write_text(MINIMAL_APP)
    plain = tmp / "plain_step.py"
    plain.write_text(PLAIN_STEP)
    py = sys.executable
    todo = {
        "minimal Hydra app --help": [py, str(app), "--help"],
        "dlpipe --help": [py, "-c", PROBE, "--help"],
        "minimal Hydra app --cfg job": [py, str(app), "--cfg", "job"],
        "dlpipe --cfg job": [py, "-c", PROBE, "--cfg", "job"],
        "plain script: first optimizer step": [py, str(plain)],
        "dlpipe tracking=none: first optimizer step": [py, "-m", "dlpipe", *ONE_STEP, "tracking=none"],
        # through PROBE: the table shows that the training process itself never imports mlflow
        "dlpipe with MLflow (SQLite): first optimizer step": [py, "-c", PROBE, *ONE_STEP,
                                                             f"tracking.uri=sqlite:///{tmp / 'm.db'}"],
    }
    if recipe_run:
        todo["dlpipe +recipe=smoke tracking=none"] = [py, "-m", "dlpipe", *SMOKE, "tracking=none"]
        todo["dlpipe +recipe=smoke with MLflow (SQLite)"] = [py, "-m", "dlpipe", *SMOKE,
                                                             f"tracking.uri=sqlite:///{tmp / 's.db'}"]
    return todo


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    elapsed = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    imported = next((line for line in r.stderr.splitlines() if line.startswith("IMPORTED ")), "")
    return elapsed, imported.removeprefix("IMPORTED ")


def main(argv=None) -> int:
    args = parse_args(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_"))}
    env.update(PYTHONPATH=str(REPO), MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true", HYDRA_FULL_ERROR="0")
    with tempfile.TemporaryDirectory(prefix="dlpipe-startup-") as tmp:
        tmp = Path(tmp)
        todo = cases(tmp, not args.no_recipe_run)
        for cmd in list(todo.values()) * args.warmup:
            timed(cmd, tmp, env)  # warm-up: page cache, the SQLite store's creation
        times = {name: [] for name in todo}
        imports = {}
        names = list(todo)
        for i in range(args.rounds):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                seconds, imported = timed(todo[name], tmp, env)
                times[name].append(seconds)
                if imported:
                    imports[name] = imported
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = [f"| {name} | {statistics.median(v):.2f} | {min(v):.2f}-{max(v):.2f} | {imports.get(name, '')} |"
            for name, v in times.items()]

    def ratio(a: str, b: str) -> float:
        return statistics.median(times[a]) / statistics.median(times[b])

    lines = [
        "# start-up",
        "",
        f"Whole-process wall time, {args.rounds} interleaved rounds after {args.warmup} warm-up round(s); "
        f"{os.cpu_count()} CPUs.",
        "",
        "| command | seconds median | min-max | imported at exit |",
        "|---|---|---|---|",
        *rows,
        "",
        f"- dlpipe --help / minimal Hydra app: {ratio('dlpipe --help', 'minimal Hydra app --help'):.2f}x",
        f"- dlpipe --cfg job / minimal Hydra app: {ratio('dlpipe --cfg job', 'minimal Hydra app --cfg job'):.2f}x",
        f"- first optimizer step, dlpipe tracking=none / plain script: "
        f"{ratio('dlpipe tracking=none: first optimizer step', 'plain script: first optimizer step'):.2f}x",
        f"- first optimizer step, dlpipe with MLflow / plain script: "
        f"{ratio('dlpipe with MLflow (SQLite): first optimizer step', 'plain script: first optimizer step'):.2f}x",
        *(f"- tracking's launch cost, {what}: {ratio(tracked, bare):.2f}x of tracking=none, "
          f"{statistics.median(times[tracked]) - statistics.median(times[bare]):+.2f} s"
          for what, tracked, bare in (
              ("to the first optimizer step", "dlpipe with MLflow (SQLite): first optimizer step",
               "dlpipe tracking=none: first optimizer step"),
              ("a whole smoke run", "dlpipe +recipe=smoke with MLflow (SQLite)",
               "dlpipe +recipe=smoke tracking=none")) if tracked in times),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
