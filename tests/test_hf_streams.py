"""Hugging Face `datasets` streams (Dataset.to_iterable_dataset) as a new user gives them, against
the real package: the share among workers dlpipe measures, each row trained once an epoch through
the real CLI, their dict items, and streams that declare they never end (loader.stream_end), with
webdataset's too. Skipped where `datasets` is not installed (it is in the `test` extra)."""

import collections
import itertools
import sys

import pytest
import torch
from conftest import runs_of
from stream_data import Rows
from test_distributed import torchrun
from test_streams_cli import refused, steps_at_epoch_ends

from dlpipe.errors import ConfigError
from dlpipe.loader import stream_fit
from dlpipe.loader.stream_end import HUGGING_FACE_REPEAT, WEBDATASET_REPEAT, WEBDATASET_RESAMPLED, declared_endless
from dlpipe.loader.stream_fit import fit_stream
from dlpipe.loader.streams import shares_itself
from dlpipe.schema import DlpipeConfig, LoaderConfig, TrainerConfig
from dlpipe.tasks.build import check_streams_end

datasets = pytest.importorskip("datasets")
from hf_data import recorded, rows  # noqa: E402  (imports datasets)

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
HF = ["dataset=custom", "dataset._target_=hf_data.rows", "+dataset.size=40", "batch.input=x", "batch.target=y",
      "model=mlp", "model.in_features=2", "model.num_classes=3", "loader.batch_size=8", "trainer.epochs=2",
      "trainer.val_fraction=0", "loader.persistent_workers=false"]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Nothing downloaded, nothing cached outside the test's folder, here and in a dlpipe subprocess."""
    for key, value in {**OFFLINE, "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(key, value)


def hf_env(tmp_path) -> dict:
    return {**OFFLINE, "HF_HOME": str(tmp_path / "hf")}


def recording(tmp_path) -> list[str]:
    """The model that writes down each training batch's rows (hf_data.RowRecorder)."""
    return ["model=custom", "model._target_=hf_data.RowRecorder", "+model.in_features=2", "+model.num_classes=3",
            f"+model.record={tmp_path / 'rows'}"]


@pytest.mark.parametrize("num_shards, why", [
    (2, "2 workers yielded different items (the stream shares itself out by get_worker_info())"),
    (1, "one of 2 workers yielded the stream's items and the other none (the stream gives itself to fewer workers, "
        "e.g. a Hugging Face stream with fewer shards than workers)")])
def test_the_probe_finds_a_hugging_face_stream_shares_itself_out(num_shards, why):
    """num_shards >= 2: each DataLoader worker reads its own shards. num_shards=1: Hugging Face stops the
    second worker ("Too many dataloader workers ... Stopping 1 dataloader workers") and the first reads
    every row: each row once, so `source` (dealing it would lose the stopped worker's batches)."""
    assert shares_itself(rows(size=40, num_shards=num_shards), None, 60) == (True, why)
    read = list(torch.utils.data.DataLoader(rows(size=40, num_shards=num_shards), batch_size=None, num_workers=2))
    assert sorted(int(item["x"][0]) for item in read) == list(range(40))


@pytest.mark.integration
@pytest.mark.parametrize("num_shards, workers", [(2, 0), (2, 2), (1, 2)])
def test_a_hugging_face_stream_trains_each_row_once_an_epoch(dlpipe, tmp_path, mlflow_store, mlflow_client,
                                                              num_shards, workers):
    experiment = f"hf-{num_shards}-{workers}"
    r = dlpipe(*[a for a in HF if not a.startswith("model")], *recording(tmp_path), f"+dataset.num_shards={num_shards}",
               f"loader.num_workers={workers}", f"tracking.uri={mlflow_store}", f"tracking.experiment={experiment}",
               env=hf_env(tmp_path))
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, experiment)
    assert run.info.status == "FINISHED"
    trained = list(itertools.chain(*recorded(tmp_path / "rows")))
    assert sorted(trained[:40]) == list(range(40))  # epoch 1: every row once (the main process trains in order)
    assert collections.Counter(trained) == {i: 2 for i in range(40)}
    said = ("2 workers yielded different items (the stream shares itself out by get_worker_info())" if num_shards > 1
            else "one of 2 workers yielded the stream's items and the other none (the stream gives itself to fewer "
                 "workers, e.g. a Hugging Face stream with fewer shards than workers)")
    if workers:
        assert f"loader.stream_share = source (auto: {said})" in r.stdout
        assert run.data.params["loader.stream_share"] == "source"
    if (num_shards, workers) == (1, 2):  # one worker reads it all: 5 batches of 8, as the main process makes
        assert "Too many dataloader workers: 2 (max is dataset.num_shards=1)" in r.stdout + r.stderr
        assert steps_at_epoch_ends(mlflow_client, run) == [5, 10]


@pytest.mark.integration
def test_hugging_face_python_items_are_one_line_and_leave_nothing(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """Without with_format("torch") a row's list of floats collates into a list of per-position tensors,
    which the model cannot take: one line, before anything is tracked."""
    refused(dlpipe(*HF, "+dataset.fmt=null", "loader.num_workers=0", f"tracking.uri={mlflow_store}",
                   "tracking.experiment=hf-python", env=hf_env(tmp_path)),
            "dlpipe: error: model._target_=dlpipe.models.mlp.MLP cannot take a batch of dataset._target_="
            "hf_data.rows (x list, y [2] int64): TypeError: linear(): argument 'input' (position 1) must be Tensor, "
            "not list; give tensors, not Python lists (a Hugging Face dataset: .with_format(\"torch\"))",
            runs_of(mlflow_client, "hf-python"), tmp_path)


def test_torch_formatted_items_collate_into_the_batch_the_model_takes():
    batch = torch.utils.data.default_collate(list(itertools.islice(rows(size=4, num_shards=2), 4)))
    assert batch["x"].shape == (4, 2) and batch["x"].dtype == torch.float32
    assert batch["y"].tolist() == [0, 1, 2, 0] and batch["y"].dtype == torch.int64


def test_streams_that_declare_no_end_are_read_as_endless():
    assert declared_endless(rows(repeat=True)) == HUGGING_FACE_REPEAT
    assert declared_endless(rows().repeat(None).shuffle(seed=0, buffer_size=4).map(lambda r: r)) == HUGGING_FACE_REPEAT
    for ends in (rows(), rows().repeat(2), rows(repeat=True).take(100), rows().shuffle(seed=0)):
        assert declared_endless(ends) is None
    assert declared_endless(rows(repeat=True).skip(3)) == HUGGING_FACE_REPEAT
    assert declared_endless(Rows()) is None  # a generator says nothing: it is read as ending


def test_webdataset_streams_that_declare_no_end_are_read_as_endless():
    wds = pytest.importorskip("webdataset")

    def shards(resampled: bool = False):  # shards are named, not opened, when the pipeline is built
        return wds.WebDataset("/nowhere/shard-{000..003}.tar", resampled=resampled, shardshuffle=False)

    assert declared_endless(shards(resampled=True)) == WEBDATASET_RESAMPLED
    assert declared_endless(shards(resampled=True).decode().to_tuple("jpg", "cls")) == WEBDATASET_RESAMPLED
    assert declared_endless(shards().repeat()) == WEBDATASET_REPEAT
    for ends in (shards(), shards(resampled=True).with_epoch(100), shards().repeat(2)):
        assert declared_endless(ends) is None
    assert wds.ResampledShards("/nowhere/a.tar").nshards == sys.maxsize  # what stream_end reads as "without end"


ENDLESS_TRAIN = ("dlpipe: error: trainer.limit_train_batches=-1, trainer.max_steps=-1: dataset._target_=hf_data.rows "
                 f"is a stream that never ends ({HUGGING_FACE_REPEAT}), so its first epoch would never end; set "
                 "trainer.limit_train_batches=N (micro-batches an epoch) or trainer.max_steps=N (optimizer steps in "
                 "all), N >= 1")
ENDLESS_VAL = ("dlpipe: error: trainer.limit_val_batches=-1: val_dataset._target_=hf_data.rows is a stream that "
               f"never ends ({HUGGING_FACE_REPEAT}), so validation would never end; set trainer.limit_val_batches=N "
               "(batches a validation pass, N >= 1), or 0 for no validation")
ENDLESS_VAL_DATASET = ["val_dataset=custom", "val_dataset._target_=hf_data.rows", "+val_dataset.size=16",
                       "+val_dataset.repeat=true"]


@pytest.mark.parametrize("task, trainer, refused_lines", [
    ("train", {}, 2), ("plan", {}, 2), ("eval", {}, 1), ("bench", {}, 1), ("tune", {}, 1),
    ("train", {"max_steps": 5}, 1), ("train", {"limit_train_batches": 5, "limit_val_batches": 0}, 0),
    ("train", {"max_steps": 5, "limit_val_batches": 2}, 0)])
def test_which_limits_an_endless_stream_needs_for_each_command(task, trainer, refused_lines):
    """bench and tune read bench.batches of the training stream; every command that validates reads
    the val_dataset stream by trainer.limit_val_batches."""
    cfg = DlpipeConfig(task=task, dataset={"_target_": "a"}, val_dataset={"_target_": "b"},
                       trainer=TrainerConfig(**trainer))
    if not refused_lines:
        check_streams_end(cfg, rows(repeat=True), rows(repeat=True))
        return
    with pytest.raises(ConfigError) as e:
        check_streams_end(cfg, rows(repeat=True), rows(repeat=True))
    assert len(e.value.problems) == refused_lines
    check_streams_end(cfg, rows(), rows())  # streams that end need no limit


@pytest.mark.integration
def test_an_endless_stream_without_a_limit_is_one_line_and_leaves_nothing(dlpipe, tmp_path, mlflow_store,
                                                                          mlflow_client):
    r = dlpipe(*HF, "+dataset.repeat=true", *ENDLESS_VAL_DATASET, f"tracking.uri={mlflow_store}",
               "tracking.experiment=hf-endless", env=hf_env(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [ENDLESS_TRAIN, ENDLESS_VAL]
    assert runs_of(mlflow_client, "hf-endless") == [] and not (tmp_path / "outputs").exists()
    refused(dlpipe(*HF, *ENDLESS_VAL_DATASET, "trainer.limit_train_batches=2", f"tracking.uri={mlflow_store}",
                   "tracking.experiment=hf-endless-val", env=hf_env(tmp_path)),
            ENDLESS_VAL, runs_of(mlflow_client, "hf-endless-val"), tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("workers", [0, 2])
def test_an_endless_stream_trains_epochs_that_end_at_the_limit(dlpipe, tmp_path, mlflow_store, mlflow_client, workers):
    experiment = f"hf-endless-limited-{workers}"
    r = dlpipe(*[a for a in HF if not a.startswith("model")], *recording(tmp_path), "+dataset.repeat=true",
               "+dataset.num_shards=2", *ENDLESS_VAL_DATASET, "trainer.limit_train_batches=7",
               "trainer.limit_val_batches=3", f"loader.num_workers={workers}",
               f"tracking.uri={mlflow_store}", f"tracking.experiment={experiment}", env=hf_env(tmp_path))
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, experiment)
    assert run.info.status == "FINISHED"
    assert steps_at_epoch_ends(mlflow_client, run) == [7, 14]  # 7 batches of 8: past the 40 rows into the repeat
    batches = recorded(tmp_path / "rows")
    assert len(batches) == 14 and all(len(b) == 8 for b in batches)
    # each epoch reads the stream from its start again: the same 56 rows (40, then 16 of the repeat)
    epochs = [collections.Counter(itertools.chain(*batches[:7])), collections.Counter(itertools.chain(*batches[7:]))]
    assert epochs[0] == epochs[1] and sum(epochs[0].values()) == 56 and set(epochs[0]) == set(range(40))
    assert {"val/loss", "val/accuracy"} <= set(run.data.metrics)


@pytest.mark.integration
def test_a_stream_split_by_node_trains_each_row_once_on_two_ranks(tmp_path):
    """split_dataset_by_node gives each rank 2 of the 4 shards and each rank's 2 workers one each; it
    splits itself, so loader.stream_share=source (auto refuses such a stream on several ranks)."""
    r = torchrun(tmp_path, *[a for a in HF if not a.startswith(("model", "trainer.epochs"))], *recording(tmp_path),
                 "+dataset.num_shards=4", "+dataset.by_rank=true", "trainer.epochs=1", "loader.num_workers=2",
                 "loader.stream_share=source", "trainer.progress=false", "tracking=none",
                 env=hf_env(tmp_path), timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    per_rank = [[int(v) for line in path.read_text().splitlines() for v in line.split()]
                for path in sorted(tmp_path.glob("rows.*"))]
    assert len(per_rank) == 2 and len(per_rank[0]) == len(per_rank[1]) == 20
    assert sorted(per_rank[0] + per_rank[1]) == list(range(40))


RAW_AUTO_WORKERS = {"num_workers": "${auto_workers:}", "prefetch_factor": "${auto_prefetch:${.num_workers}}"}


@pytest.mark.parametrize("num_shards, workers", [(1, 1), (2, 2), (4, 3)])
def test_automatic_workers_stop_at_the_streams_shards(num_shards, workers, monkeypatch):
    """loader.num_workers=auto gives a stream that shares its shards out no more workers than shards;
    a set worker count stands (the lint's business)."""
    slow = LoaderConfig(batch_size=4, num_workers=3, prefetch_factor=2)
    stream = rows(size=40, num_shards=num_shards)
    # items as costly as a remote file's, whatever this machine's load: workers pay
    monkeypatch.setattr(stream_fit, "stream_item_seconds", lambda *args, **kwargs: 0.01)
    fitted, reasons = fit_stream(RAW_AUTO_WORKERS, slow, stream, world=1, epochs=2)
    kept, _ = fit_stream({"num_workers": 3, "prefetch_factor": 2}, slow, stream, world=1, epochs=2)
    assert fitted.stream_share == "source" and fitted.num_workers == workers and kept.num_workers == 3
    if workers < 3:
        assert reasons["loader.num_workers"] == (
            f"{workers} (auto: the stream has {num_shards} shard{'s' if num_shards > 1 else ''} (num_shards) and "
            "shares them out among the workers: a worker beyond them would read nothing; the budget alone would "
            "give 3)")
        assert reasons["loader.prefetch_factor"].startswith(f"{2} (auto: ")
    else:
        assert "loader.num_workers" not in reasons


def test_a_stream_split_by_node_is_left_to_split_itself_on_as_many_ranks():
    """auto on 2 ranks refuses a stream that shares itself out (it may split itself by rank too), except
    one Hugging Face's split_dataset_by_node made for that many ranks: it says so itself."""
    from datasets.distributed import split_dataset_by_node

    asked = LoaderConfig(batch_size=4, num_workers=2, prefetch_factor=2)
    split = split_dataset_by_node(rows(size=40, num_shards=4), rank=0, world_size=2)
    fitted, reasons = fit_stream({"num_workers": 2, "prefetch_factor": 2}, asked, split, world=2, epochs=2)
    assert fitted.stream_share == "source"
    assert reasons["loader.stream_share"].endswith("; Hugging Face's split_dataset_by_node gave each of the 2 ranks "
                                                   "its part)")
    with pytest.raises(ConfigError, match="and 3 ranks train it"):  # split for 2, trained on 3
        fit_stream({"num_workers": 2, "prefetch_factor": 2}, asked, split, world=3, epochs=2)
