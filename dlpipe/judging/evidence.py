"""The measurements a job's advice is checked against, gathered and recorded for train, bench and tune:
the probe of the built training split and this job's lines in the measurement journal (judging.journal).
"""

import logging
import socket

from dlpipe.judging.advice import MODES, Evidence
from dlpipe.judging.journal import MeasurementFile, job_key, model_key
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
    return Evidence(None, {m: j for m, j in journals.items() if j.observations}, probe)


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


