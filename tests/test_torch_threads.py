"""trainer.torch_threads (dlpipe/loader/torch_threads.py) on controlled inputs: the rule's table, the
resolver under a CPU quota, the decision settled on the built loader, and what DataLoader workers get."""

import logging

import pytest
import torch
from omegaconf import OmegaConf
from test_auto_workers import host_with_quota
from test_config import make as compose_config
from test_config import registered  # noqa: F401  (autouse: resolvers, schemas and recipes registered)
from thread_probe import ThreadsInItem

from dlpipe.cli import resolve
from dlpipe.config.decisions import explain
from dlpipe.config.sources import Origin
from dlpipe.config.validation import validate
from dlpipe.errors import ConfigError
from dlpipe.loader import torch_threads
from dlpipe.loader.build import build_loader
from dlpipe.schema import TrainerConfig

NO_ENV: dict[str, str] = {}


ON_CPU = "the model computes on these threads, and the workers of a compute-bound run idle meanwhile"
ENV_KEPT = "in the environment: torch's choice kept (torch follows it, at most one thread per CPU of its affinity)"


# (CPU budget, workers, their method, trainer.device, environment, torch's own threads) -> (value, reason)
@pytest.mark.parametrize(("budget", "workers", "method", "device", "env", "torch_own", "value", "reason"), [
    # no workers: the whole budget, whatever torch took (a 4-CPU quota on a 64-core host: 4, not 64)
    (2, 0, "process", "cuda", NO_ENV, 2, 2,
     "CPU budget 2, no workers: all of it for this process; torch's default was 2"),
    (4, 0, None, "cpu", NO_ENV, 64, 4, "CPU budget 4, no workers: all of it for this process; torch's default was 64"),
    # on an accelerator, worker processes take their CPUs from the budget
    (2, 2, "process", "cuda", NO_ENV, 2, 1, "CPU budget 2 - 2 worker processes, at least 1; torch's default was 2"),
    (4, 3, "process", "cuda:1", NO_ENV, 64, 1, "CPU budget 4 - 3 worker processes; torch's default was 64"),
    (16, 8, "process", "mps", NO_ENV, 64, 8, "CPU budget 16 - 8 worker processes; torch's default was 64"),
    (2, 8, "process", "cuda", NO_ENV, 2, 1, "CPU budget 2 - 8 worker processes, at least 1; torch's default was 2"),
    # thread workers each want a CPU while they fetch, like processes
    (8, 3, "thread", "cuda", NO_ENV, 64, 5, "CPU budget 8 - 3 worker threads; torch's default was 64"),
    # before the fit decides the method (the resolver)
    (8, 6, None, "cuda", NO_ENV, 64, 2, "CPU budget 8 - 6 workers; torch's default was 64"),
    (8, 6, "auto", "cuda", NO_ENV, 64, 2, "CPU budget 8 - 6 workers; torch's default was 64"),
    # the model on the CPU: its compute is these threads', the whole budget
    (2, 2, "process", "cpu", NO_ENV, 2, 2, f"CPU budget 2, trainer.device=cpu: {ON_CPU}; torch's default was 2"),
    (4, 3, "thread", "cpu", NO_ENV, 64, 4, f"CPU budget 4, trainer.device=cpu: {ON_CPU}; torch's default was 64"),
    # the user's environment: torch follows it, and so does dlpipe
    (8, 2, "process", "cuda", {"OMP_NUM_THREADS": "1"}, 1, 1, f"OMP_NUM_THREADS=1 {ENV_KEPT}"),
    (8, 0, "process", "cpu", {"MKL_NUM_THREADS": "3"}, 3, 3, f"MKL_NUM_THREADS=3 {ENV_KEPT}"),
    (8, 2, "process", "cuda", {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, 1, 1,
     "OMP_NUM_THREADS=1 in the environment: torch's choice kept (torchrun sets OMP_NUM_THREADS=1 for each rank "
     "where it is not set)"),
    (8, 2, "process", "cuda", {"OMP_NUM_THREADS": " "}, 64, 6,
     "CPU budget 8 - 2 worker processes; torch's default was 64"),
])
def test_the_rule(budget, workers, method, device, env, torch_own, value, reason):
    d = torch_threads.decide(budget, workers, method, torch_own, device, env)
    assert (d.value, d.reason) == (value, reason)


def resolved_threads(*overrides: str) -> tuple[dict, dict]:
    raw, resolved = resolve(compose_config(*overrides))
    return raw, resolved


@pytest.mark.parametrize(("cpus", "overrides", "threads"), [
    (4, ("trainer.device=cuda",), 1),  # 4-CPU quota: 3 workers (docs/loader.md), 1 thread left
    (4, ("trainer.device=cuda", "loader=in_memory"), 4),  # no workers: the quota, not the host's 64 cores
    (4, ("trainer.device=cpu",), 4),  # the model on the CPU: the quota, not the host's 64 cores
    (16, ("trainer.device=cuda",), 8),  # 8 workers
    (16, ("trainer.device=cuda", "loader.num_workers=4"), 12),
])
def test_the_resolver_follows_the_cpu_quota(monkeypatch, tmp_path, cpus, overrides, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    host_with_quota(monkeypatch, tmp_path, "v2", cpus)
    cfg = compose_config(*overrides)
    assert OmegaConf.to_container(cfg.trainer)["torch_threads"] == \
        "${auto_torch_threads:${loader.num_workers},${.device}}"
    assert cfg.trainer.torch_threads == threads


def test_explained_as_automatic_or_by_its_source(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    raw, resolved = resolved_threads("loader=in_memory")
    said = explain(raw, resolved, Origin((), {}))["trainer.torch_threads"]
    assert said.startswith(f"{resolved['trainer']['torch_threads']} (auto: CPU budget ")
    raw, resolved = resolved_threads("trainer.torch_threads=3")
    assert explain(raw, resolved, Origin(("trainer.torch_threads=3",), {}))["trainer.torch_threads"] == \
        "3 (user override)"


@pytest.mark.parametrize("bad", [0, -2])
def test_a_bad_value_is_refused_naming_the_key(bad):
    _, resolved = resolved_threads(f"trainer.torch_threads={bad}")
    with pytest.raises(ConfigError, match=rf"trainer.torch_threads={bad}: must be >= 1"):
        validate(resolved)


def test_settled_on_the_built_loader_only_where_automatic(monkeypatch, caplog):
    """The fit may change the workers (and decides their method): the decision follows, said once."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch_threads, "torch_default", lambda: 2)
    auto = {"torch_threads": "${auto_torch_threads:${loader.num_workers},${.device}}"}
    trainer = TrainerConfig(device="cuda", torch_threads=1)
    decided = {"trainer.torch_threads": "1 (auto: CPU budget 4 - 3 workers; torch's default was 2)"}
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        torch_threads.settle(auto, trainer, 0, "process", 4, decided)  # in-memory data: the workers went
        assert trainer.torch_threads == 4
        assert decided["trainer.torch_threads"] == "4 (auto: CPU budget 4, no workers: all of it for this process; " \
                                                   "torch's default was 2)"
        torch_threads.settle(auto, trainer, 0, "process", 4, decided)  # the same again: not said twice
        torch_threads.settle(auto, trainer, 2, "thread", 4, decided)
        assert (trainer.torch_threads, decided["trainer.torch_threads"]) == (
            2, "2 (auto: CPU budget 4 - 2 worker threads; torch's default was 2)")
    assert [r.getMessage() for r in caplog.records] == [f"trainer.torch_threads = {why}" for why in (
        "4 (auto: CPU budget 4, no workers: all of it for this process; torch's default was 2)",
        "2 (auto: CPU budget 4 - 2 worker threads; torch's default was 2)")]
    mine, decided = TrainerConfig(torch_threads=3), {"trainer.torch_threads": "3 (user override)"}
    torch_threads.settle({"torch_threads": 3}, mine, 0, "process", 4, decided)
    assert (mine.torch_threads, decided["trainer.torch_threads"]) == (3, "3 (user override)")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_apply_and_using(restore_threads):
    torch_threads.apply(1)
    assert torch.get_num_threads() == 1
    with torch_threads.using(3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == 1
    torch_threads.apply(None)  # torch's own choice, as at import
    assert torch.get_num_threads() == torch_threads.torch_default()


def fetched_threads(method: str, workers: int) -> set[int]:
    plan = build_loader(ThreadsInItem(), batch_size=2, num_workers=workers, pin_memory=False, prefetch_factor=None,
                        persistent_workers=False, shuffle=False, drop_last=False, timeout=0.0,
                        multiprocessing_context=None, seed=0, cuda=False, worker_method=method)
    try:
        return {int(v) for batch in plan.loader for v in batch}
    finally:
        plan.loader.shutdown()


def test_worker_processes_keep_their_one_thread(restore_threads):
    """A forked worker inherits the parent's setting, then PyTorch's worker loop sets 1: dlpipe's
    setting of the training process never reaches the workers' fetching."""
    torch_threads.apply(3)
    assert fetched_threads("process", 2) == {1}


def test_thread_workers_set_their_own_one_thread(restore_threads):
    """Thread workers (torchdata.nodes) set 1 in each of their threads, as worker processes do, and the
    training process's main thread, where the step runs, keeps its own."""
    torch_threads.apply(3)
    assert fetched_threads("thread", 2) == {1}
    assert torch.get_num_threads() == 3
