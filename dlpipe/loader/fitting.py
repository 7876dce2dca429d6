"""A job's DataLoaders: the automatic loader values fitted to the built training split, the collate
loader.collate_fn names, and the training and validation loaders built from them.

Like tasks.build, everything here runs before a tracking run exists: a mistake is a ConfigError naming
the key.
"""

import itertools
import logging
from dataclasses import replace

from dlpipe.errors import ConfigError
from dlpipe.instantiate import instantiate_group
from dlpipe.loader import policy, worker_method
from dlpipe.loader.build import build_loader, dataloader_settings
from dlpipe.loader.decisions import prefetch, workers_for_data
from dlpipe.loader.fetch import find_gather, gather_for
from dlpipe.loader.lint import lint_job
from dlpipe.loader.probe import item_fetch_seconds
from dlpipe.loader.stream_fit import fit_stream, share_decided_on
from dlpipe.loader.streams import buffer_bytes, is_stream, reads_positions, size_of
from dlpipe.loader.worker_method import global_draws
from dlpipe.schema import DlpipeConfig, LoaderConfig

log = logging.getLogger("dlpipe")


def fit_loader_to_data(raw_loader: dict, loader: LoaderConfig, epochs: int, train_set,
                       world: int = 1, model=None) -> tuple[LoaderConfig, dict[str, str]]:
    """The automatic loader values, decided again on the built training split: the workers go when
    items are cheap to fetch in this process (data in memory), and persistence is decided on the
    real batches per epoch, and loader.fetch=auto becomes batch where the dataset gathers a batch equal
    to its per-item collate (loader.fetch). Values the user set stand (the lint and `dlpipe tune` can question
    them). `model`: the model, when it is already built (its memory is not the workers'). Returns the
    loader settings and the reason for each value decided here."""
    collate = build_collate(loader)  # the decisions below replace other fields, never collate_fn
    if is_stream(train_set):  # no index: none of the probes below applies
        return fit_stream(raw_loader, loader, train_set, world, epochs, collate,
                          model_bytes=cpu_bytes(model) if model is not None else 0)
    reasons = {}
    if loader.fetch != "item" and len(train_set):  # first: fetch=batch on a dataset that cannot is refused here
        if loader.fetch == "batch":
            gather_for(train_set, "batch", collate)
        else:
            how, why = find_gather(train_set, collate)
            loader = replace(loader, fetch="batch" if how else "item")
            reasons["loader.fetch"] = f"{loader.fetch} (auto: {why if how else 'item by item: ' + why})"
    if policy.is_auto(raw_loader["num_workers"], "auto_workers") and loader.num_workers and len(train_set):
        seconds = item_fetch_seconds(train_set, loader.batch_size, collate_fn=collate)
        decision = workers_for_data(loader.num_workers, seconds)
        if decision.value != loader.num_workers:
            loader = replace(loader, num_workers=decision.value)
            reasons["loader.num_workers"] = f"{decision.value} (auto: {decision.reason})"
            if policy.is_auto(raw_loader["prefetch_factor"], "auto_prefetch"):  # follows the worker count
                follows = prefetch(decision.value)
                loader = replace(loader, prefetch_factor=follows.value)
                reasons["loader.prefetch_factor"] = f"{follows.value} (auto: {follows.reason})"
    if policy.is_auto(raw_loader["persistent_workers"], "auto_persistent"):
        # Always: the resolver may not have known the dataset's size, and then its reason lacks the batches.
        batches = policy.batches_per_epoch(len(train_set), loader.batch_size, world, loader.drop_last)
        keep, why = policy.persist_workers(loader.num_workers, epochs, batches)
        loader = replace(loader, persistent_workers=keep)
        reasons["loader.persistent_workers"] = f"{keep} (auto: {why})"
    if loader.worker_method == "auto":
        loader = worker_method.fit(loader, raw_loader, train_set, collate, reasons,
                                   model_bytes=cpu_bytes(model) if model is not None else 0)
    elif loader.worker_method == "thread" and loader.num_workers and len(train_set):
        drawn = global_draws(train_set)  # auto would keep processes for it; asked for, it is said
        if drawn:
            log.warning("loader.worker_method=thread: the dataset draws from the global %s RNG while fetching; "
                        "threads share that stream with training and each other, so the run is not "
                        "reproducible (draw from dlpipe.sample_rng.sample_generator(), or use "
                        "loader.worker_method=process)", drawn)
    return loader, reasons


def cpu_bytes(model) -> int:
    """Bytes of a model's parameters and buffers in CPU memory."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers())
               if t.device.type == "cpu")


def build_collate(loader: LoaderConfig):
    """The callable loader.collate_fn builds (e.g. dlpipe.loader.collate.PadSequences), or None for
    PyTorch's default_collate."""
    node = loader.collate_fn
    if node is None:
        return None
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError([f"loader.collate_fn={node!r}: must be a node with a _target_ (e.g. "
                           "{_target_: dlpipe.loader.collate.PadSequences}) or null"])
    collate = instantiate_group("loader.collate_fn", node)
    if not callable(collate):
        raise ConfigError([f"loader.collate_fn._target_={node['_target_']}: built a {type(collate).__name__}, "
                           "which is not callable; a collate function takes a list of items and returns a batch"])
    return collate


def loader_settings(loader: LoaderConfig) -> dict:
    """build_loader's keyword arguments from the loader config, loader.collate_fn built: what train,
    bench and tune (each candidate) build their loaders with."""
    return {**dataloader_settings(loader), "collate_fn": build_collate(loader)}


def build_loaders(cfg: DlpipeConfig, train_set, val_set, rank: int = 0, world: int = 1):
    """Training and validation loaders (the validation one None without a split); with world > 1,
    each loads this rank's share and loader.batch_size is per rank."""
    lc = loader_settings(cfg.loader)
    cuda = cfg.trainer.device.startswith("cuda")
    seed = cfg.trainer.seed
    train = build_loader(train_set, **lc, seed=seed, cuda=cuda, role="train", rank=rank, world=world)
    if not is_stream(train_set) and len(train.loader) == 0:
        order = getattr(train.loader.sampler, "sampler", train.loader.sampler)  # under the batches, when fetched so
        raise ConfigError([
            f"loader.batch_size={lc['batch_size']} with loader.drop_last={str(lc['drop_last']).lower()}: the training "
            f"split has {len(order)} samples{' per rank' if world > 1 else ''}, so there is no batch "
            "to train on; lower batch_size or set drop_last=false"
        ])
    val = None
    if val_set is not None:
        # Validation never shuffles or drops samples: every run scores the same items. Its workers
        # live only while it runs: persistent ones would sit idle, holding memory, through training.
        lc.update(batch_size=cfg.loader.val_batch_size or lc["batch_size"], shuffle=False, drop_last=False,
                  persistent_workers=False)
        if is_stream(val_set):
            lc.update(stream_share=share_decided_on(cfg.loader, val_set, world))  # its own, not the training stream's
        val = build_loader(val_set, **lc, seed=seed, cuda=cuda, role="val", rank=rank, world=world)
    return train, val


def fit_loader(raw: dict, cfg: DlpipeConfig, train_set, decided: dict[str, str], world: int = 1,
               model=None) -> None:
    """The automatic loader values fitted to the built training split (fit_loader_to_data;
    `model` where already built): cfg.loader updated, each new reason logged and recorded."""
    cfg.loader, reasons = fit_loader_to_data(raw["loader"], cfg.loader, cfg.trainer.epochs, train_set, world, model)
    for key, why in reasons.items():
        if decided.get(key) != why:  # said once: the resolver's reason stands when it already knew
            decided[key] = why
            log.info("%s = %s", key, why)


def warn_about_loaders(cfg: DlpipeConfig, train_set, plans, cpu_budget: int) -> None:
    """Each loader's build notes, then the pre-flight lint of the training loader."""
    for note in loader_notes(plans):
        log.warning(note)
    for line in lint_job(cfg, size_of(train_set), plans[0].batch_bytes, cpu_budget, reads_positions(train_set),
                         buffer_bytes(train_set)):
        log.warning("lint: %s", line)


def loader_notes(plans) -> list[str]:
    """The loaders' build notes, each said once with the loaders it applies to ('train, val: ...'):
    a setting dropped for both is one change, and a task with only a training loader (bench, tune)
    says the same words as training does."""
    roles: dict[str, list[str]] = {}
    for plan in plans:
        for note in plan.notes if plan else ():
            role, _, text = note.partition(": ")
            roles.setdefault(text, []).append(role)
    return [f"{', '.join(where)}: {text}" for text, where in roles.items()]
