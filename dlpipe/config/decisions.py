"""Automatic values and the inputs they came from.

Every function returns a `Decision`: the value a resolver puts in the config plus the facts behind
it, so the run can print and record its reasoning.
"""

from functools import lru_cache

from dlpipe.config import sharing
from dlpipe.config.sources import Origin
from dlpipe.loader import policy, torch_threads
from dlpipe.loader.decisions import Decision, persistent, prefetch
from dlpipe.machine import hardware

# Imported inside functions: torch (seconds), only when a resolver asks a CUDA question or for torch's
# threads: the config layer never imports it, so `dlpipe --help` and printing an unresolved config do not
# pay for it.


@lru_cache(maxsize=1)
def _torch_cuda() -> tuple[bool, bool, str]:
    # Cached per process: CUDA availability cannot change during a run, and asking twice
    # (resolver, then explanation) should not cost twice.
    import torch

    if not torch.cuda.is_available():
        return False, False, "torch.cuda.is_available() is False"
    try:
        # Native support only: emulated bf16 on pre-Ampere GPUs (V100, T4) is slower than fp16.
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.4 has no emulation flag and answers natively already
        bf16 = torch.cuda.is_bf16_supported()
    return True, bool(bf16), f"{torch.cuda.device_count()} CUDA device(s)"


def workers(task: str | None = None) -> Decision:
    """Workers for this rank's CPU budget, divided between the dlpipe jobs sharing these CPUs
    (config.sharing: a job run of `task` registers there, once; None: the job's own, as settled)."""
    share = sharing.job_sharing(task)
    b = hardware.cpu_budget(sharing=share)
    value = hardware.recommended_workers(b.budget)
    cgroup = "none" if b.cgroup_cpus is None else f"{b.cgroup_cpus:g}"
    if b.rank_per_slurm_task:
        why = (f"CPU budget {b.budget} per rank -> {value} workers; budget = min(affinity {b.affinity}, "
               f"Slurm {b.slurm_cpus or 'none'} per task, cgroup {cgroup} // {b.local_world_size} tasks per node)")
    else:
        why = (f"CPU budget {b.budget} per rank -> {value} workers; budget = min(affinity {b.affinity}, "
               f"cgroup {cgroup}, Slurm {b.slurm_cpus or 'none'}) // {b.local_world_size} rank(s) per node")
    return Decision(value, why + share.describe(), b.as_params())


def cuda_available() -> Decision:
    available, _, why = _torch_cuda()
    return Decision(available, why)


def device() -> Decision:
    available, _, why = _torch_cuda()
    return Decision("cuda" if available else "cpu", why)


def amp(device: str) -> Decision:
    available, bf16, why = _torch_cuda()
    if not str(device).startswith("cuda"):
        return Decision("off", f"trainer.device={device}: autocast off the GPU rarely pays off")
    if not available:
        return Decision("off", f"no CUDA ({why})")
    if bf16:
        return Decision("bf16", "GPU supports bfloat16: same range as fp32, no loss scaling needed")
    return Decision("fp16", "GPU lacks bfloat16: fp16 with a GradScaler")


def intra_op_threads(num_workers, device: str) -> Decision:
    """trainer.torch_threads for this rank's CPU budget, the configured workers (their method is
    decided once the dataset is built: tasks settle it again there) and trainer.device."""
    budget = hardware.cpu_budget().budget
    return torch_threads.decide(budget, int(num_workers), None, torch_threads.torch_default(), str(device))


# Config key -> (resolver name, how to recompute its decision from the resolved config).
_AUTO_KEYS = {
    "loader.num_workers": ("auto_workers", lambda cfg: workers()),
    "loader.pin_memory": ("cuda_available", lambda cfg: cuda_available()),
    "loader.prefetch_factor": ("auto_prefetch", lambda cfg: prefetch(cfg["loader"]["num_workers"])),
    "loader.persistent_workers": (
        "auto_persistent",
        lambda cfg: persistent(
            cfg["loader"]["num_workers"], cfg["trainer"]["epochs"], cfg["dataset"].get("size", 0),
            cfg["loader"]["batch_size"], cfg["trainer"]["val_fraction"], cfg["loader"]["drop_last"],
        ),
    ),
    "trainer.device": ("auto_device", lambda cfg: device()),
    "trainer.amp": ("auto_amp", lambda cfg: amp(cfg["trainer"]["device"])),
    "trainer.torch_threads": (torch_threads.RESOLVER, lambda cfg: intra_op_threads(cfg["loader"]["num_workers"],
                                                                          cfg["trainer"]["device"])),
}


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def explain(raw: dict, resolved: dict, origin: Origin) -> dict[str, str]:
    """For every hardware-aware key: 'VALUE (auto: reason)', or 'VALUE (SOURCE)' with the source of
    a value set some other way (a user override, the recipe, a config option: config.sources).

    `raw` is the config before interpolation, `resolved` after; both plain containers.
    """
    out = {}
    for key, (resolver, recompute) in _AUTO_KEYS.items():
        value = _lookup(resolved, key)
        if policy.is_auto(_lookup(raw, key), resolver):
            out[key] = f"{value} (auto: {recompute(resolved).reason})"
        else:
            out[key] = f"{value} ({origin.source(key, _lookup(raw, key))})"
    return out
