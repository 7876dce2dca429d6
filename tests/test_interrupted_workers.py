"""A stop signal that lands while a DataLoader starts or runs its worker processes (Ctrl-C to the whole
group while `dlpipe bench` or `dlpipe tune` measures): the workers end before the KeyboardInterrupt
leaves the measurement, and the iterator's collection (at interpreter exit, in a real job) prints
nothing ("Exception ignored in ... _MultiProcessingDataLoaderIter.__del__ ... AttributeError:
... '_workers_status'" under load in test_task_signals' Ctrl-C test).

The signal is forced at each point: raising KeyboardInterrupt there is what the stop handler
(dlpipe.stop.stop_at_once) does when the signal lands there."""

import gc
import sys
from contextlib import contextmanager
from multiprocessing.context import ForkContext, ForkProcess

import pytest
import torch
from torch.utils.data import TensorDataset
from torch.utils.data._utils import signal_handling

from dlpipe.loader import worker_signals
from dlpipe.loader.measure import measure
from dlpipe.loader.worker_signals import SignalSafeLoader, _EndsWorkersOnError, worker_init_fn


class RecordingFork(ForkContext):
    """The fork context, recording each worker process it starts; its `interrupt_at`-th start is
    interrupted before it forks."""

    def __init__(self, interrupt_at: int | None = None):
        self.started: list[ForkProcess] = []
        context = self

        class Process(ForkProcess):
            def start(self):
                if len(context.started) + 1 == interrupt_at:
                    raise KeyboardInterrupt
                super().start()
                context.started.append(self)

        self.Process = Process


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def interrupt_at_the_third_batch(get_data):
    calls = []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return get_data(self)

    return interrupted


@contextmanager
def interrupted_as_it_ends():
    yield
    raise KeyboardInterrupt


def interrupt_once_built(monkeypatch):
    """The signal lands as the iterator's construction returns (the warning filters around it end)."""
    monkeypatch.setattr(worker_signals, "_worker_count_warning_silenced", interrupted_as_it_ends)


WHERE = {
    # the second worker about to fork, the first one started (PyTorch keeps no status of either yet)
    "as the second worker starts": lambda monkeypatch: None,
    # every worker started, before PyTorch's bookkeeping of them: the state of the traceback under load
    "before the workers' bookkeeping": lambda monkeypatch: monkeypatch.setattr(
        signal_handling, "_set_worker_pids", interrupt),
    # the iterator whole, before the DataLoader holds it
    "once the iterator is built": interrupt_once_built,
    # mid-measurement, inside next() (the traceback then holds the iterator)
    "inside next()": lambda monkeypatch: monkeypatch.setattr(
        _EndsWorkersOnError, "_get_data", interrupt_at_the_third_batch(_EndsWorkersOnError._get_data)),
}


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-pass"])
@pytest.mark.parametrize("where", list(WHERE))
def test_ctrl_c_ends_the_started_workers_before_it_leaves_the_measurement(monkeypatch, where, persistent):
    context = RecordingFork(interrupt_at=2 if where == "as the second worker starts" else None)
    loader = SignalSafeLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2,
                              persistent_workers=persistent, multiprocessing_context=context,
                              worker_init_fn=worker_init_fn())
    gc.collect()  # what earlier tests left is theirs to report
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    WHERE[where](monkeypatch)
    with pytest.raises(KeyboardInterrupt) as stopped:
        try:  # as `dlpipe bench` measures
            measure(loader, batches=8, warmup=1)
        finally:
            loader.shutdown()
    monkeypatch.undo()  # PyTorch's own again, from here on
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    # the workers started are gone as the stop leaves the measurement, not when the interpreter exits
    assert context.started and [p.is_alive() for p in context.started] == [False] * len(context.started)
    # the traceback held the iterator; freed (as at exit), it is collected without a word
    del stopped
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value} in {u.object}" for u in unraisable] == []


class BlockedSignals(torch.utils.data.Dataset):
    """Each item: whether each stop signal is blocked in the worker now, and was when its init began
    (`forked_with`, set by the test's init: what the worker was forked with, before our code ran)."""

    forked_with: tuple = ()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import signal

        now = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return torch.tensor([[s in now for s in worker_signals.STOP_SIGNALS],
                             [s in self.forked_with for s in worker_signals.STOP_SIGNALS]])


def test_forked_workers_start_with_the_stop_signals_blocked_and_unblock_them_in_init_worker(monkeypatch):
    """A signal in the few ms between a worker's fork and its handlers would kill it (group SIGTERM,
    Ctrl-C): the parent blocks the stop signals while it forks, the worker unblocks them once its
    handlers are in place, and the parent's mask is as it was once the workers run."""
    import signal

    from torch.utils.data import get_worker_info

    init = worker_signals.init_worker

    def recording_init(stop_began, worker_id):
        get_worker_info().dataset.forked_with = tuple(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        init(stop_began, worker_id)

    monkeypatch.setattr(worker_signals, "init_worker", recording_init)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    loader = SignalSafeLoader(BlockedSignals(), batch_size=None, num_workers=2, multiprocessing_context="fork",
                              worker_init_fn=worker_signals.worker_init_fn())
    items = list(loader)
    assert len(items) == 4
    for item in items:
        assert not item[0].any()  # unblocked once init_worker ran: SIGTERM reaches the handlers
        assert item[1].all()  # and blocked from the fork until then
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before  # the parent's mask restored
