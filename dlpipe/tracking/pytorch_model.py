"""tracking.log_model's MLflow PyTorch model, the tracking process's half: the model the training
process wrote (tasks.logged_model) logged with `mlflow.pytorch.log_model`, so the run lists it as a
logged model that `mlflow.pytorch.load_model("models:/<id>")` or `mlflow models serve` loads.

The only place the tracking layer imports torch, and only when a model is logged; a model that
cannot be logged (the store away, a signature that cannot be inferred) costs a warning, not the
run: its checkpoint artifact holds the same weights.
"""

import inspect
import logging
from pathlib import Path

from dlpipe.errors import first_line
from dlpipe.redact import redact_text

# Imported inside functions: mlflow and torch (seconds each), only when a model is logged: tracking.run
# imports this module, and the tracking layer imports no torch at module import.

log = logging.getLogger(__name__)

MODEL_NAME = "model"


def log_pytorch_model(run, path: str, step: int) -> str | None:
    """Log the model in `path` (then removed) to `run` (a tracking.run.MlflowRun) at optimizer `step`
    (MLflow links the run's metrics of that step to it); returns the logged model's id, or None
    after a warning."""
    try:
        return _log(run, Path(path), step)
    except Exception as e:  # noqa: BLE001 - any failure leaves the checkpoint artifact as the model
        log.warning("tracking.log_model: the MLflow PyTorch model was not logged (%s: %s); the run's "
                    "checkpoints/ artifact holds its weights", type(e).__name__, redact_text(first_line(e)))
        return None
    finally:
        Path(path).unlink(missing_ok=True)


def _log(run, path: Path, step: int) -> str:
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    # Written a moment ago by the training process of this job, for this process alone.
    saved = torch.load(path, weights_only=False)
    model, example = saved["model"], saved["example"]
    signature = None
    if example is not None:
        with torch.no_grad():
            output = model(example)
        if isinstance(output, torch.Tensor):
            signature = infer_signature(example.numpy(), output.numpy())
    # This process keeps one run: MLflow's global URI and experiment (where the logged model is
    # made, beside the run) are that run's.
    mlflow.set_tracking_uri(run.uri)
    mlflow.set_experiment(experiment_id=run.experiment_id)
    # pickle: any nn.Module that pickles. MLflow's newer default, pt2, traces the model with
    # torch.export, which many models refuse; MLflow releases before that choice only pickle.
    chosen = {"serialization_format": "pickle"} if "serialization_format" in inspect.signature(
        mlflow.pytorch.log_model).parameters else {}
    info = mlflow.pytorch.log_model(model, name=MODEL_NAME, run_id=run.run_id, step=step, signature=signature,
                                    code_paths=saved["code_paths"] or None, pip_requirements=saved["pip_requirements"],
                                    **chosen)
    log.info("tracking.log_model: logged as an MLflow PyTorch model too: models:/%s", info.model_id)
    return info.model_id
