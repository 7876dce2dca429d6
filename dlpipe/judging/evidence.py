"""The measurements a job's advice is checked against, gathered and recorded for train, bench and tune:
the probe of the built training split, this job's lines in the measurement journal (judging.journal),
the trials of the `dlpipe tune` search that wrote its loader config, and how many ranks its figures
combine.
"""

import logging
import socket

from dlpipe.judging.advice import MODES, Evidence, Tuned
from dlpipe.judging.journal import MeasurementFile, fingerprint, job_key, model_key
from dlpipe.loader.fetch import fetch_mode, item_collate
from dlpipe.loader.probe import item_fetch_seconds
from dlpipe.loader.stream_fit import stream_item_seconds
from dlpipe.loader.streams import is_stream
from dlpipe.loader.threads import worker_method_of
from dlpipe.schema import DlpipeConfig
from dlpipe.training import rng

log = logging.getLogger("dlpipe")


def measurement_file(cfg: DlpipeConfig, cpu_budget: int, mode: str, enabled: bool = True) -> MeasurementFile:
    """This job's lines of telemetry.measurements_file in `mode` ("epoch", "step" or "loader")."""
    path = cfg.telemetry.measurements_file if enabled else None
    return MeasurementFile(path, job_key(cfg, socket.gethostname(), cpu_budget), mode, model_key(cfg))


def bench_mode(cfg: DlpipeConfig) -> str:
    """The journal mode of a bench or tune measurement: the step is in the figure with bench.mode=train."""
    return "step" if cfg.bench.mode == "train" else "loader"


def gather(cfg: DlpipeConfig, cpu_budget: int, train_set, loader, enabled: bool = True) -> Evidence:
    """This job's journal in every mode (`enabled` False: none) and the probe, run when an advice
    first needs it (when workers fetch, the epoch itself cannot show what an item costs the main
    process)."""
    journals = {mode: measurement_file(cfg, cpu_budget, mode, enabled).read() for mode in MODES}
    has_items = is_stream(train_set) or len(train_set)
    probe = (lambda: item_cost_here(train_set, loader)) if loader.num_workers > 0 and has_items else None
    return Evidence(None, {m: j for m, j in journals.items() if j.observations}, probe, ranks_of(loader),
                    tuned_search(cfg, cpu_budget))


def tune_context(cfg: DlpipeConfig, cpu_budget: int) -> dict:
    """What a `dlpipe tune` search files with its trials, for a run with its config to compare."""
    return {"batch_size": cfg.loader.batch_size, "device": cfg.trainer.device, "cpu_budget": cpu_budget,
            "host": socket.gethostname(), "dataset": fingerprint(cfg.dataset)}


def tuned_search(cfg: DlpipeConfig, cpu_budget: int) -> Tuned | None:
    """The trials of the search named by loader.tuned_on (`tune=ID`, written by `dlpipe tune`), and
    how this run differs from the job it measured; None without one, or with none of its lines left.
    Ratios within one search compare with each other whatever the job, so a distributed run reads them
    too (its own samples/s is never compared with them)."""
    ids = [part.partition("=")[2] for part in (cfg.loader.tuned_on or "").split() if part.startswith("tune=")]
    journal = MeasurementFile(cfg.telemetry.measurements_file, "", "").read_tune(ids[0]) if ids else None
    if not journal or not journal.observations:
        return None
    then, now = journal.observations[0].context or {}, tune_context(cfg, cpu_budget)
    differs = [("another dataset" if key == "dataset" else f"{key} {now[key]} (tuned at {then[key]})")
               for key in now if key in then and then[key] != now[key]]
    return Tuned(journal, ", ".join(differs))


def ranks_of(loader) -> int:
    """How many ranks share the data this loader reads (its sampler's or its stream's `world`): the
    epoch figures combine theirs (training.distributed)."""
    for holder in (loader.sampler, getattr(loader.sampler, "sampler", None), getattr(loader, "batch_sampler", None),
                   getattr(getattr(loader, "batch_sampler", None), "sampler", None), loader.dataset):
        world = getattr(holder, "world", None)
        if isinstance(world, int) and world > 0:
            return world
    return 1


def item_cost_here(train_set, loader) -> float | None:
    """Seconds per item fetched and collated in the main process (loader.probe), leaving every random
    stream as it was: fetching may augment, and the run must draw what it would have drawn without it.
    None when an item fails here: the advice then goes without the figure, and the training loop, not
    a probe for advice, is where a bad item is reported."""
    state = rng.capture()
    try:
        batch = loader.batch_size or loader.sampler.batch_size  # fetching whole batches: the sampler batches
        if is_stream(train_set):  # its first items, read here
            return stream_item_seconds(train_set, batch, collate_fn=loader.collate_fn)
        return item_fetch_seconds(train_set, batch, collate_fn=item_collate(loader))
    except Exception as e:  # noqa: BLE001 - a user's __getitem__ may raise anything
        log.info("no probe of the items for the advice: %s: %s", type(e).__name__, e)
        return None
    finally:
        rng.restore(state)


def settings_of(loader) -> dict:
    """The settings a built DataLoader really runs with (after dlpipe's normalisation)."""
    return {"num_workers": loader.num_workers, "prefetch_factor": loader.prefetch_factor,
            "persistent_workers": loader.persistent_workers, "pin_memory": bool(loader.pin_memory),
            "fetch": fetch_mode(loader), "worker_method": worker_method_of(loader)}


