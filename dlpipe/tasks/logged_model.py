"""tracking.log_model's MLflow PyTorch model, the training process's half: the trained model with the
logged checkpoint's weights, pickled whole with what loading it elsewhere needs, for the tracking
process to log (tracking.pytorch_model) with `mlflow.pytorch.log_model`: this process never imports
mlflow. "Where it can": a model that cannot be pickled whole (a lambda inside it) gets a warning,
and the run keeps the checkpoint artifact (`checkpoints/`), which holds the same weights."""

import copy
import logging
import pickle
import sys
from importlib import metadata
from pathlib import Path

import torch
from torch.utils.data import default_collate

from dlpipe.errors import first_line
from dlpipe.training import rng

log = logging.getLogger("dlpipe")

EXPORT_FILE = "mlflow_model.pt"  # in the output folder until the tracking process has logged it


def export_model(model: torch.nn.Module, checkpoint: Path, objective, train_set, collate_fn,
                 folder: Path) -> tuple[Path, int] | None:
    """(the file, the checkpoint's optimizer step) for the tracking process; None, with a warning,
    when it cannot be written (the model does not pickle whole, the example cannot be fetched...):
    training is over and went well, and the checkpoint artifact holds the weights. Moves `model`
    to the CPU: a copy made on the GPU would need a second model's worth of its memory."""
    path = folder / EXPORT_FILE
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        trained = copy.deepcopy(model.cpu())
        trained.load_state_dict(state["model"])
        trained.eval()
        code_paths, requirements = code_of(trained)
        torch.save({"model": trained, "example": input_example(objective, train_set, collate_fn),
                    "code_paths": code_paths, "pip_requirements": requirements}, path)
    except Exception as e:  # noqa: BLE001 - "where it can": any failure leaves the checkpoint artifact alone
        path.unlink(missing_ok=True)
        why = "the model cannot be pickled whole" if isinstance(e, pickle.PicklingError | AttributeError) else (
            type(e).__name__)
        log.warning("tracking.log_model: no MLflow PyTorch model (%s: %s); the run's checkpoints/ artifact "
                    "holds its weights", why, first_line(e))
        return None
    return path, int(state.get("step", 0))


def code_of(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(code paths, pip requirements) that let the model's class be imported where it is loaded: the
    package (or file) that defines it is copied into the model unless it is installed from a
    distribution, which is then required by name and version; torch always."""
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    top = type(model).__module__.split(".")[0]
    module = sys.modules.get(top)
    source = Path(module.__file__) if module is not None and getattr(module, "__file__", None) else None
    if source is None:
        return [], requirements
    source = source.parent if source.name == "__init__.py" else source
    distributions = metadata.packages_distributions().get(top, [])
    if top != "dlpipe" and distributions and "site-packages" in source.parts:
        name = distributions[0]  # its version without a local label (+cu121): what an index serves
        return [], [*requirements, f"{name}=={metadata.version(name).split('+')[0]}"]
    return [str(source)], requirements  # dlpipe's own models too: they load without dlpipe installed


def input_example(objective, train_set, collate_fn=None) -> torch.Tensor | None:
    """The inputs of two real samples, when the model takes one tensor (MLflow's signature is inferred
    from it); None for dict or several inputs. Fetching may augment: every random stream stays as it was."""
    if len(train_set) == 0:
        return None
    state = rng.capture()
    try:
        batch = (collate_fn or default_collate)([train_set[i] for i in range(min(2, len(train_set)))])
    finally:
        rng.restore(state)
    args, kwargs, _ = objective.split(batch)
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        return args[0].detach().cpu()
    return None
