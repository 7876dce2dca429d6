"""`dlpipe tune ...overrides`: search for the fastest loader settings and write them as a config.

The search starts at the automatic values and measures rather than guesses, with far fewer
trials than the full grid:
1. the automatic config, `bench.repeats` times: its spread is the noise; a candidate has to beat
   the best by max(bench.min_gain, 2 x noise) to win;
2. num_workers=0, always: for data already in memory the main process beats any worker count,
   and a climb from the automatic value through 1 worker (often the slowest choice) would stop
   before reaching 0;
3. unless 0 won, a climb over the worker ladder (0 1 2 3 4 6 8 12 16 ...) up from the automatic
   value while it improves, else down towards 1; at most bench.max_workers (default: the CPU
   budget plus half of it). A start with no workers (loader=pytorch) first tries the automatic
   worker count and climbs from there if it wins;
4. with the best worker count: prefetch_factor doubled, persistent_workers flipped (only when the
   measurement crosses an epoch boundary, where it matters), pin_memory flipped (only with CUDA).
Before each trial a memory guard estimates workers x prefetch_factor x batch bytes against free
/dev/shm and the RAM the workers would take against available memory, and skips what does not fit.
"""

import logging
import socket
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from dlpipe import hardware
from dlpipe.job import JobContext, flatten, gpu_for, open_run, run_tags
from dlpipe.redact import redact_tree

log = logging.getLogger("dlpipe")

LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
SHM_SHARE = 0.5  # in-flight batches may take this share of free /dev/shm
RAM_SHARE = 0.8  # the workers may take this share of available memory


@dataclass(frozen=True)
class Candidate:
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool

    def label(self) -> str:
        if self.num_workers == 0:
            return "num_workers=0" + (" pin_memory=true" if self.pin_memory else "")
        return (f"num_workers={self.num_workers} prefetch_factor={self.prefetch_factor} "
                f"persistent_workers={str(self.persistent_workers).lower()} pin_memory={str(self.pin_memory).lower()}")

    def settings(self) -> dict:
        return {"num_workers": self.num_workers, "prefetch_factor": self.prefetch_factor if self.num_workers else None,
                "persistent_workers": self.persistent_workers and self.num_workers > 0, "pin_memory": self.pin_memory}

    def with_workers(self, n: int) -> "Candidate":
        if n == 0:
            return replace(self, num_workers=0, prefetch_factor=None, persistent_workers=False)
        return replace(self, num_workers=n, prefetch_factor=self.prefetch_factor or 2)


@dataclass
class Trial:
    candidate: Candidate
    runs: list[float] = field(default_factory=list)  # samples/s of each measurement
    metrics: dict[str, float] = field(default_factory=dict)  # of the median measurement
    skipped: str | None = None

    @property
    def samples_per_s(self) -> float:
        return statistics.median(self.runs) if self.runs else 0.0


def memory_guard(c: Candidate, batch_bytes: int, shm_free: int | None, ram_available: int,
                 worker_rss_bytes: float) -> str | None:
    """Why `c` would not fit in memory here, or None."""
    if c.num_workers == 0:
        return None
    inflight = c.num_workers * (c.prefetch_factor or 2) * batch_bytes
    if shm_free is not None and inflight > SHM_SHARE * shm_free:
        return (f"{c.num_workers} workers x prefetch {c.prefetch_factor or 2} x {batch_bytes / 2**20:.1f} MB = "
                f"{inflight / 2**20:.0f} MB in flight, over half the {shm_free / 2**20:.0f} MB free in /dev/shm")
    ram = c.num_workers * worker_rss_bytes + inflight
    if ram > RAM_SHARE * ram_available:
        return (f"{c.num_workers} workers would take about {ram / 2**20:.0f} MB, over {RAM_SHARE:.0%} of the "
                f"{ram_available / 2**20:.0f} MB available")
    return None


class Search:
    """The search of the module docstring over an `evaluate(candidate) -> Trial` function."""

    def __init__(self, evaluate, min_gain: float, max_workers: int, tune_persistent: bool, tune_pin: bool,
                 seed_workers: int = 2):
        """`seed_workers`: where to start climbing when the start config has no workers."""
        self.evaluate, self.min_gain, self.max_workers = evaluate, min_gain, max_workers
        self.seed_workers = seed_workers
        self.tune_persistent, self.tune_pin = tune_persistent, tune_pin
        self.trials: dict[Candidate, Trial] = {}
        self.threshold = min_gain

    def _score(self, c: Candidate) -> float:
        if c not in self.trials:
            self.trials[c] = self.evaluate(c)
        trial = self.trials[c]
        return 0.0 if trial.skipped else trial.samples_per_s

    def _better(self, c: Candidate, best: Candidate) -> bool:
        return self._score(c) > self._score(best) * (1 + self.threshold)

    def run(self, start: Candidate) -> Candidate:
        self._score(start)
        runs = self.trials[start].runs
        if len(runs) >= 2 and statistics.median(runs) > 0:
            noise = (max(runs) - min(runs)) / statistics.median(runs)
            self.threshold = max(self.min_gain, 2 * noise)
        best = start
        if start.num_workers != 0:
            if self._better(start.with_workers(0), best):
                best = start.with_workers(0)
            else:
                best = self._climb_workers(best)
        else:  # a start without workers (loader=pytorch, in_memory): see whether workers help at all
            seed = start.with_workers(max(1, min(self.seed_workers, self.max_workers)))
            if self.max_workers and self._better(seed, best):
                best = self._climb_workers(seed)
        if best.num_workers:
            doubled = replace(best, prefetch_factor=2 * (best.prefetch_factor or 2))
            if self._better(doubled, best):
                best = doubled
            if self.tune_persistent:
                flipped = replace(best, persistent_workers=not best.persistent_workers)
                if self._better(flipped, best):
                    best = flipped
        if self.tune_pin:
            flipped = replace(best, pin_memory=not best.pin_memory)
            if self._better(flipped, best):
                best = flipped
        return best

    def _climb_workers(self, best: Candidate) -> Candidate:
        ladder = sorted({n for n in LADDER if n <= self.max_workers} | {best.num_workers})
        i = ladder.index(best.num_workers)
        improved = False
        for n in ladder[i + 1:]:
            if not self._better(best.with_workers(n), best):
                break
            best, improved = best.with_workers(n), True
        if not improved:
            for n in reversed(ladder[1:i]):  # down, never to 0 (tried on its own)
                if not self._better(best.with_workers(n), best):
                    break
                best = best.with_workers(n)
        return best


def measure_candidate(c: Candidate, dataset, loader_settings: dict, batches: int, warmup: int, repeats: int,
                      seed: int, cuda: bool, sampler=None, step=None) -> Trial:
    """`repeats` measurements of one candidate's loader (built fresh, its workers stopped after)."""
    from dlpipe.data.loader import build_loader
    from dlpipe.loader_bench import measure

    settings = {**loader_settings, **c.settings()}
    loader = build_loader(dataset, **settings, seed=seed, cuda=cuda, role="tune").loader
    try:
        results = [measure(loader, batches, warmup, sampler, step) for _ in range(repeats)]
    finally:
        loader.shutdown()  # persistent workers end here, before the next candidate starts its own
    median = sorted(results, key=lambda r: r.samples_per_s)[len(results) // 2]
    return Trial(c, runs=[r.samples_per_s for r in results], metrics=median.metrics())


def header(resolved: dict, budget, trials: list[Trial], best: Trial, start: Trial, seconds: float) -> str:
    """The comment header of the written file: what it was tuned on and what it measured."""
    from datetime import datetime, timezone

    from dlpipe.gpu import gpu_summary

    devices, _ = gpu_summary()
    gpu = ", ".join(d.name for d in devices) or "none"
    limits = [f"affinity {budget.affinity}"]
    if budget.cgroup_cpus is not None:
        limits.append(f"cgroup {budget.cgroup_cpus:g}")
    if budget.slurm_cpus is not None:
        limits.append(f"SLURM_CPUS_PER_TASK {budget.slurm_cpus}")
    if budget.local_world_size > 1:
        limits.append(f"{budget.local_world_size} ranks per node")
    shm = hardware.shm_bytes()
    shm_text = f"{shm / 2**20:.0f} MB" if shm is not None else "none"
    dataset = resolved["dataset"].get("_target_", "?").rsplit(".", 1)[-1]
    ratio = best.samples_per_s / start.samples_per_s if start.samples_per_s else float("nan")
    measured = sum(1 for t in trials if not t.skipped)
    return "\n".join([
        f"# dlpipe --config-dir {resolved['bench']['output_dir']} loader={resolved['bench']['name']}",
        f"# Written by `dlpipe tune` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC for {dataset}, "
        f"batch_size {resolved['loader']['batch_size']}, {resolved['bench']['mode']} mode.",
        f"# Host: CPU budget {budget.budget} ({', '.join(limits)}), GPU {gpu}, /dev/shm {shm_text}.",
        f"# {measured} candidates measured in {seconds:.0f} s: {best.samples_per_s:.1f} samples/s against "
        f"{start.samples_per_s:.1f} for the automatic config ({ratio:.2f}x). Tune again on another machine.",
    ]) + "\n"


def write_config(path: Path, loader: dict, best: Candidate, head: str) -> Path:
    values = {**loader, **best.settings()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head + yaml.safe_dump(values, sort_keys=False))
    tmp.replace(path)
    return path


def run(ctx: JobContext, raw: dict, resolved: dict) -> float:
    """Search, write OUTPUT_DIR/loader/NAME.yaml, log every trial; returns the best samples/s."""
    from dlpipe.bench import describe, prepare, step_for
    from dlpipe.telemetry import ResourceSampler
    from dlpipe.tracking import MlflowRun

    bench, lc = resolved["bench"], resolved["loader"]
    train_set, plan, model, optimizer, budget = prepare(resolved, raw, with_model=bench["mode"] == "train")
    step = step_for(resolved, model, optimizer)
    cuda = resolved["trainer"]["device"].startswith("cuda")
    loader_settings = {k: v for k, v in lc.items() if k not in ("val_batch_size", "tuned_on")}
    max_workers = bench["max_workers"] if bench["max_workers"] is not None else budget.budget + max(2, budget.budget // 2)
    crosses_epochs = bench["warmup_batches"] + bench["batches"] > len(plan.loader)
    start = Candidate(plan.loader.num_workers, plan.loader.prefetch_factor if plan.loader.num_workers else None,
                      plan.loader.persistent_workers, bool(plan.loader.pin_memory))
    sampler = ResourceSampler(resolved["telemetry"]["sample_interval_s"], budget.budget,
                              gpu_for(resolved["trainer"]["device"]))
    tracking = resolved["tracking"]
    tags = run_tags(ctx, **{"dlpipe.task": "tune"})
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    worker_rss = [0.0]  # the largest per-worker RSS measured so far, for the memory guard

    with open_run(ctx, tracking, tags) as parent:
        params = flatten(redact_tree({"loader": lc, "bench": bench}))
        params.update(hardware.host_facts(cpu=budget))
        parent.log_params(params)

        def evaluate(c: Candidate) -> Trial:
            why = memory_guard(c, plan.batch_bytes, hardware.shm_free_bytes(), hardware.memory_available_bytes(),
                               worker_rss[0])
            if why:
                log.warning("tune: skip %s: %s", c.label(), why)
                return Trial(c, skipped=why)
            trial = measure_candidate(c, train_set, loader_settings, bench["batches"], bench["warmup_batches"],
                                      bench["repeats"], resolved["trainer"]["seed"], cuda, sampler, step)
            worker_rss[0] = max(worker_rss[0], trial.metrics.get("worker_rss_mean_mb", 0.0) * 2**20)
            log.info("tune: %s: %s (runs %s)", c.label(), describe(trial.metrics),
                     " ".join(f"{v:.0f}" for v in trial.runs))
            if tracking["enabled"]:
                child = MlflowRun(tracking["uri"], tracking["experiment"], c.label(), {**tags, "dlpipe.task": "tune-trial"},
                                  parent_run_id=parent.run_id, timeout_s=tracking["request_timeout_s"],
                                  retries=tracking["request_retries"])
                with child:
                    child.log_params({f"loader.{k}": v for k, v in c.settings().items()})
                    child.log_metrics(trial.metrics, step=0)
            return trial

        started = time.perf_counter()
        sampler.start()
        try:
            search = Search(evaluate, bench["min_gain"], max_workers, tune_persistent=crosses_epochs and
                            resolved["trainer"]["epochs"] > 1, tune_pin=cuda,
                            seed_workers=hardware.recommended_workers(budget.budget))
            best = search.run(start)
        finally:
            sampler.stop()
        seconds = time.perf_counter() - started
        trials = list(search.trials.values())
        best_trial, start_trial = search.trials[best], search.trials[start]
        speedup = best_trial.samples_per_s / max(start_trial.samples_per_s, 1e-9)
        head = header(resolved, budget, trials, best_trial, start_trial, seconds)
        out = Path(bench["output_dir"]) / "loader" / f"{bench['name']}.yaml"
        written = {**lc, "tuned_on": f"cpu_budget={budget.budget} host={socket.gethostname()}"}
        write_config(out, written, best, head)
        copy = write_config(ctx.output_dir / f"{bench['name']}.yaml", written, best, head)
        table = trial_table(trials, best)
        (ctx.output_dir / "tune_trials.md").write_text(table + "\n")
        parent.log_text(table + "\n", "tune/trials.md")
        parent.log_artifact(copy, "tune")
        parent.log_metrics({"best_samples_per_s": best_trial.samples_per_s,
                            "start_samples_per_s": start_trial.samples_per_s,
                            "speedup": speedup,
                            "tune_seconds": seconds, "trials": float(len(trials))}, step=0)
        parent.set_tags({"dlpipe.tuned": best.label(), "dlpipe.tuned_threshold": f"{search.threshold:.3f}"})
    print(table, flush=True)
    print(f"tuned: {best.label()}: {best_trial.samples_per_s:.1f} samples/s, {speedup:.2f}x "
          f"the automatic config, {len(trials)} trials in {seconds:.0f} s", flush=True)
    print(f"use it: dlpipe --config-dir {bench['output_dir']} loader={bench['name']} ...", flush=True)
    return best_trial.samples_per_s


def trial_table(trials: list[Trial], best: Candidate) -> str:
    lines = ["| candidate | samples/s (median) | runs | first batch s | cpu % | worker MB | note |",
             "|---|---|---|---|---|---|---|"]
    for t in trials:
        m = t.metrics
        note = "best" if t.candidate == best else (f"skipped: {t.skipped}" if t.skipped else "")
        lines.append(f"| {t.candidate.label()} | {t.samples_per_s:.1f} | {' '.join(f'{v:.0f}' for v in t.runs)} | "
                     f"{m.get('first_batch_s', 0):.2f} | {m.get('cpu_util', 0):.0f} | "
                     f"{m.get('worker_rss_mean_mb', 0):.0f} | {note} |")
    return "\n".join(lines)
