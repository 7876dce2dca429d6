"""The tuner's search and memory guard, on throughput profiles fixed by construction."""

import pytest

from dlpipe.loader.search import LADDER, Candidate, Search, Trial, memory_guard

START = Candidate(num_workers=2, prefetch_factor=2, persistent_workers=True, pin_memory=False)


def search_over(profile, max_workers=6, skip=lambda c: None, **kwargs):
    """Run the search where `profile(candidate)` gives samples/s; returns (best, evaluated candidates)."""
    def evaluate(c):
        why = skip(c)
        if why:
            return Trial(c, skipped=why)
        value = profile(c)
        return Trial(c, runs=[value, value * 1.005, value * 0.995])

    search = Search(evaluate, min_gain=0.03, max_workers=max_workers, tune_persistent=True, tune_pin=False, **kwargs)
    return search.run(START), list(search.trials)


def in_memory(c):
    """Items already in memory: every worker only adds pickling and IPC."""
    return 100_000.0 if c.num_workers == 0 else 14_000.0 + 100 * c.num_workers


def cpu_heavy(c):
    """Decode-bound: scales with workers up to 4 cores, 1 worker is the slowest of all."""
    if c.num_workers == 0:
        return 1000.0
    return {1: 700.0, 2: 1300.0, 3: 1800.0}.get(c.num_workers, 2200.0)


def test_in_memory_data_gets_no_workers():
    best, tried = search_over(in_memory)
    assert best.num_workers == 0 and len(tried) == 2


def test_cpu_heavy_data_gets_workers_and_stops_where_gains_stop():
    best, tried = search_over(cpu_heavy)
    assert best.num_workers == 4
    # far fewer trials than the grid of workers x prefetch x persistent (7 x 2 x 2 here)
    grid = len([n for n in LADDER if n <= 6]) * 2 * 2
    assert len(tried) <= grid / 3


def test_a_start_without_workers_still_finds_them():
    start = Candidate(0, None, False, False)
    search = Search(lambda c: Trial(c, runs=[cpu_heavy(c)] * 3), 0.03, 6, True, False, seed_workers=2)
    assert search.run(start).num_workers == 4


def test_gains_within_the_noise_do_not_count():
    """A 2% 'improvement' is noise at min_gain 3%: the automatic config stays."""
    best, _ = search_over(lambda c: 1000.0 * (1.02 if c.num_workers == 3 else 1.0))
    assert best == START


def test_memory_guard_skips_what_does_not_fit_and_never_picks_it():
    tiny_shm = 64 * 2**20
    skip = lambda c: memory_guard(c, batch_bytes=12 * 2**20, shm_free=tiny_shm, ram_available=2**40,  # noqa: E731
                                  worker_rss_bytes=0)
    best, tried = search_over(cpu_heavy, skip=skip)
    # 2 workers x 2 x 12 MB = 48 MB is over half of 64 MB: every worker count is skipped
    assert best.num_workers == 0 and START in tried


@pytest.mark.parametrize("workers, prefetch, shm, ram, rss, expected", [
    (4, 2, 64 * 2**20, 2**40, 0, "in flight, over half the 64 MB free in /dev/shm"),
    (4, 2, None, 2**30, 300 * 2**20, "workers would take about"),
    (0, None, 1, 1, 0, None),
    (2, 2, 2**30, 2**40, 0, None),
])
def test_memory_guard(workers, prefetch, shm, ram, rss, expected):
    why = memory_guard(Candidate(workers, prefetch, False, False), 8 * 2**20, shm, ram, rss)
    assert (why is None) if expected is None else (expected in why)


def test_automatic_persistence_follows_the_worker_count_the_climb_reaches():
    """With the job's persistence rule passed in, each candidate carries the value that rule gives
    for its worker count (here: 32 batches an epoch, so at most 3 workers make 10 each), so the
    written winner never holds a persistence the lint would then reject."""
    from dlpipe.loader import policy

    def persist(workers):
        return policy.persist_workers(workers, 3, 32)[0]

    best, tried = search_over(cpu_heavy, persist=persist)
    assert Candidate(3, 2, True, False) in tried and Candidate(4, 2, False, False) in tried
    assert best == Candidate(4, 2, False, False)
    best, _ = search_over(cpu_heavy)  # without the rule the start's value is kept
    assert best == Candidate(4, 2, True, False)


def search_with_memory(profile, max_workers=6, **kwargs):
    """As search_over, where `profile(c)` gives (samples/s, peak MB of the process tree)."""
    def evaluate(c):
        value, peak = profile(c)
        return Trial(c, runs=[value, value * 1.005, value * 0.995], metrics={"tree_rss_peak_mb": peak})

    search = Search(evaluate, min_gain=0.03, max_workers=max_workers, tune_persistent=True, tune_pin=False, **kwargs)
    return search.run(START), list(search.trials)


def decode(c):
    """JPEG decode: Pillow releases the GIL, so threads fetch as fast as processes (within 1%) with
    one process's memory instead of one per worker; it scales to 4 CPUs either way."""
    speed = cpu_heavy(c) * (0.99 if c.worker_method == "thread" else 1.0)
    return speed, 500.0 + (0 if c.worker_method == "thread" else 150.0 * c.num_workers)


def python_augment(c):
    """Pure-Python augmentation holds the GIL: threads stay at the speed of one."""
    speed = cpu_heavy(c) if c.worker_method == "process" else 900.0
    return speed, 500.0 + (0 if c.worker_method == "thread" else 150.0 * c.num_workers)


def remote_reads(c):
    """Items waiting on storage: processes stop gaining at the 4 CPUs their hand-over needs; threads,
    which only wait, gain up to 12 of them."""
    return 100.0 * min(c.num_workers, 12 if c.worker_method == "thread" else 4), 500.0 + (
        0 if c.worker_method == "thread" else 150.0 * c.num_workers)


def test_threads_win_when_as_fast_at_less_memory_and_only_then():
    best, tried = search_with_memory(decode, tune_threads=True)
    assert best == Candidate(4, 2, False, False, worker_method="thread")
    best, tried = search_with_memory(python_augment, tune_threads=True)
    assert best.worker_method == "process" and best.num_workers == 4
    assert Candidate(4, 2, False, False, worker_method="thread") in tried  # measured, and slower
    best, tried = search_with_memory(decode)  # a dataset drawing from the global RNGs: no thread trial
    assert best.worker_method == "process" and all(c.worker_method == "process" for c in tried)


def test_threads_climb_past_the_cpu_budget_while_they_gain():
    best, _ = search_with_memory(remote_reads, max_workers=16, tune_threads=True)
    assert (best.worker_method, best.num_workers) == ("thread", 12)
    best, _ = search_with_memory(remote_reads, max_workers=8, tune_threads=True)
    assert (best.worker_method, best.num_workers) == ("thread", 8)  # bench.max_workers bounds the climb


def test_whole_batch_gathers_are_tried_at_the_best_count_and_without_workers():
    def gathered(c):
        return in_memory(c) * (3.0 if c.fetch == "batch" else 1.0)

    best, tried = search_over(gathered, gathers=True)
    assert best == Candidate(0, None, False, False, fetch="batch")
    best, tried = search_over(gathered)  # a dataset without a gather equal to its items' collate
    assert best == Candidate(0, None, False, False) and all(c.fetch == "item" for c in tried)


def test_candidates_normalise_what_means_nothing():
    assert Candidate(0, None, True, False, worker_method="thread") == Candidate(0, None, False, False)
    assert Candidate(2, 2, True, False, worker_method="thread").persistent_workers is False
    assert Candidate(2, 2, False, False, "batch", "thread").label() == \
        "num_workers=2 worker_method=thread prefetch_factor=2 fetch=batch"


def test_a_noisy_start_does_not_let_much_slower_threads_in_for_their_memory():
    """The start's runs spread by 100% (threshold 2 x noise): threads at 0.45x are not 'as fast'."""
    def evaluate(c):
        if c == START:
            return Trial(c, runs=[1000.0, 2000.0, 1100.0], metrics={"tree_rss_peak_mb": 900.0})
        value = 500.0 if c.worker_method == "thread" else 1100.0
        return Trial(c, runs=[value] * 3, metrics={"tree_rss_peak_mb": 300.0 if c.worker_method == "thread" else 900.0})

    search = Search(evaluate, min_gain=0.03, max_workers=2, tune_persistent=False, tune_pin=False, tune_threads=True)
    best = search.run(START)
    assert best.worker_method == "process" and search.threshold > 1
    assert Candidate(2, 2, False, False, worker_method="thread") in search.trials  # measured, and refused
