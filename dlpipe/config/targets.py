"""`_target_` nodes checked before anything is built: the name imports, it is the kind of object its
group needs (a dataset for `dataset`), and it accepts the keys given for it.

No torch here (the config layer never imports it): a class that subclasses torch's Dataset or
Module was located by importing its module, which imported torch, so `sys.modules` has it.
"""

import importlib
import inspect
import sys
from collections.abc import Mapping

from dlpipe.errors import first_line

DATASET_ALLOWED = ("allowed: a dataset class (a map-style torch.utils.data.Dataset or any class with __getitem__ "
                   "and __len__, or a stream: a torch.utils.data.IterableDataset) or a function that returns one")


def locate(target: str):
    """The object a `_target_` names, found as Hydra's instantiate finds it: the longest importable
    module path, then attributes (so `pkg.module.Class.factory` works). Every failure, whatever the
    imported code raised, is an ImportError whose message is one line for the user."""
    parts = target.split(".")
    if len(parts) < 2 or not all(parts):
        raise ImportError(f"'{target}' is not a dotted path like package.module.Class")
    obj = _import(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
            continue
        except AttributeError:
            if not inspect.ismodule(obj):
                raise ImportError(f"{'.'.join(parts[:i - 1])} has no attribute '{part}'") from None
        except Exception as e:  # a lazy module's __getattr__ importing its real code (transformers does)
            raise ImportError(f"{'.'.join(parts[:i])} raised {type(e).__name__}: {first_line(e)}") from None
        obj = _import(".".join(parts[:i]), parent=".".join(parts[:i - 1]))
    return obj


def _import(name: str, parent: str | None = None):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:  # the module itself is not there (not one it imports)
            where = f"{parent} has no attribute or submodule '{name.rsplit('.', 1)[-1]}'" if parent else \
                f"no module named '{name}': is its package installed in this environment?"
            raise ImportError(where) from None
        raise ImportError(f"importing {name} failed: {first_line(e)}") from None
    except Exception as e:  # the module's own code failed: a missing dependency's error, a syntax error, ...
        raise ImportError(f"importing {name} raised {type(e).__name__}: {first_line(e)}") from None


def _subclasses(cls: type, module: str, name: str) -> bool:
    """issubclass(cls, module.name) without importing `module` (not imported: cls cannot subclass it)."""
    base = getattr(sys.modules.get(module), name, None)
    return base is not None and issubclass(cls, base)


def not_a_dataset(cls: type) -> str | None:
    """Why instances of `cls` cannot be the dataset (a map dataset is split by index: Subset needs
    __getitem__ and __len__; a stream is read in order), or None when they can."""
    if _subclasses(cls, "torch.utils.data", "Dataset"):  # IterableDataset (a stream) included
        return None
    if issubclass(cls, Mapping):
        return "a mapping (looked up by key), not a dataset indexed 0..N-1"
    if _subclasses(cls, "torch.nn", "Module"):
        return "a torch.nn.Module (a model: set it as model._target_)"
    if issubclass(cls, (str, bytes)):
        return "a string, not a dataset"
    missing = [m for m in ("__getitem__", "__len__") if not hasattr(cls, m)]
    if missing:
        return f"not a dataset (it has no {' or '.join(missing)})"
    return None


def _wrong_kind(group: str, target: str, obj) -> str | None:
    """One line when the class `dataset._target_` (or `val_dataset._target_`) names is not a dataset.
    A function may return one: what it returns is checked once built (tasks.build.build_datasets)."""
    if group not in ("dataset", "val_dataset") or not inspect.isclass(obj):
        return None
    why = not_a_dataset(obj)
    return f"{group}._target_={target}: {why}; {DATASET_ALLOWED}" if why else None


def is_stream_class(target: str) -> bool:
    """Whether `target` names a stream class (an IterableDataset: read in order, no index); False for
    anything else, a function or a target that does not import (reported on its own)."""
    try:
        obj = locate(target)
    except ImportError:
        return False
    return inspect.isclass(obj) and _subclasses(obj, "torch.utils.data", "IterableDataset")


def stream_split_refused(target: str, val_fraction: float) -> str:
    """The line for a stream given a random validation split: it has no index to split by."""
    return (f"trainer.val_fraction={val_fraction:g}: dataset._target_={target} is a stream (an IterableDataset: read "
            "in order, no index), which has no random split; set trainer.val_fraction=0 and give validation data "
            "as val_dataset (a `_target_` node like dataset's), or leave it out for no validation")


def check_target(group: str, node: dict, extra_args: int = 0, fills_in: tuple[str, ...] | None = None) -> list[str]:
    """A `_target_` must import, be what its group needs and accept the keys given for it (checked
    before building anything). `extra_args`: leading parameters dlpipe passes itself (optim's params).
    `fills_in`: with it, a null is refused for a parameter typed without None, except these keys, which
    dlpipe derives when null (scheduler.total_steps); without it nulls are not checked (model.num_classes
    is null until the dataset says)."""
    target = node.get("_target_")
    if not target:
        return [f"{group}._target_ is missing: set it to an importable class, e.g. {group}._target_=pkg.module.Class"]
    try:
        obj = locate(target)
    except ImportError as e:
        return [f"{group}._target_={target}: cannot be imported ({first_line(e)})"]
    kind = _wrong_kind(group, target, obj)
    if kind:
        return [kind]
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []  # builtins without a signature: let the call itself report
    params = sig.parameters.values()
    if any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params):
        return []
    allowed = [q.name for q in params if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)]
    given = [k for k in node if not k.startswith("_")]
    unknown = [k for k in given if k not in allowed]
    # A swapped _target_ keeps the keys of the group option it replaced: say how to start clean.
    hint = f"; to set only your own keys start from {group}=custom" if group in ("model", "dataset") else ""
    listed = ", ".join(allowed[extra_args:]) or "none"
    if len(unknown) > 1 and len(unknown) == len(given):  # none fits: the target, not each key, is wrong
        return [f"{group}._target_={target}: takes none of the keys given ({', '.join(unknown)}); is it the "
                f"object you meant? (allowed keys: {listed}){hint}"]
    nulls = [] if fills_in is None else [_null_refused(group, target, sig.parameters[k]) for k in given
                                         if node[k] is None and k not in unknown and k not in fills_in]
    return [f"{group}.{k}: not a parameter of {target} (allowed: {listed}){hint}" for k in unknown] + \
        [line for line in nulls if line]


_KIND_WORDS = {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}


def _alternatives(text: str) -> list[str]:
    """`float | Tensor` or `Union[float, Tensor]` -> ["float", "Tensor"], splitting only outside brackets."""
    if text.startswith(("Union[", "typing.Union[")):
        text = text[text.index("[") + 1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + "|"):
        depth += (ch == "[") - (ch == "]")
        if depth == 0 and ch in "|,":
            parts.append(text[start:i].strip())
            start = i + 1
    return parts


def _in_words(kind: str) -> str:
    name = kind.removeprefix("typing.")
    if name.startswith("Literal["):
        return "one of " + name[8:-1].replace("'", "")
    if name.startswith(("list[", "tuple[", "Sequence[", "Iterable[")):
        return "a list"
    name = name.rpartition(".")[2] if "[" not in name else name  # torch.Tensor -> Tensor
    return _KIND_WORDS.get(name, name)


def _kinds(annotation) -> list[str] | None:
    """What a parameter's annotation allows, in words; None when it allows None or says nothing
    checkable (no annotation, Any, a type variable). Torch's schedulers annotate with strings
    (`from __future__ import annotations`): all are read as text."""
    if annotation is inspect.Parameter.empty:
        return None
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    if any(word in text for word in ("None", "Optional", "Any")) or text.startswith("~"):
        return None
    return list(dict.fromkeys(_in_words(kind) for kind in _alternatives(text)))


def _null_refused(group: str, target: str, param: inspect.Parameter) -> str | None:
    """`KEY=null` for a parameter whose annotation leaves out None (AdamW's lr: float | Tensor), which
    the class would fail on with a TypeError of its own; None when null is fine for it."""
    kinds = None if param.default is None else _kinds(param.annotation)
    if kinds is None:
        return None
    takes = " or ".join(kinds)
    key = f"{group}.{param.name}"
    fix = (f"set one, or remove the key (~{key}) for its default {param.default}"
           if param.default is not inspect.Parameter.empty else "set one")
    return f"{key}=null: {target} takes {takes} as {param.name}, not null; {fix}"


def check_named_targets(group: str, nodes, example: str = "mypkg.module.Class") -> list[str]:
    """null, or name -> `_target_` node (metrics, callbacks), each importable with the keys given."""
    if nodes is None:
        return []
    if not isinstance(nodes, dict):
        return [f"{group}={nodes}: must be a mapping of name -> {{_target_: ...}} (or null)"]
    problems = []
    for name, node in nodes.items():
        if not isinstance(node, dict):
            problems.append(f"{group}.{name}={node}: must be a node with a _target_, e.g. "
                            f"+{group}.{name}._target_={example}")
        else:
            problems += check_target(f"{group}.{name}", node)
    return problems
