"""Samples of webdataset-format tar shards as a stream, each read by its position.

Each tar is a shard (dlpipe.data.shards.ShardedStream); its samples are indexed from the tar's
headers when the stream is built (dlpipe.data.tar_index), and `read_rows` reads the samples asked
for, one seek and one read each. The epoch's order is ShardedStream's: the tars in an order drawn
from (seed, epoch), their samples mixed in windows of `shuffle_buffer`, the same on any number of
workers and ranks.

Why the standard library's tarfile and not the webdataset package: webdataset reads each tar front
to back and deals whole tars to the workers, so its order depends on the worker count, and it cannot
read one sample by its position. dlpipe's order asks for any sample by position, which an index of
member offsets serves with one seek. The files are webdataset's format: shards written by its
ShardWriter or TarWriter read as they are (uncompressed, as it writes them).

An image member is decoded and transformed as dlpipe.data.vision's ImageFolderDataset does (shorter
side resized, cropped, augmented, normalised); its augmentation draws from a generator seeded by
(seed, epoch, sample), so it does not depend on which worker reads it. A `.npy` or `.pt` member is a
tensor, as stored.

A tar cut short is refused in one line when the stream is built, naming the file and the member:
its later samples would otherwise drop out of every epoch without a word; nothing trains and
nothing is tracked. A member that cannot be read or decoded during training (a file changed since)
is a DataError naming the file and the member: the run ends FAILED with that line.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import torch

from dlpipe.data.generated import write_missing
from dlpipe.data.parquet import find_files
from dlpipe.data.shards import ShardedStream
from dlpipe.data.tar_index import TarShard, index_tar
from dlpipe.data.vision import (
    MODES,
    SyntheticJPEGDataset,
    check_channels,
    check_sizes,
    load_rgb,
    resize_shorter,
    to_tensor,
)
from dlpipe.errors import ConfigError, DataError, first_line
from dlpipe.machine.disk import atomic_file

TENSORS = {"npy", "pt", "pth"}
"""Extensions of members read as tensors; any other input member is an image."""


def extensions(key: str, value) -> tuple[str, ...]:
    """`jpg`, `.jpg` or `jpg;png` (the first a sample has, webdataset's way) as ('jpg', 'png')."""
    found = tuple(e.strip().lstrip(".").lower() for e in str(value).split(";") if e.strip().lstrip("."))
    if not found:
        raise ConfigError([f"dataset.{key}={value!r}: name a member extension, like jpg (or jpg;png: the first "
                           "a sample has)"])
    return found


class TarShards(ShardedStream):
    """Samples of webdataset-format tars, each `(input, class)`: an image as a normalised float32
    [C, crop_size, crop_size] tensor (or a stored tensor) and an int; with `target: null`, the input alone.

    Args:
        files: a glob pattern, a folder (its `*.tar`, in it and below), or a list of paths and
            patterns; read in sorted order.
        input: the input member's extension (`jpg`), or several, the first a sample has (`jpg;png`);
            `npy` and `pt` members are tensors, any other an image.
        target: the extension of the member holding the class as text (`cls`), or null.
        shuffle_buffer: samples mixed together across tars (and the tars' order drawn each epoch);
            0 reads them in order.
        seed: seed of the order and the augmentations, with the epoch.
        image_size, crop_size, augment, channels, mean, std: as ImageFolderDataset's.
    """

    def __init__(self, files: str | list[str], input: str = "jpg", target: str | None = "cls",
                 shuffle_buffer: int = 0, seed: int = 0, image_size: int = 64, crop_size: int = 56,
                 augment: bool = True, channels: int = 3, mean=None, std=None):
        if not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise ConfigError([f"dataset.shuffle_buffer={shuffle_buffer!r}: must be an integer >= 0 (0: file order)"])
        self.inputs = extensions("input", input)
        self.target = None if target is None else extensions("target", target)[0]
        check_sizes(image_size, crop_size)
        self.channels, self.mean, self.std = check_channels(channels, mean, std)
        self.image_size, self.crop_size, self.augment = int(image_size), int(crop_size), bool(augment)
        self.shuffle_buffer, self.seed, self.epoch = shuffle_buffer, int(seed), 0
        self.files = find_files(files, ".tar")
        self.shards: list[TarShard] = [index_tar(path, self.inputs, self.target) for path in self.files]
        self.shard_rows = [len(shard.names) for shard in self.shards]
        if self.target is not None:
            self.num_classes = int(max(shard.targets.max() for shard in self.shards)) + 1
        self.build(self.read_rows(0, np.zeros(1, np.int64))[0])  # a member that cannot be decoded: said now

    def record_bytes(self) -> int:
        """A sample's record: its input member's bytes (the mean over the tars), and the class."""
        sizes = np.concatenate([shard.sizes for shard in self.shards])
        return int(np.ceil(sizes.mean())) + (0 if self.target is None else 8)

    def read_rows(self, shard: int, rows: np.ndarray) -> list[tuple[str, str, bytes, int | None]]:
        """(file, member, its bytes, class) of each row: one seek and one read each."""
        index = self.shards[shard]
        try:
            f = open(index.path, "rb")
        except OSError as e:
            raise DataError(f"dataset.files: {index.path} member {index.names[rows[0]]!r} cannot be read: "
                            f"{first_line(e)}") from e
        with f:
            return [self._record(index, int(row), f) for row in rows]

    def _record(self, shard: TarShard, row: int, f) -> tuple[str, str, bytes, int | None]:
        name = shard.names[row]
        f.seek(shard.offsets[row])
        data = f.read(shard.sizes[row])
        if len(data) != shard.sizes[row]:
            raise DataError(f"dataset.files: {shard.path} member {name!r} cannot be decoded: EOFError: "
                            f"{len(data)} of its {shard.sizes[row]} bytes left in the file")
        return shard.path, name, data, None if shard.targets is None else int(shard.targets[row])

    def build(self, record: tuple[str, str, bytes, int | None]):
        path, name, data, target = record
        try:
            value = self._decode(name, data)
        except Exception as e:
            raise DataError(f"dataset.files: {path} member {name!r} cannot be decoded: "
                            f"{type(e).__name__}: {first_line(e)}") from e
        return value if target is None else (value, target)

    def _decode(self, name: str, data: bytes) -> torch.Tensor:
        extension = name.rpartition("/")[2].partition(".")[2].lower()
        if extension == "npy":
            return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
        if extension in TENSORS:
            tensor = torch.load(io.BytesIO(data), weights_only=True)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"holds a {type(tensor).__name__}, not a tensor")
            return tensor
        image = resize_shorter(load_rgb(data, MODES[self.channels]), self.image_size)
        # the augmentation draws from the sample's generator (ShardedStream.build: seeded by seed, epoch, sample)
        return to_tensor(image, self.crop_size, self.augment, self.mean, self.std)


class SyntheticJPEGShards(TarShards):
    """SyntheticJPEGDataset's images written once as webdataset-format tar shards and streamed: the
    vision recipe's pipeline as a stream, on a fresh machine.

    The tars go to a folder of `root` named by every argument that shapes them, so other arguments
    never reuse tars written for these; each tar is written whole or not at all (a temp name, then
    renamed), and only when it is missing.

    Args:
        root: folder of the generated tars (``~`` is expanded).
        size, image_size, crop_size, num_classes, quality, augment, seed: as SyntheticJPEGDataset
            (seed also draws the stream's order).
        shard_size: samples per tar, >= 1 (the last tar may hold fewer).
        shuffle_buffer: as TarShards.
    """

    def __init__(self, root: str, size: int = 2048, image_size: int = 64, crop_size: int = 56,
                 num_classes: int = 10, quality: int = 90, augment: bool = True, seed: int = 0,
                 shard_size: int = 256, shuffle_buffer: int = 1024):
        for key, value in (("size", size), ("shard_size", shard_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError([f"dataset.{key}={value!r}: must be an integer >= 1"])
        args = dict(size=size, image_size=image_size, crop_size=crop_size, num_classes=num_classes,
                    quality=quality, seed=seed)
        name = f"size{size}-image{image_size}-classes{num_classes}-quality{quality}-seed{seed}-shard{shard_size}"
        folder = Path(os.path.expanduser(str(root))) / name
        paths = [folder / f"shard-{i:05d}.tar" for i in range(-(-size // shard_size))]
        write_missing(root, folder, paths, lambda: write_shards(paths, args, shard_size))
        super().__init__([str(p) for p in paths], "jpg", "cls", shuffle_buffer, seed, image_size, crop_size, augment)


def write_shards(paths: list[Path], args: dict, shard_size: int) -> None:
    """SyntheticJPEGDataset(**args)'s images and labels, `shard_size` samples a tar in order, as
    webdataset lays them out (`000042.jpg`, `000042.cls`); each tar that is missing written to a temp
    name of its own and renamed: a reader (or a second writer, a sweep's other job) sees no tar or a
    whole one."""
    data = SyntheticJPEGDataset(**args)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for number, path in enumerate(paths):
        if path.is_file():
            continue
        # the tar closes (writing its end blocks) before atomic_file syncs and renames the file
        with atomic_file(path, binary=True) as f, tarfile.open(fileobj=f, mode="w") as tar:
            for i in range(number * shard_size, min(len(data), (number + 1) * shard_size)):
                add_member(tar, f"{i:06d}.jpg", data.jpegs[i])
                add_member(tar, f"{i:06d}.cls", str(data.labels[i]).encode())


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o444
    tar.addfile(info, io.BytesIO(data))
