"""Multi-node rendezvous, as two nodes on one host: two torchrun agents (`--nnodes=2
--nproc_per_node=1`, c10d rendezvous on 127.0.0.1), each starting one rank, meet as one job.

Not a real second node: both agents share this host's CPUs, network and filesystem. What it shows is
dlpipe's side: ranks from another agent, a node-local LOCAL_WORLD_SIZE of 1, one run, the same numbers
as 2 ranks under one agent (tests/ddp_reference.py).
"""

import os
import signal
import subprocess
import sys

import pytest
from conftest import NO_PHONE_HOME, TESTS_DIR, runs_of
from ddp_reference import ARGS, two_ranks_on_one_node  # noqa: F401 (a fixture)
from mlflow_server import free_port
from test_resume import logged

from dlpipe.machine.budget_share import Sharing
from dlpipe.machine.hardware import cpu_budget

pytestmark = pytest.mark.integration


def test_two_agents_rendezvous_as_two_nodes_of_one_job(tmp_path, mlflow_store, mlflow_client,
                                                       two_ranks_on_one_node):  # noqa: F811
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "DLPIPE_", "SLURM_", "LOCAL_WORLD", "SUBMITIT_"))}
    # The two "nodes" really share this host's CPUs, and the registry of dlpipe jobs would rightly halve
    # each one's budget; off, each rank gets what a node of its own would give it.
    env.update(NO_PHONE_HOME, PYTHONPATH=str(TESTS_DIR), OMP_NUM_THREADS="1", DLPIPE_SHARED_BUDGET="0")
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=two-nodes-{port}",
             "-m", "dlpipe", *ARGS, "hydra.run.dir=run", f"tracking.uri={mlflow_store}",
             "tracking.experiment=two-nodes"]
    agents = [subprocess.Popen(agent, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, stdin=subprocess.DEVNULL, start_new_session=True) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:  # each agent with its rank, by the agent's own process group
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    [run] = runs_of(mlflow_client, "two-nodes")  # one job: rank 0 tracks, wherever c10d put it
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["dist.world_size"], params["dist.local_world_size"]) == ("2", "1")
    # each rank's worker budget is its node's, not divided by the job's 2 ranks
    node = cpu_budget(environ={}, sharing=Sharing()).budget
    assert (params["cpu.local_world_size"], params["cpu.budget"]) == ("1", str(node))
    assert "rank 0 of 2 (local 0 of 1), gloo on cpu; ranks from torchrun" in "".join(outputs)
    assert logged(mlflow_client, run) == logged(mlflow_client, two_ranks_on_one_node)
