"""DataLoader workers survive the stop signal their main process is handling.

A stop signal often reaches every process of the job, not only the main one: Ctrl-C goes to the
terminal's process group, `scancel` and Slurm's pre-emption warning to every process of the step,
`kill -TERM -PGID` to the group. SIGTERM, SIGUSR1 and SIGUSR2 kill a process by default, so the
workers would die while the main process is still on its way to a clean stop, and the run would end
FAILED ("worker killed by signal") instead of KILLED with a checkpoint.

So a worker ignores SIGINT, and on SIGTERM/SIGUSR1/SIGUSR2 checks whether the main process began a
stop within the last few seconds (dlpipe.stop's shared clock, which its signal handler sets): then it is the same
signal, and the main process shuts the worker down itself. Otherwise (the main process stopping a
stuck worker with terminate(), or a signal meant for this worker only) it dies as it would have.

A forked worker starts with the stop signals blocked (its parent blocks them while it forks) and
unblocks them in worker_init_fn, so a signal in between waits for its handlers.
A spawned (or forkserver) worker runs no Python code of ours until worker_init_fn, seconds after it
starts, and the signal mask is not inherited through exec here, so a signal in that window still
kills it. For that case PyTorch's SIGCHLD handler (which raises wherever the main thread is) is made
to stand aside during a stop, and the trainer treats "worker died" from next() as the stop itself.
"""

import os
import signal
import threading
import time
import warnings
from contextlib import contextmanager
from functools import partial
from multiprocessing import forkserver, resource_tracker
from pickle import PicklingError

from torch.utils.data import DataLoader
from torch.utils.data._utils.signal_handling import _set_SIGCHLD_handler
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from dlpipe.errors import DataError
from dlpipe.loader.threads import let_threads_end
from dlpipe.stop import EXITING, STOP_SIGNALS, stop_clock, stopping

# Workers leave Ctrl-C to the main process (ignored) and handle the other stop signals themselves.
WORKER_SIGNALS = tuple(sig for sig in STOP_SIGNALS if sig != signal.SIGINT)
SAME_SIGNAL_WINDOW_S = 3.0  # a stop begun this recently by the main process is the signal we got
WAIT_FOR_MAIN_S = 5.0  # the main process may be inside a long C call before its handler runs


def _on_stop_signal(stop_began, signum, frame) -> None:
    deadline = time.monotonic() + WAIT_FOR_MAIN_S
    while True:
        began = stop_began.value
        if began == EXITING:
            break
        if began and time.monotonic() - began < SAME_SIGNAL_WINDOW_S:
            return  # the main process is stopping for this signal and will shut us down
        if began or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal, as without this handler


def init_worker(stop_began, worker_id: int) -> None:
    """worker_init_fn (bound to the shared stop clock with functools.partial)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    for sig in WORKER_SIGNALS:
        signal.signal(sig, partial(_on_stop_signal, stop_began))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked since the fork (_EndsWorkersOnError)


def worker_init_fn():
    return partial(init_worker, stop_clock())


def start_helper_processes(context: str | None) -> None:
    """Start multiprocessing's helper processes for spawn/forkserver workers with the stop signals
    ignored (a disposition that survives exec), so a signal to the whole job cannot kill them.

    Without this, a group SIGUSR1 kills the resource tracker (which ignores only SIGINT and
    SIGTERM; its replacement then prints a KeyError traceback), and a group SIGTERM the forkserver.
    Call it before the job's own stop handlers are installed: until then these signals would have
    killed this process outright, so ignoring them for the few milliseconds this takes loses nothing.
    """
    if context not in ("spawn", "forkserver"):
        return
    ignored = STOP_SIGNALS
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    try:
        resource_tracker.ensure_running()
        if context == "forkserver":
            forkserver.ensure_running()  # its workers inherit the ignored signals until init_worker
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_child_exit(previous, signum, frame) -> None:
    if stopping():
        # stopping: next() reports dead workers, at a point where the trainer can stop cleanly;
        # exiting: multiprocessing is ending the workers itself
        return
    if callable(previous):
        previous(signum, frame)


@contextmanager
def _worker_count_warning_silenced():
    """PyTorch warns when a loader is built, and again on every iterator, when num_workers exceeds
    os.sched_getaffinity; the lint says it once, against the real budget (cgroup quota and Slurm
    included), with the fix. Scoped to those calls: no process-wide filter."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create .* worker processes",
                                category=UserWarning)
        yield


class _EndsWorkersOnError(_MultiProcessingDataLoaderIter):
    """PyTorch's worker-process iterator, whose workers stop as soon as an error leaves next(). PyTorch
    stops them when the iterator is collected, and the error's traceback holds it: kept in a reference
    cycle (a caller that logs or stores the error), it is only collected by a later gc pass, which then
    spends MP_STATUS_CHECK_INTERVAL (5 s) per worker waiting for workers whose queues gc already closed.

    The same when the iterator's construction is cut short (a stop signal raising KeyboardInterrupt or
    Terminated while it starts its workers, as Ctrl-C to the group does): PyTorch starts the workers one
    by one and only then sets up its bookkeeping of them (_workers_status), so the half-built iterator,
    which no DataLoader holds yet, would live on in the traceback until the interpreter ends, and its
    __del__ would then fail on the missing bookkeeping ("Exception ignored in ... __del__ ...
    AttributeError: ... '_workers_status'") after leaving the started workers to be terminated."""

    def __init__(self, loader):
        main = os.getpid()
        # A forked worker inherits this thread's signal mask: it starts with the stop signals blocked
        # and unblocks them in init_worker, once its own handlers are in place. A signal to the whole
        # job in between (a worker of the same loader signalling the group, Ctrl-C) then waits for
        # them, instead of killing a worker that has not run a line of ours yet.
        ours = getattr(loader.worker_init_fn, "func", None) is init_worker
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if ours else None
        try:
            super().__init__(loader)
        except BaseException:
            if os.getpid() != main:
                # a worker the signal reached right after its fork, before multiprocessing's child branch
                # (which always ends in os._exit): it must not run on through its parent's frames, ending
                # the parent's tracking run and printing the parent's message a second time
                os._exit(1)
            self._end_half_built()
            raise
        finally:
            if blocked is not None and os.getpid() == main:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _end_half_built(self) -> None:
        """Stop the workers a cut-short construction had started, through PyTorch's own shutdown, so its
        __del__ finds nothing left to do. A worker forked in the very instant the signal landed, before
        PyTorch recorded it, is out of reach: it ends on its own once this process is gone (its watchdog)."""
        if hasattr(self, "_pin_memory_thread_done_event"):
            self._pin_memory_thread_done_event.set()  # a pin-memory thread started but not yet recorded ends too
        if not hasattr(self, "_workers"):
            self._shutdown = True  # cut before any worker started: nothing to stop
            return
        if not hasattr(self, "_workers_status"):
            self._workers_status = [True] * len(self._workers)  # started, and never given work
        self._shutdown_workers()

    def _next_data(self):
        try:
            return super()._next_data()
        except StopIteration:
            raise
        except Exception:
            self._shutdown_workers()
            raise


class SignalSafeLoader(DataLoader):
    """A DataLoader whose workers leave stopping to the main process (see the module docstring)."""

    def shutdown(self) -> None:
        """Stop persistent workers now (they would otherwise live until the loader is collected,
        or be terminated at interpreter exit)."""
        iterator = getattr(self, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._iterator = None

    def __init__(self, *args, reseed: int | None = None, **kwargs):
        """`reseed`: a seed the generator is reset to before every pass, so that each pass starts its
        workers from the same base seed (validation: see dlpipe.loader.build)."""
        self.reseed = reseed
        with _worker_count_warning_silenced():
            super().__init__(*args, **kwargs)

    def _start_workers(self) -> "_EndsWorkersOnError":
        """The workers' iterator; a dataset that spawn or forkserver cannot send to them is one line
        (PyTorch re-raises the pickle error of Process.start, after a warning meant for itself, which
        _get_iterator silences: no code runs here once the iterator is built, see _get_iterator)."""
        try:
            return _EndsWorkersOnError(self)
        except (TypeError, AttributeError, PicklingError) as e:
            if "pickle" not in str(e).lower() and not isinstance(e, PicklingError):
                raise
            method = getattr(self.multiprocessing_context, "get_start_method", lambda: "spawn")()
            raise DataError(f"loader.multiprocessing_context={method}: the dataset (or collate_fn) cannot be sent to "
                            f"worker processes ({type(e).__name__}: {str(e).splitlines()[0]}): {method} pickles "
                            "it, so it may hold no lambda, open file or lock; use loader.multiprocessing_context=fork, "
                            "loader.worker_method=thread, or make it picklable") from e

    def _get_iterator(self):
        if self.reseed is not None and self.generator is not None:
            self.generator.manual_seed(self.reseed)
        if not self.num_workers:
            with _worker_count_warning_silenced():
                return super()._get_iterator()
        let_threads_end()  # a fork while another loader's threads hold a lock leaves the child stuck on it
        if threading.current_thread() is threading.main_thread():
            # PyTorch's SIGCHLD handler raises "worker exited unexpectedly" wherever the main thread is,
            # mid optimizer step included; while a stop is under way, let next() say it. Installed (once a
            # process) before the workers start rather than by the iterator as it starts them, so that a
            # worker the same signal killed cannot turn the stop into that error while they start or stop.
            _set_SIGCHLD_handler()
            previous = signal.getsignal(signal.SIGCHLD)
            if getattr(previous, "func", None) is not _on_child_exit:
                signal.signal(signal.SIGCHLD, partial(_on_child_exit, previous))
        iterator = None
        try:
            with _worker_count_warning_silenced(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Got pickle error when attempting to start a worker")
                self.check_worker_number_rationality()
                iterator = self._start_workers()
        except BaseException:
            # a stop signal landing here, once the iterator is built: no DataLoader holds it yet, so its
            # workers end now, not when the traceback that holds it is freed (at exit)
            if iterator is not None:
                iterator._shutdown_workers()
            raise
        return iterator
