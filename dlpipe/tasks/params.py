"""What a run records of its config: MLflow params (secrets masked), the settings each DataLoader
really got beside what was asked, and the values measured from what was built.

Each hardware-aware value is a short param, `auto.KEY` = `2 (auto)`: the value and its source in a
word, which the UI's tables and its compare view show whole. The sentence that explains it (the CPU
budget, the recipe, the option file) is the tag `dlpipe.auto.KEY`: tags may change when a run is
resumed on another machine, params may not, and the run page lists tags in full.
"""

import dataclasses
import logging

from dlpipe.redact import redact_tree
from dlpipe.schema import DlpipeConfig

log = logging.getLogger("dlpipe")


def recorded_config(cfg: DlpipeConfig) -> dict:
    """The config as it is recorded anywhere (params, artifacts, checkpoints): secrets masked."""
    return redact_tree(dataclasses.asdict(cfg))


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{'a': {'b': 1}} -> {'a.b': '1'}: the resolved config as MLflow params."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = "null" if value is None else str(value)
    return out


def config_params(cfg: DlpipeConfig, plan, decided: dict[str, str], *sections: str) -> dict[str, str]:
    """The config's `sections` as params (secrets masked), with the loader values `plan`'s DataLoader
    got, and `auto.KEY` for each hardware-aware value with its source, as training records them."""
    shown = recorded_config(cfg)
    return {**flatten({key: shown[key] for key in sections}), **loader_params(plan), **auto_params(decided)}


AUTO_TAG = "dlpipe.auto."  # + config key: the whole sentence that explains the value
# How config.sources and the resolvers word a value's source -> the word its param says
SOURCE_WORDS = (("auto", "auto"), ("user override", "user"), ("recipe ", "recipe"), ("config option ", "option"),
                ("the schema's default", "default"))


def auto_params(decided: dict[str, str]) -> dict[str, str]:
    """`auto.KEY` = `VALUE (SOURCE)` for each explained value (`loader.num_workers` -> `2 (auto)`):
    `decided` holds `VALUE (explanation)`, as preflight logs it."""
    return {f"auto.{key}": " ".join(filter(None, _value_and_source(why))) for key, why in decided.items()}


def auto_tags(decided: dict[str, str]) -> dict[str, str]:
    """`dlpipe.auto.KEY` = the whole explanation of each value, as the log words it."""
    return {AUTO_TAG + key: why for key, why in decided.items()}


def _value_and_source(why: str) -> tuple[str, str]:
    """`2 (auto: CPU budget ...)` -> (`2`, `(auto)`); a value dlpipe set for the data (a stream's
    shuffle) is `(dlpipe)`; a bare value has no source."""
    value, paren, reason = why.partition(" (")
    if not paren:
        return why, ""
    word = next((w for start, w in SOURCE_WORDS if reason.startswith(start)), "dlpipe")
    return value, f"({word})"


def loader_params(plan) -> dict[str, str]:
    """A built loader's settings as params: under each loader key the value the DataLoader got (a
    prefetch_factor dropped at 0 workers, pin_memory off without CUDA), and `requested.loader.KEY`
    beside it where the config asked for another value. Logged after the config's params, so these
    win: jobs that asked differently but ran the same loader record the same values."""
    return settings_params({**plan.settings, "fetch": plan.fetch, "worker_method": plan.worker_method},
                           plan.requested)


def job_params(cfg: DlpipeConfig, ranks, train_plan, model) -> dict[str, str]:
    """Params measured from what was built (the training loader's effective settings, loader memory,
    model size, the data-parallel layout)."""
    params = {**loader_params(train_plan), "loader.batch_bytes_est": str(train_plan.batch_bytes),
              "loader.inflight_bytes_est": str(train_plan.inflight_bytes),
              "model.parameters": str(sum(p.numel() for p in model.parameters()))}
    if ranks.distributed:
        params.update({"dist.world_size": str(ranks.world), "dist.local_world_size": str(ranks.local_world),
                       "dist.global_batch": str(cfg.trainer.accumulate * cfg.loader.batch_size * ranks.world)})
    return params


def settings_params(settings: dict, requested: dict) -> dict[str, str]:
    """`loader.KEY` params of the settings a DataLoader got, `requested.loader.KEY` of those asked otherwise."""
    return {**flatten({"loader": settings}), **flatten({"requested": {"loader": requested}})}
