"""Hugging Face `datasets` streams for the tests, importable by a `dlpipe` subprocess (tests/ is on
its PYTHONPATH): numbered rows built in memory (Dataset.from_dict), nothing downloaded; and a model
that writes down which rows it trained on, so that a test can count them."""

import os

import datasets
import torch
from datasets.distributed import split_dataset_by_node


def rows(size: int = 40, num_shards: int = 1, features: int = 2, classes: int = 3, fmt: str | None = "torch",
         repeat: bool = False, by_rank: bool = False):
    """Rows {"x": [the row's number, 0, ...], "y": row % classes} as Dataset.to_iterable_dataset(num_shards),
    in `fmt` (None: python lists and ints); `repeat`: repeat(None), without end; `by_rank`: this
    torchrun rank's part (split_dataset_by_node by RANK and WORLD_SIZE)."""
    table = datasets.Dataset.from_dict({"x": [[float(i)] + [0.0] * (features - 1) for i in range(size)],
                                        "y": [i % classes for i in range(size)]})
    stream = table.to_iterable_dataset(num_shards=num_shards)
    if fmt:
        stream = stream.with_format(fmt)
    if by_rank:
        stream = split_dataset_by_node(stream, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return stream.repeat(None) if repeat else stream


class RowRecorder(torch.nn.Module):
    """A linear classifier that appends the row numbers (input column 0) of each training batch it
    is called with, one line a batch, to `record`.RANK: what each rank trained on, in order.
    Validation and dlpipe's check of two items run in eval mode and are not written."""

    def __init__(self, in_features: int, num_classes: int, record: str):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, num_classes)
        self.record = record

    def forward(self, x):
        if self.training:
            with open(f"{self.record}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.linear(x)


def recorded(record) -> list[list[int]]:
    """The batches a RowRecorder wrote, each a list of row numbers, rank 0's then rank 1's ..."""
    batches = []
    for path in sorted(record.parent.glob(f"{record.name}.*")):
        batches += [[int(v) for v in line.split()] for line in path.read_text().splitlines()]
    return batches
