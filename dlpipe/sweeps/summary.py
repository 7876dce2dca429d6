"""The end of a sweep, on its parent run: the jobs read back with their metric histories, the verdict
(the best job by the objective, the fastest apart, each only beyond the sweep's noise), the table
printed and logged (`sweep_summary.md`, also the parent's description), the chart
(`sweep_summary.png`) and advice withdrawn where another job ran it no faster.

Each step is an extra for the callback that ends the parent: a failure here is logged and the
parent still ends with its status. mlflow itself is never imported: the client is handed in.
"""

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from dlpipe.sweeps.advice import CHECK_TAG, withdrawn_advice
from dlpipe.sweeps.chart import FOLLOWS, PANELS, sweep_plot
from dlpipe.sweeps.jobs import JOB_NUM_TAG, Job, sweep_jobs
from dlpipe.sweeps.noise import CONTENTION, SPEED
from dlpipe.sweeps.objective import monitored_metrics, sweep_objective
from dlpipe.sweeps.report import sweep_table
from dlpipe.sweeps.verdict import SweepVerdict, judge
from dlpipe.tracking.abandoned import FOLDER_TAGS
from dlpipe.tracking.metric_names import mlflow_name

log = logging.getLogger("dlpipe")

MAX_TAG_CHARS = 8000  # MLflow's tag value limit


def tag_value(text: str) -> str:
    """`text` cut to fit a tag. MLflow cuts a longer value the same way, but raises instead with
    MLFLOW_TRUNCATE_LONG_VALUES=false, which would leave the parent RUNNING or lose a failed job's
    row. Cut alike, a failed job's overrides still equal its child run's `dlpipe.overrides`."""
    return text[:MAX_TAG_CHARS]


@dataclass
class Summary:
    verdict: SweepVerdict
    text: str
    """The headline, the table and its notes: what is printed, logged and the parent's description."""


def hydra_job_number(folder: Path) -> int | None:
    """The Hydra job number (`hydra.job.num`) Hydra saved in a job's folder (`.hydra/hydra.yaml`), or
    None where it saved none (hydra.output_subdir=null, a folder on another machine's disk)."""
    try:
        saved = yaml.safe_load((folder / ".hydra" / "hydra.yaml").read_text())
        return int(saved["hydra"]["job"]["num"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def record_job_numbers(client, children) -> dict[str, int]:
    """run id -> Hydra job number for the children that have no JOB_NUM_TAG yet, read from their job
    folders and tagged on them, so the number stays with the run in MLflow."""
    found = {}
    for run in children:
        folder = run.data.tags.get(FOLDER_TAGS[0])
        if JOB_NUM_TAG in run.data.tags or not folder:
            continue
        num = hydra_job_number(Path(folder))
        if num is not None:
            client.set_tag(run.info.run_id, JOB_NUM_TAG, str(num))
            found[run.info.run_id] = num
    return found


def fetch_histories(client, jobs: list[Job], metrics: list[str]) -> None:
    """Fill each job's `history` (epoch -> value) for the `metrics` (dlpipe's names) it logged."""
    for job in jobs:
        if job.run_id is None:
            continue
        for metric in dict.fromkeys(metrics):
            if metric not in job.metrics:
                continue
            points = sorted(client.get_metric_history(job.run_id, mlflow_name(metric)),
                            key=lambda m: (m.step, m.timestamp))
            job.history[metric] = {m.step: m.value for m in points}  # a step logged twice: its latest value


def summarise(client, parent: str, children, failed: dict[int, str]) -> Summary | None:
    """Judge the sweep, print and log its table, chart and withdrawn advice; None where the table
    could not be made (the parent then ends without a summary)."""
    try:
        jobs = sweep_jobs(children, failed, record_job_numbers(client, children))
        objective, monitored = sweep_objective(children), monitored_metrics(children)
        ranked_panels = [p.metric for p in PANELS if p.better and p.metric not in FOLLOWS]  # each against its noise
        fetch_histories(client, jobs, [SPEED, *CONTENTION, *ranked_panels, *([objective.metric] if objective else [])])
        verdict = judge(jobs, objective)
        table = sweep_table(jobs, objective, monitored, verdict.sentences())
        text = f"**{verdict.headline()}**\n\n{table}"
        without_run = sum(j.run_id is None for j in jobs)
        counts = f"{len(children)} runs" + (f", {without_run} jobs failed before a run" if without_run else "")
        print(f"\nsweep summary ({counts}, last epoch of each)\n{text}", flush=True)
        client.log_text(parent, text + "\n", "sweep_summary.md")
    except Exception as e:  # noqa: BLE001 - any failure here must not leave the parent RUNNING
        log.warning("sweep_summary.md not logged: %s: %s", type(e).__name__, e)
        return None
    check_advice(client, jobs, children)
    log_plot(client, parent, jobs, verdict, monitored)
    return Summary(verdict, text)


def check_advice(client, jobs: list[Job], children) -> None:
    """Withdraw each job's advice that another job of the sweep ran no faster (sweeps.advice): tag
    the advising job and say it under the table."""
    try:
        withdrawn = withdrawn_advice(children, {j.run_id: j.name for j in jobs if j.run_id})
        for run_id, why in withdrawn.items():
            client.set_tag(run_id, CHECK_TAG, tag_value(why))
            job = next(j for j in jobs if j.run_id == run_id)
            print(f"advice of job #{job.number} {job.name}: {why}", flush=True)
    except Exception as e:  # noqa: BLE001 - any failure here must not leave the parent RUNNING
        log.warning("advice not checked against the sweep: %s: %s", type(e).__name__, e)


def log_plot(client, parent: str, jobs: list[Job], verdict: SweepVerdict, monitored: list[str]) -> None:
    """The table as bar charts, artifact sweep_summary.png."""
    try:
        with tempfile.TemporaryDirectory(prefix="dlpipe-sweep-") as tmp:
            png = sweep_plot(jobs, Path(tmp) / "sweep_summary.png", verdict, monitored)
            if png is not None:
                client.log_artifact(parent, str(png))
    except Exception as e:  # noqa: BLE001 - any failure here must not leave the parent RUNNING
        log.warning("sweep_summary.png not logged: %s: %s", type(e).__name__, e)
