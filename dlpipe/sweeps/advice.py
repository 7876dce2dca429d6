"""A sweep's jobs as evidence against each other's advice.

A job's verdict is given while it runs, before the sweep's later jobs have measured anything: the
0-worker job may advise `loader.num_workers=2` that the next job then measures slower. When the sweep
ends, each job's advice (its `dlpipe.advice` tag, one override) is checked against the job that ran
exactly that change: the same overrides but the advised one. Advice that job found no faster (by the
journal's MIN_GAIN) is withdrawn: the advising job gets a `dlpipe.advice_check` tag saying why, and the
sweep prints it. No torch here.
"""

from dlpipe.judging.journal import MIN_GAIN
from dlpipe.tracking.metric_names import mlflow_name

ADVICE_TAG = "dlpipe.advice"
CHECK_TAG = "dlpipe.advice_check"


def _overrides(run) -> dict[str, str]:
    pairs = (o.lstrip("+~").partition("=") for o in run.data.tags.get("dlpipe.overrides", "").split())
    return {key: value for key, _, value in pairs if key}


def _same(a: str, b: str) -> bool:
    return a.strip().lower() == b.strip().lower()


def _ran_the_advice(job, other, key: str, value: str) -> bool:
    """Whether `other` is `job` with the advised override applied (and nothing else changed)."""
    mine, theirs = _overrides(job), _overrides(other)
    if {k: v for k, v in mine.items() if k != key} != {k: v for k, v in theirs.items() if k != key}:
        return False
    ran = other.data.params.get(key, theirs.get(key))  # the effective value where the job recorded it
    return ran is not None and _same(ran, value)


def withdrawn_advice(children, names: dict[str, str]) -> dict[str, str]:
    """run_id -> why its advice is withdrawn, for every FINISHED job whose advised change another
    FINISHED job of the sweep ran no faster."""
    speed = mlflow_name("samples_per_s")
    finished = [r for r in children if r.info.status == "FINISHED" and speed in r.data.metrics]
    out = {}
    for job in finished:
        key, _, value = job.data.tags.get(ADVICE_TAG, "").partition("=")
        if not key:
            continue
        own = job.data.metrics[speed]
        for other in finished:
            if other is job or not _ran_the_advice(job, other, key, value):
                continue
            theirs = other.data.metrics[speed]
            if theirs < (1 + MIN_GAIN) * own:
                name = names.get(other.info.run_id, other.info.run_id)
                out[job.info.run_id] = (f"{key}={value} withdrawn: job '{name}' of this sweep ran it at {theirs:.1f} "
                                        f"samples/s against this job's {own:.1f}")
                break
    return out
