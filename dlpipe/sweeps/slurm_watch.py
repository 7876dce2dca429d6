"""Watching a sweep's Slurm jobs until each has a result or has ended without one.

submitit's `Job.results()` waits until the job's result file appears or `sacct` says it ended; where
Slurm's accounting does not answer it keeps the job UNKNOWN and waits for ever. Here slurmctld is
asked too (machine.slurm_queue): a job that slurmctld lists as ended, or no longer lists at all, and
that still has no result after RESULT_GRACE_S (its result is written before its process exits; the
grace covers a slow shared filesystem and a PREEMPTED or TIMEOUT job going back to PENDING) has ended
without one, and says how in one line.

A job that waits in the queue is said to wait, with squeue's reason, so that a sweep never waits
without a word: at once for a reason that needs a person (`PartitionDown`, a QOS or account limit,
`ReqNodeNotAvail`...), after PENDING_SAY_S for the queue's own pace (`Resources`, `Priority`), and
again only when it changes between those kinds or to another reason that needs a person (a busy
queue's `Priority` and `Resources` take turns: said once); a job that ran and waits again is new.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dlpipe.machine.slurm_queue import ENDED, Listed, accounting_state, queue_states

RESULT_GRACE_S = 15.0
PENDING_SAY_S = 60.0
QUEUE_PACE = frozenset({"None", "Priority", "Resources", "BeginTime", "Dependency"})
"""squeue's reasons for a wait that ends by itself: a busy cluster, a requeued job's start delay."""
QUEUE_EVERY_S = 5.0  # squeue costs slurmctld one RPC for the whole sweep
CANCELLED = "cancelled: scancel"  # Slurm's own ends (time limit, preemption) have states of their own


@dataclass
class Watched:
    """One submitted job: its Hydra job number, Slurm id, log, and what slurmctld last said of it."""

    num: int
    job_id: str
    log: Path
    has_result: Callable[[], bool]
    state: str | None = None  # slurmctld's last word (None: not listed, or not asked yet)
    reason: str | None = None  # why it waits, as squeue says (PENDING only)
    pending_since: float | None = None
    told: str | None = None  # what was last said of its wait (its reason, or QUEUE_PACE's for the queue's pace)
    gone_since: float | None = None  # when it was first seen ended or unlisted without a result
    lost: str | None = None  # how it ended without a result, once decided

    def named(self) -> str:
        return f"#{self.num} (Slurm {self.job_id})"


def update(job: Watched, states: dict[str, Listed], now: float) -> None:
    """Take slurmctld's answer (the jobs it still knows) into `job`; mark it lost once it has been
    ended or unlisted for RESULT_GRACE_S with no result."""
    listed = states.get(job.job_id)
    job.state = listed.state if listed else None
    pending = job.state == "PENDING"
    job.reason = listed.reason if pending else None
    job.pending_since = (now if job.pending_since is None else job.pending_since) if pending else None
    if not pending:
        job.told = None  # requeued, it may wait again: that is news
    if job.has_result() or (job.state is not None and job.state not in ENDED):
        job.gone_since = None
        return
    if job.gone_since is None:
        job.gone_since = now
    elif now - job.gone_since >= RESULT_GRACE_S:
        job.lost = job.state or "left the queue"


def how_it_ended(job: Watched, accounting=accounting_state) -> tuple[str, str | None]:
    """(what ended `job`, for one line; why Slurm's accounting could not tell, or None)."""
    state, why = accounting(job.job_id)
    state = job.state or state
    if state == "CANCELLED":
        return CANCELLED, why
    if state is None:
        return "left the queue without a result; how it ended is unknown", why
    return f"ended {state} without a result", why


def lost_line(jobs: list[Watched], accounting=accounting_state) -> tuple[str, str]:
    """(the sweep's parent run's status, one line) for the jobs that ended without a result: which,
    how, where their logs are, and that submitit needs Slurm's accounting where it did not answer.
    KILLED when every one was cancelled, else FAILED."""
    told = [(job, *how_it_ended(job, accounting)) for job in jobs]
    status = "KILLED" if all(how == CANCELLED for _, how, _ in told) else "FAILED"
    first, how, _ = told[0]
    same = [job for job, h, _ in told if h == how]
    if len(same) > 1:
        nums = ", ".join(f"#{j.num}" for j in same)
        ids = ", ".join(j.job_id for j in same)
        line = f"jobs {nums} (Slurm {ids}) {how}; their logs: {first.log.parent.parent}/*/"
    else:
        line = f"job {first.named()} {how}; its log: {first.log}"
    others = len(told) - len(same)
    if others:
        line += f"; {others} more job{'s' if others > 1 else ''} ended without a result"
    why = next((w for _, _, w in told if w), None)
    if why:
        line += f"; Slurm accounting did not answer ({why}): submitit needs it (slurmdbd) to see how jobs end"
    return status, line


def waiting_line(jobs: list[Watched], now: float) -> str | None:
    """One line for the jobs whose wait is news: a reason that needs a person, or the queue's own
    pace for PENDING_SAY_S; None where there is none. Said once a job for each reason that needs a
    person, once for the queue's pace however its reasons alternate."""
    due = [j for j in jobs if j.reason not in (None, "None")  # "None": just submitted, nothing to say yet
           and _kind(j.reason) != j.told and (j.reason not in QUEUE_PACE or now - j.pending_since >= PENDING_SAY_S)]
    if not due:
        return None
    parts = []
    for reason in dict.fromkeys(j.reason for j in due):
        same = [j for j in due if j.reason == reason]
        for j in same:
            j.told = _kind(reason)
        waited = now - min(j.pending_since for j in same)
        who = (f"job {same[0].named()} is" if len(same) == 1 else
               f"jobs {', '.join(f'#{j.num}' for j in same)} (Slurm {', '.join(j.job_id for j in same)}) are")
        parts.append(f"{who} waiting in the queue ({waited:.0f} s so far): {reason} (squeue's reason)")
    return "; ".join(parts)


def _kind(reason: str) -> str:
    """What is said of a wait: the reason that needs a person, or the queue's pace as one."""
    return "the queue's pace" if reason in QUEUE_PACE else reason


def watch(jobs: list[Watched], queue=queue_states, accounting=accounting_state, clock=time.monotonic,
          sleep=time.sleep, warn=lambda why: None, tell=lambda line: None) -> list[Watched]:
    """Wait until every job has a result or is lost; the lost ones. `warn(why)` is told once when
    slurmctld does not answer: the jobs are then judged by their result files and Slurm's accounting.
    `tell(line)` is told why jobs wait in the queue (waiting_line)."""
    warned = False
    last_asked = float("-inf")
    while True:
        open_jobs = [j for j in jobs if not j.has_result() and j.lost is None]
        if not open_jobs:
            return [j for j in jobs if j.lost is not None]
        now = clock()
        if now - last_asked >= QUEUE_EVERY_S:
            last_asked = now
            states = queue([j.job_id for j in open_jobs])
            if isinstance(states, str):  # slurmctld does not answer: accounting's word, where it answers
                if not warned:
                    warn(states)
                    warned = True
                told = {j.job_id: accounting(j.job_id)[0] for j in open_jobs}
                states = {job: Listed(state) for job, state in told.items() if state is not None}
                open_jobs = [j for j in open_jobs if j.job_id in states]
            for job in open_jobs:
                update(job, states, now)
            line = waiting_line(open_jobs, now)
            if line:
                tell(line)
        sleep(1.0)
