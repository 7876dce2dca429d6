"""Stopping a job on a signal, in one place: which signals, what they request, and how the request
travels from the signal handler to the training loop and to the DataLoader workers.

SIGTERM (Slurm preemption, `kill`, `docker stop`), SIGINT (Ctrl-C) and SIGUSR1/2 (Slurm's advance
warning, submitit's requeue signal) ask training to stop at its next optimizer step, where the job
writes a checkpoint and ends its run KILLED. A second signal while training stops at once (the loader
may be stuck), unless it comes within SAME_STOP_S of the first and is not Ctrl-C: Slurm's preemption
sends SIGTERM, SIGCONT, SIGTERM within about 10 ms, which is one request, not an insisting user. Once
the stop is being recorded, further signals are ignored so they cannot cut a checkpoint or the run's
status short.

The same signal often reaches the DataLoader workers too (Ctrl-C goes to the terminal's process
group, `scancel` to every process of the step). Workers read a shared timestamp of when the main
process began its stop (`stop_began`), so they can tell "the stop the main process is handling"
from a signal meant for them alone (dlpipe.loader.worker_signals).

A leaf module (no torch, no tracking): the runner, the loader, the tasks, the tracking run and the
CLI all import it.
"""

import _thread
import atexit
import logging
import multiprocessing
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("dlpipe")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
EXITING = -1.0  # the stop clock's value once this process exits: workers still alive go at once
# A repeat this soon after the first stop signal is the same request (Slurm repeats SIGTERM within
# ~10 ms; a person's second Ctrl-C or `kill` takes longer, and SIGINT always insists).
SAME_STOP_S = 1.0


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

    first_at = 0.0  # when this block's first stop signal came (monotonic seconds)

    def handler(signum, frame):
        nonlocal first_at
        name = signal.Signals(signum).name
        if request.recording:
            if signum == requeue_signal:
                request.signal = name  # this rank's own signal from submitit still means "requeue"
            log.warning("%s ignored: the stop is being recorded", name)
            return
        if not request.requested:
            first_at = stop_clock().value = time.monotonic()  # workers that got it too leave their shutdown to us
            request.signal = name
            log.warning("%s received: stopping at the next optimizer step (send it again to stop at once)", name)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if first_at and time.monotonic() - first_at < SAME_STOP_S:
            log.warning("%s again within %.0f s of %s: the same stop request", name, SAME_STOP_S, request.signal)
            return
        raise Terminated(name)

    stop_clock().value = 0.0
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        stop_clock().value = 0.0
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_at_once() -> "AtOnce":
    """From the first moment of a job until a task installs its own handlers (stop_gracefully): a
    stop signal ends the job where it is, SIGINT as KeyboardInterrupt, the others as Terminated, so
    whatever the task has open (its tracking runs, a trial's run, a temp file) ends KILLED or is
    removed on the way out, and the CLI prints its one line. Without this SIGTERM, SIGUSR1 and
    SIGUSR2 kill the process outright: runs left RUNNING, nothing printed.

    Only signals still at Python's default are taken: a sweep's handler (sweeps.callback) and
    submitit's already end the job their own way (and SIG_IGN, e.g. `nohup`, stays). Call
    restore_handlers with what this returns when the job ends."""
    return AtOnce()


class AtOnce:
    """stop_at_once's handler and what it knows.

    An exception raised from a signal handler lands in whatever Python code runs at that moment.
    Two places cannot take it: a tracking write (raised inside MLflow's SQL or HTTP call it leaves a
    run RUNNING, or a SQLite connection holding its lock, so the run's end waits forever), so those
    hold the signal and raise it right after (Unbroken); and code whose exceptions Python ignores
    (an at-fork hook when a DataLoader forks its workers, a __del__), which swallows it: until the
    stop is seen on its way out, it is raised again every REDELIVER_S."""

    REDELIVER_S = 1.0

    def __init__(self):
        self.signal: str | None = None  # the stop signal raised, once one came
        self.restored = threading.Event()
        defaults = (signal.SIG_DFL, signal.default_int_handler)
        self.previous = {sig: signal.signal(sig, self.handler) for sig in STOP_SIGNALS
                         if signal.getsignal(sig) in defaults}
        self.previous_hook, sys.unraisablehook = sys.unraisablehook, self.unraisable

    def handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None and _on_its_way(sys.exc_info()[1]):
            return  # raised and being handled: the runs are ending
        if _hold(name):  # inside a tracking write: Unbroken raises it once that is done
            self._began(name)
            return
        if self.signal is None:
            self._began(name)
            threading.Thread(target=self._redeliver, args=(signum,), daemon=True, name="dlpipe-stop").start()
        raise stop_error(self.signal)

    def _began(self, name: str) -> None:
        if self.signal is None:
            self.signal = name
            if _stop_began is not None:  # DataLoader workers exist: the same signal's shutdown is ours
                _stop_began.value = time.monotonic()

    def _redeliver(self, signum: int) -> None:
        while not self.restored.wait(self.REDELIVER_S):
            if signal.getsignal(signum) != self.handler:
                return  # another handler took over (e.g. a failed rank's ignore_termination): it decides
            _thread.interrupt_main(signum)  # the handler raises it again unless it is on its way out

    def unraisable(self, unraisable) -> None:
        """sys.unraisablehook: a stop swallowed where Python ignores exceptions is raised again
        (_redeliver), not printed as a traceback."""
        if self.signal is not None and isinstance(unraisable.exc_value, KeyboardInterrupt | Terminated):
            return
        self.previous_hook(unraisable)

    def restore(self) -> None:
        self.restored.set()
        sys.unraisablehook = self.previous_hook
        for sig, old in self.previous.items():
            signal.signal(sig, old)


def _on_its_way(exc: BaseException | None) -> bool:
    """Whether `exc` (the exception being handled where the signal landed) is a stop, or one raised
    while a stop was being handled."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt | Terminated):
            return True
        exc = exc.__context__
    return False


def hold_or_raise(name: str) -> None:
    """For a stop handler of another's (the sweep's): inside a tracking call the stop is held for it
    (Unbroken raises it once the call is done), else raised here; a second one is raised at once."""
    if not _hold(name):
        raise stop_error(name)


def _hold(name: str) -> bool:
    """Hold the stop `name` if a tracking call runs and holds none yet (a second one is not held)."""
    if _held is not None and not _held:
        _held.append(name)
        return True
    return False


def stop_error(name: str) -> BaseException:
    """What a stop signal raises: KeyboardInterrupt for SIGINT (the CLI's exit 130), else Terminated (143)."""
    return KeyboardInterrupt() if name == "SIGINT" else Terminated(name)


# The stop signal stop_at_once's handler holds back while a tracking call runs (a list while
# holding, else None); a second one is raised at once: the user insists.
_held: list[str] | None = None


@contextmanager
def _holding():
    global _held
    if threading.current_thread() is not threading.main_thread():
        yield []  # signals reach the main thread only: held for another thread, they would be lost there
        return
    outer, _held = _held, []
    try:
        yield _held
    finally:
        _held = outer


class Unbroken:
    """A context manager (a tracking run) whose every call a stop signal cannot cut in two: raised
    inside MLflow's create_run, a signal would leave a run created but never ended (RUNNING
    forever); inside a write, a SQLite connection holding its lock; inside its end, a run never
    marked ended. With stop_at_once's handler installed, a signal in those moments is held and
    raised right after: once the run is open, as the block's exception (the run ends KILLED); once
    it has ended, as the job's stop. The block gets the run with each method so held.

    `make()` creates the context manager (e.g. `lambda: MlflowRun(...)`)."""

    def __init__(self, make):
        self.make = make
        self.inner = None

    def __enter__(self):
        with _holding() as held:
            try:
                self.inner = self.make()
                entered = self.inner.__enter__()
            except BaseException as error:
                if held:  # no run to end: the stop is what the job ends with
                    raise stop_error(held[0]) from error
                raise
        if held:
            stop = stop_error(held[0])
            self.__exit__(type(stop), stop, None)
            raise stop
        return HeldCalls(entered)

    def __exit__(self, exc_type, exc, tb) -> bool:
        with _holding() as held:
            swallowed = self.inner.__exit__(exc_type, exc, tb)
        if held and not _on_its_way(exc):  # a stop held while the run ended outranks the block's error
            raise stop_error(held[0]) from exc
        return swallowed


class HeldCalls:
    """`target` with each method called as one piece (Unbroken); attributes pass through."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def held(*args, **kwargs):
            with _holding() as signals:
                try:
                    result = value(*args, **kwargs)
                except BaseException as error:
                    if signals:  # the stop still ends the job, whatever the call raised
                        raise stop_error(signals[0]) from error
                    raise
            if signals:
                raise stop_error(signals[0])
            return result

        return held

    def __setattr__(self, name: str, value) -> None:
        setattr(self._target, name, value)


def restore_handlers(stop: AtOnce) -> None:
    """Put back the handlers stop_at_once replaced; a stop raised is not raised again."""
    stop.restore()


def ignore_termination(why: str) -> None:
    """For the rest of this process, SIGTERM is logged (`why`) and ignored. For a data-parallel rank
    whose job failed: torchrun sends SIGTERM to every other rank as soon as one exits, and this rank
    must still free its model, close its connections and print its one line. It ends right after
    (one job per rank); should that hang, torchrun kills it after its grace period."""

    def handler(signum, frame):
        log.warning("SIGTERM ignored: %s", why)

    signal.signal(signal.SIGTERM, handler)
