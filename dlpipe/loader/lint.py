"""Pre-flight lint of the loader settings against this machine, before train, bench and tune.

Each finding is one line naming the key, what it costs and the fix. They are warnings, not
errors: the settings work, just slower or at risk. Settings that cannot work (a prefetch_factor
with no workers, a batch larger than the data with drop_last) are config errors instead.
"""

from dataclasses import dataclass

from dlpipe.loader import policy
from dlpipe.machine.hardware import memory_available_bytes, shm_free_bytes, world_size
from dlpipe.schema import DlpipeConfig, LoaderConfig


@dataclass(frozen=True)
class LoaderFacts:
    """What the lint compares the settings with (measured by the caller)."""

    cpu_budget: int
    cuda: bool
    train_size: int | None  # None: a stream, whose size is not known before it is read
    batch_bytes: int
    shm_free_bytes: int | None
    world_size: int = 1
    reads_positions: bool = False  # a stream that builds only the items asked for (dlpipe.data.shards)
    stream_buffer_bytes: int = 0  # what one reader of a stream holds at once (a shuffle window)
    ram_available: int | None = None  # hardware.memory_available_bytes(), for a stream's buffers


def _mb(n: int) -> str:
    return f"{n / 2**20:.0f} MB"


def tuned_budget(loader: LoaderConfig) -> int | None:
    """The CPU budget a `dlpipe tune` file was measured with (loader.tuned_on), or None."""
    for part in (loader.tuned_on or "").split():
        key, _, value = part.partition("=")
        if key == "cpu_budget" and value.isdigit():
            return int(value)
    return None


def lint_loader(loader: LoaderConfig, epochs: int, facts: LoaderFacts) -> list[str]:
    """One line per risky loader setting, each with the fix. Values `dlpipe tune` measured with
    this CPU budget are trusted: a worker count past the budget was found to be faster."""
    out = []
    workers, batch = loader.num_workers, loader.batch_size
    tuned = tuned_budget(loader)
    if tuned is not None and tuned != facts.cpu_budget:
        out.append(f"loader.tuned_on={loader.tuned_on!r}: these values were measured with a CPU budget of "
                   f"{tuned}, this machine gives {facts.cpu_budget}; run `dlpipe tune` here")
    if workers > facts.cpu_budget and tuned != facts.cpu_budget:
        out.append(f"loader.num_workers={workers} is above the CPU budget of {facts.cpu_budget}: the workers and "
                   f"the training step compete for cores; use loader.num_workers=${{auto_workers:}} or "
                   f"measure with `dlpipe tune`")
    if loader.pin_memory and not facts.cuda:
        out.append("loader.pin_memory=true without CUDA: pinned buffers only speed up copies to a GPU and cost "
                   "page-locked RAM; set loader.pin_memory=${cuda_available:}")
    if loader.persistent_workers and workers and facts.train_size is not None:
        batches = policy.batches_per_epoch(facts.train_size, batch, facts.world_size, loader.drop_last)
        keep, why = policy.persist_workers(workers, epochs, batches)
        if not keep:
            out.append(f"loader.persistent_workers=true: {why}; set loader.persistent_workers=false")
    inflight = policy.inflight_bytes(workers, loader.prefetch_factor, facts.batch_bytes)
    if workers and policy.shm_overflow(inflight, facts.shm_free_bytes):
        prefetch = policy.prefetch_in_effect(workers, loader.prefetch_factor)
        out.append(f"{workers} workers x prefetch {prefetch} x {_mb(facts.batch_bytes)} "
                   f"batches = {_mb(inflight)} in flight through /dev/shm, which has {_mb(facts.shm_free_bytes)} "
                   "free (Docker's default is 64 MB): workers may die with a bus error; raise --shm-size or "
                   "lower loader.num_workers, loader.prefetch_factor or loader.batch_size")
    if facts.train_size is None:
        return out + _lint_stream(loader, facts.reads_positions, facts.world_size) + _lint_stream_memory(loader, facts)
    per_rank = facts.train_size // max(facts.world_size, 1)
    if facts.world_size > 1 and facts.train_size % facts.world_size:
        out.append(f"{facts.train_size} training samples over {facts.world_size} ranks: each epoch repeats "
                   f"{facts.world_size - facts.train_size % facts.world_size} of them to even out the ranks' steps "
                   "(as DistributedSampler does)")
    if not loader.drop_last and per_rank % batch == 1:
        out.append(f"loader.batch_size={batch} leaves a last batch of 1 sample ({per_rank} per rank): BatchNorm "
                   "fails on it and its gradient is noisy; set loader.drop_last=true or change loader.batch_size")
    return out


def _lint_stream(loader: LoaderConfig, reads_positions: bool, world: int = 1) -> list[str]:
    """A stream dlpipe shares out: every worker reads all of it, to keep its share (unless the stream
    builds only the items asked for). A stream that splits itself between ranks: they end the epoch
    with the shortest share (dlpipe.training.stream_ranks)."""
    workers, out = loader.num_workers, []
    if workers > 1 and loader.stream_share == "dlpipe" and not reads_positions:
        out.append(f"loader.stream_share=dlpipe: each of the {workers} workers reads the whole stream and keeps "
                   f"1/{workers} of it, so the stream is read {workers} times an epoch; share it out at the source "
                   "(each worker reads its own files or rows by torch.utils.data.get_worker_info()) to read it once")
    if world > 1 and loader.stream_share == "source":
        out.append(f"loader.stream_share=source with {world} ranks: the stream is trusted to split itself between "
                   "them (e.g. split_dataset_by_node); the ranks agree before every batch that each has one (an "
                   "all-reduce) and the epoch ends for all when one runs out, so the batches the others still hold "
                   "are not trained on that epoch (one per rank where items are split round-robin, more where "
                   "whole files are); loader.stream_share=dlpipe deals every rank the same batches and loses none")
    return out


def _lint_stream_memory(loader: LoaderConfig, facts: LoaderFacts) -> list[str]:
    """A stream's readers (each worker, or the main process) each hold a shuffle window: with the
    batches in flight, more than the memory the loader may take here (policy.RAM_SHARE)."""
    if not facts.stream_buffer_bytes or facts.ram_available is None:
        return []
    readers = max(loader.num_workers, 1)
    inflight = policy.inflight_bytes(loader.num_workers, loader.prefetch_factor, facts.batch_bytes)
    if not policy.ram_overflow(readers * facts.stream_buffer_bytes, inflight, facts.ram_available):
        return []
    return [f"{readers} reader(s) of the stream each hold its shuffle window of {_mb(facts.stream_buffer_bytes)} "
            f"({_mb(readers * facts.stream_buffer_bytes + inflight)} with the batches in flight), over "
            f"{policy.RAM_SHARE:.0%} of the {_mb(facts.ram_available)} of memory available: the out-of-memory killer "
            "would end them; lower dataset.shuffle_buffer or loader.num_workers"]


def lint_job(cfg: DlpipeConfig, train_size: int | None, batch_bytes: int, cpu_budget: int,
             reads_positions: bool = False, stream_buffer_bytes: int = 0) -> list[str]:
    """The lint for a job's config on this machine; `reads_positions`, `stream_buffer_bytes`: see LoaderFacts."""
    facts = LoaderFacts(
        cpu_budget=cpu_budget, cuda=cfg.trainer.device.startswith("cuda"), train_size=train_size,
        batch_bytes=batch_bytes, shm_free_bytes=shm_free_bytes(), world_size=world_size(),
        reads_positions=reads_positions, stream_buffer_bytes=stream_buffer_bytes,
        ram_available=memory_available_bytes() if stream_buffer_bytes else None,
    )
    return lint_loader(cfg.loader, cfg.trainer.epochs, facts)
