"""OmegaConf resolvers for hardware-aware values: thin adapters over `decisions`.

Each resolver returns only the chosen value; `decisions.explain` recomputes the same decision
with its inputs so the run can log *why* (no hidden state shared between the two).
"""

from omegaconf import OmegaConf

from dlpipe.config import decisions
from dlpipe.config.paths import user_cache_dir

RESOLVERS = {
    # _root_: the job's config, whose `task` says whether this job registers as one sharing the CPUs
    "auto_workers": lambda *, _root_: decisions.workers(_root_.get("task")).value,
    "cuda_available": lambda: decisions.cuda_available().value,
    "auto_device": lambda: decisions.device().value,
    "auto_amp": lambda device: decisions.amp(device).value,
    "auto_prefetch": lambda num_workers: decisions.prefetch(num_workers).value,
    "auto_persistent": lambda *args: decisions.persistent(*args).value,
    "auto_torch_threads": lambda num_workers, device: decisions.intra_op_threads(num_workers, device).value,
    "user_cache": user_cache_dir,
}


def register_resolvers() -> None:
    """Register every dlpipe resolver; safe to call more than once (multirun, launcher jobs)."""
    for name, fn in RESOLVERS.items():
        # replace=True keeps this idempotent; use_cache=False because a resolver may be asked again
        # in a job process whose environment (LOCAL_WORLD_SIZE, Slurm) differs from the launcher's.
        OmegaConf.register_new_resolver(name, fn, replace=True, use_cache=False)
