"""How many dlpipe jobs this job's CPU budget is divided between, and when a job registers.

A Hydra job run that sizes its workers (`${auto_workers:}`) registers in `dlpipe.machine.budget_share`'s
folder and counts the live jobs on its CPUs; a plan or a printed config (`--cfg job --resolve`)
only counts, as if it were one more job. The answer is settled once per job, so the resolver, the
logged reason and the budget recorded with the run agree however other jobs come and go.

The jobs of a sweep start together: the first to register would see itself alone. Where the launcher
says how many it runs at once (the joblib launcher's `n_jobs`, submitit_local's whole batch), a sweep
job counts at least that many of its siblings, read from the sweep's `multirun.yaml`.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dlpipe.config.paths import user_cache_dir
from dlpipe.machine import budget_share, hardware
from dlpipe.machine.budget_share import Sharing

SHARED_BUDGET_ENV = "DLPIPE_SHARED_BUDGET"
_ON, _OFF = ("", "1", "true", "yes", "on"), ("0", "false", "no", "off")


def jobs_folder() -> Path:
    """The registry of this host's jobs (per host: a home folder may be shared by many nodes)."""
    return Path(user_cache_dir()) / "dlpipe" / "jobs" / socket.gethostname()


def shared_budget_enabled() -> bool:
    value = os.environ.get(SHARED_BUDGET_ENV, "").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"{SHARED_BUDGET_ENV}={os.environ[SHARED_BUDGET_ENV]!r}: use 1 (divide the CPU budget "
                         "between dlpipe jobs sharing these CPUs, the default) or 0 (each job takes the whole budget)")
    return value in _ON


def job_sharing(task: str | None = None) -> Sharing:
    """This job's share of the CPUs: registered and settled in a job run of any task but `plan`."""
    if not shared_budget_enabled():
        return Sharing()
    hc = _running_job()
    key = None if hc is None else f"{jobs_folder()}|{hc.runtime.output_dir}"
    known = None if key is None else budget_share.settled(key)
    if known is not None:
        return known
    undivided = hardware.cpu_budget(sharing=Sharing())
    multirun = hc is not None and hc.mode == RunMode.MULTIRUN
    sweep = str(Path(str(hc.sweep.dir)).resolve()) if multirun else ""
    ranks = undivided.local_world_size > 1 or hardware.world_size() > 1
    me = budget_share.this_process(undivided.cgroup_source, ranks=ranks, sweep=sweep)
    registry = budget_share.Registry(jobs_folder())
    records = registry.join(me) if hc is not None and task != "plan" else registry.peek(me)
    declared = launcher_concurrency(hc, undivided) if multirun else None
    share = budget_share.count(me, records, declared)
    if key is not None:
        budget_share.settle(key, share)
    return share


def _running_job():
    """Hydra's config of the job this process is running, or None (no Hydra job: a test composing a
    config, or `--cfg job`, which sets the config but runs no job and so has no output folder)."""
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    return hc if OmegaConf.select(hc, "runtime.output_dir", default=None) else None


def launcher_concurrency(hc, undivided: hardware.CpuBudget) -> tuple[int, str] | None:
    """(jobs of this sweep running at once, what says so), where the launcher tells; else None.

    The joblib launcher runs `n_jobs` at once (negative: all CPUs but n_jobs + 1 of them, as joblib
    counts); submitit_local starts a whole batch at once; both run no more than the batch holds.
    Other launchers send jobs elsewhere (Slurm) or one at a time (the basic launcher)."""
    target = str(OmegaConf.select(hc, "launcher._target_", default="") or "")
    if target.endswith(".JoblibLauncher"):
        n_jobs = OmegaConf.select(hc, "launcher.n_jobs", default=None)
        n_jobs = 1 if n_jobs is None else int(n_jobs)
        limits = [undivided.affinity] + ([] if undivided.cgroup_cpus is None else [math.ceil(undivided.cgroup_cpus)])
        slots: int | None = n_jobs if n_jobs > 0 else max(1, min(limits) + 1 + n_jobs)
        name = "the joblib launcher runs {} jobs at once"
    elif target.endswith("submitit_launcher.LocalLauncher"):
        slots, name = None, "submitit_local runs {} jobs at once"
    else:
        return None
    batch = sweep_batch(hc)
    known = [n for n in (slots, batch) if n is not None]
    if not known:
        return None
    at_once = min(known)
    return at_once, name.format(at_once)


def sweep_batch(hc) -> int | None:
    """How many jobs the basic sweeper launches together with this one (the batch holding
    `hydra.job.num`), from the `multirun.yaml` it saved before launching; None where it cannot tell
    (another sweeper, a glob sweep, a missing or unreadable file)."""
    try:
        saved = OmegaConf.load(Path(str(hc.sweep.dir)) / "multirun.yaml")
        sweeper = OmegaConf.to_container(saved.hydra.sweeper, resolve=False)
        if not str(sweeper.get("_target_", "")).endswith(".BasicSweeper"):
            return None
        arguments = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
        arguments += OmegaConf.to_container(saved.hydra.overrides.task, resolve=False)
        values = {}  # the sweeper's rule: one entry per key, the last one wins
        for override in OverridesParser.create().parse_overrides(arguments):
            sweep = override.sweep_string_iterator() if override.is_sweep_override() else [None]
            values[override.get_key_element()] = len(list(sweep))
        total = math.prod(values.values())
        size = sweeper.get("max_batch_size") or total
        size = total if size < 0 else size
        first = int(hc.job.num) // size * size
        return max(1, min(size, total - first))
    except (OSError, HydraException, OmegaConfBaseException, ValueError, TypeError, AttributeError):
        return None
