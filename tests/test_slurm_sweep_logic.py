"""The deciding parts of dlpipe's Slurm sweeps on controlled slurmctld text, without a cluster: what a
partition allows (scontrol's records as Slurm 22.05 prints them), which requests it refuses and how the
line reads, how squeue's and sacct's answers are read, and when a watched job counts as ended without
a result. tests/test_slurm_sweeps.py runs the same through the CLI on a real cluster."""

import subprocess
import sys
from pathlib import Path

import pytest

from dlpipe.machine.slurm_partition import minutes, parse
from dlpipe.machine.slurm_queue import Listed, accounting_state, parse_squeue, queue_states
from dlpipe.sweeps.slurm_check import problems
from dlpipe.sweeps.slurm_watch import PENDING_SAY_S, RESULT_GRACE_S, Watched, lost_line, update, waiting_line, watch

# as `scontrol show partition -o` and `scontrol show node -o` printed them on the test cluster (trimmed)
PARTITIONS = """\
PartitionName=debug AllowGroups=ALL Default=YES GraceTime=20 MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 \
MaxCPUsPerNode=UNLIMITED Nodes=vm State=UP TotalCPUs=2 TotalNodes=1 DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED
PartitionName=small AllowGroups=ALL Default=NO MaxNodes=1 MaxTime=00:05:00 MinNodes=1 MaxCPUsPerNode=1 Nodes=vm \
State=UP TotalCPUs=2 TotalNodes=1 DefMemPerNode=UNLIMITED MaxMemPerNode=1024
PartitionName=wide Default=NO MaxNodes=UNLIMITED MaxTime=1-12:00:00 MaxCPUsPerNode=UNLIMITED Nodes=n[01-02] \
TotalNodes=2 MaxMemPerNode=UNLIMITED
"""
NODES = """\
NodeName=vm Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=2.48 RealMemory=19284 AllocMem=0 \
State=IDLE Partitions=debug,small
NodeName=n01 CPUTot=64 RealMemory=256000 State=IDLE Partitions=wide
NodeName=n02 CPUTot=32 RealMemory=512000 State=IDLE Partitions=wide
"""
FITS = {"partition": None, "cpus_per_task": 1, "tasks_per_node": 1, "mem_gb": 1, "timeout_min": 5, "nodes": 1}


@pytest.fixture
def partitions():
    return parse(PARTITIONS, NODES)


@pytest.mark.parametrize("text, expected", [("UNLIMITED", None), ("INFINITE", None), ("30", 30), ("05:30", 5.5),
                                            ("00:05:00", 5), ("1-12:00:00", 2160), ("2-06", 3240),
                                            ("1-00:30", 1470)])
def test_slurm_time_limits_read_as_minutes(text, expected):
    assert minutes(text) == expected


def test_partitions_read_with_their_nodes_and_limits(partitions):
    debug, small, wide = partitions["debug"], partitions["small"], partitions["wide"]
    assert debug.default and not small.default
    assert (debug.largest_cpus(), debug.largest_mem_mb(), debug.max_time_min, debug.max_nodes) == (2, 19284, None, None)
    assert (small.largest_cpus(), small.largest_mem_mb(), small.max_time_min, small.max_nodes) == (1, 1024, 5, 1)
    assert (wide.largest_cpus(), wide.largest_mem_mb(), wide.total_nodes) == (64, 512000, 2)  # the largest node's


def test_a_request_the_partition_can_give_passes(partitions):
    assert problems(FITS, partitions) == []
    assert problems({**FITS, "partition": "wide", "cpus_per_task": 16, "tasks_per_node": 4, "mem_gb": 400,
                     "timeout_min": 2160, "nodes": 2}, partitions) == []


def test_the_presets_defaults_on_a_small_node_name_each_key_its_value_and_what_is_allowed(partitions):
    assert problems({**FITS, "cpus_per_task": 8, "mem_gb": 32}, partitions) == [
        "hydra.launcher.cpus_per_task=8: a node of partition debug (the default) gives a job at most 2 CPUs "
        "(asked 8); set it to at most 2",
        "hydra.launcher.mem_gb=32: a node of partition debug (the default) gives a job at most 19284 MB (18.8 GB); "
        "set it to at most 18"]


def test_cpus_count_every_task_on_the_node(partitions):
    [line] = problems({**FITS, "partition": "wide", "cpus_per_task": 10, "tasks_per_node": 8}, partitions)
    assert line == ("hydra.launcher.cpus_per_task=10: a node of partition wide gives a job at most 64 CPUs "
                    "(asked 10 x tasks_per_node=8 = 80); set it to at most 8")


def test_the_partitions_own_limits_count_over_its_nodes(partitions):
    found = problems({**FITS, "partition": "small", "cpus_per_task": 2, "mem_gb": 2, "timeout_min": 10, "nodes": 2},
                     partitions)
    assert found == [
        "hydra.launcher.cpus_per_task=2: a node of partition small gives a job at most 1 CPU (asked 2); "
        "set it to at most 1",
        "hydra.launcher.mem_gb=2: a node of partition small gives a job at most 1024 MB (1.0 GB); set it to at most 1",
        "hydra.launcher.timeout_min=10: partition small allows at most 5 minutes (MaxTime); set it to at most 5",
        "hydra.launcher.nodes=2: partition small gives a job at most 1 node; set it to at most 1"]


def test_an_unknown_partition_lists_the_clusters_and_no_default_asks_for_one(partitions):
    assert problems({**FITS, "partition": "nope"}, partitions) == [
        "hydra.launcher.partition=nope: no such partition on this cluster; it has debug (the default), small, wide"]
    partitions["debug"].default = False
    assert problems(FITS, partitions) == [
        "hydra.launcher.partition=null: this cluster has no default partition; name one of debug, small, wide"]


def done(returncode: int, stdout: str = "", stderr: str = ""):
    """A fake subprocess.run answering as the Slurm command did."""
    return lambda cmd, **kw: subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


@pytest.fixture
def slurm_on_path(tmp_path, monkeypatch):
    """squeue and sacct present on PATH (their answers come from the fake `run`)."""
    for name in ("squeue", "sacct"):
        (tmp_path / name).write_text("#!/bin/sh\nexit 99\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_squeue_answers_read(slurm_on_path):
    assert parse_squeue("12_0|RUNNING|None\n12_1|CANCELLED by 0|None\n") == {
        "12_0": Listed("RUNNING"), "12_1": Listed("CANCELLED")}
    assert queue_states(["12_0"], run=done(0, "12_0|PENDING|ReqNodeNotAvail, UnavailableNodes:vm\n")) == {
        "12_0": Listed("PENDING", "ReqNodeNotAvail, UnavailableNodes:vm")}
    # none of the ids is known any more: squeue exits 1 saying so (measured), which is "none listed"
    assert queue_states(["12_0"], run=done(1, stderr="slurm_load_jobs error: Invalid job id specified\n")) == {}
    assert queue_states(["12_0"], run=done(1, stderr="squeue: error: Unable to contact slurm controller\n")) == (
        "squeue exited 1: squeue: error: Unable to contact slurm controller")


def test_sacct_without_slurmdbd_says_why(slurm_on_path):
    refused = ("sacct: error: Sending PersistInit msg: Connection refused\n"
               "sacct: error: Problem talking to the database: Connection refused\n")
    assert accounting_state("12_0", run=done(1, stderr=refused)) == (
        None, "sacct exited 1: sacct: error: Problem talking to the database: Connection refused")
    assert accounting_state("12_0", run=done(0, "REQUEUED\nCOMPLETED\n")) == ("COMPLETED", None)


def job(num: int, result: bool = False) -> Watched:
    return Watched(num, f"12_{num}", Path(f"/sweep/.submitit/12_{num}/12_{num}_0_log.err"), lambda: result)


def test_a_job_is_lost_only_after_the_grace_without_a_result():
    j = job(0)
    update(j, {"12_0": Listed("RUNNING")}, now=0)
    assert (j.gone_since, j.lost) == (None, None)
    update(j, {"12_0": Listed("PREEMPTED")}, now=10)  # requeued by Slurm: it goes back to PENDING within the grace
    update(j, {"12_0": Listed("PENDING", "BeginTime")}, now=12)
    assert (j.gone_since, j.lost) == (None, None)
    update(j, {}, now=20)  # no longer listed
    update(j, {}, now=20 + RESULT_GRACE_S - 1)
    assert j.lost is None
    update(j, {}, now=20 + RESULT_GRACE_S)
    assert j.lost == "left the queue"
    finished = job(1, result=True)
    update(finished, {}, now=0)
    update(finished, {}, now=100)
    assert finished.lost is None  # its result is there: Hydra reads it


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_watch_ends_when_every_job_has_a_result_or_is_lost_and_falls_back_to_accounting():
    clock = Clock()
    jobs = [job(0, result=True), job(1)]
    lost = watch(jobs, queue=lambda ids: {"12_1": Listed("CANCELLED")}, accounting=lambda j: (None, "x"), clock=clock,
                 sleep=clock.sleep)
    assert lost == [jobs[1]] and RESULT_GRACE_S <= clock.now <= RESULT_GRACE_S + 6
    warned = []
    clock = Clock()
    # slurmctld does not answer: told once, and the job is judged by Slurm's accounting
    lost = watch([job(2)], queue=lambda ids: "squeue exited 1", accounting=lambda j: ("FAILED", None),
                 clock=clock, sleep=clock.sleep, warn=warned.append)
    assert [j.lost for j in lost] == ["FAILED"] and warned == ["squeue exited 1"]


def test_a_job_waiting_in_the_queue_is_said_to_wait_with_squeues_reason():
    """A reason that needs a person at once; the queue's own pace after PENDING_SAY_S; each reason
    once a job, again when it changes; nothing for a job just submitted."""
    a, b, c = job(0), job(1), job(2)
    listed = {"12_0": Listed("PENDING", "PartitionDown"), "12_1": Listed("PENDING", "PartitionDown"),
              "12_2": Listed("PENDING", "Resources")}
    for j in (a, b, c):
        update(j, listed, now=0)
    assert waiting_line([a, b, c], now=0) == ("jobs #0, #1 (Slurm 12_0, 12_1) are waiting in the queue (0 s so far): "
                                              "PartitionDown (squeue's reason)")
    assert waiting_line([a, b, c], now=5) is None  # said once
    for j in (a, b, c):
        update(j, listed, now=PENDING_SAY_S)
    assert waiting_line([a, b, c], now=PENDING_SAY_S) == (
        f"job #2 (Slurm 12_2) is waiting in the queue ({PENDING_SAY_S:.0f} s so far): Resources (squeue's reason)")
    update(a, {"12_0": Listed("PENDING", "QOSMaxCpuPerUserLimit")}, now=70)
    update(b, {"12_1": Listed("RUNNING")}, now=70)
    assert waiting_line([a, b, c], now=70) == ("job #0 (Slurm 12_0) is waiting in the queue (70 s so far): "
                                               "QOSMaxCpuPerUserLimit (squeue's reason)")
    update(c, {"12_2": Listed("PENDING", "Priority")}, now=80)  # a busy queue's reasons take turns: said once
    assert waiting_line([c], now=80) is None
    update(c, {"12_2": Listed("RUNNING")}, now=90)
    update(c, {"12_2": Listed("PENDING", "Resources")}, now=100)  # requeued, waiting again: news after a while
    assert waiting_line([c], now=100) is None
    update(c, {"12_2": Listed("PENDING", "Resources")}, now=100 + PENDING_SAY_S)
    assert waiting_line([c], now=100 + PENDING_SAY_S) == (
        f"job #2 (Slurm 12_2) is waiting in the queue ({PENDING_SAY_S:.0f} s so far): Resources (squeue's reason)")
    fresh = job(3)
    update(fresh, {"12_3": Listed("PENDING")}, now=0)  # just submitted: squeue's reason is None
    assert waiting_line([fresh], now=PENDING_SAY_S * 2) is None
    said = []
    clock = Clock()
    watch([job(4, result=False)], queue=lambda ids: {"12_4": Listed("PENDING", "PartitionDown")} if clock.now < 10
          else {"12_4": Listed("COMPLETED")}, accounting=lambda j: (None, None), clock=clock, sleep=clock.sleep,
          tell=said.append)
    assert said == ["job #4 (Slurm 12_4) is waiting in the queue (0 s so far): PartitionDown (squeue's reason)"]


def test_the_lost_jobs_line_names_them_how_they_ended_their_logs_and_the_accounting():
    a, b = job(0), job(1)
    a.state = b.state = "CANCELLED"
    no_dbd = lambda j: (None, "sacct exited 1: Problem talking to the database")  # noqa: E731
    assert lost_line([a, b], no_dbd) == (
        "KILLED", "jobs #0, #1 (Slurm 12_0, 12_1) cancelled: scancel; their logs: /sweep/.submitit/*/; Slurm "
        "accounting did not answer (sacct exited 1: Problem talking to the database): submitit needs it (slurmdbd) "
        "to see how jobs end")
    gone = job(3)
    assert lost_line([gone], no_dbd)[1].startswith(
        "job #3 (Slurm 12_3) left the queue without a result; how it ended is unknown; "
        "its log: /sweep/.submitit/12_3/12_3_0_log.err; Slurm accounting did not answer")
    assert lost_line([gone, a], lambda j: ("NODE_FAIL", None)) == (
        "FAILED", "job #3 (Slurm 12_3) ended NODE_FAIL without a result; its log: /sweep/.submitit/12_3/12_3_0_log.err;"
        " 1 more job ended without a result")


def test_where_slurmctld_cannot_be_asked_the_sweep_is_submitted_with_one_warning(tmp_path, caplog):
    from omegaconf import OmegaConf

    from dlpipe.sweeps.slurm_check import refuse_what_cannot_start

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}, "launcher": {
        "_target_": "hydra_plugins.dlpipe_submitit_launcher.SlurmLauncher", **FITS, "cpus_per_task": 512}}})

    def unreachable():
        raise OSError("scontrol show partition -o exited 1: slurm_load_partitions: Unable to contact slurm controller")

    refuse_what_cannot_start(config, read=unreachable)  # returns: the sweep goes on
    assert [r.getMessage() for r in caplog.records] == [
        "cannot check the Slurm partition before submitting (scontrol show partition -o exited 1: "
        "slurm_load_partitions: Unable to contact slurm controller): submitting as asked"]
    with pytest.raises(SystemExit) as e:
        refuse_what_cannot_start(config, read=lambda: parse(PARTITIONS, NODES))
    assert e.value.code == 2


def test_without_the_slurm_extra_hydras_plugin_scan_finds_no_launcher_and_prints_nothing(monkeypatch):
    """Hydra imports every module of hydra_plugins at each start: dlpipe's launcher module must import
    without hydra-submitit-launcher (a plain `pip install dlpipe`), or every command would print
    Hydra's 'plugin is incompatible or buggy' warning; it then offers no launcher at all."""
    import importlib.util
    import warnings

    from hydra.plugins.plugin import Plugin

    import hydra_plugins.dlpipe_submitit_launcher as installed

    monkeypatch.setitem(sys.modules, "hydra_plugins.hydra_submitit_launcher", None)  # as if not installed
    spec = importlib.util.spec_from_file_location("dlpipe_launcher_without_extra", installed.__file__)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec.loader.exec_module(module)
    assert not issubclass(module.SlurmLauncher, Plugin)
    assert issubclass(installed.SlurmLauncher, Plugin)  # with the extra (this environment): Hydra's launcher
