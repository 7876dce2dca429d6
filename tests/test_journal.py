"""The measurement journal: what train, bench and tune measured of a job, read back by later runs."""

import json
import logging
import multiprocessing
import os

from dlpipe.judging.journal import MeasurementFile, effective

ZERO = {"num_workers": 0, "prefetch_factor": 4, "persistent_workers": True, "pin_memory": False}
TWO = {"num_workers": 2, "prefetch_factor": None, "persistent_workers": True, "pin_memory": False}


def test_lines_are_filed_under_their_effective_settings_and_read_back(tmp_path):
    """Prefetch and persistence mean nothing without workers, and an unset prefetch is PyTorch's 2."""
    journal = MeasurementFile(str(tmp_path / "m.jsonl"), "job-a", "loader")
    journal.append(ZERO, 1000.0, "dlpipe bench")
    journal.append(TWO, 400.0, "dlpipe tune")
    journal.append(TWO, 600.0, "dlpipe tune")
    read = journal.read()
    assert [o.settings for o in read.observations] == [effective(ZERO), effective(TWO), effective(TWO)]
    assert effective(ZERO) == {"num_workers": 0, "prefetch_factor": None, "persistent_workers": False,
                               "pin_memory": False, "fetch": "item", "worker_method": "process"}
    assert effective(TWO)["prefetch_factor"] == 2
    assert read.median(TWO) == 500.0 and read.median(ZERO) == 1000.0
    assert read.best(num_workers=2).samples_per_s == 600.0 and read.best(num_workers=4) is None


def test_only_this_job_in_this_mode_and_model_counts(tmp_path):
    """Another job's lines, another mode's, another step's and broken lines are all left out."""
    path = str(tmp_path / "m.jsonl")
    MeasurementFile(path, "job-b", "loader").append(ZERO, 1.0, "x")
    MeasurementFile(path, "job-a", "epoch", model="m1").append(ZERO, 2.0, "x")
    MeasurementFile(path, "job-a", "epoch", model="m2").append(ZERO, 3.0, "x")
    with open(path, "a") as f:
        f.write('{"job": "job-a", "mode": "epoch", "model": "m1", "settings": {"num_workers": 2\n')  # torn
        f.write("not json\n")
        f.write(json.dumps({"job": "job-a", "mode": "epoch", "model": "m1"}) + "\n")  # no settings
    read = MeasurementFile(path, "job-a", "epoch", model="m1").read()
    assert [o.samples_per_s for o in read.observations] == [2.0]
    # the loader alone does not depend on the model: its lines ignore it
    assert MeasurementFile(path, "job-b", "loader", model="anything").read().observations[0].samples_per_s == 1.0


def test_nothing_is_kept_when_off_or_nothing_was_measured(tmp_path):
    MeasurementFile(None, "job", "loader").append(ZERO, 5.0, "x")
    path = tmp_path / "m.jsonl"
    MeasurementFile(str(path), "job", "loader").append(ZERO, 0.0, "x")
    assert not path.exists() and MeasurementFile(None, "job", "loader").read().observations == ()


def test_an_unwritable_journal_warns_once_and_never_fails_the_job(tmp_path, caplog):
    """A read-only home (a cluster's) leaves the advice to the run's own numbers, with one warning."""
    folder = tmp_path / "ro"
    folder.mkdir()
    journal = MeasurementFile(str(folder / "sub" / "m.jsonl"), "job", "loader")
    os.chmod(folder, 0o500)
    try:
        if os.access(folder, os.W_OK):  # root ignores modes: a file where the folder should be fails for all
            os.chmod(folder, 0o700)
            (folder / "sub").write_text("a file, not a folder")
        with caplog.at_level(logging.WARNING, logger="dlpipe"):
            journal.append(ZERO, 1.0, "x")
            journal.append(ZERO, 2.0, "x")
    finally:
        os.chmod(folder, 0o700)
    warnings = [r.getMessage() for r in caplog.records if "measurements_file" in r.getMessage()]
    assert len(warnings) == 1 and "not written" in warnings[0]
    assert journal.read().observations == ()


def _append_many(path: str, who: int) -> None:
    journal = MeasurementFile(path, "job", "loader")
    for i in range(200):
        journal.append({**ZERO, "num_workers": who}, 1.0 + i, f"process {who}")


def test_concurrent_jobs_append_whole_lines(tmp_path):
    """Sweep jobs of one node write at the same time: every line stays whole."""
    path = str(tmp_path / "m.jsonl")
    processes = [multiprocessing.get_context("spawn").Process(target=_append_many, args=(path, w)) for w in (1, 2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
        assert p.exitcode == 0
    lines = open(path).read().splitlines()
    assert len(lines) == 400 and all(json.loads(line)["job"] == "job" for line in lines)
    read = MeasurementFile(path, "job", "loader").read()
    assert sorted({o.settings["num_workers"] for o in read.observations}) == [1, 2]


def test_the_default_journal_follows_xdg_cache_home(tmp_path, monkeypatch):
    """conf/telemetry/default.yaml puts it under XDG_CACHE_HOME, else ~/.cache."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from dlpipe.config.paths import conf_dir
    from dlpipe.config.resolvers import register_resolvers
    from dlpipe.config.store import register_schemas

    register_resolvers()
    register_schemas()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config")
    where = OmegaConf.select(cfg, "telemetry.measurements_file")
    assert where == str(tmp_path / "xdg" / "dlpipe" / "measurements.jsonl")
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty counts as unset: never the filesystem's root
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert OmegaConf.select(cfg, "telemetry.measurements_file") == str(tmp_path / "home" / ".cache" / "dlpipe" /
                                                              "measurements.jsonl")


def test_lines_that_would_mislead_or_crash_the_reader_are_skipped(tmp_path):
    """Deeply nested JSON (RecursionError), and rates of 0, below 0, NaN and inf: none reaches the advice."""
    path = tmp_path / "m.jsonl"
    journal = MeasurementFile(str(path), "job", "loader")
    journal.append(ZERO, 10.0, "x")
    good = json.loads(path.read_text())
    with open(path, "a") as f:
        f.write("[" * 100_000 + "\n")
        for rate in ("0", "-5", "NaN", "Infinity"):
            f.write(json.dumps(good).replace('"samples_per_s": 10.0', f'"samples_per_s": {rate}') + "\n")
    assert [o.samples_per_s for o in journal.read().observations] == [10.0]


def test_only_the_newest_lines_are_read(tmp_path, monkeypatch):
    """The file is never rotated: a start reads its last READ_BYTES, from the first whole line."""
    from dlpipe.judging import journal as module

    path = tmp_path / "m.jsonl"
    journal = MeasurementFile(str(path), "job", "loader")
    for i in range(50):
        journal.append(ZERO, float(i + 1), "x")
    line = len(path.read_text().splitlines()[0]) + 1
    monkeypatch.setattr(module, "READ_BYTES", 10 * line + line // 2)  # ten whole lines and half of one
    assert [o.samples_per_s for o in journal.read().observations] == [float(i) for i in range(41, 51)]
