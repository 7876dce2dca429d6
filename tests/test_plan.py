"""`dlpipe plan`: the values a run will use, fitted to the data, with their sources; nothing written."""

import yaml


def test_plan_shows_values_sources_and_the_dataloader_and_leaves_nothing(dlpipe, tmp_path):
    r = dlpipe("plan", "+recipe=tabular", "dataset.size=256", "loader.timeout=3", "loader.batch_size=64")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("plan for `dlpipe plan +recipe=tabular dataset.size=256 loader.timeout=3")
    assert "loader.num_workers = 0 (config option loader=in_memory, chosen by recipe tabular)" in out
    assert "loader.batch_size = 64 (user override)" in out
    assert any(x.startswith("trainer.device = ") and "(auto: " in x for x in out)
    [train] = [x for x in out if x.startswith("DataLoader (train, 230 items): ")]
    assert "batch_size=64 num_workers=0 " in train and "timeout=0.0 (asked 3.0)" in train
    assert ("dropped: train, val: loader.timeout=3.0 ignored: it bounds the wait for a worker's batch "
            "(num_workers=0)") in out
    assert any(x.startswith("memory: a training batch about ") for x in out)
    assert list(tmp_path.iterdir()) == []  # no outputs/, no Hydra record, no log, no mlflow.db


def test_plan_shows_what_cfg_job_cannot(dlpipe, tmp_path):
    """--cfg job --resolve prints the composed config; the plan what the DataLoader gets from it."""
    shown = dlpipe("+recipe=smoke", "loader.pin_memory=true", "--cfg", "job", "--resolve")
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["loader"]["pin_memory"] is True
    r = dlpipe("plan", "+recipe=smoke", "loader.pin_memory=true", "trainer.device=cpu")
    assert r.returncode == 0, r.stderr
    assert "loader.pin_memory = True (user override)" in r.stdout.splitlines()
    assert "pin_memory=False (asked True)" in r.stdout
    assert "lint: loader.pin_memory=true without CUDA" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_bad_input_to_plan_is_one_line_and_leaves_nothing(dlpipe, tmp_path):
    for args, expected in [
        (["loader.num_workers=-1"], "dlpipe: error: loader.num_workers=-1: must be >= 0"),
        (["--multirun", "loader.num_workers=0,2"], "dlpipe: error: plan with --multirun: a plan shows one job"),
    ]:
        r = dlpipe("plan", "+recipe=tabular", *args)
        assert r.returncode == 2, r.stderr
        [line] = r.stderr.strip().splitlines()
        assert line.startswith(expected), line
        assert list(tmp_path.iterdir()) == []
