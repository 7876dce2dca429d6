"""Objects from a resolved config: dataset splits, model, optimizer and DataLoaders.

Everything here runs before a tracking run exists, so every user mistake it finds (a class that
does not build, a device this machine lacks, a batch size that leaves no batch) is a ConfigError
naming the key, and nothing is left half-made.
"""

import copy

from dlpipe.errors import ConfigError, DlpipeError


def _instantiate(group: str, node: dict, **extra):
    from hydra.utils import instantiate

    try:
        return instantiate(node, **extra)
    except DlpipeError:
        raise
    except Exception as e:  # a user's class may raise anything: name the group and target
        cause = e.__cause__ or e  # Hydra wraps the constructor's exception
        raise ConfigError([f"{group}._target_={node.get('_target_')}: {type(cause).__name__}: {cause}"]) from e


def check_device(device: str) -> None:
    """The requested device must exist here; checked before anything is built or tracked."""
    import torch

    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(["trainer.device=mps: this torch build or machine has no MPS device; use cpu"])
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError([f"trainer.device={device}: torch sees no CUDA device (CPU-only build or no driver); use trainer.device=cpu"])
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError([f"trainer.device={device}: only cuda:0 to cuda:{torch.cuda.device_count() - 1} are visible"])


def validation_view(dataset):
    """The same samples without random augmentation, so every epoch and every sweep job scores
    identical inputs. Applies to datasets with an `augment` attribute (the built-in image ones);
    a shallow copy shares the decoded-once data."""
    if not getattr(dataset, "augment", False):
        return dataset
    plain = copy.copy(dataset)
    plain.augment = False
    return plain


def build_datasets(resolved: dict):
    """(train split, validation split or None, the whole dataset); raises ConfigError/DataError."""
    from torch.utils.data import Subset

    from dlpipe.data.faults import NamedErrors
    from dlpipe.data.split import train_val_split

    trainer = resolved["trainer"]
    check_device(trainer["device"])
    dataset = _instantiate("dataset", resolved["dataset"])
    train_set, val_set = train_val_split(dataset, trainer["val_fraction"], trainer["seed"])
    if val_set is not None:
        val_set = Subset(validation_view(dataset), val_set.indices)
        val_set = NamedErrors(val_set)
    return NamedErrors(train_set), val_set, dataset


def build_model(resolved: dict, dataset):
    """Model and optimizer (the model's num_classes may come from the dataset)."""
    model_cfg = dict(resolved["model"])
    if model_cfg.get("num_classes", 0) is None:
        if not hasattr(dataset, "num_classes"):
            raise ConfigError([f"model.num_classes=null: {type(dataset).__name__} has no num_classes; set model.num_classes"])
        model_cfg["num_classes"] = int(dataset.num_classes)
    model = _instantiate("model", model_cfg)
    # The model's parameters are the optimizer's first argument, `params`, passed here.
    optimizer = _instantiate("optim", resolved["optim"], params=model.parameters())
    return model, optimizer


def build_data_and_model(resolved: dict):
    """Dataset splits, model and optimizer; raises ConfigError/DataError naming the bad key."""
    train_set, val_set, dataset = build_datasets(resolved)
    model, optimizer = build_model(resolved, dataset)
    return train_set, val_set, model, optimizer


def fit_workers_to_data(raw: dict, resolved: dict, train_set) -> str | None:
    """With automatic worker settings, drop the workers when items are cheap to fetch in this
    process (data in memory): updates `resolved["loader"]` and returns the explanation, or None."""
    from dlpipe.config.decisions import workers_for_data
    from dlpipe.data.probe import item_fetch_seconds

    loader = resolved["loader"]
    if not (isinstance(raw["loader"]["num_workers"], str) and raw["loader"]["num_workers"].startswith("${auto_workers:")):
        return None  # the user chose: their value stands (the lint and `dlpipe tune` can question it)
    if loader["num_workers"] == 0 or len(train_set) == 0:
        return None
    decision = workers_for_data(loader["num_workers"], item_fetch_seconds(train_set, loader["batch_size"]))
    if decision.value == loader["num_workers"]:
        return None
    loader["num_workers"] = decision.value
    # the values derived from the worker count follow it, unless the user set them
    if isinstance(raw["loader"]["prefetch_factor"], str) and "auto_prefetch" in raw["loader"]["prefetch_factor"]:
        loader["prefetch_factor"] = None
    if isinstance(raw["loader"]["persistent_workers"], str) and "auto_persistent" in raw["loader"]["persistent_workers"]:
        loader["persistent_workers"] = False
    return f"{decision.value} (auto: {decision.reason})"


def build_loaders(resolved: dict, train_set, val_set, rank: int = 0, world: int = 1):
    """Training and validation loaders (the validation one None without a split); with world > 1,
    each loads this rank's share and loader.batch_size is per rank."""
    from dlpipe.data.loader import build_loader

    lc = dict(resolved["loader"])
    val_batch = lc.pop("val_batch_size") or lc["batch_size"]
    lc.pop("tuned_on")  # provenance for the lint, not a DataLoader setting
    cuda = resolved["trainer"]["device"].startswith("cuda")
    seed = resolved["trainer"]["seed"]
    train = build_loader(train_set, **lc, seed=seed, cuda=cuda, role="train", rank=rank, world=world)
    if len(train.loader) == 0:
        raise ConfigError([
            f"loader.batch_size={lc['batch_size']} with loader.drop_last={str(lc['drop_last']).lower()}: the training "
            f"split has {len(train.loader.sampler)} samples{' per rank' if world > 1 else ''}, so there is no batch to train on; lower batch_size or set drop_last=false"
        ])
    val = None
    if val_set is not None:
        # Validation never shuffles or drops samples: every run scores the same items. Its workers
        # live only while it runs: persistent ones would sit idle, holding memory, through training.
        lc.update(batch_size=val_batch, shuffle=False, drop_last=False, persistent_workers=False)
        val = build_loader(val_set, **lc, seed=seed, cuda=cuda, role="val", rank=rank, world=world)
    return train, val
