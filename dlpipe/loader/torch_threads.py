"""The training process's torch intra-op threads (`trainer.torch_threads`), beside the loader's workers.

torch gives a process one intra-op thread per CPU of its affinity (a cgroup quota is not read: a
container with a 4-CPU quota on a 64-core host runs 64), and the DataLoader's workers want CPUs of
the same budget. Every parallel op of the host's step waits at its end for its last thread, and a
thread whose CPU a worker holds waits for a time slice: measured (benchmarks/sim_device.py --explain,
20 ms asynchronous device step, JPEG pipeline, 2 CPUs, 2 worker processes) the host's step more
than doubled and the device was 0.31 busy with torch's 2 threads against 0.67 with 1.

The rule, first match wins:
- OMP_NUM_THREADS or MKL_NUM_THREADS in the environment: torch already follows it (capped at the
  CPUs of its affinity; MKL_NUM_THREADS wins over OMP_NUM_THREADS): kept. torchrun sets
  OMP_NUM_THREADS=1 for each rank where it is not set, and dlpipe keeps that 1.
- no workers: the CPU budget (all of it: the main process fetches and steps alone).
- trainer.device=cpu: the CPU budget too. The model computes on these threads, and in a
  compute-bound run the workers idle while it does: measured on the vision recipe's CNN beside 2
  worker processes on 2 quiet CPUs (benchmarks/torch_threads.py), budget - workers (1 thread) ran
  at 0.66x the samples/s of 2 threads. (Under heavy load from other work 1 thread won, 1.6x: a CPU
  taken by others is not one the budget can see.)
- an accelerator with workers: max(1, CPU budget - workers). The host's step only launches work,
  and its threads contend with workers that are busy all the time. Worker processes run 1 thread
  each (PyTorch's worker loop sets it, a forked worker included). Thread workers are threads of this
  process that each want a CPU while they fetch (image decoding releases the GIL) and run their
  torch ops on 1 thread (torchdata.nodes sets it in each of its threads; the main thread keeps its
  own), so they count the same: measured with 2 thread workers, the device was 0.28 busy with 2
  intra-op threads and 0.65 with 1.

No torch and nothing read at import: the config resolvers import this module.
"""

import logging
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from functools import lru_cache

from dlpipe.loader import policy
from dlpipe.loader.decisions import Decision

# Imported inside functions: torch (seconds), only where a decision needs torch's own count or sets it:
# the config resolvers import this module, and `dlpipe --help` must not pay for torch.

log = logging.getLogger("dlpipe")

KEY = "trainer.torch_threads"
RESOLVER = "auto_torch_threads"
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@lru_cache(maxsize=1)
def torch_default() -> int:
    """torch's own intra-op threads in this process, as it set them at import (asked once: after
    apply() torch says ours)."""
    import torch

    return torch.get_num_threads()


def decide(budget: int, workers: int, worker_method: str | None, torch_threads: int, device: str,
           environ: Mapping[str, str] | None = None) -> Decision:
    """The intra-op threads of a training process with `workers` loader workers on a CPU budget of
    `budget`. `worker_method`: "process", "thread", or None/"auto" where not decided yet; `torch_threads`:
    torch's own choice in this process (torch_default()); `device`: trainer.device (cpu: the model
    computes on these threads; anything else is an accelerator)."""
    env = os.environ if environ is None else environ
    given = [f"{k}={env[k]}" for k in ENV_KEYS if env.get(k, "").strip()]
    if given:
        why = ("torchrun sets OMP_NUM_THREADS=1 for each rank where it is not set" if "TORCHELASTIC_RUN_ID" in env
               else "torch follows it, at most one thread per CPU of its affinity")
        return Decision(torch_threads, f"{' '.join(given)} in the environment: torch's choice kept ({why})")
    default = f"torch's default was {torch_threads}"
    if workers <= 0:
        return Decision(max(1, budget), f"CPU budget {budget}, no workers: all of it for this process; {default}")
    if str(device).startswith("cpu"):
        return Decision(max(1, budget), f"CPU budget {budget}, trainer.device={device}: the model computes on these "
                                        f"threads, and the workers of a compute-bound run idle meanwhile; {default}")
    kind = {"process": "worker processes", "thread": "worker threads"}.get(worker_method or "", "workers")
    value = max(1, budget - workers)
    floor = ", at least 1" if budget - workers < 1 else ""
    return Decision(value, f"CPU budget {budget} - {workers} {kind}{floor}; {default}")


def is_auto(raw_trainer: Mapping) -> bool:
    """Whether the config leaves trainer.torch_threads to the rule (`${auto_torch_threads:...}`)."""
    return policy.is_auto(raw_trainer.get("torch_threads"), RESOLVER)


def rule_for(budget: int, device: str, environ: Mapping[str, str] | None = None
             ) -> Callable[[int, str | None], Decision]:
    """decide() on this process's budget, device and torch default, for a worker count and method."""
    return lambda workers, method: decide(budget, workers, method, torch_default(), device, environ)


def settle(raw_trainer: Mapping, trainer, workers: int, worker_method: str, budget: int,
           decided: dict[str, str], say: bool = True) -> None:
    """trainer.torch_threads decided again on the loader as built (the fit to the data may have
    changed its workers and decided their method), where the config leaves it automatic: `trainer`
    (schema.TrainerConfig) updated and the reason put in `decided` (the run's auto.* params, `dlpipe
    plan`'s line). A new value is logged unless `say` is False; the same value is not said twice
    (the recorded reason then names the workers' method, which the resolver did not know)."""
    if not is_auto(raw_trainer):
        return
    d = rule_for(budget, trainer.device)(workers, worker_method)
    changed = d.value != trainer.torch_threads
    trainer.torch_threads = d.value
    decided[KEY] = f"{d.value} (auto: {d.reason})"
    if changed and say:
        log.info("%s = %s", KEY, decided[KEY])


def apply(threads: int | None) -> None:
    """Set this process's intra-op threads (None: torch's own choice, as at import: a sweep's jobs
    may run one after another in one process). DataLoader worker processes set their own 1 whatever
    the parent has (torch.utils.data's worker loop)."""
    import torch

    default = torch_default()  # asked before any change: later jobs of this process compare with torch's own
    if threads is None:
        threads = default
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@contextmanager
def using(threads: int | None):
    """apply(threads) for the block, torch's previous setting back after it (tune's trials)."""
    import torch

    before = torch.get_num_threads()
    apply(threads)
    try:
        yield
    finally:
        apply(before)
