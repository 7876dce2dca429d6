"""Facts about the Slurm job this process runs in, read from its environment and from slurmctld.

What a SIGTERM means under Slurm depends on why slurmctld sent it, and only slurmctld knows: its
record of the job (`scontrol show job`), read at the moment the signal is handled, tells them apart.
Measured on Slurm 22.05 (one node, PreemptMode=REQUEUE):

| SIGTERM from | JobState | PreemptTime | Restarts |
|---|---|---|---|
| preemption, the partition's GraceTime running | RUNNING | the preemption's time | unchanged |
| preemption without grace (SIGTERM, SIGCONT, SIGTERM within ms) | COMPLETING | not shown | already +1: requeued |
| `scancel` | COMPLETING | None | unchanged |
| the end of a grace period (Slurm requeues the job itself) | COMPLETING | not shown | already +1 |

Only the first needs the job's help: Slurm would requeue it at the end of the grace period, but only
if it still runs then; a job that checkpointed and exited ends FAILED and is never requeued. So a
job in that state requeues itself (`scontrol requeue`, what submitit does for its own signal):
Slurm accepts it within the grace period, the preempting job gets the node at once, and the job
starts again once that one leaves it. Everything else is left to Slurm.

A leaf module: no torch, nothing read at import.
"""

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

log = logging.getLogger("dlpipe")

COMMAND_TIMEOUT_S = 20  # slurmctld answers in ms; an unreachable one must not eat a grace period or hold a sweep
_FIELD = re.compile(r"(\w+)=(\S*)")


def command(argv: list[str], run=subprocess.run) -> subprocess.CompletedProcess | str:
    """A Slurm command (scontrol, squeue, sacct, scancel) run to its end, whatever its exit code, or
    why it did not run: not on PATH, no answer within COMMAND_TIMEOUT_S, the OS's error."""
    program = shutil.which(argv[0])
    if program is None:
        return f"no {argv[0]} on PATH"
    try:
        return run([program, *argv[1:]], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                   stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"{argv[0]} did not answer within {COMMAND_TIMEOUT_S} s"
    except OSError as e:
        return str(e)


def last_line(text: str) -> str:
    """The line of a command's stderr that says why (Slurm's tools end with it), cut to 200 characters."""
    return (text.strip().splitlines() or [""])[-1][:200]


def fields(line: str) -> dict[str, str]:
    """One record of `scontrol show ... -o` (`Key=Value` fields) as {field: value}."""
    return dict(_FIELD.findall(line))


def job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """This job's own id (an array task's own, not the array's), or None outside a Slurm job."""
    return environ.get("SLURM_JOB_ID") or None


# The job's place in Slurm, as tags on its MLflow runs: which job, array task, partition and nodes
JOB_TAGS = {"slurm.job_id": "SLURM_JOB_ID", "slurm.array_job_id": "SLURM_ARRAY_JOB_ID",
            "slurm.array_task_id": "SLURM_ARRAY_TASK_ID", "slurm.partition": "SLURM_JOB_PARTITION",
            "slurm.nodelist": "SLURM_JOB_NODELIST"}


def job_tags(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """JOB_TAGS that this job's environment sets; none outside a Slurm job."""
    return {tag: environ[name] for tag, name in JOB_TAGS.items() if environ.get(name)}


def is_first_rank(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is the job's rank 0 (torchrun's RANK, else Slurm's task id): one
    process speaks for the whole job to slurmctld."""
    return environ.get("RANK", environ.get("SLURM_PROCID", "0")) == "0"


def show_job(job: str, run=subprocess.run) -> dict[str, str] | None:
    """slurmctld's record of `job` as {field: value} (`scontrol show job -o`); None when scontrol is
    missing (silently: no Slurm here) or does not answer."""
    if shutil.which("scontrol") is None:
        return None
    r = command(["scontrol", "show", "job", "-o", job], run)
    if isinstance(r, str):
        log.warning("scontrol show job %s: %s", job, r)
        return None
    if r.returncode != 0:
        log.warning("scontrol show job %s exited %d: %s", job, r.returncode, r.stderr.strip()[:200])
        return None
    return fields(r.stdout)


def being_preempted(record: Mapping[str, str]) -> bool:
    """Whether slurmctld is preempting the job with a grace period: still RUNNING, with a
    PreemptTime. (scancel and a preemption without grace leave it COMPLETING.)"""
    return record.get("JobState") == "RUNNING" and record.get("PreemptTime", "None") not in ("None", "Unknown", "")


def requeue(job: str, run=subprocess.run) -> str | None:
    """`scontrol requeue JOB`; None when slurmctld took it, else why not."""
    r = command(["scontrol", "requeue", job], run)
    if isinstance(r, str):
        return r
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")[:200]
