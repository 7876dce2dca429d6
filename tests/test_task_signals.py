"""tune, eval, bench (and train while it is built) under real stop signals and full disks: every run
ends KILLED or FAILED with its reason, one line is printed, a half-made output folder goes, and
what `dlpipe tune` found is never lost; and two writers of one tuned config, as real processes."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import NO_PHONE_HOME, TESTS_DIR, runs_of
from faulty_data import SignalsItself
from test_disk_faults import fill, tmpfs  # noqa: F401 (a fixture)
from test_tracking_faults import _dead, server  # noqa: F401 (a fixture)
from test_tracking_outage import wait_for

from dlpipe.stop import Terminated, Unbroken, hold_or_raise, restore_handlers, stop_at_once
from dlpipe.tasks.tune import write_whole

CLUSTERS = ["--config-dir", str(TESTS_DIR / "conf"), "dataset=signals_itself", "model=mlp", "model.in_features=4",
            "loader=in_memory", "trainer.progress=false"]
# Items that take 10 ms each: a trial lasts seconds, the whole search many of them.
SLOW = ["--config-dir", str(TESTS_DIR / "conf"), "model=mlp", "model.in_features=4", "dataset=slow",
        "dataset.size=2048", "dataset.delay_s=0.01", "loader.batch_size=16", "trainer.progress=false",
        "trainer.device=cpu", "bench.batches=30", "bench.warmup_batches=2", "bench.repeats=1"]


class StopsItself(SignalsItself):
    """SignalsItself with the signal a parameter: `signal_name` to its own process at the `at`-th item."""

    def __init__(self, marker: str, at: int, signal_name: str = "SIGTERM", **kwargs):
        super().__init__(marker, at, **kwargs)
        self.signal_name = signal_name

    def __getitem__(self, i):
        self.fetched += 1
        if self.fetched == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.Signals[self.signal_name])
        return self.x[i].clone(), int(self.y[i])


class FillsDisk(SignalsItself):
    """SignalsItself (never signalling) that fills the disk holding `fill` as it is built: after the
    pre-flight checks found the folder writable, before anything is written there."""

    def __init__(self, fill: str, **kwargs):
        fill_disk(Path(fill))
        super().__init__(**kwargs)


fill_disk = fill  # the name `fill` is FillsDisk's parameter


def dlpipe_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dlpipe:")]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A checkpoint of the clusters' model, for eval to score."""
    root = tmp_path_factory.mktemp("weights")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_"))}
    r = subprocess.run([sys.executable, "-m", "dlpipe", *CLUSTERS, "trainer.epochs=1", "tracking=none",
                        f"hydra.run.dir={root}"], cwd=root, env={**env, **NO_PHONE_HOME, "PYTHONPATH": str(TESTS_DIR)},
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return root / "checkpoints" / "best.pt"


# -- item 5: a signal before the task's run opens ---------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("task, sig", [("tune", "SIGTERM"), ("eval", "SIGTERM"), ("bench", "SIGTERM"),
                                       ("train", "SIGTERM"), ("tune", "SIGINT"), ("eval", "SIGINT")])
def test_a_signal_while_the_job_is_built_ends_it_in_one_line_and_leaves_nothing(
        dlpipe, tmp_path, weights, mlflow_store, mlflow_client, task, sig):
    """The signal comes at the first item the job fetches, before any run opens: exit 143 (130 for
    Ctrl-C), one line, no run in the store, and Hydra's half-made outputs/ folder gone."""
    exp = f"signal-while-built-{task}-{sig}"
    args = [task] if task != "train" else []
    r = dlpipe(*args, *CLUSTERS, f"dataset._target_={__name__}.StopsItself", f"+dataset.signal_name={sig}",
               "dataset.at=1", f"dataset.marker={tmp_path / 'signalled'}", f"checkpoint.init_from={weights}",
               f"bench.output_dir={tmp_path / 'tuned'}", f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}")
    assert (tmp_path / "signalled").exists()  # the signal was sent, by the job to itself
    expected = "dlpipe: interrupted (Ctrl-C)" if sig == "SIGINT" else f"dlpipe: terminated ({sig})"
    assert (r.returncode, dlpipe_lines(r.stderr)) == (130 if sig == "SIGINT" else 143, [expected]), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert runs_of(mlflow_client, exp) == []
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "tuned").exists()


# -- item 5: SIGTERM to a tune in the middle of its search --------------------------------------------


def start_task(tmp_path: Path, uri: str, exp: str, task: str, *overrides: str) -> subprocess.Popen:
    """`dlpipe TASK ...OVERRIDES` over the slow items in a process group of its own (the signal goes to all of
    it, DataLoader workers included, as scancel, a terminal's Ctrl-C or `kill -TERM -PGID` sends it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_"))}
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR))
    return subprocess.Popen(
        [sys.executable, "-m", "dlpipe", task, *SLOW, *overrides, f"hydra.run.dir={tmp_path / 'run'}",
         f"tracking.uri={uri}", f"tracking.experiment={exp}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        start_new_session=True)


def signal_group_once(proc: subprocess.Popen, ready, what: str, sig) -> tuple[str, str, list]:
    """Once `ready()`, send `sig` to the job's whole group: (stdout, stderr, the group's processes then)."""
    try:
        wait_for(lambda: ready() or proc.poll() is not None, proc, what, timeout_s=300)
        assert proc.poll() is None, proc.communicate()
        main = psutil.Process(proc.pid)
        group = [main, *main.children(recursive=True)]  # DataLoader workers among them
        os.killpg(proc.pid, sig)
        return *proc.communicate(timeout=120), group
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.integration
@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_sigterm_mid_search_ends_every_run_killed_prints_the_trials_and_writes_nothing(
        request, tmp_path, mlflow_store, store):
    from mlflow import MlflowClient

    uri = mlflow_store if store == "sqlite" else request.getfixturevalue("server")[0]
    client, exp = MlflowClient(uri), f"tune-sigterm-{store}"
    proc = start_task(tmp_path, uri, exp, "tune", f"bench.output_dir={tmp_path / 'tuned'}")
    # once a trial has been measured and recorded, the search is on its next candidate
    out, err, group = signal_group_once(proc, lambda: any(r.info.status == "FINISHED" for r in runs_of(client, exp)),
                                        "the first trial's run", signal.SIGTERM)
    assert (proc.returncode, dlpipe_lines(err)) == (143, ["dlpipe: terminated (SIGTERM)"]), err
    assert "Traceback" not in err + out and "killed by signal" not in err
    runs = runs_of(client, exp)
    [parent] = [r for r in runs if r.data.tags.get("dlpipe.task") == "tune"]
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert (parent.info.status, parent.data.tags["dlpipe.end_reason"]) == ("KILLED", "terminated (SIGTERM)")
    assert trials and len(trials) == len(runs) - 1  # every run is the parent's or a trial
    for trial in trials:  # measured before the signal, or ended by it
        assert trial.info.status == "FINISHED" or (
            trial.info.status == "KILLED" and trial.data.tags["dlpipe.end_reason"] == "terminated (SIGTERM)")
    assert "dlpipe.tuned" not in parent.data.tags
    assert "tune/tuned.yaml" not in [a.path for a in client.list_artifacts(parent.info.run_id, "tune")]
    # what was measured is printed, and that the search stopped with nothing written
    table = [line for line in out.splitlines() if line.startswith("| num_workers=")]
    assert {t.info.run_name for t in trials} <= {line.split(" | ")[0].removeprefix("| ") for line in table}
    n = len(table)
    stopped = f"tune: search stopped (SIGTERM) with {n} candidate{'' if n == 1 else 's'} measured; no config written"
    assert [line for line in out.splitlines() if line.startswith("tune: ")] == [stopped]
    assert not (tmp_path / "tuned").exists()
    kept = {p.name for p in (tmp_path / "run").iterdir()}  # the run's folder, named by its tags: kept
    assert {".hydra", "dlpipe.log", "mlflow_run.json"} <= kept and not kept & {"tuned.yaml", "tune_trials.md"}
    assert not [p for p in kept if p.endswith(".tmp")]
    assert parent.info.run_id in (tmp_path / "run" / "mlflow_run.json").read_text()
    wait_for(lambda: all(map(_dead, group)), None, "the job's processes to end")


# -- item 6: the disk under bench.output_dir is full when tune writes its config ----------------------


@pytest.mark.integration
def test_a_full_disk_at_the_end_of_a_tune_loses_nothing(dlpipe, tmp_path, tmpfs, mlflow_store, mlflow_client):  # noqa: F811
    """The pre-flight finds bench.output_dir writable; the disk is full when the search ends: one line
    naming the file and why, no temp file, the config printed and kept in the run, the run FAILED
    naming the file, the copy in the job's folder written."""
    folder = tmpfs("16k")
    r = dlpipe("tune", *CLUSTERS, f"dataset._target_={__name__}.FillsDisk", f"+dataset.fill={folder}",
               "bench.batches=4", "bench.warmup_batches=1", "bench.repeats=1", f"bench.output_dir={folder}",
               f"hydra.run.dir={tmp_path / 'run'}", f"tracking.uri={mlflow_store}", "tracking.experiment=tune-full")
    target, copy = folder / "loader" / "tuned.yaml", tmp_path / "run" / "tuned.yaml"
    [parent] = [x for x in runs_of(mlflow_client, "tune-full") if x.data.tags.get("dlpipe.task") == "tune"]
    line = (f"bench.output_dir={folder}: cannot write {target} (No space left on device: 0 B free of 16.0 KiB); "
            f"free space there or choose another folder; the tuned config is printed above, in MLflow run "
            f"{parent.info.run_id} as tune/tuned.yaml, in {copy}")
    assert (r.returncode, dlpipe_lines(r.stderr)) == (2, [f"dlpipe: error: {line}"]), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == ["filler.bin", "loader"]  # no temp file
    kept = mlflow_client.download_artifacts(parent.info.run_id, "tune/tuned.yaml", str(tmp_path))
    text = Path(kept).read_text()
    assert text in r.stdout and copy.read_text() == text  # printed, in the run, in the job's folder
    assert yaml.safe_load(text)["num_workers"] >= 0 and text.startswith(f"# dlpipe --config-dir {folder} loader=tuned")
    assert (parent.info.status, parent.data.tags["dlpipe.end_reason"]) == ("FAILED", f"DlpipeError: {line}")
    assert parent.data.tags["dlpipe.tuned"] in r.stdout


# -- item 10: two writers of one tuned config ----------------------------------------------------------


def write_many(path: str, writer: int, times: int, go) -> None:
    """A writer process: `times` whole configs into `path`, each saying who wrote it and how long it is."""
    go.wait()
    for n in range(times):
        body = yaml.safe_dump({"writer": writer, "n": n, "padding": "x" * (4096 * (1 + n % 3))})
        write_whole(Path(path), f"# Written by `dlpipe tune` writer {writer}, {len(body)} bytes\n{body}")


def whole(text: str) -> dict:
    head, _, body = text.partition("\n")
    values = yaml.safe_load(body)
    assert head.endswith(f", {len(body)} bytes") and set(values) == {"writer", "n", "padding"}, text[:200]
    return values


def test_two_writers_of_one_config_leave_it_whole_and_the_last_one_wins(tmp_path):
    """Two processes writing one file 200 times each while it is read: every read is one writer's
    whole file, no write fails, no temp file is left, and the file ends as a last write."""
    path, times = tmp_path / "loader" / "tuned.yaml", 200
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    writers = [context.Process(target=write_many, args=(str(path), w, times, go)) for w in (0, 1)]
    for w in writers:
        w.start()
    try:
        go.set()
        reads = 0
        while any(w.is_alive() for w in writers):
            if path.exists():
                whole(path.read_text())
                reads += 1
    finally:
        for w in writers:
            w.join(timeout=120)
    assert [w.exitcode for w in writers] == [0, 0]  # no writer failed (a shared temp name made them)
    assert reads > 0
    assert whole(path.read_text())["n"] == times - 1
    assert [p.name for p in path.parent.iterdir()] == ["tuned.yaml"]


def test_a_tuned_config_replaced_is_named_with_what_it_measured(tmp_path, caplog):
    path = tmp_path / "tuned.yaml"
    first = ("# dlpipe --config-dir x loader=tuned\n"
             "# Written by `dlpipe tune` on 2026-12-06 07:25 UTC for SlowDataset.\n# Host: CPU budget 2.\n"
             "# 5 candidates measured in 16 s: 412.4 samples/s against 193.1 for the automatic "
             "config (2.14x). Tune again on another machine.\nnum_workers: 4\n")
    with caplog.at_level("WARNING", logger="dlpipe"):
        write_whole(path, first)
        assert caplog.messages == []
        write_whole(path, "num_workers: 2\n")
        write_whole(path, "num_workers: 0\n")
    assert caplog.messages == [
        f"tune: replaced {path} (Written by `dlpipe tune` on 2026-12-06 07:25 UTC for SlowDataset. 5 candidates "
        "measured in 16 s: 412.4 samples/s against 193.1 for the automatic config (2.14x).)",
        f"tune: replaced {path} (not written by dlpipe tune)"]
    assert path.read_text() == "num_workers: 0\n" and oct(path.stat().st_mode & 0o777) == "0o644"


@pytest.mark.integration
def test_ctrl_c_to_a_bench_mid_measurement_ends_its_run_killed(tmp_path, mlflow_store, mlflow_client):
    """A terminal's Ctrl-C reaches the whole group, workers included, while bench measures."""
    proc = start_task(tmp_path, mlflow_store, "bench-ctrl-c", "bench", "bench.batches=2000", "loader.num_workers=2")
    # its run is open once the measurement has begun (bench opens it right before)
    out, err, _ = signal_group_once(proc, lambda: runs_of(mlflow_client, "bench-ctrl-c"), "the bench run",
                                    signal.SIGINT)
    assert (proc.returncode, dlpipe_lines(err)) == (130, ["dlpipe: interrupted (Ctrl-C)"]), err
    assert "Traceback" not in err + out and not [line for line in out.splitlines() if line.startswith("bench: ")]
    [run] = runs_of(mlflow_client, "bench-ctrl-c")
    assert (run.info.status, run.data.tags["dlpipe.end_reason"]) == ("KILLED", "interrupted (Ctrl-C)")


# -- stop.stop_at_once in this process, with real signals --------------------------------------------


class Recorded:
    """A context manager that records how it was entered, called and left (a tracking run's stand-in)."""

    def __init__(self, log: list, signal_in: str | None = None):
        self.log, self.signal_in = log, signal_in
        if signal_in == "make":
            os.kill(os.getpid(), signal.SIGTERM)
        self.log.append("made")

    def __enter__(self):
        return self

    def write(self, value):
        if self.signal_in in ("write", "failing write"):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.signal_in == "failing write":
            raise ValueError("the store refused it")
        self.log.append(f"wrote {value}")
        return value

    def __exit__(self, exc_type, exc, tb):
        self.log.append(f"ended {exc_type.__name__ if exc_type else 'cleanly'}")
        return False


@pytest.fixture
def at_once():
    stop = stop_at_once()
    yield stop
    restore_handlers(stop)


@pytest.mark.parametrize("where, expected", [("make", ["made", "ended Terminated"]),
                                             ("write", ["made", "wrote 1", "ended Terminated"])])
def test_a_signal_inside_a_tracking_call_is_raised_once_the_call_is_done(at_once, where, expected):
    log = []
    with pytest.raises(Terminated, match="SIGTERM"):
        with Unbroken(lambda: Recorded(log, where)) as run:
            run.write(1)
            log.append("went on")  # never: the signal is raised as the write returns
    assert log == expected


def test_a_stop_held_during_a_call_that_fails_still_stops_the_job(at_once):
    log = []
    with pytest.raises(Terminated, match="SIGTERM") as stopped:
        with Unbroken(lambda: Recorded(log, "failing write")) as run:
            run.write(1)
    assert isinstance(stopped.value.__cause__, ValueError)
    assert log == ["made", "ended Terminated"]


def test_a_stop_handler_of_the_sweeps_holds_the_signal_inside_a_tracking_call():
    """A sweep installs its own handler first (so stop_at_once leaves SIGTERM to it): it holds the
    stop inside a tracking call through stop.hold_or_raise, like stop_at_once's own."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: hold_or_raise("SIGTERM"))
    stop = stop_at_once()
    log = []
    try:
        with pytest.raises(Terminated, match="SIGTERM"):
            with Unbroken(lambda: Recorded(log, "write")) as run:
                run.write(1)
                log.append("went on")
    finally:
        restore_handlers(stop)
        signal.signal(signal.SIGTERM, previous)
    assert log == ["made", "wrote 1", "ended Terminated"]


class SignalsWhenCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler's exception is ignored here by Python


def test_a_stop_swallowed_where_python_ignores_exceptions_is_raised_again(at_once, capfd):
    SignalsWhenCollected()  # collected at once: its __del__ swallows the Terminated raised in it
    assert at_once.signal == "SIGTERM"
    deadline = time.monotonic() + 60
    with pytest.raises(Terminated, match="SIGTERM"):
        while time.monotonic() < deadline:
            time.sleep(0.05)
    restore_handlers(at_once)  # here, not in a teardown that may lag past the next redelivery
    assert capfd.readouterr().err == ""  # no "Exception ignored" traceback for it
