"""Pre-flight lint of the loader settings against this machine, before train, bench and tune.

Each finding is one line naming the key, what it costs and the fix. They are warnings, not
errors: the settings work, just slower or at risk. Settings that cannot work (a prefetch_factor
with no workers, a batch larger than the data with drop_last) are config errors instead.
"""

from dataclasses import dataclass

TINY_DATASET_BATCHES = 20  # persistent workers save a worker start per epoch; worth it only past this
SHM_SHARE = 0.5  # in-flight batches may use this share of free /dev/shm before a warning


@dataclass(frozen=True)
class LoaderFacts:
    """What the lint compares the settings with (measured by the caller)."""

    cpu_budget: int
    cuda: bool
    train_size: int
    batch_bytes: int
    shm_free_bytes: int | None
    world_size: int = 1


def _mb(n: int) -> str:
    return f"{n / 2**20:.0f} MB"


def tuned_budget(loader: dict) -> int | None:
    """The CPU budget a `dlpipe tune` file was measured with (loader.tuned_on), or None."""
    for part in (loader.get("tuned_on") or "").split():
        key, _, value = part.partition("=")
        if key == "cpu_budget" and value.isdigit():
            return int(value)
    return None


def lint_loader(loader: dict, epochs: int, facts: LoaderFacts) -> list[str]:
    """One line per risky loader setting, each with the fix. Values `dlpipe tune` measured with
    this CPU budget are trusted: a worker count past the budget was found to be faster."""
    out = []
    workers, batch = loader["num_workers"], loader["batch_size"]
    tuned = tuned_budget(loader)
    if tuned is not None and tuned != facts.cpu_budget:
        out.append(f"loader.tuned_on={loader['tuned_on']!r}: these values were measured with a CPU budget of "
                   f"{tuned}, this machine gives {facts.cpu_budget}; run `dlpipe tune` here")
    if workers > facts.cpu_budget and tuned != facts.cpu_budget:
        out.append(f"loader.num_workers={workers} is above the CPU budget of {facts.cpu_budget}: the workers and "
                   f"the training step compete for cores; use loader.num_workers=${{auto_workers:}} or "
                   f"measure with `dlpipe tune`")
    if loader["pin_memory"] and not facts.cuda:
        out.append("loader.pin_memory=true without CUDA: pinned buffers only speed up copies to a GPU and cost "
                   "page-locked RAM; set loader.pin_memory=${cuda_available:}")
    batches = facts.train_size // max(batch * facts.world_size, 1)
    if loader["persistent_workers"] and workers and (epochs == 1 or batches < TINY_DATASET_BATCHES):
        why = "one epoch" if epochs == 1 else f"{batches} batches an epoch"
        out.append(f"loader.persistent_workers=true with {why}: nothing to save by keeping {workers} workers "
                   "resident, and they hold their memory all run; set loader.persistent_workers=false")
    if workers and facts.shm_free_bytes is not None:
        inflight = workers * (loader.get("prefetch_factor") or 2) * facts.batch_bytes
        if inflight > SHM_SHARE * facts.shm_free_bytes:
            out.append(f"{workers} workers x prefetch {loader.get('prefetch_factor') or 2} x {_mb(facts.batch_bytes)} "
                       f"batches = {_mb(inflight)} in flight through /dev/shm, which has {_mb(facts.shm_free_bytes)} "
                       "free (Docker's default is 64 MB): workers may die with a bus error; raise --shm-size or "
                       "lower loader.num_workers, loader.prefetch_factor or loader.batch_size")
    per_rank = facts.train_size // max(facts.world_size, 1)
    if facts.world_size > 1 and facts.train_size % facts.world_size:
        out.append(f"{facts.train_size} training samples over {facts.world_size} ranks: each epoch repeats "
                   f"{facts.world_size - facts.train_size % facts.world_size} of them to even out the ranks' steps "
                   "(as DistributedSampler does)")
    if not loader["drop_last"] and per_rank % batch == 1:
        out.append(f"loader.batch_size={batch} leaves a last batch of 1 sample ({per_rank} per rank): BatchNorm "
                   "fails on it and its gradient is noisy; set loader.drop_last=true or change loader.batch_size")
    return out


def lint_job(resolved: dict, train_size: int, batch_bytes: int, cpu_budget: int) -> list[str]:
    """The lint for a resolved job config on this machine."""
    from dlpipe.distributed import ranks_from_env
    from dlpipe.hardware import shm_free_bytes

    facts = LoaderFacts(
        cpu_budget=cpu_budget, cuda=resolved["trainer"]["device"].startswith("cuda"), train_size=train_size,
        batch_bytes=batch_bytes, shm_free_bytes=shm_free_bytes(), world_size=ranks_from_env().world,
    )
    return lint_loader(resolved["loader"], resolved["trainer"]["epochs"], facts)
