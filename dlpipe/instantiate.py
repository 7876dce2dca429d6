"""A user's `_target_` node built into an object with Hydra's instantiate, a failure named by its
config group in one line (`model._target_=mypkg.Net: TypeError: ...`).

In the base layer because both the task builders (dataset, model, loss, metrics, callbacks,
scheduler) and the loader's fit (loader.collate_fn) build user nodes.
"""

from hydra.utils import instantiate

from dlpipe.errors import ConfigError, DlpipeError


def instantiate_group(group: str, node: dict, **extra):
    try:
        return instantiate(node, **extra)
    except DlpipeError:
        raise
    except Exception as e:  # a user's class may raise anything: name the group and target
        cause = e.__cause__ or e  # Hydra wraps the constructor's exception
        if isinstance(cause, DlpipeError):  # dlpipe's own classes say their line, naming the key, already
            raise cause from None
        raise ConfigError([f"{group}._target_={node.get('_target_')}: {type(cause).__name__}: {cause}"]) from e
