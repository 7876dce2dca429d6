"""Checkpoints and resume through the real CLI: exact continuation, reattached MLflow run, faults."""

import torch
from conftest import runs_of

SMOKE = ["+recipe=smoke", "trainer.progress=false", "trainer.deterministic=true"]


def final_state(run_dir):
    """(model weights, per-epoch train losses) from the newest checkpoint of a run directory."""
    ckpts = sorted((run_dir / "checkpoints").glob("epoch-*.pt"))
    state = torch.load(ckpts[-1], weights_only=True)
    return state["model"], [row["train_loss"] for row in state["history"]], state


def test_interrupted_run_plus_resume_equals_straight_run(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """3 epochs straight == 1 epoch, stop, resume to 3 (weights and loss history), in the same MLflow run."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    r = dlpipe(*SMOKE, "trainer.epochs=3", f"hydra.run.dir={straight}", "tracking=none")
    assert r.returncode == 0, r.stderr
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
    steps = sorted(m.step for m in mlflow_client.get_metric_history(run.info.run_id, "train_loss"))
    assert steps == [1, 2, 3]
    assert "epoch 1" in run.data.tags["dlpipe.resumed_from"]


def test_retention_and_best_checkpoint(dlpipe, tmp_path):
    """keep_last epoch checkpoints are kept, plus best.pt; no temp files are left."""
    run_dir = tmp_path / "run"
    r = dlpipe(*SMOKE, "trainer.epochs=3", "checkpoint.keep_last=1", f"hydra.run.dir={run_dir}", "tracking=none")
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("epoch-")] == ["epoch-0003.pt"]
    assert "best.pt" in names and not [n for n in names if n.endswith(".tmp")]


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
    """A changed model exits 2 naming the parameter; a changed optimizer setting only warns."""
    run_dir = tmp_path / "run"
    assert dlpipe(*SMOKE, "trainer.epochs=1", f"hydra.run.dir={run_dir}", "tracking=none").returncode == 0
    r = dlpipe(*SMOKE, "trainer.epochs=2", "model.width=16", f"hydra.run.dir={run_dir}", "tracking=none")
    assert r.returncode == 2 and "has shape" in r.stderr and "Traceback" not in r.stderr
    assert (run_dir / "checkpoints").is_dir()  # a failed resume never removes the run it tried to resume
    r = dlpipe(*SMOKE, "trainer.epochs=2", "optim.lr=0.01", f"hydra.run.dir={run_dir}", "tracking=none")
    assert r.returncode == 0, r.stderr
    assert "resuming with a changed config: optim.lr" in r.stdout + r.stderr
