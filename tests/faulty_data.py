"""Datasets that fail or stall on purpose, importable by a dlpipe subprocess (PYTHONPATH=tests)."""

import os
import signal
import time

import torch
from torch.utils.data import Dataset, get_worker_info

from dlpipe.sample_rng import sample_generator


class ExplodingDataset(Dataset):
    """Raises RuntimeError at item `bad_index`: a run must end FAILED, not RUNNING."""

    num_classes = 2

    def __init__(self, size: int = 64, bad_index: int = 40):
        self.size, self.bad_index = size, bad_index

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if i == self.bad_index:
            raise RuntimeError(f"sample {i} is corrupt")
        return torch.randn(4), i % 2


class SlowDataset(Dataset):
    """Sleeps per item so a run stays alive long enough to be interrupted."""

    num_classes = 2

    def __init__(self, size: int = 100000, delay_s: float = 0.01):
        self.size, self.delay_s = size, delay_s

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return torch.randn(4), i % 2


class TokenizedDataset(Dataset):
    """Takes credentials like a dataset reading from remote storage would (they are never used)."""

    num_classes = 2

    def __init__(self, size: int = 32, api_token: str = "", mirror: str = ""):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return torch.randn(4), i % 2


class OutOfMemoryModel(torch.nn.Module):
    """Raises the exception type a real CUDA OOM raises, at the given forward call (CPU stand-in)."""

    def __init__(self, in_features: int = 4, num_classes: int = 2, fail_at: int = 3):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, num_classes)
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.linear(x)


class DyingWorkerDataset(Dataset):
    """The worker that serves item `die_at` is killed (as the OOM killer would do)."""

    num_classes = 2

    def __init__(self, size: int = 64, die_at: int = 20):
        self.size, self.die_at = size, die_at

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if i == self.die_at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return torch.randn(4), i % 2


class HangingDataset(Dataset):
    """Item `hang_at` never arrives in time (a stuck read)."""

    num_classes = 2

    def __init__(self, size: int = 64, hang_at: int = 20, hang_s: float = 60.0):
        self.size, self.hang_at, self.hang_s = size, hang_at, hang_s

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if i == self.hang_at:
            time.sleep(self.hang_s)
        return torch.randn(4), i % 2


class RankFailingDataset(Dataset):
    """Raises on one rank of a data-parallel job (RANK from torchrun) after `fail_after` items,
    mid-training: the other ranks must not hang waiting for it."""

    num_classes = 2

    def __init__(self, size: int = 512, fail_rank: int = 1, fail_after: int = 100):
        self.size, self.fail_rank, self.fail_after = size, fail_rank, fail_after
        self.fetched = 0

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        self.fetched += 1
        if os.environ.get("RANK") == str(self.fail_rank) and self.fetched > self.fail_after:
            raise RuntimeError(f"rank {self.fail_rank} cannot read sample {i}")
        return torch.randn(4), i % 2


class SignalsItself(Dataset):
    """Gaussian class clusters that send SIGTERM to their own process at the `at`-th item fetched,
    once: `marker` (a file path) records that it did, so the same command run again trains on. A
    real stop signal at a known point of a run, without timing; needs num_workers=0, unless `group`
    (then a worker fetching its `at`-th item signals the job's whole process group)."""

    num_classes = 3

    def __init__(self, marker: str, at: int, size: int = 120, num_features: int = 4, group: bool = False,
                 noise: float = 0.0, global_noise: float = 0.0):
        self.noise = noise  # augmentation: noise from each sample's own generator (dlpipe.sample_rng)
        self.global_noise = global_noise  # augmentation the plain PyTorch way: torch's global RNG
        g = torch.Generator().manual_seed(0)
        self.y = torch.arange(size) % self.num_classes
        self.x = torch.randn(self.num_classes, num_features, generator=g)[self.y]
        self.x += 0.5 * torch.randn(size, num_features, generator=g)
        self.marker, self.at, self.fetched = marker, at, 0
        self.group = group  # signal the whole process group (kill -TERM -PGID), workers included

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        # With `group`, a worker's own fetches count: the main process's before the workers fork (pre-flight
        # probes, as many as their time budget allows) would be inherited and move the signal by a timing.
        if not self.group or get_worker_info() is not None:
            self.fetched += 1
        if self.fetched == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if self.group:
                os.killpg(os.getpgid(0), signal.SIGTERM)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
        if self.global_noise:
            return self.x[i] + self.global_noise * torch.randn(self.x.shape[1]), int(self.y[i])
        if self.noise:
            return self.x[i] + self.noise * torch.randn(self.x.shape[1], generator=sample_generator()), int(self.y[i])
        return self.x[i].clone(), int(self.y[i])
