"""The pre-flight lint: one line per risky loader setting, each naming the key and the fix."""

from dataclasses import replace

import pytest

from dlpipe.loader import decisions as loader_decisions
from dlpipe.loader.lint import LoaderFacts, lint_loader
from dlpipe.loader.policy import train_samples
from dlpipe.schema import LoaderConfig


def lint(values: dict, epochs: int, facts: LoaderFacts) -> list[str]:
    return lint_loader(LoaderConfig(**values), epochs=epochs, facts=facts)

GOOD = {"batch_size": 32, "num_workers": 2, "pin_memory": False, "prefetch_factor": 2,
        "persistent_workers": True, "drop_last": False}
FACTS = LoaderFacts(cpu_budget=4, cuda=False, train_size=3200, batch_bytes=2**20, shm_free_bytes=2**30)


def test_a_sound_config_has_no_findings():
    assert lint(GOOD, epochs=5, facts=FACTS) == []


@pytest.mark.parametrize("change, facts, expected", [
    ({"num_workers": 8}, {}, "loader.num_workers=8 is above the CPU budget of 4"),
    ({"pin_memory": True}, {}, "loader.pin_memory=true without CUDA"),
    ({}, {"train_size": 320}, "loader.persistent_workers=true: 5.0 batches per worker per epoch, under 10"),
    ({}, {"shm_free_bytes": 64 * 2**20, "batch_bytes": 20 * 2**20},
     "2 workers x prefetch 2 x 20 MB batches = 80 MB in flight through /dev/shm, which has 64 MB free"),
    ({}, {"world_size": 3}, "3200 training samples over 3 ranks: each epoch repeats 1 of them"),
    ({}, {"train_size": 3201}, "loader.batch_size=32 leaves a last batch of 1 sample"),
])
def test_each_risk_is_one_line_with_the_fix(change, facts, expected):
    values = {**FACTS.__dict__, **facts}
    [line] = lint({**GOOD, **change}, epochs=5, facts=LoaderFacts(**values))
    assert expected in line and "\n" not in line
    assert any(word in line for word in ("set ", "use ", "raise ", "change ", "to even"))


def test_one_epoch_makes_persistent_workers_pointless():
    [line] = lint(GOOD, epochs=1, facts=FACTS)
    assert "a single epoch" in line and "loader.persistent_workers=false" in line


def test_pinning_with_cuda_and_a_measured_worker_count_are_fine():
    cuda = LoaderFacts(**{**FACTS.__dict__, "cuda": True})
    assert lint({**GOOD, "pin_memory": True}, epochs=5, facts=cuda) == []
    tuned = {**GOOD, "num_workers": 8, "tuned_on": "cpu_budget=4 host=a"}
    assert lint(tuned, epochs=5, facts=FACTS) == []


def test_values_tuned_on_another_budget_ask_for_a_new_tune():
    tuned = {**GOOD, "num_workers": 8, "tuned_on": "cpu_budget=16 host=big"}
    first, second = lint(tuned, epochs=5, facts=FACTS)
    assert "measured with a CPU budget of 16, this machine gives 4; run `dlpipe tune` here" in first
    assert "loader.num_workers=8 is above the CPU budget of 4" in second


@pytest.mark.parametrize("size", [1, 63, 640, 1100, 1290, 4096, 50_000])  # unknown sizes: test_probe.py
@pytest.mark.parametrize("batch", [1, 16, 64, 256])
@pytest.mark.parametrize("epochs", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2, 4, 8])
def test_the_persistence_resolver_and_the_lint_never_disagree(size, batch, epochs, workers):
    """The automatic persistent_workers is never a value the lint then tells the user to change, and
    a value the lint accepts is the one the resolver would pick (same rule: loader/policy.py). The
    lint sees the training split the job really builds (size less the validation share)."""
    auto = loader_decisions.persistent(workers, epochs, size, batch, 0.1, False).value
    train = train_samples(size, 0.1)
    facts = LoaderFacts(cpu_budget=16, cuda=False, train_size=train, batch_bytes=1, shm_free_bytes=None)
    chosen = lint({**GOOD, "batch_size": batch, "num_workers": workers, "persistent_workers": auto},
                  epochs, facts)
    assert not [line for line in chosen if "persistent_workers" in line]
    if workers:
        flipped = lint({**GOOD, "batch_size": batch, "num_workers": workers, "persistent_workers": not auto},
                       epochs, facts)
        assert any("persistent_workers=true" in line for line in flipped) == (not auto)


def test_the_issue_case_keeps_no_workers_the_lint_would_refuse():
    """dataset.size=1100, batch 64, 3 epochs, 4 workers: 990 training items, 16 batches, 4 per worker."""
    decision = loader_decisions.persistent(4, 3, 1100, 64, 0.1, False)
    assert decision.value is False and "4.0 batches per worker" in decision.reason


def test_a_streams_shuffle_windows_count_against_the_memory_available():
    """Each reader of a stream (each worker) holds its own window: 2 x 500 MB and 4 MB of batches in
    flight against 80% of 1 GB is over, one worker's is not; nothing said without a window."""
    stream = {**GOOD, "persistent_workers": False, "stream_share": "dlpipe"}
    facts = replace(FACTS, train_size=None, reads_positions=True, stream_buffer_bytes=500 * 2**20,
                    ram_available=2**30)
    [line] = lint(stream, epochs=5, facts=facts)
    assert line == ("2 reader(s) of the stream each hold its shuffle window of 500 MB (1004 MB with the batches in "
                    "flight), over 80% of the 1024 MB of memory available: the out-of-memory killer would end "
                    "them; lower dataset.shuffle_buffer or loader.num_workers")
    assert lint(stream, epochs=5, facts=replace(facts, stream_buffer_bytes=100 * 2**20)) == []
    assert lint({**stream, "num_workers": 1}, epochs=5, facts=facts) == []
    assert lint(stream, epochs=5, facts=replace(facts, stream_buffer_bytes=0)) == []
