"""The user's own modules in the folder they run `dlpipe` from import as under `python -m dlpipe`:
the console script puts its own folder on sys.path, not the current one, so without this a
`_target_` naming ./mypkg failed until PYTHONPATH=. was set."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_PHONE_HOME

from dlpipe.cli import import_from_here

MODULE = '''
import torch
from torch.utils.data import Dataset


class Clusters(Dataset):
    """Two Gaussian clusters in 4 dimensions."""

    num_classes = 2

    def __init__(self, size: int = 64):
        g = torch.Generator().manual_seed(0)
        self.y = torch.arange(size) % 2
        self.x = torch.randn(size, 4, generator=g) + 3 * self.y[:, None]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
'''


def test_the_current_folder_goes_first_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["/site", str(tmp_path / "elsewhere")])
    import_from_here()
    import_from_here()
    assert sys.path == [os.getcwd(), "/site", str(tmp_path / "elsewhere")]


@pytest.mark.integration
def test_the_dlpipe_script_trains_a_dataset_from_the_current_folder(tmp_path):
    """The installed `dlpipe` script (not `python -m`), a dataset in ./mypkg, spawned workers
    (which import it again in fresh interpreters)."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "data.py").write_text(MODULE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DLPIPE_", "PYTHON"))}
    script = Path(sys.executable).with_name("dlpipe")
    r = subprocess.run([str(script), "dataset=custom", "dataset._target_=mypkg.data.Clusters", "model=mlp",
                        "model.in_features=4", "loader.num_workers=2", "loader.multiprocessing_context=spawn",
                        "loader.worker_method=process", "trainer.epochs=1", "trainer.progress=false", "tracking=none"],
                       cwd=tmp_path, env={**env, **NO_PHONE_HOME}, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "bottleneck:" in r.stdout
