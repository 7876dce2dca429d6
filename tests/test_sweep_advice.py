"""A sweep's jobs checked against each other's advice (sweeps/advice.py), on Run-like objects."""

from types import SimpleNamespace

from dlpipe.sweeps.advice import withdrawn_advice


def job(run_id, overrides, samples_per_s, advice=None, status="FINISHED", params=None):
    """A child run as MLflow returns it: its metrics under MLflow's names."""
    tags = {"dlpipe.overrides": f"+recipe=smoke {overrides}"}
    if advice:
        tags["dlpipe.advice"] = advice
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id, status=status),
                           data=SimpleNamespace(tags=tags, metrics={"perf/samples_per_s": samples_per_s},
                                                params=params or {}))


def names(runs):
    return {r.info.run_id: r.data.tags["dlpipe.overrides"].split(" ", 1)[1] for r in runs}


def test_advice_a_later_job_measured_slower_is_withdrawn():
    """The issue's smoke sweep: the 0-worker job advised 2 workers, which the next job ran at 1075
    against its 1793 samples/s."""
    runs = [job("a", "loader.num_workers=0", 1793.0, advice="loader.num_workers=2",
                params={"loader.num_workers": "0"}),
            job("b", "loader.num_workers=2", 1075.0, params={"loader.num_workers": "2"})]
    why = withdrawn_advice(runs, names(runs))
    assert list(why) == ["a"]
    assert why["a"].startswith("loader.num_workers=2 withdrawn: job 'loader.num_workers=2' of this sweep ran it")
    assert "1075.0 samples/s against this job's 1793.0" in why["a"]


def test_advice_a_job_measured_faster_stands():
    runs = [job("a", "loader.num_workers=0", 1000.0, advice="loader.num_workers=2"),
            job("b", "loader.num_workers=2", 1500.0)]
    assert withdrawn_advice(runs, names(runs)) == {}


def test_only_the_job_that_ran_exactly_the_advised_change_counts():
    """A job that also changed prefetch, one that failed, and one whose effective value differs from its
    override (pinning requested, not possible without CUDA) do not speak to the advice."""
    runs = [job("a", "loader.num_workers=0 loader.prefetch_factor=2", 1000.0, advice="loader.num_workers=2"),
            job("b", "loader.num_workers=2 loader.prefetch_factor=4", 10.0),
            job("c", "loader.num_workers=2 loader.prefetch_factor=2", 10.0, status="FAILED"),
            job("d", "loader.pin_memory=false", 1000.0, advice="loader.pin_memory=true"),
            job("e", "loader.pin_memory=true", 10.0, params={"loader.pin_memory": "False"})]
    assert withdrawn_advice(runs, names(runs)) == {}
    runs.append(job("f", "loader.num_workers=2 loader.prefetch_factor=2", 1029.0))  # within MIN_GAIN: no faster
    assert list(withdrawn_advice(runs, names(runs))) == ["a"]


def test_sweep_end_tags_and_prints_withdrawn_advice_on_a_real_store(tmp_path, capsys):
    """The Hydra callback's end of a sweep on a SQLite store: the advising job gets the check tag, the
    sweep prints it, the job whose advice stands gets none, and the parent still ends FINISHED."""
    import time

    from mlflow import MlflowClient

    from dlpipe.sweeps.callback import SweepTracking
    from dlpipe.tracking.run import PARENT_TAG

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("advice")
    parent = client.create_run(exp, run_name="sweep", tags={"dlpipe.role": "sweep"}).info.run_id
    start = int(time.time() * 1000)
    ids = []
    for i, (override, rate, advice) in enumerate([("loader.num_workers=0", 1793.0, "loader.num_workers=2"),
                                                  ("loader.num_workers=2", 1075.0, "loader.num_workers=0")]):
        tags = {PARENT_TAG: parent, "dlpipe.overrides": f"+recipe=smoke {override}", "dlpipe.advice": advice}
        run = client.create_run(exp, start_time=start + i, run_name=f"job {i}", tags=tags).info.run_id
        client.log_metric(run, "perf/samples_per_s", rate)  # as MlflowRun names it
        client.log_param(run, "loader.num_workers", override.rpartition("=")[2])
        client.set_terminated(run, "FINISHED")
        ids.append(run)
    callback = SweepTracking()
    callback.client, callback.parent_id = client, parent
    callback._finish(ended_cleanly=True)
    assert client.get_run(parent).info.status == "FINISHED"
    first, second = (client.get_run(i).data.tags for i in ids)
    assert first["dlpipe.advice_check"].startswith("loader.num_workers=2 withdrawn: job 'loader.num_workers=2'")
    assert "dlpipe.advice_check" not in second  # its advice (0 workers) ran faster: it stands
    assert "advice of job #0 loader.num_workers=0: loader.num_workers=2 withdrawn" in capsys.readouterr().out
