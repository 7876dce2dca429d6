"""Streams through the real `dlpipe` command: a stream trains with the loader fitted to it, each
sample once an epoch whatever the workers, validation from val_dataset, and bad input in one line."""

import pytest
import yaml
from conftest import runs_of

STREAM = ["dataset=custom", "dataset._target_=stream_data.Rows", "+dataset.size=40", "model=mlp",
          "model.in_features=2", "loader.batch_size=8", "trainer.epochs=2", "trainer.val_fraction=0",
          "loader.persistent_workers=false"]


def refused(r, line: str, runs: list, folder) -> None:
    """Bad input: exit 2, the one line on stderr, no run in the store and no output folder."""
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [line]
    assert runs == [] and not (folder / "outputs").exists()


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


def test_a_stream_validates_on_val_dataset_whole_whatever_the_workers(dlpipe, mlflow_store, mlflow_client):
    """The validation stream shares itself out among workers, the training stream does not: each is
    measured on its own (dealing the validation stream again would score half of it). 2 workers and
    none train on the same batches, so they score the same val_loss only if both score every item
    (up to the order of a sum: 2 workers batch the validation rows otherwise)."""
    losses = []
    for workers in (0, 2):
        r = dlpipe(*STREAM, "val_dataset=custom", "val_dataset._target_=stream_data.SharedOut",
                   "+val_dataset.size=24", f"loader.num_workers={workers}", "trainer.deterministic=true",
                   f"tracking.uri={mlflow_store}", f"tracking.experiment=stream-val-{workers}")
        assert r.returncode == 0, r.stderr
        [run] = runs_of(mlflow_client, f"stream-val-{workers}")
        assert {"val/loss", "val/accuracy"} <= set(run.data.metrics)
        losses.append([m.value for m in mlflow_client.get_metric_history(run.info.run_id, "val/loss")])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_a_stream_given_a_random_split_is_one_line_and_leaves_nothing(dlpipe, tmp_path, mlflow_store,
                                                                        mlflow_client):
    args = [a for a in STREAM if not a.startswith("trainer.val_fraction")]
    refused(dlpipe(*args, f"tracking.uri={mlflow_store}", "tracking.experiment=stream-split"),
            "dlpipe: error: trainer.val_fraction=0.1: dataset._target_=stream_data.Rows is a stream (an "
            "IterableDataset: read in order, no index), which has no random split; set trainer.val_fraction=0 and "
            "give validation data as val_dataset (a `_target_` node like dataset's), or leave it out for no "
            "validation", runs_of(mlflow_client, "stream-split"), tmp_path)


def test_a_failing_stream_item_is_named_and_the_run_ends_failed(dlpipe, mlflow_store, mlflow_client):
    r = dlpipe(*STREAM, "+dataset.fail_at=13", "loader.num_workers=0", f"tracking.uri={mlflow_store}",
               "tracking.experiment=stream-fail")
    assert r.returncode == 2  # a data fault during training (docs/errors.md)
    assert r.stderr.splitlines() == ["dlpipe: error: stream item 13: OSError: truncated record"]
    [run] = runs_of(mlflow_client, "stream-fail")
    assert run.info.status == "FAILED"
    assert "stream item 13: OSError: truncated record" in run.data.tags["dlpipe.end_reason"]


def test_plan_bench_and_tune_take_a_stream(dlpipe, tmp_path):
    r = dlpipe("plan", *STREAM, "loader.num_workers=2")
    assert r.returncode == 0, r.stderr
    assert "DataLoader (train, a stream): " in r.stdout
    assert "loader.stream_share = dlpipe (auto: 2 workers each yielded the stream's first 8 items" in r.stdout
    assert "lint: loader.stream_share=dlpipe: each of the 2 workers reads the whole stream" in r.stdout
    r = dlpipe("bench", *STREAM, "loader.num_workers=0", "tracking=none", "bench.batches=3", "bench.warmup_batches=1")
    assert r.returncode == 0, r.stderr
    assert "bench: " in r.stdout and "samples/s" in r.stdout
    # tune: the automatic config reads the stream in the main process; the candidates with workers are
    # dealt their batches (the probe runs for them), and the written file leaves the share to the job
    r = dlpipe("tune", *STREAM, "tracking=none", "bench.batches=6", "bench.warmup_batches=1", "bench.repeats=2",
               f"bench.output_dir={tmp_path / 'tuned'}", "bench.max_workers=2")
    assert r.returncode == 0, r.stderr
    trials = [line.split("|")[1].strip() for line in r.stdout.splitlines() if line.startswith("| num_workers=")]
    assert trials[0] == "num_workers=0" and any(t.startswith("num_workers=2 ") for t in trials), trials
    written = yaml.safe_load((tmp_path / "tuned" / "loader" / "tuned.yaml").read_text())
    assert written["stream_share"] == "auto" and written["fetch"] == "item" and written["shuffle"] is False
    r = dlpipe("tune", *[a.replace("stream_data.Rows", "stream_data.Noise") for a in STREAM], "tracking=none",
               "loader.num_workers=0")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "dlpipe: error: loader.stream_share=auto: cannot tell whether the stream shares itself out among workers "
        "(its first items differ between two passes in this process); set loader.stream_share=source (it does, by "
        "get_worker_info()) or loader.stream_share=dlpipe (each worker keeps every Nth item)"]


def test_a_stream_run_resumes_from_its_checkpoint(dlpipe, tmp_path):
    """The same command again continues from the folder's checkpoint (tests/test_stream_resume.py: exact,
    on another number of workers too)."""
    args = [*STREAM, "tracking=none", "trainer.epochs=1", "hydra.run.dir=run"]
    r = dlpipe(*args, "trainer.max_steps=3")
    assert r.returncode == 0, r.stderr
    r = dlpipe(*args, "trainer.epochs=2")
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout and "(epoch 1, step 3)" in r.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("epoch-*.pt")) == [
        "epoch-0001.pt", "epoch-0002.pt"]


@pytest.mark.parametrize("workers", ["0", "auto"])
def test_a_stream_whose_items_do_not_collate_is_one_line_and_leaves_nothing(dlpipe, tmp_path, mlflow_store,
                                                                           mlflow_client, workers):
    args = [a.replace("stream_data.Rows", "stream_data.Ragged") for a in STREAM]
    if workers != "auto":
        args.append(f"loader.num_workers={workers}")
    refused(dlpipe(*args, f"tracking.uri={mlflow_store}", "tracking.experiment=stream-ragged"),
            "dlpipe: error: the stream's items 0-7 do not collate into a batch (RuntimeError: stack expects each "
            "tensor to be equal size, but got [1] at entry 0 and [2] at entry 1); variable-length items need "
            "loader.collate_fn (e.g. dlpipe.loader.collate.PadSequences)", runs_of(mlflow_client, "stream-ragged"),
            tmp_path)
