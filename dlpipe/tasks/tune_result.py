"""What a `dlpipe tune` search found and may claim: the trial table, the inconclusive line, and the
comment header of the loader file it writes (what it measured, so the file says it wherever it goes).

A row is marked `best` only when no other row measured faster; rows faster by less than the noise are
ties (`faster, within the noise`), the kept row then reads `kept` and the search is inconclusive.
"""

from dataclasses import dataclass
from datetime import UTC, datetime

from dlpipe.judging.contention import contention
from dlpipe.loader.search import Candidate, Outcome, Trial
from dlpipe.machine import hardware
from dlpipe.machine.gpu import gpu_summary
from dlpipe.schema import DlpipeConfig

QUIETER_AT = 30
"""Past this many repeats to decide, a quieter machine is the practical answer, and named first."""


@dataclass(frozen=True)
class TuneResult:
    trials: list[Trial]
    best: Trial
    """The kept trial: the search's choice (the best only when `outcome.conclusive`)."""
    start: Trial
    seconds: float
    outcome: Outcome
    cpu_budget: int = 1

    @property
    def threshold(self) -> float:
        return self.outcome.threshold

    @property
    def speedup(self) -> float:
        return self.best.samples_per_s / max(self.start.samples_per_s, 1e-9)

    def table(self) -> str:
        return trial_table(self.trials, self.outcome)

    def contended(self) -> tuple[int, str]:
        """(how many measured trials were starved of CPU, the figures of the worst one)."""
        found = [(t, contention(t.metrics, self.cpu_budget)) for t in self.trials if not t.skipped]
        starved = [(t, c) for t, c in found if c is not None]
        worst = max(starved, key=lambda tc: tc[0].metrics.get("run_queue_s_per_s", 0.0), default=None)
        return len(starved), (f"{worst[0].candidate.label()}: {worst[1].text}" if worst else "")

    def inconclusive(self) -> str | None:
        """One line: which candidates the noise hides, what was kept, and what would decide it; None
        when the search is conclusive."""
        o = self.outcome
        if o.conclusive:
            return None
        kept, runs = self.best.samples_per_s, self.start.runs
        ties = [t for t in self.trials if t.candidate in o.ties]
        rival = max(ties, key=lambda t: t.samples_per_s)
        gap = rival.samples_per_s / kept - 1
        others = f" and {len(ties) - 1} more" if len(ties) > 1 else ""
        what = ("kept the automatic config" if o.chosen == self.start.candidate else
                f"kept {o.chosen.label()}, which beat the automatic config beyond the noise")
        repeats = o.repeats_to_decide(gap)
        starved, figures = self.contended()
        measured = sum(1 for t in self.trials if not t.skipped)
        quieter = "a quieter machine (CPUs of the job's own)" + (
            f": {starved} of {measured} trials were contended ({figures})" if starved else "")
        decide = (f"{quieter}, or bench.repeats={repeats}" if repeats > QUIETER_AT else
                  f"bench.repeats={repeats} or more (at the noise measured), or {quieter}")
        return (f"tune: inconclusive: {rival.candidate.label()}{others} measured faster than the kept "
                f"{o.chosen.label()} ({rival.samples_per_s:.1f} against {kept:.1f} samples/s, {1 + gap:.2f}x) "
                f"but within the noise: the automatic config's {len(runs)} repeats spread "
                f"{min(runs):.1f}-{max(runs):.1f} samples/s (noise {o.noise:.0%}), so a gain had to pass "
                f"{1 + o.threshold:.2f}x; {what}. To decide: {decide}")

    def measured_lines(self) -> list[str]:
        """Every measured candidate against the kept one, for the written file's header."""
        kept = self.best.samples_per_s
        lines = [f"Measured (samples/s, median of {self.outcome.repeats}; x the kept config; a gain under "
                 f"{1 + self.threshold:.2f}x is noise here):"]
        for t in sorted((t for t in self.trials if not t.skipped), key=lambda t: -t.samples_per_s):
            lines.append(f"  {t.candidate.label()}: {t.samples_per_s:.1f} ({t.samples_per_s / kept:.2f}x) "
                         f"{note(t.candidate, self.outcome)}".rstrip())
        return lines


def note(c: Candidate, outcome: Outcome) -> str:
    """The table's word for a candidate: best, kept (a tie), faster within the noise, or nothing."""
    if c == outcome.chosen:
        return "best" if outcome.conclusive else "kept: faster rows are within the noise"
    return "faster, within the noise" if c in outcome.ties else ""


def trial_table(trials: list[Trial], outcome: Outcome | None, fastest: Candidate | None = None) -> str:
    """The trial table; `outcome` None (a search stopped early): `fastest` is marked `fastest so far`."""
    lines = ["| candidate | samples/s (median) | runs | first batch s | cpu % | worker MB | peak MB (all processes) "
             "| note |", "|---|---|---|---|---|---|---|---|"]
    for t in trials:
        m = t.metrics
        said = note(t.candidate, outcome) if outcome else "fastest so far" if t.candidate == fastest else ""
        said = f"skipped: {t.skipped}" if t.skipped else said
        lines.append(f"| {t.candidate.label()} | {t.samples_per_s:.1f} | {' '.join(f'{v:.0f}' for v in t.runs)} | "
                     f"{m.get('first_batch_s', 0):.2f} | {m.get('cpu_util', 0):.0f} | "
                     f"{m.get('worker_rss_mean_mb', 0):.0f} | {m.get('tree_rss_peak_mb', 0):.0f} | {said} |")
    return "\n".join(lines)


def header(cfg: DlpipeConfig, budget, result: TuneResult) -> str:
    """The comment header of the written file: what it was tuned on and what it measured (its first
    four lines are what tune.written_by reads back)."""
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
    dataset = cfg.dataset.get("_target_", "?").rsplit(".", 1)[-1]
    best, start = result.best, result.start
    ratio = best.samples_per_s / start.samples_per_s if start.samples_per_s else float("nan")
    measured = sum(1 for t in result.trials if not t.skipped)
    said = result.inconclusive()
    lines = [
        f"dlpipe --config-dir {cfg.bench.output_dir} loader={cfg.bench.name}",
        f"Written by `dlpipe tune` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC for {dataset}, "
        f"batch_size {cfg.loader.batch_size}, {cfg.bench.mode} mode.",
        f"Host: CPU budget {budget.budget} ({', '.join(limits)}), GPU {gpu}, /dev/shm {shm_text}.",
        f"{measured} candidates measured in {result.seconds:.0f} s: {best.samples_per_s:.1f} samples/s against "
        f"{start.samples_per_s:.1f} for the automatic config ({ratio:.2f}x). Tune again on another machine.",
        *([said.removeprefix("tune: ").replace("inconclusive", "Inconclusive", 1)] if said else []),
        *result.measured_lines(),
    ]
    return "".join(f"# {line}\n" for line in lines)
