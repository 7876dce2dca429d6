"""What torch's intra-op threads are where dlpipe runs code: in the training step, in a DataLoader worker.
Used by the trainer.torch_threads tests through _target_ (the dlpipe fixture puts tests/ on PYTHONPATH)."""

import json

import torch
from torch.utils.data import Dataset


class RecordThreads:
    """A callback: torch.get_num_threads() after every optimizer step (the training process, its
    main thread, where the step ran), written to `record` as a JSON list of the values seen."""

    def __init__(self, record: str):
        self.record, self.seen = record, set()

    def on_step_end(self, trainer, step: int) -> None:
        self.seen.add(torch.get_num_threads())

    def on_train_end(self, trainer, history: list) -> None:
        with open(self.record, "w") as f:
            json.dump(sorted(self.seen), f)


class ThreadsInItem(Dataset):
    """Each item is torch.get_num_threads() where it was fetched (a worker process, a worker thread,
    or the main process)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return torch.get_num_threads()
