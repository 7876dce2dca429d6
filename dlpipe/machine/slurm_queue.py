"""Where a submitted Slurm job stands, asked of slurmctld and of Slurm's accounting, and its cancel.

submitit learns how a job ended only from `sacct` (Slurm's accounting, slurmdbd): where that fails
it bypasses the error and keeps the job UNKNOWN, so a job that ended without writing its result is
waited for for ever. slurmctld itself knows every job still queued or running, and for MinJobAge
(300 s by default) after its end also how it ended: `squeue -t all -r -j IDS` lists them all, array
tasks one by one. Measured on Slurm 22.05: a job slurmctld has forgotten is not listed (and when none
of the ids asked is known, squeue exits 1 with "Invalid job id specified"); with slurmdbd stopped,
`sacct` exits 1 with "sacct: error: Problem talking to the database: Connection refused".

A leaf module: nothing read at import.
"""

import subprocess
from typing import NamedTuple

from dlpipe.machine.slurm import command, last_line

ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT"})
"""Slurm job states after which the job runs no more (unless Slurm requeues it: PREEMPTED, TIMEOUT
under submitit's requeue go back to PENDING)."""
FORGOTTEN = "Invalid job id specified"


class Listed(NamedTuple):
    """A job as squeue lists it: its state, and why it waits (`Resources`, `PartitionDown`...;
    `None`, Slurm's word, where it does not)."""

    state: str
    reason: str = "None"


def parse_squeue(text: str) -> dict[str, Listed]:
    """`squeue -h -o %i|%T|%r` as {job id: Listed}."""
    listed = {}
    for line in text.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job and state:
            listed[job] = Listed(state.split()[0], reason.strip() or "None")
    return listed


def queue_states(job_ids: list[str], run=subprocess.run) -> dict[str, Listed] | str:
    """{job id: Listed} for every job of `job_ids` slurmctld still knows (an array's tasks by
    ARRAY_TASK ids); a job it forgot is absent. A string says why squeue did not answer."""
    r = command(["squeue", "-h", "-t", "all", "-r", "-j", ",".join(job_ids), "-o", "%i|%T|%r"], run)
    if isinstance(r, str):
        return r
    if r.returncode != 0:
        if FORGOTTEN in r.stderr:
            return {}
        return f"squeue exited {r.returncode}: {last_line(r.stderr)}"
    return parse_squeue(r.stdout)


def accounting_state(job_id: str, run=subprocess.run) -> tuple[str | None, str | None]:
    """(the job's last state in Slurm's accounting or None, why sacct could not tell or None)."""
    r = command(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], run)
    if isinstance(r, str):
        return None, r
    if r.returncode != 0:
        return None, f"sacct exited {r.returncode}: {last_line(r.stderr)}"
    states = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return (states[-1] if states else None), None


def cancel(job_ids: list[str], run=subprocess.run) -> str | None:
    """`scancel IDS`; None when slurmctld took it, else why not."""
    r = command(["scancel", *job_ids], run)
    if isinstance(r, str):
        return r
    return None if r.returncode == 0 else f"scancel exited {r.returncode}: {last_line(r.stderr)}"
