"""Streams through the real `dlpipe` command: a stream trains with the loader fitted to it, each
sample once an epoch whatever the workers, validation from val_dataset, and bad input in one line."""

import pytest
from conftest import runs_of

STREAM = ["dataset=custom", "dataset._target_=stream_data.Rows", "+dataset.size=40", "model=mlp",
          "model.in_features=2", "loader.batch_size=8", "trainer.epochs=2", "trainer.val_fraction=0",
          "loader.persistent_workers=false"]


def steps_at_epoch_ends(client, run) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "perf/samples_per_s"))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_trains_each_sample_once_an_epoch_whatever_the_workers(dlpipe, mlflow_store, mlflow_client,
                                                                          workers):
    experiment = f"stream-{workers}"
    r = dlpipe(*STREAM, f"loader.num_workers={workers}", f"tracking.uri={mlflow_store}",
               f"tracking.experiment={experiment}")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, experiment)
    assert run.info.status == "FINISHED"
    # 40 rows in batches of 8: dlpipe deals whole batches to the workers, so 2 workers make the 5 batches
    # of the main process (each worker batching half of the rows would make 8 + 8 + 4 twice, 6; every
    # row in both workers, 10).
    assert steps_at_epoch_ends(mlflow_client, run) == [5, 10]
    if workers:
        assert "loader.stream_share = dlpipe (auto: 2 workers each yielded the stream's first 8 items" in r.stdout
        assert run.data.params["loader.stream_share"] == "dlpipe"


def test_a_stream_validates_on_val_dataset(dlpipe, mlflow_store, mlflow_client):
    r = dlpipe(*STREAM, "val_dataset=custom", "val_dataset._target_=stream_data.SharedOut", "+val_dataset.size=24",
               "loader.num_workers=2", f"tracking.uri={mlflow_store}", "tracking.experiment=stream-val")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "stream-val")
    assert {"val/loss", "val/accuracy"} <= set(run.data.metrics)


def test_a_stream_given_a_random_split_is_one_line_and_leaves_nothing(dlpipe, tmp_path, mlflow_store,
                                                                        mlflow_client):
    args = [a for a in STREAM if not a.startswith("trainer.val_fraction")]
    r = dlpipe(*args, f"tracking.uri={mlflow_store}", "tracking.experiment=stream-split")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "dlpipe: error: trainer.val_fraction=0.1: dataset._target_=stream_data.Rows is a stream (an IterableDataset: "
        "read in order, no index), which has no random split; set trainer.val_fraction=0 and give validation data "
        "as val_dataset (a `_target_` node like dataset's), or leave it out for no validation"]
    assert runs_of(mlflow_client, "stream-split") == [] and not (tmp_path / "outputs").exists()


def test_a_failing_stream_item_is_named_and_the_run_ends_failed(dlpipe, mlflow_store, mlflow_client):
    r = dlpipe(*STREAM, "+dataset.fail_at=13", "loader.num_workers=0", f"tracking.uri={mlflow_store}",
               "tracking.experiment=stream-fail")
    assert r.returncode == 2  # a data fault during training (docs/errors.md)
    assert r.stderr.splitlines() == ["dlpipe: error: stream item 13: OSError: truncated record"]
    [run] = runs_of(mlflow_client, "stream-fail")
    assert run.info.status == "FAILED"
    assert "stream item 13: OSError: truncated record" in run.data.tags["dlpipe.end_reason"]


def test_plan_and_bench_take_a_stream_and_tune_says_it_does_not_yet(dlpipe, tmp_path):
    r = dlpipe("plan", *STREAM, "loader.num_workers=2")
    assert r.returncode == 0, r.stderr
    assert "DataLoader (train, a stream): " in r.stdout
    assert "loader.stream_share = dlpipe (auto: 2 workers each yielded the stream's first 8 items" in r.stdout
    assert "lint: loader.stream_share=dlpipe: each of the 2 workers reads the whole stream" in r.stdout
    r = dlpipe("bench", *STREAM, "loader.num_workers=0", "tracking=none", "bench.batches=3", "bench.warmup_batches=1")
    assert r.returncode == 0, r.stderr
    assert "bench: " in r.stdout and "samples/s" in r.stdout
    made = sorted((tmp_path / "outputs").rglob("*"))  # bench's folder
    r = dlpipe("tune", *STREAM, "tracking=none")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "dlpipe: error: dlpipe tune: dataset._target_=stream_data.Rows is a stream; the search runs on map datasets "
        "for now: compare a stream's loader settings with `dlpipe bench --multirun ... loader.num_workers=0,2,4`"]
    assert sorted((tmp_path / "outputs").rglob("*")) == made  # tune left nothing behind


def test_a_stream_run_resumes_from_its_checkpoint(dlpipe, tmp_path):
    """The same command again continues from the folder's checkpoint (a stream's batches follow the
    loader settings, so a changed worker count is a change to what the run computes)."""
    args = [*STREAM, "tracking=none", "trainer.epochs=1", "hydra.run.dir=run"]
    r = dlpipe(*args, "trainer.max_steps=3")
    assert r.returncode == 0, r.stderr
    r = dlpipe(*args, "trainer.epochs=2")
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout and "(epoch 1, step 3)" in r.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("epoch-*.pt")) == [
        "epoch-0001.pt", "epoch-0002.pt"]
