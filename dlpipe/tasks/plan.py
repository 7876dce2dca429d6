"""`dlpipe plan ...overrides`: the values a run will use, where each came from, before running it.

Hydra's `--cfg job --resolve` prints the composed config before dlpipe runs, so it cannot show what
is fitted to the data (the worker count of in-memory data, persistence on the real batches per
epoch) or what the loader builder drops. This does what a training job does up to its loaders
(validate, build the dataset, fit the loader to it, build the loaders, lint them) and prints the
result. It builds no model, opens no tracking run and writes nothing (the CLI runs it without an
output folder).
"""

from torch.utils.data import BatchSampler

from dlpipe.config.decisions import explain
from dlpipe.config.validation import validate
from dlpipe.judging.advice import MODES
from dlpipe.judging.evidence import measurement_file
from dlpipe.loader import policy, torch_threads
from dlpipe.loader.build import EpochOrder
from dlpipe.loader.fitting import build_loaders, fit_loader_to_data, loader_notes
from dlpipe.loader.lint import lint_job
from dlpipe.loader.streams import buffer_bytes, reads_positions, size_of
from dlpipe.machine import hardware
from dlpipe.redact import redact_overrides
from dlpipe.schema import DlpipeConfig, LoaderConfig
from dlpipe.tasks.build import build_datasets
from dlpipe.tasks.params import recorded_config
from dlpipe.tasks.preflight import JobContext
from dlpipe.training.distributed import ranks_from_env
from dlpipe.training.rng import seed_everything

TRAINER_KEYS = ("trainer.device", "trainer.amp", torch_threads.KEY)


def run(ctx: JobContext, raw: dict, resolved: dict) -> None:
    """Print the plan of the job these overrides make."""
    cfg = validate(resolved)
    decided = explain(raw, resolved, ctx.origin)
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)  # the split a run of this seed makes
    train_set, val_set, _ = build_datasets(cfg)
    world = hardware.world_size()
    cfg.loader, fitted = fit_loader_to_data(raw["loader"], cfg.loader, cfg.trainer.epochs, train_set, world)
    decided.update(fitted)
    plans = build_loaders(cfg, train_set, val_set, world=world)
    budget = hardware.cpu_budget().budget
    # as the run decides them once its loader's workers are final (it sets them; plan only says them)
    torch_threads.settle(raw["trainer"], cfg.trainer, plans[0].loader.num_workers, plans[0].worker_method, budget,
                         decided, say=False)
    lint = lint_job(cfg, size_of(train_set), plans[0].batch_bytes, budget, reads_positions(train_set),
                    buffer_bytes(train_set))
    if ranks_from_env().is_main:  # trainer.devices=N plans as N torchrun ranks (each rank's share): said once
        print(report(ctx, raw, cfg, decided, plans, lint, size_of(train_set)), flush=True)
        for line in measured_lines(cfg, budget):
            print(line, flush=True)


def report(ctx: JobContext, raw: dict, cfg: DlpipeConfig, decided: dict[str, str], plans, lint: list[str],
           train_size: int | None) -> str:
    """The plan as text: every loader key and the device settings with their sources, what each
    DataLoader gets, what was dropped and why, the memory estimate and the lint."""
    config = ["--config-dir", ctx.config_dir] if ctx.config_dir else []
    command = " ".join(["dlpipe plan", *config, *redact_overrides([o for o in ctx.overrides if o != "task=plan"])])
    lines = [f"plan for `{command}`: values the run will use (nothing trained, tracked or written)"]
    lines += value_lines(ctx, raw, cfg, decided)
    train, val = plans
    items = "a stream" if train_size is None else f"{train_size} items"
    lines.append(f"DataLoader (train, {items}): {dataloader_line(cfg.loader, train)}")
    if val is not None:
        lines.append(f"DataLoader (val): {dataloader_line(cfg.loader, val)}")
    lines += [f"dropped: {note}" for note in loader_notes(plans)]
    workers = train.loader.num_workers
    prefetch = policy.prefetch_in_effect(workers, train.settings["prefetch_factor"])
    lines.append(f"memory: a training batch about {_mb(train.batch_bytes)}; in flight {_mb(train.inflight_bytes)} "
                 f"({workers} workers x prefetch {prefetch} x batch)")
    lines += [f"lint: {line}" for line in lint] or ["lint: nothing to change"]
    return "\n".join(lines)


def value_lines(ctx: JobContext, raw: dict, cfg: DlpipeConfig, decided: dict[str, str]) -> list[str]:
    """'KEY = VALUE (SOURCE)' for each loader key, then the trainer's hardware-aware settings: automatic
    ones with the reason they were decided on (fitted to the data included), the others with where
    they were set."""
    lines = []
    for name, value in recorded_config(cfg)["loader"].items():  # secrets masked, as everywhere dlpipe shows them
        key = f"loader.{name}"
        said = decided.get(key) or f"{value} ({ctx.origin.source(key, raw['loader'].get(name))})"
        lines.append(f"{key} = {said}")
    lines += [f"{key} = {decided[key]}" for key in TRAINER_KEYS]
    return lines


def dataloader_line(loader: LoaderConfig, plan) -> str:
    """The settings a DataLoader gets, a value the config asked otherwise marked `(asked X)`."""
    built = plan.loader
    # whole-batch fetching and thread workers batch the order first; PyTorch's own path batches after
    batches = built.sampler if isinstance(built.sampler, BatchSampler) else built.batch_sampler
    order = batches.sampler
    shuffled = isinstance(order, EpochOrder) and order.shuffle  # validation never shuffles
    settings = {"batch_size": batches.batch_size, "num_workers": built.num_workers, **plan.settings,
                "shuffle": shuffled, "drop_last": batches.drop_last, "fetch": plan.fetch,
                "worker_method": plan.worker_method,
                "collate_fn": (loader.collate_fn or {}).get("_target_", "default_collate")}
    return " ".join(f"{key}={value}" + (f" (asked {plan.requested[key]})" if key in plan.requested else "")
                    for key, value in settings.items())


def measured_lines(cfg: DlpipeConfig, cpu_budget: int) -> list[str]:
    """What dlpipe has measured of this job (the evidence its advice will be checked against): the
    best figure of each loader setting, per way of measuring, fastest first."""
    lines = []
    for mode, how in MODES.items():
        best = {}
        for o in measurement_file(cfg, cpu_budget, mode).read().observations:
            if o.label() not in best or o.samples_per_s > best[o.label()].samples_per_s:
                best[o.label()] = o
        lines += [f"measured ({how}): {o.label()}: {o.samples_per_s:.0f} samples/s ({o.source}, {o.when})"
                  for o in sorted(best.values(), key=lambda o: -o.samples_per_s)]
    return lines or [f"measured: nothing yet for this job in {cfg.telemetry.measurements_file}"]


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MB"
