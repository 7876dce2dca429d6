"""Requeueing a stopped job: through submitit (Hydra's submitit launcher, locally or on Slurm), or
through Slurm itself when Slurm's own SIGTERM says the job is being preempted.

submitit asks a job to stop with one signal (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says
otherwise), sent before a time limit or on preemption. Its own handler would checkpoint the
launcher's call and requeue it at once, in the middle of a training step. dlpipe's stop handler
(dlpipe.stop.stop_gracefully) takes that signal instead: training stops at the next optimizer step, the
checkpoint and the MLflow run are written, and only then is submitit's handler, which
stop_gracefully has put back, called to requeue the same call. The requeued job gets the same
overrides and the same output directory (Hydra's launcher keeps the sweep's resolved timestamps),
so the usual resume finds the checkpoint and reopens the same MLflow run.

Preemption by Slurm's default signal (SIGTERM; no `preempt_send_user_signal`) reaches the job with a
grace period: Slurm requeues it at the end only if it still runs, and a job that checkpointed and
exited would end FAILED, never requeued. So after the checkpoint the job requeues itself when
slurmctld's record says it is being preempted (dlpipe.machine.slurm, where the states are measured);
a `scancel` or a time limit ends the job as before (its run KILLED), and a preemption without grace
has already been requeued by Slurm.
"""

import logging
import os
import signal

from dlpipe.machine import slurm
from dlpipe.stop import ignore_termination

# Imported inside functions: submitit (optional: the slurm extra), only in a submitit job; the CLI imports
# this module.

log = logging.getLogger("dlpipe")


def submitit_signal() -> signal.Signals | None:
    """The signal submitit sends this job to stop it, or None outside a submitit job."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    from submitit import JobEnvironment

    return signal.Signals[f"SIG{JobEnvironment.USR_SIG}"]


def requeue_through_submitit(stopped_by: str) -> None:
    """After a stop was recorded (checkpoint written, run ended): requeue the job if the signal asked
    for it. Slurm's SIGTERM of a preemption with grace: through `scontrol requeue`. submitit's signal:
    through submitit's handler.

    submitit's handler ends this process (SystemExit) when it requeues, and raises when it will
    not (e.g. the job timed out more often than max_num_timeout allows); on ranks other than 0 it
    returns (rank 0 requeues the whole job). Any other stop returns here and exits as usual.
    """
    if stopped_by == "SIGTERM":
        requeue_if_preempted()
        return
    sig = submitit_signal()
    if sig is None or stopped_by != sig.name:
        return
    handler = signal.getsignal(sig)
    if not callable(handler):
        return  # not started by submitit's job runner after all: nothing to hand over to
    log.warning("%s from submitit: checkpoint written, handing the job back to submitit to requeue it", sig.name)
    handler(sig, None)


def requeue_if_preempted() -> None:
    """Under a Slurm job that slurmctld is preempting with a grace period, requeue it now (rank 0
    only: the requeue is the whole job's). Slurm's requeue sends SIGTERM again while this process
    ends: ignored from here on."""
    job = slurm.job_id()
    if job is None or not slurm.is_first_rank():
        return
    record = slurm.show_job(job)
    if record is None or not slurm.being_preempted(record):
        return
    ignore_termination(f"job {job} is requeued and this process is ending")
    why_not = slurm.requeue(job)
    if why_not is not None:
        log.warning("SIGTERM: Slurm is preempting job %s, but `scontrol requeue %s` failed (%s): the job ends "
                    "here; the checkpoint is written, run the same command to resume", job, job, why_not)
        return
    log.warning("SIGTERM: Slurm is preempting job %s (preempted at %s): checkpoint written, job requeued; it "
                "resumes from the checkpoint in the same MLflow run", job, record.get("PreemptTime"))
