"""A sweep's jobs, one per row of its summary: the child runs plus the jobs that failed before they had one.

A job is named by the overrides that set it apart (the ones every job shares are noise). Where
dlpipe ran another value than the one asked for (a child's param `requested.<key>` differs from its
param `<key>`, e.g. `loader.pin_memory=true` on a machine without CUDA), the name says what ran,
and jobs whose swept keys ran with the same values are grouped: their difference is noise.
Jobs are numbered as Hydra numbers them (`#0`, `#1`, ...), so a row, a chart label and Hydra's own
`#N :` log line name the same job.
No Hydra, no MLflow imports: the inputs are MLflow `Run`-like objects and plain strings.
"""

from dataclasses import dataclass, field

from dlpipe.tracking.metric_names import dlpipe_names
from dlpipe.tracking.run_names import override_key

REQUESTED_PREFIX = "requested."  # + config key: the value asked for, where the run used another
JOB_NUM_TAG = "dlpipe.job_num"  # a child's Hydra job number: tagged by the job (tasks.tracking_run) and the callback


@dataclass
class Job:
    """One row of the sweep summary."""

    number: int
    """Hydra's job number (`hydra.job.num`, from 0): the row's `#N`, which notes refer to."""
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
    history: dict[str, dict[int, float]] = field(default_factory=dict)
    """metric (dlpipe name) -> {epoch: value}, for the metrics the noise rule reads (sweeps.noise);
    empty where nobody fetched them."""

    @property
    def finished(self) -> bool:
        return self.status == "FINISHED"


def split_overrides(text: str) -> list[str]:
    """The overrides of a `dlpipe.overrides` tag (space-joined; "none" when there were none)."""
    return [] if text.strip() == "none" else text.split()


def one_line(text: str) -> str:
    """Newlines and tabs in a name would break a table row or a chart label: show them as spaces."""
    return " ".join(text.split())


def sweep_jobs(children, failed_overrides: dict[int, str] | None = None,
               job_nums: dict[str, int] | None = None) -> list[Job]:
    """The jobs in Hydra's order: child runs and jobs that failed without a run, by job number.

    `failed_overrides` maps the Hydra job number of every failed job to its overrides (the parent's
    `dlpipe.failed_job.N` tags); those matching a child's `dlpipe.overrides` failed inside their run
    and are that child already, so each job is one row. A child's number is `job_nums[run_id]` or
    its JOB_NUM_TAG; a child without either takes, in start order, the numbers no other job holds
    (Hydra launches jobs in number order, and a job that failed before its run keeps its number from
    its tag).
    """
    failed_overrides = failed_overrides or {}
    runs = sorted(children, key=lambda r: r.info.start_time)
    run_overrides = [r.data.tags.get("dlpipe.overrides", "") for r in runs]
    seen = set(run_overrides)
    without_run = {n: o for n, o in sorted(failed_overrides.items()) if o not in seen}
    every = [split_overrides(o) for o in run_overrides + list(without_run.values())]
    common = set.intersection(*map(set, every)) if every else set()
    swept = sorted({override_key(o) for own in every for o in own if o not in common})
    nums = job_numbers(runs, set(without_run), job_nums or {})
    jobs = []
    for r, own, num in zip(runs, every, nums):
        params = r.data.params
        varied = [o for o in own if o not in common]
        shown = [_ran(o, params) for o in varied]
        name = " ".join(shown) or r.info.run_name or r.info.run_id
        jobs.append(Job(num, one_line(name), r.info.status, dlpipe_names(r.data.metrics), r.info.run_id,
                        _settings(swept, own, params), ran_other=shown != varied))
    for num, own in zip(without_run, every[len(runs):]):
        name = " ".join(o for o in own if o not in common) or "-"
        jobs.append(Job(num, one_line(name), "FAILED"))
    return sorted(jobs, key=lambda j: j.number)


def job_numbers(runs, taken: set[int], known: dict[str, int]) -> list[int]:
    """Each run's Hydra job number: `known[run_id]` or its JOB_NUM_TAG, else the next number, in
    start order, that no numbered run and no job in `taken` holds."""
    tagged = [known.get(r.info.run_id, _int(r.data.tags.get(JOB_NUM_TAG))) for r in runs]
    used = taken | {n for n in tagged if n is not None}
    free = (n for n in range(len(runs) + len(used)) if n not in used)
    return [n if n is not None else next(free) for n in tagged]


def _int(text: str | None) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


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
    """`#1`, `#1 and #2`, `#1, #3 and #4`, `#0-#3`: job numbers for a sentence (three or more in a
    row as a range)."""
    parts, nums = [], sorted(j.number for j in jobs)
    for n in nums:
        if parts and n == parts[-1][1] + 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    items = [text for a, b in parts for text in ([f"#{a}-#{b}"] if b - a >= 2 else [f"#{n}" for n in range(a, b + 1)])]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def same_settings_notes(jobs: list[Job]) -> list[str]:
    """One sentence per group of jobs that ran the same settings."""
    notes = []
    for group in same_settings(jobs):
        ran = " ".join(f"{k}={v}" for k, v in group[0].settings)
        notes.append(f"jobs {numbers(group)} ran the same settings ({ran}): their difference is noise")
    return notes
