"""Removing a half-made run directory never touches anything that was not made by this job."""

import os

from dlpipe.cli import remove_if_half_made


def hydra_record(d):
    (d / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (d / ".hydra" / name).write_text("x")


def test_removes_only_what_hydra_wrote(tmp_path, monkeypatch):
    """outputs/DATE/TIME with Hydra's record and the job log goes, with its empty parents."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "2026-12-02" / "18-00-00"
    hydra_record(run)
    (run / "dlpipe.log").write_text("error")
    remove_if_half_made(run, "dlpipe")
    assert not (tmp_path / "outputs").exists()


def test_keeps_user_files_and_resumed_runs(tmp_path, monkeypatch):
    """A user's own log, a checkpoint folder, the working directory itself: never removed."""
    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "logs"
    hydra_record(logs)
    (logs / "notes.log").write_text("mine")
    remove_if_half_made(logs, "dlpipe")
    assert (logs / "notes.log").exists()

    resumed = tmp_path / "run"
    hydra_record(resumed)
    (resumed / "checkpoints").mkdir()
    remove_if_half_made(resumed, "dlpipe")
    assert (resumed / "checkpoints").is_dir()

    hydra_record(tmp_path / "here")
    os.chdir(tmp_path / "here")
    remove_if_half_made(tmp_path / "here", "dlpipe")  # hydra.run.dir=. : the working directory
    assert (tmp_path / "here" / ".hydra").is_dir()
    remove_if_half_made(tmp_path, "dlpipe")  # an ancestor of it
    assert tmp_path.is_dir()
