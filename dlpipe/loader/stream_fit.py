"""The automatic loader values of a stream (loader.streams), decided on the built stream: the workers
(none where items are so cheap that workers only add hand-over), who fetches (worker processes:
each reads its own copy of the stream) and whether dlpipe shares the stream out among them
(loader.stream_share: measured, see loader.streams.shares_itself).

The map-dataset decisions (loader.fitting) need an index: a whole-batch gather, a probe of items
spread over the data, batches per epoch. A stream has none, so each of those is a reason here.
"""

import itertools
import time
from dataclasses import replace

from torch.utils.data import IterableDataset, default_collate

from dlpipe.errors import ConfigError
from dlpipe.loader import policy, worker_method
from dlpipe.loader.collate import collate_first
from dlpipe.loader.decisions import prefetch, workers_for_data
from dlpipe.loader.stream_threads import EpochPositions
from dlpipe.loader.streams import reads_positions, shares_itself
from dlpipe.schema import LoaderConfig

PROBE_TIMEOUT_S = 60.0  # for the probing workers' first items: a reader of remote files may be slow to open


def stream_item_seconds(stream: IterableDataset, batch_size: int, collate_fn=None,
                        enough_s: float = 0.01) -> float | None:
    """Mean seconds per item to read and collate the stream's items here (item_fetch_seconds of a map
    dataset), after a first, untimed batch: it pays for opening the stream (a file, a shuffle buffer
    filling) and for the collate's first calls, which spread over a few items would read as an
    expensive item. None when the stream ends before anything is timed."""
    collate = collate_fn if collate_fn is not None else default_collate
    items = iter(stream)
    warm = list(itertools.islice(items, max(batch_size, 2)))
    if not warm:
        return None
    collate_first(warm, collate_fn, "the stream's items")  # items that do not collate: one line, said here
    batch, count, started = [], 0, time.perf_counter()
    for item in items:
        batch.append(item)
        count += 1
        if len(batch) == batch_size:
            collate(batch)
            batch = []
        if count >= 2 * batch_size or time.perf_counter() - started > enough_s:
            break
    if batch:
        collate(batch)
    return (time.perf_counter() - started) / count if count else None


def fit_stream(raw_loader: dict, loader: LoaderConfig, stream: IterableDataset, world: int, epochs: int,
               collate_fn=None, model_bytes: int = 0) -> tuple[LoaderConfig, dict[str, str]]:
    """fit_loader_to_data for a stream: (the loader settings, the reason for each value decided here).
    `model_bytes`: the CPU memory of a model already built (worker_method.fit)."""
    reasons = {}
    if loader.shuffle:  # said once, as a decision: a stream with its own shuffle buffer is configured right
        reasons["loader.shuffle"] = ("False (a stream is read in its own order: it shuffles itself, e.g. a "
                                     "shuffle buffer)")
        loader = replace(loader, shuffle=False)
    if loader.fetch != "item":
        reasons["loader.fetch"] = "item (auto: a stream is read item by item)" if loader.fetch == "auto" else \
            "item (loader.fetch=batch does not apply: a stream is read item by item)"
        loader = replace(loader, fetch="item")
    if policy.is_auto(raw_loader["num_workers"], "auto_workers") and loader.num_workers:
        decision = workers_for_data(loader.num_workers, stream_item_seconds(stream, loader.batch_size, collate_fn))
        if decision.value != loader.num_workers:
            loader = _with_workers(loader, decision.value, raw_loader, reasons,
                                   f"{decision.value} (auto: {decision.reason}; the stream's first items)")
    if policy.is_auto(raw_loader.get("persistent_workers"), "auto_persistent"):
        keep, why = policy.persist_workers(loader.num_workers, epochs, None)  # a stream's batches are not known
        if keep and hasattr(stream, "set_epoch"):
            keep, why = False, "the stream's set_epoch(epoch) reaches workers only when they start anew"
        loader = replace(loader, persistent_workers=keep)
        reasons["loader.persistent_workers"] = f"{keep} (auto: {why})"
    loader = _share(loader, stream, reasons, world)
    if loader.stream_share == "source" and policy.is_auto(raw_loader["num_workers"], "auto_workers"):
        loader = _workers_for_shards(loader, stream, raw_loader, reasons)
    if thread_workers_possible(loader, stream):  # the map dataset's decision, on the epoch's positions
        if loader.worker_method == "auto":
            loader = worker_method.fit(loader, raw_loader, EpochPositions(stream), collate_fn, reasons, model_bytes)
    elif not loader.num_workers:
        loader = replace(loader, worker_method="process")  # no workers: nothing to decide, PyTorch's default
    elif loader.worker_method != "process":
        reasons["loader.worker_method"] = ("process (auto: a stream: each worker process reads its own copy; "
                                           "threads would share one reader)")
        loader = replace(loader, worker_method="process")
    return loader, reasons


def thread_workers_possible(loader: LoaderConfig, stream: IterableDataset) -> bool:
    """Whether thread workers can fetch `stream` with `loader`'s settings: dlpipe deals it, and it reads
    any position of its epoch (loader.stream_threads), so threads build batches like worker processes."""
    return bool(loader.num_workers) and loader.stream_share == "dlpipe" and reads_positions(stream)


def share_decided_on(loader: LoaderConfig, stream: IterableDataset, world: int) -> str:
    """loader.stream_share as `auto` decides it on `stream` for `loader`'s workers and `world` ranks,
    whatever the config's value was decided for: a val_dataset stream may share itself out where the
    training stream does not (dealing it again would score only a part of it), and tune's candidates
    have workers where the job's loader may have none."""
    return _share(replace(loader, stream_share="auto"), stream, {}, world).stream_share


def _share(loader: LoaderConfig, stream: IterableDataset, reasons: dict[str, str], world: int = 1) -> LoaderConfig:
    """loader.stream_share=auto decided by the probe: `dlpipe` (whole batches dealt to each rank and,
    within it, to each worker) for a stream that yields all its items to every worker, `source` for
    one that shares itself out. With several ranks a stream that shares itself out is refused
    (_refuse_ranks): dlpipe cannot tell whether it also splits itself between the ranks."""
    if loader.stream_share == "dlpipe" and loader.num_workers and not reads_positions(stream):
        _refuse_dealing_a_share(loader.num_workers, stream, loader.multiprocessing_context)
    if loader.stream_share != "auto":
        return loader
    if not loader.num_workers and world == 1:
        reasons["loader.stream_share"] = ("dlpipe (auto: no workers: the main process reads the stream once and "
                                          "dlpipe batches it in its order)")
        return replace(loader, stream_share="dlpipe")
    if reads_positions(stream):
        reasons["loader.stream_share"] = (f"dlpipe (auto: {type(stream).__name__} reads any position of its epoch: "
                                          f"dlpipe deals whole batches to the {_readers(loader.num_workers, world)}, "
                                          "each building only its own, in an order that does not depend on them)")
        return replace(loader, stream_share="dlpipe")
    # With several ranks the probe runs even without workers: a stream that shares itself out among
    # workers is likely to split itself between ranks too, which dlpipe's dealing would split again.
    shares, why = shares_itself(stream, loader.multiprocessing_context, PROBE_TIMEOUT_S)
    if shares is None:
        raise ConfigError([f"loader.stream_share=auto: cannot tell whether the stream shares itself out among "
                           f"workers ({why}); set loader.stream_share=source (it does, by get_worker_info()) or "
                           "loader.stream_share=dlpipe (each worker keeps every Nth item)"])
    if shares and world > 1 and getattr(getattr(stream, "_distributed", None), "world_size", None) == world:
        reasons["loader.stream_share"] = (f"source (auto: {why}; Hugging Face's split_dataset_by_node gave each of "
                                          f"the {world} ranks its part)")
        return replace(loader, stream_share="source")
    if shares and world > 1:
        raise ConfigError([_refuse_ranks(why, world)])
    if shares:
        reasons["loader.stream_share"] = f"source (auto: {why})"
        return replace(loader, stream_share="source")
    n = loader.num_workers
    readers = _readers(n, world)
    reasons["loader.stream_share"] = (
        f"dlpipe (auto: {why}: each of the {readers} keeps every {_ordinal(max(n, 1) * world)} batch, so each sample "
        f"comes once an epoch; each {'worker' if n else 'rank'} still reads the whole stream"
        + (f": share it out at the source with get_worker_info() to read 1/{n} each)" if n else ")"))
    return replace(loader, stream_share="dlpipe")


def _refuse_dealing_a_share(workers: int, stream: IterableDataset, context: str | None) -> None:
    """loader.stream_share=dlpipe set for workers, on a stream that shares itself out: each worker would
    deal out its own share only, keeping 1/workers of it, and the rest would never be trained. Measured
    (a probe of two workers), as auto measures it: a second reason to set `source` is cheap, a silent
    loss of most rows is not."""
    shares, why = shares_itself(stream, context, PROBE_TIMEOUT_S)
    if shares:
        raise ConfigError([f"loader.stream_share=dlpipe with loader.num_workers={workers}: {why}: each worker would "
                           f"deal out its own share only and keep 1/{workers} of it, so most rows would never be "
                           "trained; set loader.stream_share=source (or auto), or loader.num_workers=0"])


def _workers_for_shards(loader: LoaderConfig, stream: IterableDataset, raw_loader: dict,
                        reasons: dict[str, str]) -> LoaderConfig:
    """loader.num_workers=auto capped at the shards of a stream that shares its shards out among the
    workers (a Hugging Face stream's `num_shards`): a worker beyond them starts and stops unread."""
    shards = getattr(stream, "num_shards", None)
    if not isinstance(shards, int) or isinstance(shards, bool) or not 0 < shards < loader.num_workers:
        return loader
    return _with_workers(loader, shards, raw_loader, reasons,
                         f"{shards} (auto: the stream has {shards} shard{'s' if shards > 1 else ''} (num_shards) "
                         f"and shares them out among the workers: a worker beyond them would read nothing; the "
                         f"budget alone would give {loader.num_workers})")


def _with_workers(loader: LoaderConfig, workers: int, raw_loader: dict, reasons: dict[str, str],
                  why: str) -> LoaderConfig:
    """An automatic worker count changed after the budget's: the prefetch that follows the workers (where
    it is automatic too) follows it."""
    reasons["loader.num_workers"] = why
    loader = replace(loader, num_workers=workers)
    if policy.is_auto(raw_loader["prefetch_factor"], "auto_prefetch"):
        follows = prefetch(workers)
        loader = replace(loader, prefetch_factor=follows.value)
        reasons["loader.prefetch_factor"] = f"{follows.value} (auto: {follows.reason})"
    return loader


def _readers(workers: int, world: int) -> str:
    """Who dlpipe deals a stream's batches to: '2 workers', '2 ranks', '2 workers of each of the 2 ranks'."""
    if world == 1:
        return f"{workers} workers"
    return f"{workers} workers of each of the {world} ranks" if workers else f"{world} ranks"


def _refuse_ranks(why: str, world: int) -> str:
    """The one line for loader.stream_share=auto on a stream that shares itself out, under several ranks."""
    return (f"loader.stream_share=auto: {why} and {world} ranks train it: dlpipe cannot split such a stream "
            "between the ranks, nor tell whether it splits itself between them too; set "
            "loader.stream_share=source if it does (e.g. Hugging Face's split_dataset_by_node; the epoch ends for "
            "every rank when one runs out of batches), or loader.stream_share=dlpipe with loader.num_workers=0 if it "
            "does not (each rank reads it whole and dlpipe deals its batches; with workers, each would deal from its "
            "own share only and lose the rest)")


def _ordinal(n: int) -> str:
    """2 -> 2nd, 3 -> 3rd, 11 -> 11th, 22 -> 22nd."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
