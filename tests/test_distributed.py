"""Data-parallel training: real torchrun, 2 gloo ranks on the CPU, against single-process training."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import NO_PHONE_HOME, TESTS_DIR, epochs_logged, runs_of

from dlpipe.errors import ConfigError, DlpipeError
from dlpipe.loader.build import EpochOrder
from dlpipe.training.distributed import Ranks, check_ranks, device_for, ranks_from_env, torchrun_command

# 832 training samples: 13 global batches of 64, so no rank pads and the two runs see the same data,
# and with accumulate 2 every epoch ends on a partial window. Plain SGD: unlike Adam's, its update
# changes with the gradient's scale, so a sum instead of a mean over ranks would show.
SAME_DATA = ["+recipe=tabular", "dataset.size=1040", "trainer.val_fraction=0.2", "trainer.epochs=2",
             "trainer.accumulate=2", "trainer.progress=false", "tracking=none", "loader.num_workers=0",
             "optim=sgd", "optim.momentum=0", "optim.lr=0.5"]


def torchrun(tmp_path, *args: str, ranks: int = 2, env: dict | None = None, timeout: float = 240):
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "LOCAL_WORLD", "SUBMITIT_"))}
    full_env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR), OMP_NUM_THREADS="1",
                    TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "dlpipe",
         *args],
        cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def checkpoint(path):
    return torch.load(path, weights_only=True)


def test_two_ranks_train_the_same_model_as_one_process_with_the_global_batch(tmp_path, dlpipe):
    one = dlpipe(*SAME_DATA, "loader.batch_size=64", "hydra.run.dir=one")
    assert one.returncode == 0, one.stderr
    two = torchrun(tmp_path, *SAME_DATA, "loader.batch_size=32", "hydra.run.dir=two")
    assert two.returncode == 0, two.stderr[-4000:]

    a, b = (checkpoint(tmp_path / "one/checkpoints/epoch-0002.pt"),
            checkpoint(tmp_path / "two/checkpoints/epoch-0002.pt"))
    assert a["step"] == b["step"] == 14  # 2 epochs x 7 windows (6 of 2 batches, 1 of 1)
    for name, weight in a["model"].items():
        assert torch.allclose(weight, b["model"][name], rtol=1e-4, atol=1e-6), name
    for row_a, row_b in zip(a["history"], b["history"]):  # losses aggregated over ranks
        assert row_b["train_loss"] == pytest.approx(row_a["train_loss"], rel=1e-4)
        assert row_b["val_loss"] == pytest.approx(row_a["val_loss"], rel=1e-4)  # every val sample once
        assert row_b["val_accuracy"] == pytest.approx(row_a["val_accuracy"])
    # Only rank 0 writes: one output directory, nothing from rank 1 in the working directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]
    assert two.stdout.count("bottleneck:") == 1


@pytest.mark.integration
def test_a_failing_rank_ends_the_job_with_its_error_instead_of_a_hang(tmp_path, mlflow_store, mlflow_client):
    started = time.monotonic()
    r = torchrun(
        tmp_path, "--config-dir", str(TESTS_DIR / "conf"), "dataset=rank_failing", "model=mlp", "model.in_features=4",
        "loader.num_workers=0", "loader.batch_size=16", "trainer.epochs=3",
        "trainer.progress=false", "trainer.val_fraction=0", f"tracking.uri={mlflow_store}",
        "tracking.experiment=rank-failure", timeout=180,
    )
    assert r.returncode != 0
    assert time.monotonic() - started < 150  # ended by the failure, not by a collective timing out
    assert "dlpipe: error: rank 1: dataset item" in r.stderr and "rank 1 cannot read sample" in r.stderr
    # rank 0 says why it stopped, in one line, not with a gloo traceback
    assert "dlpipe: error: rank 0: another rank left the job mid-step" in r.stderr or "terminated (SIGTERM)" in r.stderr
    assert "Traceback" not in r.stderr.split("failed (exitcode")[0]  # before torchrun's own report
    runs = runs_of(mlflow_client, "rank-failure")
    assert len(runs) == 1  # rank 0's; the other rank never tracks
    assert runs[0].info.status in ("FAILED", "KILLED")


def rank_process(proc: subprocess.Popen, rank: int) -> psutil.Process | None:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "dlpipe" in " ".join(child.cmdline()):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.integration
def test_a_stop_on_one_rank_stops_both_at_one_step_and_the_same_command_resumes(tmp_path, mlflow_store, mlflow_client):
    exp = "ddp-stop"
    args = ["--config-dir", str(TESTS_DIR / "conf"), "dataset=slow", "dataset.size=480", "dataset.delay_s=0.004",
            "model=mlp", "model.in_features=4", "loader.num_workers=0", "loader.batch_size=16", "trainer.epochs=4",
            "trainer.val_fraction=0", "trainer.progress=false", "hydra.run.dir=run",
            f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "LOCAL_WORLD", "SUBMITIT_"))}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dlpipe", *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "run" / "checkpoints" / "epoch-0001.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
            time.sleep(0.1)
        rank_process(proc, 1).send_signal(signal.SIGTERM)  # only rank 1 hears it
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    stopped = checkpoint(tmp_path / "run" / "checkpoints" / "epoch-0002.pt")  # rank 0 saved the stop
    assert stopped["batches_done"] > 0 and stopped["epoch"] == 1
    # each rank's own random state, so dropout and augmentation stay different per rank after resuming
    rank0, rank1 = stopped["ranks"]
    assert not torch.equal(rank0["rng"]["torch"], rank1["rng"]["torch"])
    assert not torch.equal(rank0["loader_generator"], rank1["loader_generator"])
    [run] = runs_of(mlflow_client, exp)
    assert run.info.status == "KILLED"

    again = torchrun(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    [run] = runs_of(mlflow_client, exp)  # the same run, continued
    assert run.info.status == "FINISHED" and "dlpipe.resumed_from" in run.data.tags
    assert epochs_logged(mlflow_client, run.info.run_id, "train/loss") == [1, 2, 3, 4]


def test_epoch_order_shards_one_shared_permutation():
    whole = list(EpochOrder(10, seed=3))
    shards = [EpochOrder(10, seed=3, rank=r, world=2) for r in range(2)]
    assert [len(s) for s in shards] == [5, 5]
    interleaved = [i for pair in zip(*(list(s) for s in shards)) for i in pair]
    assert interleaved == whole  # step k of 2 ranks = batch k of one process with twice the batch


def test_epoch_order_pads_training_but_not_validation():
    train = [list(EpochOrder(7, seed=0, rank=r, world=3)) for r in range(3)]
    assert [len(t) for t in train] == [3, 3, 3]  # 2 samples repeated so every rank takes 3 steps
    assert set(sum(train, [])) == set(range(7))
    val = [list(EpochOrder(7, seed=0, shuffle=False, rank=r, world=3, pad=False)) for r in range(3)]
    assert sorted(sum(val, [])) == list(range(7))  # each validation sample scored exactly once
    assert [len(EpochOrder(7, seed=0, shuffle=False, rank=r, world=3, pad=False)) for r in range(3)] == [3, 2, 2]


def test_epoch_order_changes_with_the_epoch_only():
    order = EpochOrder(50, seed=1, rank=1, world=2)
    first = list(order)
    assert list(order) == first
    order.set_epoch(2)
    assert list(order) != first


def test_ranks_come_from_torchrun_variables():
    assert ranks_from_env({}) == Ranks()
    assert ranks_from_env({"WORLD_SIZE": "1", "RANK": "0"}) == Ranks()
    r = ranks_from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (r.rank, r.world, r.local_rank, r.local_world, r.is_main) == (3, 4, 1, 2, False)
    assert device_for("cuda", r) == "cuda:1" and device_for("cpu", r) == "cpu"
    assert device_for("cuda", Ranks()) == "cuda"


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_what_data_parallel_training_refuses(tmp_path):
    ranks = Ranks(rank=0, world=2, local_world=2)
    with pytest.raises(DlpipeError, match="WORLD_SIZE=2 without MASTER_ADDR, MASTER_PORT"):
        check_ranks(ranks, False, "cpu", {"RANK": "0", "LOCAL_RANK": "0"})
    with pytest.raises(ConfigError, match=r"trainer.device=cuda:1: with 2 ranks each one takes cuda:LOCAL_RANK"):
        check_ranks(ranks, False, "cuda:1", TORCHRUN_ENV)
    with pytest.raises(ConfigError, match="trainer.device=mps"):
        check_ranks(ranks, False, "mps", TORCHRUN_ENV)
    with pytest.raises(DlpipeError, match="--multirun under torchrun"):
        check_ranks(ranks, True, "cpu", TORCHRUN_ENV)
    check_ranks(ranks, True, "cpu", {**TORCHRUN_ENV, "SUBMITIT_EXECUTOR": "slurm"})  # one submitit task per rank: fine
    check_ranks(Ranks(), False, "cuda:1", {})  # one process may use any GPU


def test_bench_refuses_to_run_under_torchrun(tmp_path, dlpipe):
    r = dlpipe("bench", "+recipe=tabular", "tracking=none", env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert r.returncode == 2
    assert "dlpipe: error: rank 0: WORLD_SIZE=2: dlpipe bench measures one process" in r.stderr


def _fail_holding(model):
    held = model  # a failed job's frame holds its DDP model, as train_tracked's holds the job
    raise DlpipeError(f"failed with {type(held).__name__}")


def test_a_failed_rank_frees_its_ddp_model_while_its_group_lives(tmp_path, monkeypatch):
    """release_failed clears the error's finished frames and stop() collects before it destroys the
    group: the DDP model, held by the frames and in a reference cycle as the job's is, is gone by then
    (afterwards, its reducer would destroy the group holding the GIL), and the error still prints its
    traceback."""
    import traceback
    import weakref

    import torch.distributed as dist

    from dlpipe.training.distributed import release_failed, stop

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        ddp.__dict__["job"] = ddp  # the cycle (the trainer calls back into the job)
        alive = weakref.ref(ddp)
        try:
            _fail_holding(ddp)
        except DlpipeError as error:
            del ddp
            release_failed(error)
            printed = "".join(traceback.format_exception(error))
        assert "in _fail_holding" in printed and "failed with DistributedDataParallel" in printed
        assert alive() is not None  # in its cycle, until a collection
        destroy, at_destroy = dist.destroy_process_group, []
        monkeypatch.setattr(dist, "destroy_process_group", lambda: (at_destroy.append(alive()), destroy()))
        stop()
        assert at_destroy == [None] and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    """no_sync on the micro-batches that do not step: DDP communicates once per optimizer step,
    including the partial window at the end of the epoch (a one-rank gloo group, in process)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from dlpipe.models.mlp import MLP
    from dlpipe.schema import TrainerConfig
    from dlpipe.training.distributed import Collectives, stop
    from dlpipe.training.runner import Trainer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = MLP(in_features=4, num_classes=2, hidden=8, depth=1)
        settings = TrainerConfig(epochs=1, accumulate=4, progress=False, log_every=1)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), settings,
                          peers=Collectives(Ranks(), torch.device("cpu")))
        reductions = []

        def count(state, bucket):
            reductions.append(bucket.index())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        trainer.net.register_comm_hook(None, count)
        data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
        trainer.fit(DataLoader(data, batch_size=10))  # 10 micro-batches: windows of 4, 4 and 2
        assert trainer.step == 3
        assert len(reductions) == 3  # not 10
    finally:
        # DDP's reducer holds the group too: freed after the group is destroyed, it destroys it itself
        # while holding the GIL and joins gloo's threads, one of which may be waiting for the GIL to
        # drop its last work's tensors (a hang, once in CI). Let go of it; stop() collects it first.
        trainer = None
        stop()


def _epoch_row_on_rank(rank: int, store: str, rows: list[dict], out: str) -> None:
    import torch.distributed as dist

    from dlpipe.training.distributed import Collectives

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        row = Collectives(Ranks(rank=rank, world=2, local_world=2), torch.device("cpu")).epoch_row(rows[rank])
        with open(f"{out}.{rank}", "w") as f:
            json.dump(row, f)
    finally:
        dist.destroy_process_group()


def test_epoch_metrics_are_the_whole_jobs_even_when_ranks_report_different_keys(tmp_path):
    """Two real gloo ranks; rank 1 has no worker metrics this epoch (its workers had exited)."""
    import torch.multiprocessing as mp

    rows = [
        {"epoch": 1.0, "samples_per_s": 100.0, "epoch_time_s": 2.0, "cpu_util": 50.0, "worker_rss_mean_mb": 10.0,
         "worker_rss_max_mb": 12.0, "val_loss": 0.5},
        {"epoch": 1.0, "samples_per_s": 50.0, "epoch_time_s": 3.0, "cpu_util": 30.0, "val_loss": 0.5},
    ]
    out = tmp_path / "row"
    mp.spawn(_epoch_row_on_rank, args=(str(tmp_path / "store"), rows, str(out)), nprocs=2)
    got = [json.loads((tmp_path / f"row.{r}").read_text()) for r in range(2)]
    assert got[0] == got[1]  # every rank logs and judges the same numbers
    assert got[0] == {"epoch": 1.0, "samples_per_s": 150.0, "epoch_time_s": 3.0, "cpu_util": 40.0,
                      "worker_rss_mean_mb": 10.0, "worker_rss_max_mb": 12.0, "val_loss": 0.5}


def test_trainer_devices_on_the_command_line_restarts_under_torchrun(tmp_path, dlpipe, mlflow_store, mlflow_client):
    r = dlpipe("+recipe=tabular", "dataset.size=512", "trainer.epochs=1", "trainer.progress=false",
               "trainer.devices=2", f"tracking.uri={mlflow_store}", "tracking.experiment=devices-shortcut")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trainer.devices=2: running 2 ranks as torchrun --standalone --nproc_per_node=2 -m dlpipe" in r.stderr
    [run] = runs_of(mlflow_client, "devices-shortcut")
    assert run.info.status == "FINISHED"
    assert (run.data.params["dist.world_size"], run.data.params["trainer.devices"]) == ("2", "2")


def test_when_trainer_devices_starts_torchrun():
    cmd = torchrun_command(["+recipe=vision", "trainer.devices=4", "loader.batch_size=32"], {})
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m"]
    assert cmd[6:] == ["dlpipe", "+recipe=vision", "trainer.devices=4", "loader.batch_size=32"]
    assert torchrun_command(["trainer.devices=4", "trainer.devices=1"], {}) is None  # the last one wins
    assert torchrun_command(["trainer.devices=2"], {"WORLD_SIZE": "2"}) is None  # already a rank
    assert torchrun_command(["trainer.devices=2", "--cfg", "job"], {}) is None  # only printing
    assert torchrun_command(["+recipe=vision"], {}) is None


def test_trainer_devices_must_match_the_ranks(tmp_path):
    with pytest.raises(ConfigError, match="trainer.devices=2: set in a config file"):
        check_ranks(Ranks(), False, "cpu", {}, devices=2)
    with pytest.raises(ConfigError, match=r"trainer.devices=2: this node runs 4 ranks"):
        check_ranks(Ranks(rank=0, world=4, local_world=4), False, "cpu", TORCHRUN_ENV, devices=2)
    check_ranks(Ranks(rank=0, world=4, local_world=4), False, "cpu", TORCHRUN_ENV, devices=4)
