"""The dataset as an MLflow run input (the UI's "Datasets used" column and a run's Inputs section),
as `mlflow.log_input` records one: a name, a digest, a source, and the split it fed (the input tag
`mlflow.data.context`).

MLflow's dataset classes wrap data it can read (pandas, NumPy, Spark, Hugging Face); a dlpipe dataset
is any Python class, so it is logged as MLflow's MetaDataset does, from what describes it: the
source is the folder or file its config names (MLflow's own local source), or else the code that
makes it (`_target_`); the digest hashes the config and the split, so two runs on the same data
under the same settings show the same digest, and a changed setting a different one. It does not
hash the files: that would read a whole image folder at every launch.
"""

import hashlib
import json
import warnings
from pathlib import Path

from dlpipe.redact import redact_tree

# Imported inside functions: mlflow (seconds), only where a run's inputs are written: tasks.train_job and
# tracking.outbox import this module in a training process that leaves mlflow to the tracking process.

RACE_RETRIES = 3
"""Tries of a run-input write that lost the store's dataset race (log_inputs) before its error stands."""

PATH_KEYS = ("root", "path", "data_dir", "data_path", "file", "files")
"""Dataset config keys that name where the data lives (image_folder's `root`, custom datasets' `path`)."""


def describe(dataset: dict, sizes: dict[str, int]) -> dict:
    """{"name", "target", "path" or None, "splits": {split: {"digest", "samples"}}} for the dataset
    config and its split sizes ({"train": n, "validation": m}); plain data, kept as is by the offline
    outbox. Each split is a dataset of its own, with its own digest: MLflow keeps one input per
    dataset and run, so a split sharing the train split's digest would be dropped."""
    dataset = redact_tree(dataset)
    target = str(dataset.get("_target_", "dataset"))
    config = json.dumps(dataset, sort_keys=True, default=str)
    path = next((dataset[k] for k in PATH_KEYS if isinstance(dataset.get(k), str)), None)
    return {"name": target.rpartition(".")[2], "target": target,
            "path": str(Path(path).expanduser().resolve()) if path else None,
            "splits": {split: {"digest": hashlib.sha256(f"{config} {split}".encode()).hexdigest()[:8], "samples": n}
                       for split, n in sizes.items()}}


def mlflow_inputs(described: dict) -> list:
    """MLflow's DatasetInput entities for describe()'s result: the dataset once per split it fed."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.entities import Dataset, DatasetInput, InputTag

    path = described["path"]
    if path:
        with warnings.catch_warnings():  # MLflow registers its local source twice and says so; either is the same
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple")
            source = resolve_dataset_source(path)
    else:
        source = CodeDatasetSource({"dlpipe.dataset": described["target"]})
    return [DatasetInput(Dataset(described["name"], split["digest"], source._get_source_type(), source.to_json(),
                                 profile=json.dumps({"samples": split["samples"]})),
                         tags=[InputTag("mlflow.data.context", context)])
            for context, split in described["splits"].items()]


def log_inputs(client, run_id: str, described: dict) -> None:
    """Log describe()'s result as the run's inputs. MLflow's stores look a dataset up and insert it
    when missing, in one transaction but without a lock: the jobs of a parallel sweep (one
    experiment, one dataset) that log it at the same moment can all miss it, and all but the first
    insert then fail on the store's unique key (UNIQUE constraint failed: datasets.experiment_id,
    datasets.name, datasets.digest). The loser's transaction is rolled back, so writing again is
    safe, and it finds the winner's dataset and links it to this run."""
    for attempt in range(1, RACE_RETRIES + 1):
        try:
            client.log_inputs(run_id, datasets=mlflow_inputs(described))
            return
        except Exception as e:
            if attempt == RACE_RETRIES or not lost_insert_race(e):
                raise


def lost_insert_race(error: Exception) -> bool:
    """Whether a store refused a write on a unique key (SQLite, PostgreSQL and MySQL say it so; a
    tracking server passes the store's message on)."""
    from mlflow.exceptions import MlflowException

    text = str(error).lower()
    return isinstance(error, MlflowException) and ("unique constraint" in text or "duplicate" in text)
