"""What a stop signal means, in this process: Slurm's repeated SIGTERM is one stop request, and
slurmctld's record of a job tells a preemption with grace from a `scancel` (dlpipe.machine.slurm).
The same on a real cluster, through the CLI: tests/test_slurm.py."""

import signal
import subprocess
import time

import pytest

from dlpipe import stop
from dlpipe.machine import slurm
from dlpipe.stop import StopRequest, Terminated, stop_gracefully


def test_slurms_sigterm_sigcont_sigterm_is_one_stop_request_a_later_one_stops_at_once(monkeypatch):
    monkeypatch.setattr(stop, "SAME_STOP_S", 0.2)
    request = StopRequest()
    with stop_gracefully(request):
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGCONT)
        signal.raise_signal(signal.SIGTERM)  # Slurm's preemption: the three within ~10 ms
        assert request.signal == "SIGTERM"
        time.sleep(0.3)
        with pytest.raises(Terminated):  # a person's second `kill`: stop at once
            signal.raise_signal(signal.SIGTERM)


def test_a_second_ctrl_c_stops_at_once_however_soon():
    request = StopRequest()
    with stop_gracefully(request):
        signal.raise_signal(signal.SIGINT)
        assert request.signal == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


# `scontrol show job -o` lines as slurmctld 22.05 wrote them at each SIGTERM (tests/test_slurm.py makes
# each of these situations on a real cluster), shortened to the fields around the ones read.
GRACE = ("JobId=13 JobName=submitit UserId=root(0) Priority=1 JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
         "RunTime=00:00:23 TimeLimit=00:10:00 EndTime=2026-12-06T20:34:25 PreemptEligibleTime=2026-12-06T20:33:49 "
         "PreemptTime=2026-12-06T20:34:05 SuspendTime=None Partition=debug NodeList=vm")
SCANCEL = ("JobId=4 JobName=cancel UserId=root(0) JobState=COMPLETING Reason=None Requeue=1 Restarts=0 "
           "RunTime=00:00:09 EndTime=2026-12-06T20:22:36 PreemptEligibleTime=2026-12-06T20:22:27 PreemptTime=None "
           "SuspendTime=None Partition=debug NodeList=vm")
NO_GRACE = ("JobId=9 JobName=nog UserId=root(0) JobState=COMPLETING Reason=None Requeue=1 Restarts=1 "
            "RunTime=00:00:00 TimeLimit=UNLIMITED EndTime=Unknown SuspendTime=None Partition=nograce NodeList=vm")


@pytest.mark.parametrize("line, preempted", [(GRACE, True), (SCANCEL, False), (NO_GRACE, False)],
                         ids=["preemption-with-grace", "scancel", "preemption-without-grace"])
def test_only_a_running_job_with_a_preempt_time_is_being_preempted(monkeypatch, line, preempted):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")

    def scontrol(argv, **kwargs):
        assert argv == ["/usr/bin/scontrol", "show", "job", "-o", "13"]
        return subprocess.CompletedProcess(argv, 0, line + "\n", "")

    record = slurm.show_job("13", run=scontrol)
    assert slurm.being_preempted(record) is preempted


def test_no_scontrol_or_no_answer_is_no_record(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    assert slurm.show_job("13") is None
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    refused = subprocess.CompletedProcess([], 1, "", "slurm_load_jobs error: Invalid job id specified")
    assert slurm.show_job("13", run=lambda argv, **kw: refused) is None


@pytest.mark.parametrize("environ, first", [({}, True), ({"SLURM_PROCID": "1"}, False),
                                            ({"SLURM_PROCID": "0", "RANK": "3"}, False), ({"RANK": "0"}, True)])
def test_one_rank_speaks_for_the_job(environ, first):
    assert slurm.is_first_rank(environ) is first


def test_the_jobs_place_in_slurm_becomes_tags_where_the_environment_gives_it():
    environ = {"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2",
               "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_PROCID": "0"}
    assert slurm.job_tags(environ) == {"slurm.job_id": "42", "slurm.array_job_id": "40", "slurm.array_task_id": "2",
                                       "slurm.partition": "debug", "slurm.nodelist": "node[1-2]"}
    assert slurm.job_tags({"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": ""}) == {"slurm.job_id": "7"}
    assert slurm.job_tags({}) == {}  # outside Slurm: no tag at all, not empty ones
