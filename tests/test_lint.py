"""The pre-flight lint: one line per risky loader setting, each naming the key and the fix."""

import pytest

from dlpipe.lint import LoaderFacts, lint_loader

GOOD = {"batch_size": 32, "num_workers": 2, "pin_memory": False, "prefetch_factor": 2,
        "persistent_workers": True, "drop_last": False}
FACTS = LoaderFacts(cpu_budget=4, cuda=False, train_size=3200, batch_bytes=2**20, shm_free_bytes=2**30)


def test_a_sound_config_has_no_findings():
    assert lint_loader(GOOD, epochs=5, facts=FACTS) == []


@pytest.mark.parametrize("change, facts, expected", [
    ({"num_workers": 8}, {}, "loader.num_workers=8 is above the CPU budget of 4"),
    ({"pin_memory": True}, {}, "loader.pin_memory=true without CUDA"),
    ({}, {"train_size": 320}, "loader.persistent_workers=true with 10 batches an epoch"),
    ({}, {"shm_free_bytes": 64 * 2**20, "batch_bytes": 20 * 2**20},
     "2 workers x prefetch 2 x 20 MB batches = 80 MB in flight through /dev/shm, which has 64 MB free"),
    ({}, {"world_size": 3}, "3200 training samples over 3 ranks: each epoch repeats 1 of them"),
    ({}, {"train_size": 3201}, "loader.batch_size=32 leaves a last batch of 1 sample"),
])
def test_each_risk_is_one_line_with_the_fix(change, facts, expected):
    values = {**FACTS.__dict__, **facts}
    [line] = lint_loader({**GOOD, **change}, epochs=5, facts=LoaderFacts(**values))
    assert expected in line and "\n" not in line
    assert any(word in line for word in ("set ", "use ", "raise ", "change ", "to even"))


def test_one_epoch_makes_persistent_workers_pointless():
    [line] = lint_loader(GOOD, epochs=1, facts=FACTS)
    assert "with one epoch" in line and "loader.persistent_workers=false" in line


def test_pinning_with_cuda_and_a_measured_worker_count_are_fine():
    cuda = LoaderFacts(**{**FACTS.__dict__, "cuda": True})
    assert lint_loader({**GOOD, "pin_memory": True}, epochs=5, facts=cuda) == []
    tuned = {**GOOD, "num_workers": 8, "tuned_on": "cpu_budget=4 host=a"}
    assert lint_loader(tuned, epochs=5, facts=FACTS) == []


def test_values_tuned_on_another_budget_ask_for_a_new_tune():
    tuned = {**GOOD, "num_workers": 8, "tuned_on": "cpu_budget=16 host=big"}
    first, second = lint_loader(tuned, epochs=5, facts=FACTS)
    assert "measured with a CPU budget of 16, this machine gives 4; run `dlpipe tune` here" in first
    assert "loader.num_workers=8 is above the CPU budget of 4" in second
