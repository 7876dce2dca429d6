"""The data-parallel run other launchers are held to: a tiny config trained by 2 gloo ranks on one
node under `torchrun --standalone --nproc_per_node=2` (tests/test_distributed.py's helper), tracked
to the session's SQLite store. A launcher that makes the same 2 ranks (plain srun, submitit's
slurm_node, two torchrun agents on two "nodes", the shipped sbatch template) must log the same numbers.
"""

import pytest
from conftest import TESTS_DIR, runs_of
from test_distributed import torchrun

# 384 training rows, a global batch of 64 (32 a rank), 2 epochs of 3 optimizer steps (accumulate 2);
# plain SGD, whose update shows a sum where a mean over ranks belongs. One intra-op thread in every
# launcher: a rank's arithmetic must not depend on how many CPUs its launcher gave it.
ARGS = ["--config-dir", str(TESTS_DIR / "conf"), "+recipe=tiny_tabular", "dataset.size=512",
        "trainer.val_fraction=0.25", "trainer.epochs=2", "trainer.accumulate=2", "trainer.progress=false",
        "trainer.torch_threads=1", "loader.batch_size=32", "loader.num_workers=0", "optim=sgd", "optim.momentum=0",
        "optim.lr=0.5"]


@pytest.fixture(scope="session")  # one per test process, for every module that compares with it
def two_ranks_on_one_node(tmp_path_factory, mlflow_store, mlflow_client):
    """ARGS under torchrun with 2 ranks on this host: its MLflow run."""
    out = tmp_path_factory.mktemp("torchrun")
    exp = f"ddp-reference-{out.name}"
    r = torchrun(out, *ARGS, "hydra.run.dir=run", f"tracking.uri={mlflow_store}", f"tracking.experiment={exp}")
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = runs_of(mlflow_client, exp)
    assert run.info.status == "FINISHED" and run.data.params["dist.world_size"] == "2"
    return run
