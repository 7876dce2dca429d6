"""Slurm sweeps that never hang, never submit what cannot start, and fail in one line, through the CLI on
the real one-node cluster (tests/slurm_cluster.py) with test_slurm's fixtures.

- a request beyond the partition (the presets' 8 CPUs and 32 GB on this 2-CPU node, an unknown
  partition, a partition's MaxTime and MaxNodes) is refused before anything is made or submitted;
- sbatch's own refusal is one line, and the parent run says no job ran;
- `scancel` of a whole sweep with Slurm's accounting down (`sacct` first on PATH answering as Slurm
  22.05's does with slurmdbd stopped, measured: a stopped slurmdbd would take the session's cluster
  from the other tests) ends the submitter promptly with one line; parent and children end KILLED;
- SIGTERM to the submitter cancels its jobs and says so; the parent ends KILLED, terminated (SIGTERM).
"""

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import test_slurm
from conftest import runs_of
from test_slurm import WAITING, finish
from test_submitit import children_of

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

sweep = test_slurm.sweep  # test_slurm's fixture: `dlpipe --multirun` submitting 1-CPU, 1 GB jobs to the cluster

TABULAR = ["+recipe=tabular", "dataset.size=256", "trainer.epochs=1", "trainer.progress=false"]
# what `sacct` prints with slurmdbd stopped (Slurm 22.05, measured on the test cluster), exit 1
NO_SLURMDBD = """sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection to \
host:127.0.0.1:6819: Connection refused
sacct: error: Sending PersistInit msg: Connection refused
sacct: error: Problem talking to the database: Connection refused
"""


@pytest.fixture(scope="module")
def small_partition(slurm):
    """A partition with a MaxTime of 5 minutes, one node at most, 1 CPU and 1 GB a node, made for this
    module (slurmctld takes it at run time) and removed after."""
    name = f"small{os.getpid()}"
    slurm.run("scontrol", "create", f"PartitionName={name}", f"Nodes={slurm.host}", "MaxTime=5", "MaxNodes=1",
              "MaxCPUsPerNode=1", "MaxMemPerNode=1024", "State=UP")
    yield name
    slurm.run("scontrol", "delete", f"PartitionName={name}", check=False)


@pytest.fixture
def no_accounting(tmp_path, monkeypatch):
    """Slurm's accounting down for the sweep's submitter: a `sacct` answering as without slurmdbd, first
    on PATH. Set up before `sweep` (list it first), which takes the environment when it starts."""
    folder = tmp_path / "no-slurmdbd"
    folder.mkdir()
    (folder / "sacct").write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{NO_SLURMDBD}EOF\nexit 1\n")
    (folder / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")


def queued(slurm) -> list[str]:
    return slurm.run("squeue", "-h", "-t", "all", "-o", "%i").split()


@pytest.mark.parametrize("case", ["presets-defaults", "unknown-partition", "partition-limits"])
def test_a_job_that_could_never_start_is_refused_before_anything_is_made(slurm, sweep, tmp_path, mlflow_store,
                                                                         mlflow_client, small_partition, case):
    given, expected = {
        # slurm.yaml's own cpus_per_task and mem_gb, beyond this 2-CPU node: PENDING for ever before
        "presets-defaults": (["hydra.launcher.cpus_per_task=8", "hydra.launcher.mem_gb=32"],
                             [f"hydra.launcher.cpus_per_task=8: a node of partition debug (the default) gives a job "
                              f"at most {slurm.cpus} CPUs (asked 8); set it to at most {slurm.cpus}",
                              "hydra.launcher.mem_gb=32: a node of partition debug (the default) gives a job at "
                              "most "]),
        "unknown-partition": (["hydra.launcher.partition=nope"],
                              ["hydra.launcher.partition=nope: no such partition on this cluster; it has debug "
                               "(the default), nograce, urgent"]),
        "partition-limits": ([f"hydra.launcher.partition={small_partition}", "hydra.launcher.nodes=2"],
                             [f"hydra.launcher.timeout_min=10: partition {small_partition} allows at most 5 minutes "
                              "(MaxTime); set it to at most 5",
                              f"hydra.launcher.nodes=2: partition {small_partition} gives a job at most 1 node; "
                              "set it to at most 1"]),
    }[case]
    before = queued(slurm)
    code, err = finish(sweep(*TABULAR, *given, f"tracking.uri={mlflow_store}",
                             f"tracking.experiment=slurm-refused-{case}"), timeout=120)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == len(expected), err
    assert all(line.startswith(f"dlpipe: error: {e}") for line, e in zip(lines, expected, strict=True)), err
    # nothing made: no sweep folder (nor anything else here), no parent run, no job submitted
    assert list(tmp_path.iterdir()) == []
    assert runs_of(mlflow_client, f"slurm-refused-{case}") == []
    assert queued(slurm) == before


def test_sbatchs_refusal_is_one_line_and_the_parent_says_no_job_ran(slurm, sweep, mlflow_store, mlflow_client):
    code, err = finish(sweep(*TABULAR, "hydra.launcher.constraint=nope", f"tracking.uri={mlflow_store}",
                             "tracking.experiment=slurm-sbatch-refused"), timeout=120)
    line = ("no job ran: sbatch refused the sweep's 1 job (sbatch: error: Batch job submission failed: "
            "Invalid feature specification)")
    assert (code, err) == (1, f"dlpipe: error: {line}\n")
    [parent] = runs_of(mlflow_client, "slurm-sbatch-refused")
    assert (parent.info.status, parent.data.tags["dlpipe.end_reason"]) == ("FAILED", line)


def waiting_jobs(tmp_path: Path, proc, markers: list[Path], timeout: float = 180) -> str:
    """The sweep's Slurm job id (an array's, for several jobs), once each of its jobs waits for the test's
    signal (its marker)."""
    deadline = time.monotonic() + timeout
    while not all(m.exists() for m in markers):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)[1][-3000:]
        time.sleep(0.2)
    [array] = [p.name for p in (tmp_path / "sweep" / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name)]
    return array


def ended(mlflow_client, exp: str, timeout: float = 60):
    """The sweep's parent and children once none is RUNNING (a cancelled job ends its own run)."""
    deadline = time.monotonic() + timeout
    while True:
        parent, children = children_of(runs_of(mlflow_client, exp))
        if all(r.info.status != "RUNNING" for r in [parent, *children]) or time.monotonic() > deadline:
            return parent, children
        time.sleep(0.5)


def test_scancel_of_a_whole_sweep_without_accounting_ends_it_in_one_line(slurm, no_accounting, sweep, tmp_path,
                                                                         mlflow_store, mlflow_client):
    """submitit alone never sees these jobs end (sacct fails, the jobs stay UNKNOWN: a wait for ever);
    slurmctld's record does."""
    markers = [tmp_path / "waiting0", tmp_path / "waiting1"]
    proc = sweep(*WAITING, "dataset.at=150", f"dataset.marker={markers[0]},{markers[1]}",
                 f"tracking.uri={mlflow_store}", "tracking.experiment=slurm-sweep-cancelled")
    array = waiting_jobs(tmp_path, proc, markers)
    slurm.run("scancel", array)
    cancelled = time.monotonic()
    code, err = finish(proc, timeout=120)
    assert time.monotonic() - cancelled < 60  # promptly: within the result grace and a few polls
    line = (f"jobs #0, #1 (Slurm {array}_0, {array}_1) cancelled: scancel; their logs: "
            f"{tmp_path / 'sweep' / '.submitit'}/*/; Slurm accounting did not answer (sacct exited 1: sacct: error: "
            "Problem talking to the database: Connection refused): submitit needs it (slurmdbd) to see how jobs end")
    assert (code, err) == (1, f"dlpipe: error: {line}\n")
    parent, children = ended(mlflow_client, "slurm-sweep-cancelled")
    assert (parent.info.status, parent.data.tags["dlpipe.end_reason"]) == ("KILLED", line)
    assert [(c.info.status, c.data.tags["dlpipe.end_reason"]) for c in children] == [
        ("KILLED", "terminated (SIGTERM)")] * 2


@pytest.fixture
def signal_while_cancelling(tmp_path, monkeypatch):
    """A second SIGTERM to the submitter while it cancels its jobs: a `scancel` first on PATH that sends
    one to the process that started it (once, and only to a dlpipe), then runs Slurm's. Set up before
    `sweep`, which takes the environment when it starts."""
    folder, once = tmp_path / "signals-submitter", tmp_path / "signalled-submitter"
    folder.mkdir()
    real = shutil.which("scancel") or "/usr/bin/scancel"
    # only a dlpipe parent (the submitter), never pytest: a teardown's scancel after a failure must not
    (folder / "scancel").write_text(
        f"#!/bin/sh\nif [ ! -e {once} ] && tr '\\0' ' ' < /proc/$PPID/cmdline | grep -q -- '-m dlpipe'; then\n"
        f"  touch {once}; kill -TERM $PPID\nfi\nexec {real} \"$@\"\n")
    (folder / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return once


@pytest.mark.parametrize("again", [False, True], ids=["once", "again-while-cancelling"])
def test_sigterm_to_the_submitter_cancels_its_jobs_and_ends_the_parent_killed(request, again, slurm, tmp_path,
                                                                             mlflow_store, mlflow_client):
    signalled_again = request.getfixturevalue("signal_while_cancelling") if again else None
    sweep = request.getfixturevalue("sweep")  # after the fake scancel: the submitter's PATH is taken here
    marker = tmp_path / "waiting"
    proc = sweep(*WAITING, "dataset.at=150", f"dataset.marker={marker}", f"tracking.uri={mlflow_store}",
                 f"tracking.experiment=slurm-submitter-terminated-{request.node.callspec.id}")
    job = waiting_jobs(tmp_path, proc, [marker])  # a one-job sweep is one Slurm job, no array
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, timeout=60)
    assert signalled_again is None or signalled_again.exists()  # the second SIGTERM was sent, mid-cancel
    line = (f"terminated (SIGTERM): cancelled the sweep's 1 unfinished Slurm job ({job}): each checkpoints and "
            "ends its run KILLED; run the same command with hydra.sweep.dir=sweep to resume them; "
            "logs: sweep/.submitit")
    assert (code, err) == (143, f"dlpipe: error: {line}\n")
    slurm.wait("the job cancelled", lambda: slurm.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").strip()
               == "CANCELLED", timeout=60)
    parent, [child] = ended(mlflow_client, f"slurm-submitter-terminated-{request.node.callspec.id}")
    assert (parent.info.status, parent.data.tags["dlpipe.end_reason"]) == ("KILLED", line)
    assert (child.info.status, child.data.tags["dlpipe.end_reason"]) == ("KILLED", "terminated (SIGTERM)")
    assert (tmp_path / "sweep" / "0" / "checkpoints" / "epoch-0002.pt").is_file()  # what resumes it


def test_a_job_waiting_in_a_down_partition_is_said_to_wait_and_cancelled_at_a_stop(slurm, sweep, tmp_path):
    """A DOWN partition takes the job and keeps it PENDING (Slurm 22.05, measured): the submitter says so
    at once, with squeue's reason, instead of waiting without a word; SIGTERM still cancels it."""
    import threading

    name = f"down{os.getpid()}"
    slurm.run("scontrol", "create", f"PartitionName={name}", f"Nodes={slurm.host}", "State=DOWN")
    try:
        proc = sweep(*TABULAR, f"hydra.launcher.partition={name}")
        said: list[str] = []  # the submitter's log, on stdout (Hydra's console handler)
        reader = threading.Thread(target=lambda: said.extend(proc.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 90
        while not any("PartitionDown" in line for line in said):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(said)[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code, err = proc.wait(timeout=60), proc.stderr.read()
        reader.join(timeout=10)
    finally:
        slurm.run("scancel", "--partition", name, check=False)
        slurm.run("scontrol", "delete", f"PartitionName={name}", check=False)
    [job] = [p.name for p in (tmp_path / "sweep" / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name)]
    [waiting] = [line for line in said if "waiting in the queue" in line]
    assert re.search(rf"job #0 \(Slurm {job}\) is waiting in the queue \(\d+ s so far\): PartitionDown "
                     r"\(squeue's reason\)$", waiting.rstrip()), waiting
    assert code == 143 and err.startswith(
        f"dlpipe: error: terminated (SIGTERM): cancelled the sweep's 1 unfinished Slurm job ({job})"), err
