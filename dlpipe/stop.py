"""Stopping a job on a signal, in one place: which signals, what they request, and how the request
travels from the signal handler to the training loop and to the DataLoader workers.

SIGTERM (Slurm preemption, `kill`, `docker stop`), SIGINT (Ctrl-C) and SIGUSR1/2 (Slurm's advance
warning, submitit's requeue signal) ask training to stop at its next optimizer step, where the job
writes a checkpoint and ends its run KILLED. A second signal while training stops at once (the loader
may be stuck); once the stop is being recorded, further signals are ignored so they cannot cut a
checkpoint or the run's status short.

The same signal often reaches the DataLoader workers too (Ctrl-C goes to the terminal's process
group, `scancel` to every process of the step). Workers read a shared timestamp of when the main
process began its stop (`stop_began`), so they can tell "the stop the main process is handling"
from a signal meant for them alone (dlpipe.loader.worker_signals).

A leaf module (no torch, no tracking): the runner, the loader, the tasks, the tracking run and the
CLI all import it.
"""

import atexit
import logging
import multiprocessing
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("dlpipe")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
EXITING = -1.0  # the stop clock's value once this process exits: workers still alive go at once


class Terminated(BaseException):
    """The job was told to stop by a signal other than SIGINT; the run ends KILLED.
    (BaseException: no `except Exception` on the way out may swallow it.)"""


class StopTraining(Exception):
    """Training stopped on a stop request: at an optimizer step (`StopRequest.at_batch` says after
    which batch), or between steps when the loader's workers died of the same signal (at_batch None:
    there is no step to checkpoint)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class StopRequest:
    """What the signal handler tells the training loop; the loop reads it at every optimizer step."""

    signal: str | None = None
    """The first stop signal this process got (e.g. "SIGTERM"); None while none came."""
    by_peer: bool = False
    """Stopping because another rank of a data-parallel job was asked to (`signal` stays None)."""
    at_batch: int | None = None
    """Batches done in the epoch the stop interrupted, always at an optimizer step; None when the
    stop came between steps (the last finished epoch is then the resume point)."""
    recording: bool = False
    """The stop is being recorded (checkpoint, tracking run): further signals are ignored."""

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def interrupted_epoch(self) -> bool:
        """The epoch stopped at an optimizer step: there is a mid-epoch state to checkpoint."""
        return self.at_batch is not None

    def reason(self) -> str:
        return self.signal or ("a stop on another rank" if self.by_peer else "stop")


# The stop clock: when the main process began its stop (monotonic seconds), 0 while training,
# EXITING at interpreter exit. A RawValue from the spawn context is shared with workers of every
# start method (fork inherits it, spawn and forkserver get it pickled through worker_init_fn).
_stop_began = None


def stop_clock():
    """The shared clock (created on first use, never at import)."""
    global _stop_began
    if _stop_began is None:
        _stop_began = multiprocessing.get_context("spawn").RawValue("d", 0.0)
        # atexit runs last-registered first, so this runs before multiprocessing terminates the
        # remaining (daemonic) workers, which then must not wait for a stop that never comes
        atexit.register(_mark_exiting)
    return _stop_began


def _mark_exiting() -> None:
    stop_clock().value = EXITING


def stopping() -> bool:
    """Whether this process is stopping or exiting (the workers' shutdown is then ours)."""
    return bool(stop_clock().value)


@contextmanager
def stop_gracefully(request: StopRequest, requeue_signal: signal.Signals | None = None):
    """Route STOP_SIGNALS into `request` for the duration of the block (see the module docstring).

    `requeue_signal`: the signal submitit sends to ask for a requeue (dlpipe.training.requeue);
    it is remembered even while another rank's stop is being recorded, so the job still requeues.
    Enter it before the tracking run so it also covers ending the run.
    """

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if request.recording:
            if signum == requeue_signal:
                request.signal = name  # this rank's own signal from submitit still means "requeue"
            log.warning("%s ignored: the stop is being recorded", name)
            return
        if not request.requested:
            stop_clock().value = time.monotonic()  # workers that got the same signal leave their shutdown to us
            request.signal = name
            log.warning("%s received: stopping at the next optimizer step (send it again to stop at once)", name)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(name)

    stop_clock().value = 0.0
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        stop_clock().value = 0.0
        for sig, old in previous.items():
            signal.signal(sig, old)


def ignore_termination(why: str) -> None:
    """For the rest of this process, SIGTERM is logged (`why`) and ignored. For a data-parallel rank
    whose job failed: torchrun sends SIGTERM to every other rank as soon as one exits, and this rank
    must still free its model, close its connections and print its one line. It ends right after
    (one job per rank); should that hang, torchrun kills it after its grace period."""

    def handler(signum, frame):
        log.warning("SIGTERM ignored: %s", why)

    signal.signal(signal.SIGTERM, handler)
