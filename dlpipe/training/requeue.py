"""Requeueing a stopped job through submitit (Hydra's submitit launcher, locally or on Slurm).

submitit asks a job to stop with one signal (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says
otherwise), sent before a time limit or on preemption. Its own handler would checkpoint the
launcher's call and requeue it at once, in the middle of a training step. dlpipe's stop handler
(dlpipe.stop.stop_gracefully) takes that signal instead: training stops at the next optimizer step, the
checkpoint and the MLflow run are written, and only then is submitit's handler, which
stop_gracefully has put back, called to requeue the same call. The requeued job gets the same
overrides and the same output directory (Hydra's launcher keeps the sweep's resolved timestamps),
so the usual resume finds the checkpoint and reopens the same MLflow run.
"""

import logging
import os
import signal

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
    """After a stop by submitit's signal was recorded: let submitit requeue the job.

    submitit's handler ends this process (SystemExit) when it requeues, and raises when it will
    not (e.g. the job timed out more often than max_num_timeout allows); on ranks other than 0 it
    returns (rank 0 requeues the whole job). Any other stop returns here and exits as usual.
    """
    sig = submitit_signal()
    if sig is None or stopped_by != sig.name:
        return
    handler = signal.getsignal(sig)
    if not callable(handler):
        return  # not started by submitit's job runner after all: nothing to hand over to
    log.warning("%s from submitit: checkpoint written, handing the job back to submitit to requeue it", sig.name)
    handler(sig, None)
