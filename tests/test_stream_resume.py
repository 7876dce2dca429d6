"""Exact, elastic resume of a stream through the real CLI: a real SIGTERM in the middle of epoch 2
while worker processes read the stream, then the printed command again on another number of workers:
every logged number that is not a timing equals an uninterrupted run's on none. dlpipe deals a
stream's batches in the stream's own order (dlpipe.loader.stream_deal), so who reads them does not
change them, and a resumed epoch's workers leave out the rounds already trained on."""

import shlex

import pytest
import torch
from conftest import runs_of
from test_resume import logged

COMMON = ["model=mlp", "model.hidden=8", "model.depth=1", "loader.batch_size=16", "trainer.accumulate=2",
          "trainer.epochs=3", "trainer.log_every=3", "trainer.deterministic=true", "trainer.progress=false",
          "trainer.val_fraction=0", "optim=sgd", "scheduler=cosine", "scheduler.warmup_steps=3"]
# A stream read whole by every worker (each keeps its own batches), and a parquet stream that builds
# only the rows of its worker's batches, its rows mixed in windows: 120 and 1000 rows an epoch. The
# parquet stream counts its rows, so its loader has a length (the schedule's steps); the other is
# given the run's optimizer steps.
STREAMS = {
    "read-whole": (["dataset=custom", "dataset._target_=stream_data.SignalsItself", "model.in_features=4",
                    "+dataset.at=40", "trainer.max_steps=12"], "dataset.at"),
    "parquet": (["dataset=tabular_parquet", "dataset._target_=stream_data.SignalsItselfParquet", "dataset.size=1000",
                 "dataset.num_features=4", "dataset.row_group_size=64", "dataset.shuffle_buffer=200",
                 "+dataset.at=100"], "dataset.at"),
}


@pytest.mark.parametrize("kind, resumed_on", [("parquet", ["loader.num_workers=3"]),
                                              ("parquet", ["loader.num_workers=3", "loader.worker_method=thread"]),
                                              ("read-whole", ["loader.num_workers=3"])])
def test_a_stream_stopped_on_2_workers_resumes_on_3_exactly(dlpipe, tmp_path, mlflow_store, mlflow_client, kind,
                                                             resumed_on):
    """Resumed on 3 worker processes, or, for a stream that reads positions, 3 worker threads
    (dlpipe.loader.stream_threads)."""
    data, at = STREAMS[kind]
    case = kind + "".join("-" + value.partition("=")[2] for value in resumed_on)  # its own experiments in the store
    args = [*data, *COMMON, f"+dataset.marker={tmp_path / 'signalled'}", f"tracking.uri={mlflow_store}"]
    r = dlpipe(*args, f"{at}=-1", "loader.num_workers=0", f"hydra.run.dir={tmp_path / 'straight'}",
               f"tracking.experiment=straight-{case}")
    assert r.returncode == 0, r.stderr
    r = dlpipe(*args, "loader.num_workers=2", "loader.worker_method=process", f"hydra.run.dir={tmp_path / 'split'}",
               f"tracking.experiment=split-{case}", new_session=True)  # a group of its own: the signal's
    assert r.returncode == 143, r.stderr
    assert "loader.stream_share = dlpipe" in r.stdout
    stopped = torch.load(tmp_path / "split" / "checkpoints" / "epoch-0002.pt", weights_only=True)
    assert stopped["epoch"] == 1 and stopped["batches_done"] > 0
    [hint] = [line.split("resume with: dlpipe ")[1] for line in (r.stdout + r.stderr).splitlines()
              if "resume with: dlpipe " in line]
    r = dlpipe(*shlex.split(hint), *resumed_on)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "resuming from" in out and "resuming with a changed config" not in out
    [line] = [line for line in out.splitlines() if "resuming with other loader settings (the batches stay" in line]
    assert all(key.partition("=")[0] in line for key in resumed_on), line

    [straight], [resumed] = runs_of(mlflow_client, f"straight-{case}"), runs_of(mlflow_client, f"split-{case}")
    assert resumed.info.status == "FINISHED"
    a, b = logged(mlflow_client, straight), logged(mlflow_client, resumed)
    assert {"train_loss", "train_loss_step", "lr", "grad_norm"} <= set(a)
    assert a == b
