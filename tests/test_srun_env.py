"""A plain `srun` step's tasks as ranks: Slurm's variables read on controlled environments (no cluster;
tests/test_slurm_ranks.py runs it on a real one). The environments are those Slurm 22.05 gave a task of
`srun` in `sbatch --ntasks=2 --cpus-per-task=1`, and their multi-node forms."""

import os
import random
import sys

import pytest

from dlpipe.errors import DlpipeError
from dlpipe.machine.budget_share import Sharing
from dlpipe.machine.hardware import cpu_budget
from dlpipe.machine.slurm_ranks import StepError, first_host, master_port, step_ranks, tasks_per_node
from dlpipe.training.ranks import (
    Ranks,
    check_ranks,
    export_srun_env,
    ranks_from_env,
    ranks_source,
    sweep_across_ranks,
    torchrun_command,
)

# Task 1 of `srun` in `sbatch --ntasks=2 --cpus-per-task=1` on node `vm`, as measured.
TASK_1 = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_NTASKS": "2",
          "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
          "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "vm",
          "SLURM_JOB_NODELIST": "vm", "SLURM_NODELIST": "vm", "SLURM_CPUS_PER_TASK": "1", "SLURM_STEP_NUM_NODES": "1"}
# Task 5 of 7 in a step over 3 nodes of gpu[007-009], 3+3+1 tasks: the second task on the second node.
MULTI_NODE = {**TASK_1, "SLURM_NTASKS": "7", "SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "4", "SLURM_LOCALID": "1",
              "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "3(x2),1", "SLURM_TASKS_PER_NODE": "3(x2),1",
              "SLURM_STEP_NODELIST": "gpu[007-009]", "SLURM_JOB_NODELIST": "gpu[007-009]"}


def test_slurms_compressed_forms():
    assert tasks_per_node("2") == [2]
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4(x2),2,1(x2)") == [4, 4, 2, 1, 1]
    assert first_host("vm") == "vm"
    assert first_host("gpu[007-009,012],cpu1") == "gpu007"  # zero padding kept, as scontrol prints it
    assert first_host("cpu1,gpu[1-2]") == "cpu1"
    assert first_host("gpu[12,3-4]") == "gpu12"  # Slurm's order, not sorted
    assert first_host("rack[1-2]-node[3-4]") == "rack1-node3"
    for bad in ("", "gpu[1-2", "gpu]1["):
        with pytest.raises(ValueError):
            first_host(bad)
    for bad in ("", "2(x)", "two", "2(3)"):
        with pytest.raises(ValueError):
            tasks_per_node(bad)


def test_a_task_of_a_step_gets_torchruns_variables():
    assert step_ranks(TASK_1) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                  "MASTER_ADDR": "vm", "MASTER_PORT": str(master_port(TASK_1))}
    found = step_ranks(MULTI_NODE)
    assert (found["RANK"], found["WORLD_SIZE"], found["LOCAL_RANK"], found["LOCAL_WORLD_SIZE"]) == ("4", "7", "1", "3")
    assert found["MASTER_ADDR"] == "gpu007"  # task 0's node
    last = step_ranks({**MULTI_NODE, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "2"})
    assert last["LOCAL_WORLD_SIZE"] == "1"  # the third node runs one task
    # without the step's own counts, the job's (a step over the whole allocation)
    job_only = {k: v for k, v in MULTI_NODE.items() if not k.startswith("SLURM_STEP_") or k == "SLURM_STEP_ID"}
    assert step_ranks(job_only) == found


def test_every_task_of_a_step_meets_at_one_port_and_other_steps_elsewhere():
    port = master_port(TASK_1)
    assert 20000 <= port <= 60000
    assert master_port({**TASK_1, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) == port  # the other task
    assert master_port({**TASK_1, "SLURM_STEP_ID": "1"}) != port  # a second step of the job, maybe at once
    assert master_port({**TASK_1, "SLURM_JOB_ID": "42"}) != port
    # an array task draws from ARRAY_TASK, as submitit names it, whatever its own job id
    array = {**TASK_1, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    assert master_port(array) == random.Random("40_3.0").randint(20000, 60000)
    # set by hand (node names that do not resolve, a port the site opens): kept
    assert step_ranks({**TASK_1, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"})["MASTER_ADDR"] == "10.0.0.7"
    assert step_ranks({**TASK_1, "MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"


def test_only_a_plain_step_of_several_tasks_becomes_ranks():
    batch_script = {k: v for k, v in TASK_1.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    assert step_ranks(batch_script) is None  # sbatch --ntasks=2 running dlpipe itself: one process
    assert step_ranks({**TASK_1, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}) is None  # srun of one task
    torchrun = {**TASK_1, "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert step_ranks(torchrun) is None  # torchrun inside a Slurm task: its ranks stand
    assert step_ranks({**TASK_1, "SUBMITIT_EXECUTOR": "slurm"}) is None  # submitit exports its own
    assert step_ranks({}) is None


def test_export_makes_ranks_and_the_log_names_srun():
    env = dict(TASK_1)
    assert export_srun_env(env)
    assert ranks_from_env(env) == Ranks(rank=1, world=2, local_rank=1, local_world=2)
    assert ranks_source(env) == "srun"
    assert not export_srun_env(env)  # once: WORLD_SIZE is there now
    assert ranks_source({**env, "TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert ranks_source({**env, "SUBMITIT_EXECUTOR": "slurm"}) == "submitit"
    assert ranks_source({"WORLD_SIZE": "2", "RANK": "1"}) == "the environment"


@pytest.fixture
def own_environment(monkeypatch):
    """os.environ as a task of TASK_1 sees it; every variable the export writes is restored afterwards."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "SUBMITIT_EXECUTOR", *TASK_1):
        monkeypatch.setenv(key, "")  # remembered, so that teardown removes what the test left
        monkeypatch.delenv(key)
    for key, value in TASK_1.items():
        monkeypatch.setenv(key, value)


def test_the_cli_exports_them_before_anything_reads_its_rank(own_environment, monkeypatch):
    """cli.main exports the step's ranks before Hydra starts (reading a rank has no side effect), so
    everything after it (the config's worker budget, init_process_group) sees torchrun's variables."""
    assert ranks_from_env() == Ranks() and "WORLD_SIZE" not in os.environ
    assert sweep_across_ranks(["loader.batch_size=16"]) is None and "WORLD_SIZE" not in os.environ
    from dlpipe import cli

    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the working directory on it
    monkeypatch.setattr(cli, "refuse_a_sweep_into_one_run", lambda argv: sys.exit(0))  # just after the export
    monkeypatch.setattr(sys, "argv", ["dlpipe", "loader.batch_size=16"])
    with pytest.raises(SystemExit):
        cli.main()
    assert ranks_from_env().rank == 1
    assert (os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("2", "2", "vm")
    check_ranks(ranks_from_env(), False, "cpu", os.environ)  # vm resolves here: the cluster's node is this host


def test_the_worker_budget_is_each_tasks_own_as_under_torchrun(tmp_path):
    """Two tasks sharing 2 CPUs without --cpus-per-task binding them apart: 1 each once they are ranks,
    as torchrun's 2 ranks on 2 CPUs; with SLURM_CPUS_PER_TASK=1, that is each rank's already."""
    step = {k: v for k, v in TASK_1.items() if k != "SLURM_CPUS_PER_TASK"}

    def budget(env):
        return cpu_budget(proc_root=str(tmp_path), environ=env, affinity=2, sharing=Sharing())

    assert budget(step).budget == 2  # before the export: each task would size workers for both CPUs
    export_srun_env(step)
    assert (budget(step).budget, budget(step).rank_per_slurm_task, budget(step).local_world_size) == (1, True, 2)
    bound = {**TASK_1}
    export_srun_env(bound)
    assert (cpu_budget(proc_root=str(tmp_path), environ=bound, affinity=1, sharing=Sharing()).budget) == 1


def test_trainer_devices_in_a_step_compares_with_the_tasks_instead_of_starting_torchrun():
    assert torchrun_command(["trainer.devices=2"], TASK_1) is None
    env = dict(TASK_1)
    export_srun_env(env)
    ranks = ranks_from_env(env)
    check_ranks(ranks, False, "cpu", env, devices=2)  # 2 tasks on this node: 2 devices, fine
    with pytest.raises(DlpipeError, match=r"trainer.devices=4: this node runs 2 ranks \(LOCAL_WORLD_SIZE\); "
                                          r"srun --ntasks-per-node=4 to run 4, or leave trainer.devices at 1"):
        check_ranks(ranks, False, "cpu", env, devices=4)


def test_what_a_plain_srun_step_refuses_in_one_line():
    env = dict(TASK_1)
    export_srun_env(env)
    ranks = ranks_from_env(env)
    with pytest.raises(DlpipeError, match=r"^--multirun in an srun step of 2 tasks: every rank would run the whole "
                                          r"sweep; sweep with hydra/launcher=slurm_node \(tasks_per_node=N\), or "
                                          r"start one srun per job$"):
        check_ranks(ranks, True, "cpu", env)
    # rank 0's node named by Slurm but unknown to this node's resolver: refused, not a 10-minute wait
    lost = {**env, "MASTER_ADDR": "no-such-node.invalid"}
    with pytest.raises(DlpipeError, match=r"^MASTER_ADDR=no-such-node.invalid \(rank 0's node, from Slurm's node "
                                          r"list\) does not resolve here \(.+\): export MASTER_ADDR=<its address> "
                                          r"before srun$"):
        check_ranks(ranks, False, "cpu", lost)
    # Slurm's variables that cannot describe one task of a step (set by hand, or a broken wrapper)
    for change, named in [({"SLURM_STEP_TASKS_PER_NODE": "2(x"}, r"SLURM_STEP_TASKS_PER_NODE='2\(x'"),
                          ({"SLURM_PROCID": "5"}, r"SLURM_PROCID=5, SLURM_LOCALID=1"),
                          ({"SLURM_LOCALID": "two"}, r"SLURM_LOCALID='two': not a task count or id"),
                          ({"SLURM_STEP_NODELIST": "gpu[1-"}, r"SLURM_STEP_NODELIST='gpu\[1-': not a Slurm node list")]:
        broken = {**TASK_1, **change}
        assert not export_srun_env(dict(broken))
        with pytest.raises(StepError):
            step_ranks(broken)
        with pytest.raises(DlpipeError, match=rf"^srun with 2 tasks: {named}"):
            check_ranks(ranks_from_env(broken), False, "cpu", broken)


def test_a_sweep_is_refused_before_hydra_opens_it_in_every_rank():
    """What the CLI checks before Hydra starts a sweep: the ranks of an srun step or of torchrun would
    each run all of it; a submitit job (one sweep point per job) and a single process may sweep."""
    env = dict(TASK_1)
    assert sweep_across_ranks(["--multirun", "loader.batch_size=16,32"], env) == (
        "--multirun in an srun step of 2 tasks: every rank would run the whole sweep; sweep with "
        "hydra/launcher=slurm_node (tasks_per_node=N), or start one srun per job")
    assert sweep_across_ranks(["loader.batch_size=16"], dict(TASK_1)) is None
    torchrun = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    assert sweep_across_ranks(["-m", "a=1,2"], torchrun).startswith("--multirun under torchrun (WORLD_SIZE=2)")
    assert sweep_across_ranks(["-m", "a=1,2"], {**torchrun, "SUBMITIT_EXECUTOR": "slurm"}) is None
    assert sweep_across_ranks(["-m", "a=1,2"], {}) is None


def test_a_step_without_its_task_counts_or_node_list_is_refused_naming_the_variable():
    no_counts = {k: v for k, v in TASK_1.items() if not k.endswith("TASKS_PER_NODE")}
    with pytest.raises(StepError, match=r"^SLURM_STEP_TASKS_PER_NODE not set in a Slurm step of several tasks: "
                                        r"cannot tell how many ranks share this node$"):
        step_ranks(no_counts)
    no_nodes = {k: v for k, v in TASK_1.items() if not k.endswith("NODELIST")}
    with pytest.raises(StepError, match=r"^SLURM_STEP_NODELIST not set .*; set MASTER_ADDR to its address$"):
        step_ranks(no_nodes)
    assert step_ranks({**no_nodes, "MASTER_ADDR": "10.0.0.7"})["MASTER_ADDR"] == "10.0.0.7"
