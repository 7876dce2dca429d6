"""What dlpipe measured about a job's loader, kept across runs: the evidence its advice is checked
against (judging.advice), so it never suggests a setting it has already measured slower.

`dlpipe bench`, each `dlpipe tune` trial and each training run append one JSON line per measurement
to telemetry.measurements_file (default ~/.cache/dlpipe/measurements.jsonl). A line holds:
- `job`: a fingerprint of what decides the loader's speed apart from its own settings (the dataset
  node, batch size, collate, split, device, host and CPU budget): lines of other jobs never count;
- `mode`: how it was measured: "loader" (batches alone, bench.mode=loader), "step" (each batch through
  the training step, bench.mode=train) or "epoch" (a training run: samples/s of its epochs after the
  first); with `model`, a fingerprint of the step, for the two modes where the step is in the figure.
  Only measurements of the same mode and model are compared;
- `settings`: the loader settings the DataLoader really got (after normalisation), `samples_per_s`,
  `source` (which command measured it) and `when`;
- from `dlpipe tune` also `noise` (the gain its search asked of a candidate: bench.min_gain, or twice
  the spread of the automatic config's repeats, whichever is larger: a figure closer than that to
  another of the same search is noise), `tune` (the search's id, which the written config's
  `loader.tuned_on` names) and `context` (batch size, device, CPU budget, host, dataset: what a later
  run with the tuned config may differ in).

Writing is best-effort: a read-only or full home never fails a job (the advice then rests on the
run's own numbers). No torch here: the verdict and the config layer read it.
"""

import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from dlpipe.loader import policy

log = logging.getLogger("dlpipe")

SETTINGS = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "fetch", "worker_method")
"""The loader settings a measurement is filed under."""

MIN_GAIN = 0.03
"""A setting counts as measured faster only when it beat the other by this share (dlpipe tune's
default bench.min_gain): closer than that is noise on a shared machine."""


def fingerprint(*parts) -> str:
    """A short stable hash of plain containers (dict order does not matter)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def job_key(cfg, host: str, cpu_budget: int) -> str:
    """What decides loader speed apart from the loader's own settings (cfg: a validated DlpipeConfig)."""
    loader = cfg.loader
    return fingerprint(cfg.dataset, loader.batch_size, loader.collate_fn, loader.drop_last, loader.shuffle,
                       loader.multiprocessing_context, cfg.trainer.val_fraction, cfg.trainer.device, host, cpu_budget)


def model_key(cfg) -> str:
    """What decides the step's cost: measurements through the step compare only with the same step."""
    t = cfg.trainer
    return fingerprint(cfg.model, cfg.optim, cfg.loss, t.amp, t.accumulate, t.compile, t.device)


def effective(settings: dict) -> dict:
    """The filed settings: what PyTorch does with them (prefetch, persistence and the worker method
    mean nothing without workers, threads keep nothing across epochs; an unset prefetch_factor is
    PyTorch's default; lines filed before a setting existed had its default)."""
    workers = int(settings["num_workers"])
    threads = workers > 0 and settings.get("worker_method") == "thread"
    return {"num_workers": workers,
            "prefetch_factor": policy.prefetch_in_effect(workers, settings.get("prefetch_factor")) or None,
            "persistent_workers": bool(settings.get("persistent_workers")) and workers > 0 and not threads,
            "pin_memory": bool(settings.get("pin_memory")), "fetch": settings.get("fetch") or "item",
            "worker_method": "thread" if threads else "process"}


@dataclass(frozen=True)
class Observation:
    settings: dict
    samples_per_s: float
    source: str
    when: str
    noise: float = 0.0
    """The relative gap under which another figure of the same measurement is noise (dlpipe tune's)."""
    tune: str = ""
    """The id of the `dlpipe tune` search that measured it, if one did."""
    context: dict | None = None
    """What the measured job was (a tune's: batch_size, device, cpu_budget, host, dataset)."""

    def label(self) -> str:
        s = self.settings
        pin = (" pin_memory=true" if s["pin_memory"] else "") + (" fetch=batch" if s.get("fetch") == "batch" else "")
        if s["num_workers"] == 0:
            return "num_workers=0" + pin
        if s.get("worker_method") == "thread":
            return f"num_workers={s['num_workers']} worker_method=thread prefetch_factor={s['prefetch_factor']}{pin}"
        return (f"num_workers={s['num_workers']} prefetch_factor={s['prefetch_factor']} "
                f"persistent_workers={str(s['persistent_workers']).lower()}{pin}")


@dataclass(frozen=True)
class Journal:
    """The measurements of one job, in one mode (and model), read from the file."""

    observations: tuple[Observation, ...] = ()

    def best(self, **match) -> Observation | None:
        """The fastest measurement whose settings have these values, or None."""
        rows = [o for o in self.observations if all(o.settings.get(k) == v for k, v in match.items())]
        return max(rows, key=lambda o: o.samples_per_s, default=None)

    def median(self, settings: dict) -> float | None:
        """The median samples/s measured with exactly these (effective) settings, or None."""
        wanted = effective(settings)
        values = [o.samples_per_s for o in self.observations if o.settings == wanted]
        return statistics.median(values) if values else None

    def noise(self, settings: dict) -> float:
        """The largest noise recorded with a measurement of exactly these settings (0 when none)."""
        wanted = effective(settings)
        return max((o.noise for o in self.observations if o.settings == wanted), default=0.0)


class MeasurementFile:
    """Appends and reads one job's lines in telemetry.measurements_file (None: off)."""

    def __init__(self, path: str | None, job: str, mode: str, model: str | None = None):
        self.path = Path(path).expanduser() if path else None
        self.job, self.mode, self.model = job, mode, model if mode != "loader" else None
        self._warned = False

    def append(self, settings: dict, samples_per_s: float, source: str, **tune) -> None:
        """One measurement; `tune`: a tune trial's noise, tune (its id) and context (see the module)."""
        if self.path is None or not samples_per_s > 0:
            return
        line = json.dumps({"job": self.job, "mode": self.mode, "model": self.model, "settings": effective(settings),
                           "samples_per_s": round(float(samples_per_s), 3), "source": source,
                           "when": time.strftime("%Y-%m-%d %H:%M"), **tune}, sort_keys=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One write of one line with O_APPEND: concurrent jobs' lines do not interleave.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            if not self._warned:
                log.warning("telemetry.measurements_file=%s: not written (%s); advice rests on this run's own "
                            "numbers", self.path, e.strerror or e)
                self._warned = True

    def read(self) -> Journal:
        """This job's measurements in this mode; a missing or unreadable file is an empty journal, and a
        torn or foreign line is skipped (another job may be appending right now)."""
        return _read(self.path, lambda row: (row["job"], row["mode"], row.get("model")) ==
                     (self.job, self.mode, self.model))

    def read_tune(self, tune: str) -> Journal:
        """Every trial of the `dlpipe tune` search `tune`, whatever job it measured: a run with the
        config it wrote may have changed what the job fingerprint holds (batch size, device) and still
        say what the search found."""
        return _read(self.path, lambda row: row.get("tune") == tune) if tune else Journal()


def _read(path: Path | None, wanted) -> Journal:
    """The lines of the journal at `path` that `wanted(row)` keeps."""
    if path is None:
        return Journal()
    try:
        text = _tail(path, READ_BYTES)
    except OSError:
        return Journal()
    found = []
    for raw in text.splitlines():
        try:
            row = json.loads(raw)
            if not wanted(row):
                continue
            rate = float(row["samples_per_s"])
            if math.isfinite(rate) and rate > 0:
                context = row.get("context")
                found.append(Observation(effective(row["settings"]), rate, str(row.get("source", "?")),
                                         str(row.get("when", "?")), max(float(row.get("noise") or 0.0), 0.0),
                                         str(row.get("tune") or ""), context if isinstance(context, dict) else None))
        except Exception:  # noqa: BLE001 - any line a person or a torn write left is skipped, never fatal
            continue
    return Journal(tuple(found))


READ_BYTES = 4 * 2**20
"""Only the newest 4 MiB of the journal are read (about 15,000 lines): the file is never rotated, and
a job's start-up must not grow with every run ever measured. Old lines also speak least for today."""


def _tail(path: Path, size: int) -> str:
    """The file's last `size` bytes as text, from the first whole line in them."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        start = max(f.tell() - size, 0)
        f.seek(start)
        data = f.read()
    if start:
        data = data.partition(b"\n")[2]  # the first line is cut
    return data.decode(errors="replace")
