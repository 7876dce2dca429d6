"""A sweep's jobs, one per row of its summary: the child runs plus the jobs that failed before they had one.

A job is named by the overrides that set it apart (the ones every job shares are noise). Where
dlpipe ran another value than the one asked for (a child's param `requested.<key>` differs from its
param `<key>`, e.g. `loader.pin_memory=true` on a machine without CUDA), the name says what ran,
and jobs whose swept keys ran with the same values are grouped: their difference is noise.
No Hydra, no MLflow imports: the inputs are MLflow `Run`-like objects and plain strings.
"""

from dataclasses import dataclass, field

from dlpipe.tracking.metric_names import dlpipe_names
from dlpipe.tracking.run_names import override_key

REQUESTED_PREFIX = "requested."  # + config key: the value asked for, where the run used another


@dataclass
class Job:
    """One row of the sweep summary."""

    number: int
    """1-based position in the table and the chart, which notes refer to."""
    name: str
    """The overrides that set this job apart, each with `(ran X)` where dlpipe ran X instead."""
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None
    """None for a job that failed before it had a run (known only from the parent's tags)."""
    settings: tuple[tuple[str, str], ...] | None = None
    """(swept key, value it ran with) for each swept key; None without a run."""
    ran_other: bool = False
    """Some override of its name was not what ran (the name says `(ran X)`)."""

    @property
    def finished(self) -> bool:
        return self.status == "FINISHED"


def split_overrides(text: str) -> list[str]:
    """The overrides of a `dlpipe.overrides` tag (space-joined; "none" when there were none)."""
    return [] if text.strip() == "none" else text.split()


def one_line(text: str) -> str:
    """Newlines and tabs in a name would break a table row or a chart label: show them as spaces."""
    return " ".join(text.split())


def sweep_jobs(children, failed_overrides: list[str] = ()) -> list[Job]:
    """The jobs in sweep order: child runs by start time, then jobs that failed without a run.

    `failed_overrides` holds the overrides of every failed job (the parent's `dlpipe.failed_job.N`
    tags, in job order); those matching a child's `dlpipe.overrides` failed inside their run and
    are that child already, so each job is one row.
    """
    runs = sorted(children, key=lambda r: r.info.start_time)
    run_overrides = [r.data.tags.get("dlpipe.overrides", "") for r in runs]
    seen = set(run_overrides)
    without_run = [o for o in dict.fromkeys(failed_overrides) if o not in seen]
    every = [split_overrides(o) for o in run_overrides + without_run]
    common = set.intersection(*map(set, every)) if every else set()
    swept = sorted({override_key(o) for own in every for o in own if o not in common})
    jobs = []
    for r, own in zip(runs, every):
        params = r.data.params
        varied = [o for o in own if o not in common]
        shown = [_ran(o, params) for o in varied]
        name = " ".join(shown) or r.info.run_name or r.info.run_id
        jobs.append(Job(len(jobs) + 1, one_line(name), r.info.status, dlpipe_names(r.data.metrics), r.info.run_id,
                        _settings(swept, own, params), ran_other=shown != varied))
    for own in every[len(runs):]:
        name = " ".join(o for o in own if o not in common) or "-"
        jobs.append(Job(len(jobs) + 1, one_line(name), "FAILED"))
    return jobs


def _ran(override: str, params: dict[str, str]) -> str:
    """The override, plus what actually ran where the job's params say dlpipe changed it."""
    key = override_key(override)
    requested = params.get(REQUESTED_PREFIX + key)
    if requested is not None and key in params and params[key] != requested:
        return f"{override} (ran {params[key]})"
    return override


def _settings(swept: list[str], own: list[str], params: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The value each swept key ran with: the job's param where it logged one (the effective value),
    else the override as given (a config group choice such as `loader=in_memory` is no param)."""
    given = {override_key(o): o.partition("=")[2] for o in own}
    return tuple((key, params[key] if key in params else given.get(key, "-")) for key in swept)


def same_settings(jobs: list[Job]) -> list[list[Job]]:
    """Groups of two or more jobs that ran the swept keys with identical values, in job order."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        if job.settings:  # a run, and some key was swept
            groups.setdefault(job.settings, []).append(job)
    return [group for group in groups.values() if len(group) > 1]


def numbers(jobs: list[Job]) -> str:
    """`1`, `1 and 2`, `1, 2 and 3`: job numbers for a sentence."""
    nums = [str(j.number) for j in jobs]
    return nums[0] if len(nums) == 1 else ", ".join(nums[:-1]) + " and " + nums[-1]


def same_settings_notes(jobs: list[Job]) -> list[str]:
    """One sentence per group of jobs that ran the same settings."""
    notes = []
    for group in same_settings(jobs):
        ran = " ".join(f"{k}={v}" for k, v in group[0].settings)
        notes.append(f"jobs {numbers(group)} ran the same settings ({ran}): their difference is noise")
    return notes


def best_job(jobs: list[Job]) -> Job | None:
    """The FINISHED job with the highest samples/s (the first on a tie), or None: a failed or killed
    job's numbers cover a partial run."""
    finished = [j for j in jobs if j.finished and "samples_per_s" in j.metrics]
    return max(finished, key=lambda j: j.metrics["samples_per_s"], default=None)
