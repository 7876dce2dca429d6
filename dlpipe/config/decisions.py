"""Automatic values and the inputs they came from.

Every function returns a `Decision`: the value a resolver puts in the config plus the facts behind
it, so the run can print and record its reasoning. torch is imported lazily (only when a CUDA
question is actually asked) so printing an unresolved config never pays for it.
"""

from dataclasses import dataclass, field
from functools import lru_cache

from dlpipe import hardware
from dlpipe.config import sharing
from dlpipe.config.sources import Origin
from dlpipe.loader import policy


@dataclass(frozen=True)
class Decision:
    value: object
    reason: str
    inputs: dict = field(default_factory=dict)


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


def workers_for_data(cpu_workers: int, item_fetch_s: float | None) -> Decision:
    """The CPU-based worker count, or 0 when items are so cheap to fetch in this process that
    workers can only slow it down (data already in memory). `item_fetch_s` None: not measured."""
    if cpu_workers and item_fetch_s is not None and item_fetch_s < policy.CHEAP_ITEM_S:
        return Decision(0, f"items take {item_fetch_s * 1e6:.1f} us each to fetch in this process (data in memory), "
                           f"under the {policy.CHEAP_ITEM_S * 1e6:.0f} us where workers start to pay for their "
                           "hand-over; "
                           f"the CPU budget alone would give {cpu_workers}")
    return Decision(cpu_workers, "")


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


def prefetch(num_workers: int) -> Decision:
    if int(num_workers) == 0:
        return Decision(None, "no workers: PyTorch rejects prefetch_factor without them")
    n = policy.PREFETCH_DEFAULT
    return Decision(n, f"{num_workers} workers x {n} batches in flight")


def persistent(num_workers: int, epochs: int, dataset_size, batch_size=None, val_fraction=0.0,
               drop_last=False) -> Decision:
    """policy.persist_workers on the batches this config gives each rank per epoch; without a known
    dataset size (or batch size) the batches are unknown here, and tasks.build decides again once
    the dataset is built."""
    num_workers, epochs, size = int(num_workers), int(epochs), int(dataset_size or 0)
    batches = None
    if size > 0 and batch_size:
        train = policy.train_samples(size, float(val_fraction or 0.0))
        batches = policy.batches_per_epoch(train, int(batch_size), hardware.world_size(), bool(drop_last))
    value, why = policy.persist_workers(num_workers, epochs, batches)
    inputs = {"num_workers": str(num_workers), "epochs": str(epochs), "dataset_size": str(size or "unknown"),
              "batches_per_epoch": "unknown" if batches is None else str(batches)}
    return Decision(value, why, inputs)


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
