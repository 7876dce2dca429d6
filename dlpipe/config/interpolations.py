"""An interpolation that does not resolve (`${dataset.nope}`, `${oc.env:UNSET}`) as one line naming
the key that holds it, the interpolation as written and the fix.

OmegaConf names the key it was resolving when the failure surfaced, which is often a key that only
refers to the broken one (`loader.persistent_workers` reads `${trainer.epochs}`): the key whose own
text names what is missing is the one a user has to change.
"""

import difflib
import re

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, MissingMandatoryValue, OmegaConfBaseException

_QUOTED = re.compile(r"'([^']+)'")
_ENV = re.compile(r"Environment variable '([^']+)' not found")


def unresolved(cfg: DictConfig, error: OmegaConfBaseException) -> str:
    """The line for `error`, raised while resolving `cfg`."""
    reported = getattr(error, "full_key", None) or "config"
    if isinstance(error, MissingMandatoryValue):
        return f"{reported}=???: no value given; set {reported}=..."
    key, text = _culprit(cfg, _reason(error)) or (reported, _raw(cfg, reported))
    return _line(key, text, error, cfg)


def unresolved_in_print(error: OmegaConfBaseException, overrides: list[str]) -> str:
    """The line for `error` raised where Hydra resolved the config itself (`--cfg job --resolve`),
    which leaves no key in it: the override whose value names what is missing, else the text alone."""
    quoted = _QUOTED.findall(_reason(error))
    for override in overrides:
        key, eq, text = override.lstrip("+~").partition("=")
        if eq and not override.startswith("-") and any(q in text for q in quoted):
            return _line(key, text, error, None)
    return _line("an interpolation", None, error, None)


def _reason(error: OmegaConfBaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _line(key: str, text, error: OmegaConfBaseException, cfg: DictConfig | None) -> str:
    """`key=text: why; fix` for an interpolation that did not resolve."""
    reason = _reason(error)
    where = f"{key}={text}" if isinstance(text, str) else key
    env = _ENV.search(reason)
    if env:
        name = env.group(1)
        return (f"{where}: environment variable {name} is not set; export {name}=..., or give a default: "
                f"${{oc.env:{name},DEFAULT}}")
    if isinstance(error, InterpolationKeyError):
        missing = _QUOTED.search(reason)
        missing = missing.group(1) if missing else "?"
        guess = _guess(cfg, missing) if cfg is not None else None
        point = f"write ${{{guess}}}" if guess else "name an existing key"
        return f"{where}: no key {missing} in the config; {point}, or set {key} to a plain value"
    return f"{where}: {reason}; fix the interpolation or set {key} to a plain value"


def _culprit(cfg: DictConfig, reason: str) -> tuple[str, str] | None:
    """(key, its text) of the first interpolation that fails and itself names what the error quotes
    (the missing key or variable), or None when none does."""
    quoted = _QUOTED.findall(reason)
    for key, text in _interpolations(cfg, ""):
        if any(q in text for q in quoted) and not _resolves(cfg, key):
            return key, text
    return None


def _interpolations(node, prefix: str):
    """(full key, text) of every interpolated value under `node`, in the config's order."""
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
    for k, _ in items:
        key = f"{prefix}{k}"
        if OmegaConf.is_interpolation(node, k):
            yield key, node._get_node(k)._value()
            continue
        child = node._get_node(k)
        if OmegaConf.is_config(child) and not child._is_none() and not child._is_missing():
            yield from _interpolations(child, f"{key}.")


def _resolves(cfg: DictConfig, key: str) -> bool:
    try:
        OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException:
        return False
    return True


def _raw(cfg: DictConfig, key: str):
    """The value at `key` as written (an interpolation's text), or None where there is none."""
    node = cfg
    for part in key.split("."):
        if not OmegaConf.is_config(node):
            return None
        node = node._get_node(part if isinstance(node, DictConfig) else int(part))
        if node is None:
            return None
    return node._value()


def _guess(cfg: DictConfig, missing: str) -> str | None:
    """The existing key closest to `missing` in the same section (dataset.sise -> dataset.size), if any."""
    section, _, name = missing.rpartition(".")
    parent = OmegaConf.select(cfg, section, default=None) if section else cfg
    if not isinstance(parent, DictConfig):
        return None
    guess = difflib.get_close_matches(name, [str(k) for k in parent.keys()], n=1)
    return f"{section + '.' if section else ''}{guess[0]}" if guess else None
