"""Checkpoints and resume through the real CLI: exact continuation, reattached MLflow run, faults."""

import shlex

import pytest
import torch
from conftest import epochs_logged, runs_of

from dlpipe.tracking.metric_names import SECTIONS, dlpipe_name

SMOKE = ["+recipe=smoke", "trainer.progress=false", "trainer.deterministic=true"]


def final_state(run_dir):
    """(model weights, per-epoch train losses) from the newest checkpoint of a run directory."""
    ckpts = sorted((run_dir / "checkpoints").glob("epoch-*.pt"))
    state = torch.load(ckpts[-1], weights_only=True)
    return state["model"], [row["train_loss"] for row in state["history"]], state


def test_interrupted_run_plus_resume_equals_straight_run(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """3 epochs straight == 1 epoch, stop, resume to 3 (weights and loss history), in the same MLflow run.
    The straight run keeps checkpoint.keep_last=1 epoch checkpoint, plus best.pt, and no temp files."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    r = dlpipe(*SMOKE, "trainer.epochs=3", "checkpoint.keep_last=1", f"hydra.run.dir={straight}", "tracking=none")
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("epoch-")] == ["epoch-0003.pt"]
    assert "best.pt" in names and not [n for n in names if n.endswith(".tmp")]
    track = [f"tracking.uri={mlflow_store}", "tracking.experiment=resume"]
    r = dlpipe(*SMOKE, "trainer.epochs=1", f"hydra.run.dir={split}", *track)
    assert r.returncode == 0, r.stderr
    r = dlpipe(*SMOKE, "trainer.epochs=3", f"hydra.run.dir={split}", *track)
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout + r.stderr

    weights_a, losses_a, _ = final_state(straight)
    weights_b, losses_b, state_b = final_state(split)
    assert losses_a == losses_b  # bitwise: same data order, augmentations and updates
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    assert state_b["epoch"] == 3

    [run] = runs_of(mlflow_client, "resume")  # reattached, not a second run
    assert run.info.status == "FINISHED" and run.info.run_id == state_b["mlflow_run_id"]
    assert epochs_logged(mlflow_client, run.info.run_id, "train/loss") == [1, 2, 3]
    assert "epoch 1" in run.data.tags["dlpipe.resumed_from"]


# What each attempt measures of its own part of an epoch: timings, resource samples and contention,
# every metric of those MLflow sections and the clock's own. Every other metric must be bitwise the
# uninterrupted run's.
MEASURED = {name for section in ("perf", "loader", "resources", "contention") for name in SECTIONS[section]} | {
    "elapsed_s", "main_cpu_s", "workers_cpu_s"}
# 120 items, 12 held out: 108 in batches of 16 (7 a batch), accumulate 2: 4 optimizer steps an epoch.
# train_loss_step every 3 steps: its windows span epoch boundaries and the stop. A cosine schedule
# with warm-up: its state is resumed too (lr and epoch_lr equal the straight run's).
SIGNALLED = ["--config-dir", "{tests}/conf", "dataset=signals_itself", "model=mlp", "model.hidden=8", "model.depth=1",
             "loader=in_memory", "loader.batch_size=16", "trainer.accumulate=2", "trainer.epochs=3",
             "trainer.log_every=3", "trainer.deterministic=true", "trainer.progress=false",
             "optim=sgd", "scheduler=cosine", "scheduler.warmup_steps=3", "scheduler.min_lr_ratio=0.1"]


def logged(client, run) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run but the measured ones, by dlpipe's names: {key: [(step, value), ...]} in step order."""
    keys = [k for k in client.get_run(run.info.run_id).data.metrics if dlpipe_name(k) not in MEASURED]
    return {dlpipe_name(k): sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
            for k in keys}


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, mlflow_store):
    """The uninterrupted run of a set of arguments, made once per test process (the parameters of the
    test below that share one are an xdist group): returns its MLflow experiment's name."""
    made: dict[tuple[str, ...], str] = {}

    def straight(dlpipe, args: list[str]) -> str:
        if tuple(args) not in made:
            out = tmp_path_factory.mktemp("straight")
            exp = f"straight-{out.name}"
            r = dlpipe(*args, "dataset.at=-1", f"hydra.run.dir={out}", f"tracking.uri={mlflow_store}",
                       f"tracking.experiment={exp}")
            assert r.returncode == 0, r.stderr
            made[tuple(args)] = exp
        return made[tuple(args)]

    return straight


# (the signal, the dataset, the loader of the interrupted run). The main process alone signalled at its
# 150th fetch (pre-flight and epoch 1 fetch about 110); or, from a persistent worker at its own 80th fetch (it
# fetches 60 or 48 an epoch), the job's whole process group. Or a dataset drawing its augmentation from
# torch's global RNG, resumed with the same loader (docs/checkpoints.md). The uninterrupted run fetches in
# the main process.
@pytest.mark.xdist_group("straight-runs")
@pytest.mark.parametrize("signal_at, data, loader", [
    (["dataset.at=150"], [], []),
    (["dataset.at=80", "+dataset.group=true"], [],
     ["loader.num_workers=2", "loader.persistent_workers=true", "loader.worker_method=process"]),
    (["dataset.at=150"], ["+dataset.global_noise=0.3"], [])],
    ids=["main", "group-persistent-workers", "main-global-rng"])
def test_sigterm_mid_epoch_then_resume_logs_every_number_of_a_straight_run(dlpipe, tmp_path, mlflow_store,
                                                                            mlflow_client, straight_runs,
                                                                            signal_at, data, loader):
    """A real SIGTERM in epoch 2, then the same command: every logged metric that is not a timing or a
    resource sample, epoch by epoch and step by step, equals the uninterrupted run's bitwise: the
    interrupted epoch's train_loss and the train_loss_step whose window the stop cut included. With
    persistent workers too: this dataset draws no randomness in its workers (docs/checkpoints.md:
    what differs for one that does)."""
    from conftest import TESTS_DIR

    args = [a.replace("{tests}", str(TESTS_DIR)) for a in SIGNALLED] + data
    straight_exp = straight_runs(dlpipe, args)
    exp = f"exact-{tmp_path.name}"
    split = [*args, *signal_at, *loader, f"dataset.marker={tmp_path / 'signalled'}",
             f"hydra.run.dir={tmp_path / 'split'}", f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}"]
    r = dlpipe(*split, new_session=True)  # a group of its own: `group` signals all of it, and only it
    assert r.returncode == 143, r.stderr
    assert "killed by signal" not in r.stderr  # no worker died of the group's signal
    stopped = torch.load(tmp_path / "split" / "checkpoints" / "epoch-0002.pt", weights_only=True)
    assert stopped["epoch"] == 1 and 0 < stopped["batches_done"] < 7 and stopped["epoch_loss"]["samples"] > 0
    assert stopped["step"] % 3 != 0  # the stop fell inside a train_loss_step window
    # The command the stop printed resumes it (it names the output folder: Hydra's default is new each launch).
    [hint] = [line.split("resume with: dlpipe ")[1] for line in (r.stdout + r.stderr).splitlines()
              if "resume with: dlpipe " in line]
    r = dlpipe(*shlex.split(hint))
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout + r.stderr

    [straight], [resumed] = runs_of(mlflow_client, straight_exp), runs_of(mlflow_client, exp)  # reopened
    assert resumed.info.status == "FINISHED" and "dlpipe.end_reason" not in resumed.data.tags
    a, b = logged(mlflow_client, straight), logged(mlflow_client, resumed)
    assert {"train_loss", "train_loss_step", "val_loss", "val_accuracy", "lr", "grad_norm", "epoch_lr"} <= set(a)
    assert a == b
    assert [step for step, _ in a["train_loss_step"]] == [3, 6, 9, 12]


def test_a_run_stopped_with_worker_processes_resumes_with_threads_exactly(dlpipe, tmp_path, mlflow_store,
                                                                         mlflow_client):
    """Elastic exact resume: augmentation drawn from each sample's generator (dlpipe.sample_rng). The
    straight run fetches in the main process; the split one is stopped (the group's SIGTERM) while 2
    persistent worker processes fetch, and resumed with 1 thread worker: every logged number equals
    the straight run's, the interrupted epoch's loss and the cut train_loss_step window included."""
    from conftest import TESTS_DIR

    args = [a.replace("{tests}", str(TESTS_DIR)) for a in SIGNALLED] + ["+dataset.noise=0.3"]
    track = [f"tracking.uri={mlflow_store}"]
    r = dlpipe(*args, "dataset.at=-1", "loader.num_workers=0", f"hydra.run.dir={tmp_path / 'straight'}", *track,
               "tracking.experiment=elastic-a")
    assert r.returncode == 0, r.stderr
    r = dlpipe(*args, "dataset.at=80", "+dataset.group=true", "loader.num_workers=2", "loader.persistent_workers=true",
               "loader.worker_method=process", f"dataset.marker={tmp_path / 'signalled'}",
               f"hydra.run.dir={tmp_path / 'split'}", *track, "tracking.experiment=elastic-b", new_session=True)
    assert r.returncode == 143, r.stderr
    stopped = torch.load(tmp_path / "split" / "checkpoints" / "epoch-0002.pt", weights_only=True)
    assert stopped["epoch"] == 1 and 0 < stopped["batches_done"] < 7
    [hint] = [line.split("resume with: dlpipe ")[1] for line in (r.stdout + r.stderr).splitlines()
              if "resume with: dlpipe " in line]
    r = dlpipe(*shlex.split(hint), "loader.num_workers=1", "loader.worker_method=thread",
               "loader.persistent_workers=false")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "resuming from" in out and "resuming with a changed config" not in out
    speed = "loader.num_workers, loader.persistent_workers, loader.worker_method"
    assert f"resuming with other loader settings (the batches stay the same): {speed}" in out

    [straight], [resumed] = runs_of(mlflow_client, "elastic-a"), runs_of(mlflow_client, "elastic-b")
    # MLflow params cannot change: the first attempt's stand, and the tags name what the resume changed:
    # the loader's speed settings only, the log and the run agree
    assert "dlpipe.resumed_changed_params" not in resumed.data.tags
    assert resumed.data.tags["dlpipe.resumed_loader_changes"] == speed
    a, b = logged(mlflow_client, straight), logged(mlflow_client, resumed)
    assert {"train_loss", "train_loss_step", "val_loss"} <= set(a)
    assert a == b


def test_resume_must_without_checkpoint_is_an_error(dlpipe, tmp_path):
    """checkpoint.resume=must with nothing to resume exits 2 naming the folder."""
    r = dlpipe(*SMOKE, "checkpoint.resume=must", f"hydra.run.dir={tmp_path / 'empty'}", "tracking=none")
    assert r.returncode == 2 and "checkpoint.resume=must: no checkpoint in" in r.stderr


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(dlpipe, tmp_path):
    """A truncated newest checkpoint: warn naming it, resume from the previous one, never from scratch."""
    run_dir = tmp_path / "run"
    assert dlpipe(*SMOKE, "trainer.epochs=2", f"hydra.run.dir={run_dir}", "tracking=none").returncode == 0
    newest = run_dir / "checkpoints" / "epoch-0002.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    r = dlpipe(*SMOKE, "trainer.epochs=3", f"hydra.run.dir={run_dir}", "tracking=none")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert str(newest) in out and "falling back to" in out and "(epoch 1," in out


def test_shape_mismatch_and_changed_config(dlpipe, tmp_path):
    """A changed model exits 2 naming the parameter; a changed optimizer setting only warns, and other
    loader settings (which loader=auto may decide differently on a busier machine) are only noted."""
    run_dir = tmp_path / "run"
    first = ["trainer.epochs=1", "loader.num_workers=1", f"hydra.run.dir={run_dir}", "tracking=none"]
    assert dlpipe(*SMOKE, *first).returncode == 0
    r = dlpipe(*SMOKE, *first, "trainer.epochs=2", "model.width=16")
    assert r.returncode == 2 and "has shape" in r.stderr and "Traceback" not in r.stderr
    assert (run_dir / "checkpoints").is_dir()  # a failed resume never removes the run it tried to resume
    r = dlpipe(*SMOKE, *first, "trainer.epochs=2", "optim.lr=0.01", "loader.num_workers=0")
    assert r.returncode == 0, r.stderr
    changed, speed = [line.split(" - ")[1] for line in (r.stdout + r.stderr).splitlines() if "resuming with" in line]
    assert changed == "resuming with a changed config: optim.lr"
    assert speed.startswith("resuming with other loader settings (the batches stay the same): loader.num_workers")


def test_other_loader_settings_change_the_samples_of_a_dataset_drawing_from_global_rngs(dlpipe, tmp_path,
                                                                                        mlflow_store, mlflow_client):
    """Its noise is drawn from torch's global RNG by whoever fetches: a resume with another worker count
    changes what the run computes, and the warning and the run's tag say so."""
    from conftest import TESTS_DIR

    args = [a.replace("{tests}", str(TESTS_DIR)) for a in SIGNALLED] + [
        "dataset.at=-1", "+dataset.global_noise=0.3", "trainer.epochs=1", f"hydra.run.dir={tmp_path / 'run'}",
        f"tracking.uri={mlflow_store}", "tracking.experiment=global-rng"]
    assert dlpipe(*args, "loader.num_workers=0").returncode == 0
    r = dlpipe(*args, "trainer.epochs=2", "loader.num_workers=1")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    # With a worker, PyTorch's prefetch_factor 2 applies (the effective settings are compared); how
    # far ahead workers fetch does not say which worker fetches a sample.
    assert "resuming with a changed config: loader.num_workers\n" in out
    assert "resuming with other loader settings (the batches stay the same): loader.prefetch_factor\n" in out
    [run] = runs_of(mlflow_client, "global-rng")
    assert run.data.tags["dlpipe.resumed_changed_params"] == "loader.num_workers"
    assert run.data.tags["dlpipe.resumed_loader_changes"] == "loader.prefetch_factor"


def test_a_resume_tells_changes_to_the_results_from_changes_to_the_loaders_speed():
    """Where checkpoints go and how long to train say nothing; loader speed settings are apart, unless
    the dataset draws from the global RNGs and the setting decides which worker fetches a sample."""
    from dlpipe.training.resume import config_changes

    saved = {"optim.lr": "0.1", "loader.num_workers": "2", "loader.prefetch_factor": "2", "loader.batch_size": "32",
             "checkpoint.keep_last": "3", "trainer.epochs": "2"}
    now = {**saved, "optim.lr": "0.2", "loader.num_workers": "0", "loader.prefetch_factor": "None",
           "checkpoint.keep_last": "5", "trainer.epochs": "4"}
    assert config_changes(saved, now) == (["optim.lr"], ["loader.num_workers", "loader.prefetch_factor"])
    assert config_changes(saved, now, samples_follow_loader=True) == (["loader.num_workers", "optim.lr"],
                                                                      ["loader.prefetch_factor"])
    assert config_changes(saved, {**saved, "loader.batch_size": "64"}) == (["loader.batch_size"], [])


def test_the_resume_hint_is_the_jobs_own_command_in_its_folder(tmp_path):
    """Built from what Hydra recorded, not this process's argv (a launcher's): the config folder, the
    job's overrides with secrets masked and checkpoint.resume replaced by must, its own output folder."""
    from dlpipe.tasks.preflight import JobContext
    from dlpipe.tasks.resume_point import resume_hint

    ctx = JobContext(output_dir=tmp_path / "sweep" / "3", overrides=["loader.num_workers=2", "checkpoint.resume=never",
                                                                       "+dataset.api_key=SECRET", "x=a b"],
                     recipe="smoke", multirun=True, config_dir="/my conf")
    expected = ("resume with: dlpipe --config-dir '/my conf' loader.num_workers=2 '+dataset.api_key=***' 'x=a b' "
                f"checkpoint.resume=must hydra.run.dir={tmp_path}/sweep/3 (secrets are not printed; supply "
                "dataset.api_key's secret in place of ***)")
    assert resume_hint(ctx) == expected
