"""Thread workers (loader.worker_method) and per-sample randomness (dlpipe.sample_rng): the same
batches whoever fetches them, the same errors and timeout as processes, and the auto choice."""

import ctypes
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import Dataset, Subset, get_worker_info

from dlpipe.errors import user_message
from dlpipe.loader import worker_method
from dlpipe.loader.build import build_loader
from dlpipe.loader.faults import NamedErrors, SampleError, explain_loader_failure
from dlpipe.loader.threads import ThreadLoader
from dlpipe.loader.worker_method import (
    THREAD_SCALING_MIN,
    Timed,
    choose,
    fit,
    global_draws,
    processes_forbidden,
)
from dlpipe.machine import cgroups
from dlpipe.sample_rng import SampleBatch, sample_generator, sample_seed
from dlpipe.schema import LoaderConfig


class Augments(Dataset):
    """Rows plus noise from the sample's own generator; `delay_s` of sleep (which releases the GIL)."""

    def __init__(self, size=48, delay_s=0.0):
        self.x, self.delay_s = torch.arange(size * 3, dtype=torch.float32).reshape(size, 3), delay_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i] + torch.randn(3, generator=sample_generator()), i


class GlobalNoise(Augments):
    """Draws its noise from Python's global `random`: processes seed it per worker, threads share it."""

    def __getitem__(self, i):
        return self.x[i] + random.random(), i


class HoldsTheGIL(Augments):
    """A C call that keeps the GIL while it works (here it waits 2 ms: ctypes.PyDLL does not release
    the GIL), as pure-Python augmentation or a GIL-holding extension does: threads cannot overlap it.
    Waiting, not computing, so a loaded machine does not blur the measurement."""

    def __getitem__(self, i):
        ctypes.PyDLL(None).usleep(2000)
        return super().__getitem__(i)


class FailsAt(Augments):
    def __getitem__(self, i):
        if i == 13:
            raise ValueError("corrupt record")
        return super().__getitem__(i)


class Hangs(Augments):
    def __getitem__(self, i):
        time.sleep(30 if i == 5 else 0)
        return super().__getitem__(i)


def plan_of(dataset, num_workers=0, worker_method="process", **over):
    settings = dict(batch_size=8, num_workers=num_workers, pin_memory=False, prefetch_factor=None,
                    persistent_workers=False, shuffle=True, drop_last=False, timeout=0.0,
                    multiprocessing_context=None, seed=5, cuda=False, fetch="item", worker_method=worker_method)
    settings.update(over)
    return build_loader(NamedErrors(Subset(dataset, range(len(dataset)))), **settings)


def epochs_of(plan, epochs=(0, 1, 2)):
    out = []
    for epoch in epochs:
        plan.loader.sampler.set_epoch(epoch)
        out.append([(x.clone(), y.clone()) for x, y in plan.loader])
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(ea) == len(eb) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(ea, eb))
        for ea, eb in zip(a, b))


def test_a_sample_is_augmented_the_same_whoever_fetches_it():
    """Main process, 2 worker processes (persistent or not), 1 and 3 threads: bitwise the same batches,
    epoch after epoch; the noise differs between epochs and between samples."""
    reference = epochs_of(plan_of(Augments()))
    for variant in (dict(num_workers=2), dict(num_workers=2, persistent_workers=True),
                    dict(num_workers=1, worker_method="thread"), dict(num_workers=3, worker_method="thread")):
        assert same(epochs_of(plan_of(Augments(), **variant)), reference), variant
    first, second = reference[0], reference[1]
    noise = {int(i): x - torch.arange(int(i) * 3, int(i) * 3 + 3) for xs, ys in first for x, i in zip(xs, ys)}
    noise2 = {int(i): x - torch.arange(int(i) * 3, int(i) * 3 + 3) for xs, ys in second for x, i in zip(xs, ys)}
    assert not torch.equal(noise[0], noise2[0]) and not torch.equal(noise[0], noise[1])


def test_sample_seeds_depend_on_stream_and_index_only_and_batches_pickle_with_them():
    import pickle

    batch = pickle.loads(pickle.dumps(SampleBatch([4, 2], 17)))
    assert batch == [4, 2] and batch.stream == 17 and isinstance(batch, SampleBatch)
    seeds = {sample_seed(s, i) for s in range(5) for i in range(50)}
    assert len(seeds) == 250 and all(0 <= x < 2**63 for x in seeds)
    assert sample_generator() is None  # outside a training fetch: torch's functions use the global RNG


def test_validation_draws_the_same_every_epoch_whoever_fetches():
    """Validation batches carry one stream for all epochs: a dataset that draws at validation scores
    the same samples the same way each epoch, in the main process, processes or threads."""
    batches = [epochs_of(plan_of(Augments(), role="val", shuffle=False, **variant), epochs=(0, 3))
               for variant in (dict(), dict(num_workers=2), dict(num_workers=2, worker_method="thread"))]
    assert [int(i) for _, ys in batches[0][0] for i in ys] == list(range(48))
    assert same([batches[0][0]], [batches[0][1]])  # epoch 3 as epoch 0
    assert same(batches[1], batches[0]) and same(batches[2], batches[0])


@pytest.mark.parametrize("threads", [dict(), dict(prefetch_factor=3), dict(timeout=30.0)],
                         ids=["plain", "prefetcher", "timeout-relay"])
def test_a_failing_item_is_named_from_a_thread_as_from_a_process(threads):
    """Through torchdata's Prefetcher thread or the timeout relay too, the error names the worker."""
    errors = []
    for variant in (dict(num_workers=2), dict(num_workers=2, worker_method="thread", **threads)):
        with pytest.raises(SampleError) as caught:
            list(plan_of(FailsAt(), shuffle=False, **variant).loader)
        errors.append(user_message(caught.value))
    assert errors[0][0].startswith("dataset item 13: ValueError: corrupt record (DataLoader worker process")
    assert errors[1] == ["dataset item 13: ValueError: corrupt record (a DataLoader worker thread)"]


def test_a_failed_epoch_stops_its_worker_processes_when_the_error_is_raised():
    """Not when the iterator its traceback holds is collected: from a reference cycle that is a later
    gc pass, which then waits 5 s per worker (a process loader after a failed one waited 20 s)."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(SampleError) as caught:
        list(plan_of(FailsAt(), shuffle=False, num_workers=2).loader)
    assert caught.value is not None and set(multiprocessing.active_children()) - before == set()


def loader_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if "_apply_udf" in t.name or t.name == "dlpipe-loader-relay"}


def left_behind(before: set, deadline_s=10.0) -> set[str]:
    """Loader threads started since `before` still alive once they are gone, or after `deadline_s`
    (they poll every 0.1 s)."""
    ends = time.monotonic() + deadline_s
    while loader_threads() - before and time.monotonic() < ends:
        time.sleep(0.05)
    return {t.name for t in loader_threads() - before}


@pytest.mark.parametrize("timeout", [0.0, 5.0])
def test_an_epoch_left_early_leaves_no_thread_behind(timeout):
    """Stopped one batch short (limit_train_batches): with the timeout relay, which had the last batch
    in hand, too; by dropping the epoch, and by shutdown() while it is still held."""
    before = loader_threads()
    plan = plan_of(Augments(size=64), num_workers=2, worker_method="thread", timeout=timeout, shuffle=False)
    epoch = iter(plan.loader)
    for _ in range(len(plan.loader) - 1):
        next(epoch)
    assert loader_threads() - before
    del epoch
    assert left_behind(before) == set()
    held = iter(plan.loader)
    next(held)
    plan.loader.shutdown()
    assert left_behind(before) == set()


class KeepsATable(Augments):
    """Keeps its own data in a `dataset` attribute that has a __getitems__ (as a Hugging Face table)."""

    def __init__(self):
        super().__init__()
        self.dataset = Subset(list(range(48)), range(48))


def test_a_dataset_attribute_of_the_users_own_is_not_taken_for_a_wrapper():
    reference = epochs_of(plan_of(Augments()))
    assert same(epochs_of(plan_of(KeepsATable(), num_workers=2, worker_method="thread")), reference)


def test_the_timeout_holds_for_threads_with_pytorchs_message():
    plan = plan_of(Hangs(), num_workers=2, worker_method="thread", shuffle=False, timeout=1.0)
    with pytest.raises(RuntimeError) as caught:
        list(plan.loader)
    assert str(caught.value) == "DataLoader timed out after 1.0 seconds"
    line = explain_loader_failure(caught.value, LoaderConfig(timeout=1.0, num_workers=2))
    assert line.startswith("loader.timeout=1.0: no batch arrived from the workers in 1.0 s")


def test_thread_settings_are_normalised_with_a_note_each():
    plan = plan_of(Augments(), num_workers=2, worker_method="thread", persistent_workers=True,
                   multiprocessing_context="spawn", prefetch_factor=3)
    assert isinstance(plan.loader, ThreadLoader) and plan.worker_method == "thread"
    assert plan.settings["persistent_workers"] is False and plan.settings["multiprocessing_context"] is None
    assert plan.requested == {"persistent_workers": True, "multiprocessing_context": "spawn"}
    assert [n.split(" ignored")[0] for n in plan.notes] == ["train: loader.persistent_workers=true",
                                                            "train: loader.multiprocessing_context=spawn"]
    assert len(plan.loader) == 6 and sum(len(ys) for _, ys in plan.loader) == 48
    # no workers: nothing to thread, PyTorch's loader in the main process
    assert plan_of(Augments(), num_workers=0, worker_method="thread").worker_method == "process"


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_every_prefetch_factor_delivers_every_batch_in_order(prefetch):
    plan = plan_of(Augments(size=100), num_workers=2, worker_method="thread", prefetch_factor=prefetch, shuffle=False)
    assert [int(i) for _, ys in plan.loader for i in ys] == list(range(100))


class HoldsTheGILFailsInWorkers(HoldsTheGIL):
    """Fetches in this process and in threads; fails in worker processes (as a dataset that does not
    survive pickling, or a worker without a resource the main process has)."""

    def __getitem__(self, i):
        if get_worker_info() is not None:
            raise OSError("no such device in a worker")
        return super().__getitem__(i)


class MeasuredProbe:
    """worker_method.Probe with set timings (seconds for the same batches: in this thread, by the
    threads, by the processes): the choice is under test, not the clock of a shared machine."""

    threads_differ = False
    size = 8  # items a probe batch holds

    def __init__(self, serial_s: float, threads: Timed, processes: Timed):
        self.serial_s, self.threads, self.processes = serial_s, threads, processes

    def __call__(self, dataset, num_workers, batch_size, collate_fn):
        return self

    def time_processes(self, context):
        return self.processes


def test_auto_picks_threads_where_they_scale_and_processes_where_they_cannot(monkeypatch):
    """Threads that fetch N workers' worth faster than the main process (I/O: the GIL released) are
    kept; where they do not, and N processes timed on the same batches are faster, processes."""
    dataset = NamedErrors(Subset(Augments(size=64), range(64)))  # as training builds it
    two = LoaderConfig(batch_size=8, num_workers=2, persistent_workers=True)
    processes = Timed(first_s=0.10, total_s=0.40, batches=8, workers=2)
    monkeypatch.setattr(worker_method, "Probe", MeasuredProbe(1.0, Timed(0.06, 0.52, 8, 2), processes))
    assert choose(dataset, two, None, forbidden=None) == (
        "thread", "2 threads fetched 1.92x as fast as the main process alone (the dataset releases the GIL): as "
                  "fast as processes, without their memory, start-up and hand-over")
    monkeypatch.setattr(worker_method, "Probe", MeasuredProbe(1.0, Timed(0.30, 0.95, 8, 2), processes))
    method, why = choose(dataset, two, None, forbidden=None)
    assert method == "process", why
    # the epoch each would take (Timed.epoch_s: threads start anew each epoch, persistent processes do not)
    threads_s, processes_s = Timed(0.30, 0.95, 8, 2).epoch_s(64, 8, restarts=True), processes.epoch_s(64, 8, False)
    assert why == (f"2 threads fetched 1.05x as fast as the main process alone, under {THREAD_SCALING_MIN:g} x 2; "
                   f"timed on the same batches, an epoch of 64 items would take {threads_s:.2f} s with 2 threads "
                   f"and {processes_s:.2f} s with 2 persistent processes (the dataset holds the GIL)")
    slow = Timed(first_s=0.10, total_s=1.30, batches=8, workers=2)  # processes no faster than the threads
    monkeypatch.setattr(worker_method, "Probe", MeasuredProbe(1.0, Timed(0.30, 0.95, 8, 2), slow))
    method, why = choose(dataset, two, None, forbidden=None)
    assert method == "thread" and why.endswith(": threads are as fast, without the processes' memory and hand-over")


def test_auto_keeps_processes_off_a_dataset_that_draws_from_a_global_rng():
    """No timing involved: the dataset's draws decide before anything is measured."""
    two = LoaderConfig(batch_size=8, num_workers=2, persistent_workers=True)
    noise = GlobalNoise()
    dataset = NamedErrors(Subset(noise, range(len(noise))))
    method, why = choose(dataset, two, None, forbidden=None)
    assert (method, why.split(" while")[0]) == ("process", "the dataset draws from the global random RNG")
    assert choose(dataset, two, None, forbidden="/dev/shm is too small") == (
        "thread", "/dev/shm is too small; the dataset draws from the global random RNG while fetching: with threads "
                  "its draws are not reproducible")


def test_processes_that_fail_on_the_probes_batches_leave_threads(monkeypatch):
    """Real worker processes, failing where the threads fetched; the thread speed-up is set out of
    reach so that the processes are always tried, whatever the machine's load."""
    monkeypatch.setattr(worker_method, "THREAD_SCALING_MIN", 1e9)
    two = LoaderConfig(batch_size=8, num_workers=2, persistent_workers=True)
    dataset = NamedErrors(Subset(HoldsTheGILFailsInWorkers(size=64), range(64)))
    method, why = choose(dataset, two, None, forbidden=None)
    assert method == "thread", why
    assert why == ("2 worker processes failed on batches 2 threads fetched (SampleError: dataset item 0: OSError: "
                   "no such device in a worker (DataLoader worker process 0)): threads")


class SharedCursor(Augments):
    """Reads records through one cursor, as a dataset with one open file does (seek, then read): right
    in the main process and in worker processes (each has its own copy), wrong with threads, which
    move each other's cursor while one sleeps (the read releases the GIL)."""

    def __getitem__(self, i):
        self.cursor = i
        time.sleep(0.002)
        return self.x[self.cursor], i


def test_auto_keeps_processes_for_a_dataset_threads_would_fetch_wrongly():
    """Sleeping items scale with threads, but threads sharing the dataset's cursor fetch other
    records than the main process: processes, and the reason says why."""
    dataset = NamedErrors(Subset(SharedCursor(size=64), range(64)))
    method, why = choose(dataset, LoaderConfig(batch_size=8, num_workers=2, persistent_workers=True), None,
                         forbidden=None)
    assert (method, why.split(":")[0]) == ("process", "2 threads fetched the probe's batches otherwise than the "
                                                      "main process, which fetched them alike every time"), why
    assert "not thread-safe" in why


def test_one_worker_is_a_thread_only_where_two_threads_show_the_gil_released(monkeypatch):
    """One thread fetches as fast as the main process whether or not the dataset holds the GIL, so the
    probe times two: items that scale get a thread, GIL-bound ones a process, which fetches beside the
    training loop instead of taking the GIL from it (timings set: the choice is under test)."""
    dataset = NamedErrors(Subset(Augments(size=64), range(64)))
    one = LoaderConfig(batch_size=8, num_workers=1, persistent_workers=True)
    unused = Timed(0.0, 0.0, 8, 1)  # one worker never times processes
    monkeypatch.setattr(worker_method, "Probe", MeasuredProbe(1.0, Timed(0.06, 0.52, 8, 2), unused))
    method, why = choose(dataset, one, None, forbidden=None)
    assert (method, why.split(" fetched")[0]) == ("thread", "2 threads"), why
    monkeypatch.setattr(worker_method, "Probe", MeasuredProbe(1.0, Timed(0.30, 0.95, 8, 2), unused))
    assert choose(dataset, one, None, forbidden=None) == (
        "process", f"2 threads fetched only 1.05x as fast as the main process alone, under {THREAD_SCALING_MIN:g} x 2 "
                   "(the dataset holds the GIL): one worker thread would take the GIL from the training loop, one "
                   "process fetches beside it")


def test_a_probes_epoch_prediction_separates_start_up_from_the_steady_rate():
    """2 workers deliver 8 batches of 4 items in 4 waves: processes that start in 0.2 s, then take 0.1 s
    a wave, see their first batch at 0.3 s and the last at 0.6 s: 0.05 s a batch steady. An epoch of 64
    items (16 batches) then takes 0.8 s, plus 0.2 s where the workers start anew. Threads holding the GIL
    take 0.1 s a batch one after the other: their first batch is late (0.2 s) for contention, not
    start-up, and their epoch comes out at 1.6 s, no faster than one."""
    processes = Timed(first_s=0.3, total_s=0.6, batches=8, workers=2)
    assert processes.epoch_s(64, 4, restarts=False) == pytest.approx(0.8)
    assert processes.epoch_s(64, 4, restarts=True) == pytest.approx(1.0)
    gil_bound = Timed(first_s=0.2, total_s=0.8, batches=8, workers=2)
    assert gil_bound.epoch_s(64, 4, restarts=True) == pytest.approx(1.6)


def test_the_automatic_decision_leaves_every_global_stream_as_it_was():
    """fit() fetches items (estimates, probes) in the main process: the run's streams must not move."""
    raw = {"persistent_workers": "${auto_persistent:${.num_workers},${trainer.epochs},0}"}
    for dataset in (Augments(), GlobalNoise()):
        torch.manual_seed(1)
        random.seed(1)
        expected = (torch.rand(2), random.random())
        torch.manual_seed(1)
        random.seed(1)
        fit(LoaderConfig(num_workers=2, batch_size=8, persistent_workers=True), raw,
            NamedErrors(Subset(dataset, range(48))), None, {})
        assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]


def test_validation_workers_draw_the_same_global_randomness_every_pass():
    """A dataset drawing from the global RNG in worker processes: each validation pass starts its
    workers from the same base seed, so every epoch (and a resumed run's, whose validation generator
    starts afresh) scores the same batches; training's workers draw anew each epoch."""
    def two_passes(role):
        plan = plan_of(GlobalNoise(), num_workers=2, role=role, shuffle=False)
        return [[batch[0] for batch in plan.loader] for _ in range(2)]

    first, second = two_passes("val")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    first, second = two_passes("train")
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_dataset_spawn_cannot_send_to_workers_is_one_line(recwarn):
    """spawn pickles the dataset for its workers: a lambda attribute fails in Process.start, which
    PyTorch re-raises after a warning of its own; the run gets one DataError line naming the setting,
    the pickle error and what to do, and no warning."""
    from dlpipe.errors import DataError

    dataset = Augments(size=16)
    dataset.transform = lambda x: x
    plan = plan_of(dataset, num_workers=1, multiprocessing_context="spawn", prefetch_factor=2)
    with pytest.raises(DataError) as caught:
        iter(plan.loader)
    line = str(caught.value)
    assert line.startswith("loader.multiprocessing_context=spawn: the dataset (or collate_fn) cannot be sent to "
                           "worker processes (AttributeError: Can't pickle local object") and "\n" not in line
    assert "loader.multiprocessing_context=fork, loader.worker_method=thread" in line
    assert not [w for w in recwarn if "pickle" in str(w.message)]


def test_threads_asked_for_a_global_rng_dataset_are_warned_about(caplog):
    """loader.worker_method=thread set by hand stands, but a dataset drawing from the global RNG is
    said to be unreproducible with it (auto would keep processes); one that draws its own is not."""
    import logging

    from dlpipe.loader.fitting import fit_loader_to_data

    raw = {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": False}
    asked = LoaderConfig(batch_size=8, num_workers=2, worker_method="thread", fetch="item")
    caplog.set_level(logging.WARNING, logger="dlpipe")
    for dataset in (Augments(), GlobalNoise()):
        fitted, _ = fit_loader_to_data(raw, asked, 2, NamedErrors(Subset(dataset, range(len(dataset)))))
        assert fitted.worker_method == "thread"
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("loader.worker_method=thread: the dataset draws from the global random RNG")


def test_the_rng_probe_leaves_every_global_stream_as_it_was():
    torch.manual_seed(1)
    random.seed(1)
    expected = (torch.rand(2), random.random())
    torch.manual_seed(1)
    random.seed(1)
    assert global_draws(NamedErrors(GlobalNoise())) == "random"
    assert global_draws(NamedErrors(Augments())) is None
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]


def test_a_process_exits_with_a_thread_epoch_still_open(tmp_path):
    """An epoch still referenced at exit (a traceback kept alive), and one retiring in the background
    as the process ends: the process exits cleanly, neither hanging (no thread can start during
    shutdown) nor aborted by torch ("terminate called without an active exception")."""
    import subprocess
    import sys

    script = tmp_path / "open_epoch.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "from dlpipe.loader.build import build_loader\n"
        "from dlpipe.loader.faults import NamedErrors\n"
        "ds = NamedErrors(TensorDataset(torch.randn(640, 4), torch.arange(640)))\n"
        "plan = build_loader(ds, batch_size=8, num_workers=2, pin_memory=False, prefetch_factor=2,\n"
        "                    persistent_workers=False, shuffle=True, drop_last=False, timeout=0.0,\n"
        "                    multiprocessing_context=None, seed=0, cuda=False, worker_method='thread')\n"
        "assert len(list(plan.loader)) == 80\n"  # a whole epoch: its graph retires as the process ends
        "epoch = iter(plan.loader)\n"
        "next(epoch)\n"
        "print('left open')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "left open\n", r.stderr


def test_processes_are_forbidden_where_shm_or_memory_cannot_hold_them():
    """The reasons the automatic choice takes threads without measuring: /dev/shm too small for the
    batches in flight, or N forks of this process over the share of the memory left."""
    mb = 2**20
    assert processes_forbidden(2, 10 * mb, 1000 * mb, 300 * mb, 8000 * mb) is None
    assert processes_forbidden(2, 600 * mb, 1000 * mb, 300 * mb, 8000 * mb).startswith("/dev/shm cannot hold")
    why = processes_forbidden(4, 40 * mb, None, 300 * mb, 1500 * mb)  # 1240 MB > 0.8 x 1500 MB
    assert why.startswith("4 worker processes, each holding up to this process's 300 MB, and 40 MB of batches in "
                          "flight could take 1240 MB, over 80% of the 1500 MB of memory left (cgroup limits included)")
    assert processes_forbidden(4, 40 * mb, None, 290 * mb, 1500 * mb) is None  # 1200 MB: at the share, not over


@contextmanager
def memory_cgroup(limit_bytes: int):
    """A child of this process's own v1 memory cgroup, limited to `limit_bytes` (the parent's limits
    still apply); skips where there is none to create (cgroup v2 forbids one beside our processes)."""
    found = cgroups.hierarchy("memory", ("memory",), "/proc", "/sys/fs/cgroup")
    if found is None or found[2]:
        pytest.skip("no cgroup v1 memory hierarchy to make a child in")
    mount, rel, _ = found
    group = Path(mount, rel.lstrip("/"), f"dlpipe-test-{os.getpid()}")
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError as e:
        if group.is_dir():
            group.rmdir()
        pytest.skip(f"cannot make a memory cgroup here ({e})")
    try:
        yield group
    finally:
        # Empty once the job and every process it started have exited; a job that timed out may
        # have left some: they are killed, so the group can go and the test's own error shows.
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.1)
        group.rmdir()


@pytest.mark.integration
def test_a_job_under_a_tight_memory_limit_fetches_with_threads(tmp_path):
    """A real job in a memory cgroup of 1000 MB (a container's --memory, Slurm's --mem): 4 worker
    processes, each a fork of a process of ~230 MB of its own (USS), do not fit in 80% of the ~770 MB
    left, so loader=auto takes 4 threads; the log names the memory left, read from the cgroup (the
    host has far more), and the job trains (it peaks at ~330 MB)."""
    from conftest import NO_PHONE_HOME, TESTS_DIR

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_"))}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR))
    args = ["+recipe=smoke", "loader.num_workers=4", "trainer.epochs=1", "trainer.progress=false", "tracking=none"]
    with memory_cgroup(1000 * 2**20) as group:
        r = subprocess.run(["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$0" -m dlpipe "$@"', sys.executable,
                            *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    [line] = [line for line in (r.stdout + r.stderr).splitlines() if "loader.worker_method = " in line]
    assert "loader.worker_method = thread (auto: 4 worker processes, each holding up to this process's " in line, line
    left = int(re.search(r"of the (\d+) MB of memory left \(cgroup limits included\)", line).group(1))
    assert left < 1000 < psutil.virtual_memory().available / 2**20
