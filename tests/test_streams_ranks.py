"""Streams on several ranks: real torchrun with 2 gloo ranks (as tests/test_distributed.py), and the
agreements between ranks (dlpipe.training.stream_ranks) in-process with a stand-in for the other rank."""

import math

import pytest
import torch
from conftest import runs_of
from stream_data import Rows
from test_distributed import checkpoint, torchrun
from torch.utils.data import DataLoader, TensorDataset

from dlpipe.loader.streams import StreamShare
from dlpipe.stop import StopRequest
from dlpipe.training.accumulation import Window
from dlpipe.training.step_log import LossSum
from dlpipe.training.stream_ranks import StreamRanks

STREAM = ["dataset=custom", "dataset._target_=stream_data.Rows", "model=mlp", "model.in_features=2",
          "trainer.epochs=2", "trainer.val_fraction=0", "trainer.progress=false", "loader.persistent_workers=false"]


@pytest.mark.integration
@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_train_a_dealt_stream_as_one_process_with_the_global_batch(tmp_path, dlpipe, workers):
    """Global batch k goes to rank k % 2, so a step of 2 ranks x 4 rows is one process's batch of 8:
    the same weights prove every row trained once, in the same steps. 43 rows: the last round (3
    rows) gives the ranks 1 and 2, so their windows differ and the stream's end cuts the last one
    short (accumulate 4, 6 batches a rank). (41 rows would leave 1 row for 2 ranks, which training
    pads as DistributedSampler does: both ranks train row 40, one process once.)"""
    args = [*STREAM, "+dataset.size=43", f"loader.num_workers={workers}", "tracking=none", "optim=sgd",
            "optim.momentum=0", "optim.lr=0.01", "trainer.accumulate=4"]
    one = dlpipe(*args, "loader.batch_size=8", "hydra.run.dir=one")
    assert one.returncode == 0, one.stderr
    two = torchrun(tmp_path, *args, "loader.batch_size=4", "hydra.run.dir=two", timeout=120)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (checkpoint(tmp_path / "one/checkpoints/epoch-0002.pt"),
            checkpoint(tmp_path / "two/checkpoints/epoch-0002.pt"))
    assert a["step"] == b["step"] == 4  # 2 epochs x (a window of 4 batches, one of 2)
    for name, weight in a["model"].items():
        assert torch.allclose(weight, b["model"][name], rtol=1e-5, atol=1e-7), name
    for row_a, row_b in zip(a["history"], b["history"], strict=True):  # over the job's 43 samples
        assert row_b["train_loss"] == pytest.approx(row_a["train_loss"], rel=1e-5)
    said = "loader.stream_share = dlpipe (auto: 2 workers each yielded the stream's first 8 items: each of the "
    said += "2 workers of each of the 2 ranks keeps every 4th batch" if workers else "2 ranks keeps every 2nd batch"
    assert said in two.stdout


@pytest.mark.integration
def test_a_parquet_stream_trains_on_two_ranks_and_validates_on_a_stream(tmp_path, mlflow_store, mlflow_client):
    parquet = ["dlpipe.data.parquet.SyntheticTabularParquet", f"{tmp_path / 'cache'}", "4", "3", "0.5"]
    val = [f"val_dataset._target_={parquet[0]}", f"+val_dataset.root={parquet[1]}", "+val_dataset.size=150",
           f"+val_dataset.num_features={parquet[2]}", f"+val_dataset.num_classes={parquet[3]}", "+val_dataset.seed=7",
           "+val_dataset.files_count=2", "+val_dataset.row_group_size=32"]
    r = torchrun(tmp_path, "dataset=tabular_parquet", f"dataset.root={parquet[1]}", "dataset.size=300",
                 f"dataset.num_features={parquet[2]}", f"dataset.num_classes={parquet[3]}", "dataset.files_count=2",
                 "dataset.row_group_size=64", "dataset.shuffle_buffer=64", "val_dataset=custom", *val, "model=mlp",
                 "trainer.val_fraction=0", "trainer.epochs=2", "trainer.progress=false", "loader.batch_size=16",
                 "loader.num_workers=2", f"tracking.uri={mlflow_store}", "tracking.experiment=ranks-parquet",
                 timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = runs_of(mlflow_client, "ranks-parquet")
    assert run.info.status == "FINISHED"
    assert {"val/loss", "val/accuracy"} <= set(run.data.metrics)
    # 300 rows, rounds of 2 x 16: 9 whole, then 12 rows, 6 to each rank: 10 steps an epoch
    assert sorted(m.step for m in mlflow_client.get_metric_history(run.info.run_id, "perf/samples_per_s")) == [10, 20]


@pytest.mark.integration
def test_a_stream_that_shares_itself_out_is_refused_on_two_ranks_in_one_line(tmp_path, mlflow_store, mlflow_client):
    r = torchrun(tmp_path, *STREAM, "dataset._target_=stream_data.SharedOut", "+dataset.size=40",
                 "loader.batch_size=4", "loader.num_workers=2", f"tracking.uri={mlflow_store}",
                 "tracking.experiment=ranks-shared-out", timeout=120)
    line = ("loader.stream_share=auto: 2 workers yielded different items (the stream shares itself out by "
            "get_worker_info()) and 2 ranks train it: dlpipe cannot split such a stream between the ranks, nor tell "
            "whether it splits itself between them too; set loader.stream_share=source if it does (e.g. Hugging "
            "Face's split_dataset_by_node; the epoch ends for every rank when one runs out of batches), or "
            "loader.stream_share=dlpipe with loader.num_workers=0 if it does not (each rank reads it whole and dlpipe "
            "deals its batches; with workers, each would deal from its own share only and lose the rest)")
    errors = [e for e in r.stderr.splitlines() if e.startswith("dlpipe: error:")]
    assert f"dlpipe: error: rank 0: {line}" in errors  # each rank says it (torchrun may end rank 1 first)
    assert all(e.endswith(line) for e in errors)
    assert "exitcode  : 2" in r.stderr  # the rank's ConfigError; torchrun itself exits 1
    assert "Traceback" not in r.stderr.split("failed (exitcode")[0]  # before torchrun's own report
    assert runs_of(mlflow_client, "ranks-shared-out") == [] and not (tmp_path / "outputs").exists()


@pytest.mark.integration
def test_a_stream_split_unevenly_between_ranks_ends_each_epoch_on_every_rank(tmp_path, mlflow_store, mlflow_client):
    """loader.stream_share=source is trusted: rank 0 reads 30 rows, rank 1 the other 11, which its 2
    workers batch as 6 and 5 rows, 4 batches: the epoch ends for both after 4 batches, instead of rank 0
    waiting in an all-reduce that rank 1 never joins."""
    r = torchrun(tmp_path, *STREAM, "dataset._target_=stream_data.SplitsByRank", "+dataset.size=41",
                 "+dataset.first=30", "loader.batch_size=4", "loader.num_workers=2", "loader.stream_share=source",
                 f"tracking.uri={mlflow_store}", "tracking.experiment=ranks-uneven", timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = runs_of(mlflow_client, "ranks-uneven")
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in mlflow_client.get_metric_history(run.info.run_id, "perf/samples_per_s")) == [4, 8]
    assert "lint: loader.stream_share=source with 2 ranks: the stream is trusted to split itself" in r.stdout
    assert "the epoch ended for every rank when one rank's stream did: 1 other rank(s) had batches left" in r.stdout


class OtherRank:
    """Peers of a 2-rank job whose other rank has `batches` batches an epoch and windows like ours."""

    def __init__(self, batches: int, stopped_at: int | None = None):
        self.batches, self.stopped_at, self.asked = batches, stopped_at, 0

    def sum(self, values: list[float]) -> list[float]:
        if len(values) == 3:  # all_have: [has a batch, 1, stopped]
            has = float(self.asked < self.batches)
            stopped = float(self.stopped_at is not None and self.asked == self.stopped_at)
            self.asked += 1
            return [values[0] + has, 2.0, values[2] + stopped]
        return [2 * values[0], 2 * values[1]]  # job_window and mean_loss: the same on the other rank

    def any(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        return None

    def epoch_row(self, row: dict[str, float]) -> dict[str, float]:
        return row


def stream_loader(size: int, share: bool):
    return DataLoader(StreamShare(Rows(size=size), share=share, batch_size=4, world=2), batch_size=4)


def test_only_a_stream_on_several_ranks_needs_agreements():
    peers = OtherRank(3)
    assert StreamRanks.of(stream_loader(8, share=False), None).peers is None  # one process: nothing to agree
    assert StreamRanks.of(DataLoader(TensorDataset(torch.zeros(4)), batch_size=2), peers).peers is None  # a map dataset
    alone, loss = StreamRanks(), LossSum(torch.device("cpu"))
    loss.add(torch.tensor(2.0), 3)
    assert (alone.all_have(False, StopRequest(), 0), alone.job_window(3), alone.mean_loss(loss)) == (False, None, 2.0)
    assert StreamRanks.of(stream_loader(8, share=True), peers).uneven is False  # dealt: as many batches each
    assert StreamRanks.of(stream_loader(8, share=False), peers).uneven is True


def test_ranks_go_on_while_every_one_has_a_batch_and_a_stop_on_one_stops_all():
    ranks, stop = StreamRanks(OtherRank(2), uneven=True), StopRequest()
    assert [ranks.all_have(True, stop, done) for done in range(3)] == [True, True, False]
    assert ranks.left == 1  # this rank still held a batch
    dealt = StreamRanks(OtherRank(0), uneven=False)  # no collective: its own loader says
    assert dealt.all_have(True, stop, 0) and not dealt.all_have(False, stop, 1)
    ranks = StreamRanks(OtherRank(5, stopped_at=1), uneven=True)
    assert ranks.all_have(True, stop, 0)
    assert not ranks.all_have(True, stop, 4)  # the other rank's workers died of the stop signal
    assert (stop.at_batch, stop.by_peer, stop.interrupted_epoch) == (4, True, True)


def test_a_window_is_the_mean_over_the_jobs_samples_on_every_rank():
    """DDP averaged the ranks' gradients: rank 0's window held 4 samples, rank 1's 2, of a nominal 4
    each; the mean over the 6 is 8/6 times the average, on both ranks (not 4/4 on one, 4/2 on the other)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    for own in (4, 2):
        window = Window(1, 4)
        window.add(own)
        param.grad = torch.ones(1)
        window.mean_over_samples(optimizer, job=(6, 2))
        assert param.grad.item() == pytest.approx(8 / 6)
    ranks = StreamRanks(OtherRank(0), uneven=False)
    assert ranks.job_window(3) == (6, 2)
    loss = LossSum(torch.device("cpu"))
    loss.add(torch.tensor(2.0), 3)
    assert ranks.mean_loss(loss) == pytest.approx(2.0)  # (2 x 3 here + 2 x 3 there) / 6


def test_the_trainer_ends_an_uneven_epoch_with_the_shortest_rank(tmp_path):
    """An in-process one-rank gloo group (DDP needs one) and a stand-in other rank with 3 batches:
    10 batches here, 3 trained; accumulate 2 makes the last window one batch, cut short and averaged."""
    import torch.distributed as dist

    from dlpipe.models.mlp import MLP
    from dlpipe.schema import TrainerConfig
    from dlpipe.training.distributed import stop
    from dlpipe.training.runner import Trainer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = MLP(in_features=2, num_classes=3, hidden=8, depth=1)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                          TrainerConfig(epochs=1, accumulate=2, progress=False), peers=OtherRank(3))
        history = trainer.fit(stream_loader(40, share=False))
        assert trainer.step == 2 and trainer.stream_ranks.left == 1
        assert math.isfinite(history[0]["train_loss"])  # over the 12 samples trained
    finally:
        trainer = None
        stop()
