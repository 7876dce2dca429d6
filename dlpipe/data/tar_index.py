"""An index of webdataset-format tar shards, from their headers: each sample's input member (its
name, data offset and size) and its target, so that a sample can be read by position with one seek.

webdataset's layout: a sample is the run of consecutive members that share a key, the member's
path up to the first dot of its file name; the rest of the name is the member's extension
(`000123.jpg` and `000123.cls` are sample `000123`'s `jpg` and `cls`). Members without a dot in
their file name, and entries that are not files, belong to no sample (webdataset skips them too).

Everything wrong with a file is found here, while the stream is built, in one line naming the file
and the member or sample: a file that is not a tar, a tar cut short (a member's data, or the tar's
end blocks, past the end of the file), a sample without the input or target member, a target that
is not a class number.
"""

from __future__ import annotations

import os
import tarfile
from typing import NamedTuple

import numpy as np

from dlpipe.errors import ConfigError, first_line

BLOCK = 512
"""A tar's block: headers and each member's padded data come in whole blocks."""
END_BLOCKS = 2
"""A tar ends with two zero blocks (POSIX); Python's tarfile, GNU tar and webdataset write them."""


class TarShard(NamedTuple):
    """One tar's samples, in the file's order: each one's input member and target."""

    path: str
    names: list[str]  # the input members' names, for messages
    offsets: np.ndarray  # int64: where each input member's data starts in the file
    sizes: np.ndarray  # int64: its bytes
    targets: np.ndarray | None  # int64 classes; None without a target


def index_tar(path: str, inputs: tuple[str, ...], target: str | None) -> TarShard:
    """The shard's samples: their input member (the first of the extensions `inputs` a sample has)
    and their `target` member's class, read now (a few bytes each)."""
    names, offsets, sizes, target_members = [], [], [], []
    for key, members in samples_of(path, read_headers(path)):
        found = next((ext for ext in inputs if ext in members), None)
        if found is None or (target is not None and target not in members):
            wanted = "|".join(inputs) if found is None else target
            raise ConfigError([f"dataset.files: {path} sample {key!r} has no {wanted} member "
                               f"(dataset.{'input' if found is None else 'target'}); its members: "
                               f"{', '.join(sorted(members))}"])
        names.append(members[found].name)
        offsets.append(members[found].offset_data)
        sizes.append(members[found].size)
        if target is not None:
            target_members.append(members[target])
    if not names:
        raise ConfigError([f"dataset.files: {path} holds no samples (members named KEY.EXTENSION, "
                           "as webdataset writes them)"])
    targets = read_classes(path, target_members) if target is not None else None
    return TarShard(path, names, np.array(offsets, np.int64), np.array(sizes, np.int64), targets)


def read_headers(path: str) -> list[tarfile.TarInfo]:
    """The tar's members, from their headers alone. A file that is not an uncompressed tar, or one
    cut short, is one line naming the file and the last member it holds whole or in part."""
    seen: list[tarfile.TarInfo] = []
    failure = None
    try:
        with tarfile.open(path, "r:") as tar:  # "r:": a compressed tar has no offsets to seek to
            for info in tar:
                seen.append(info)
    except (tarfile.TarError, OSError) as e:
        failure = e
    if not seen:
        reason = first_line(failure) if failure is not None else "no members"
        raise ConfigError([f"dataset.files: {path} is not a readable tar file (an uncompressed tar, as "
                           f"webdataset writes them): {reason}"])
    end = os.path.getsize(path)
    for info in seen:
        if info.offset_data + info.size > end:
            raise ConfigError([f"dataset.files: {path} is cut short: member {info.name!r} needs bytes "
                               f"{info.offset_data}..{info.offset_data + info.size} and the file ends at {end}"])
    if failure is not None:
        raise ConfigError([f"dataset.files: {path} cannot be read past member {seen[-1].name!r}: "
                           f"{first_line(failure)}"])
    check_end(path, seen[-1])
    return seen


def check_end(path: str, last: tarfile.TarInfo) -> None:
    """The zero blocks that end a tar follow its last member: without them the file was cut at a
    member's boundary (tarfile's reading stops there without a word) and its later samples are gone."""
    data_end = last.offset_data + -(-last.size // BLOCK) * BLOCK
    with open(path, "rb") as f:
        f.seek(data_end)
        tail = f.read(END_BLOCKS * BLOCK)
    if tail != bytes(END_BLOCKS * BLOCK):
        raise ConfigError([f"dataset.files: {path} is cut short after member {last.name!r}: the tar's end "
                           "blocks do not follow it (later members lost?)"])


def samples_of(path: str, infos: list[tarfile.TarInfo]) -> list[tuple[str, dict[str, tarfile.TarInfo]]]:
    """(key, {extension: member}) of each sample, in the file's order (webdataset's grouping)."""
    samples: list[tuple[str, dict[str, tarfile.TarInfo]]] = []
    for info in infos:
        if not info.isfile():
            continue
        folder, _, base = info.name.rpartition("/")
        stem, dot, extension = base.partition(".")
        if not dot:
            continue
        key = f"{folder}/{stem}" if folder else stem
        if not samples or samples[-1][0] != key:
            samples.append((key, {}))
        samples[-1][1][extension.lower()] = info
    return samples


def read_classes(path: str, members: list[tarfile.TarInfo]) -> np.ndarray:
    """Each member's text as a class number (>= 0); one that is not is one line naming it."""
    classes = np.empty(len(members), np.int64)
    with open(path, "rb") as f:
        for i, info in enumerate(members):
            f.seek(info.offset_data)
            text = f.read(info.size)
            try:
                classes[i] = int(text.decode("utf-8").strip())
            except (UnicodeDecodeError, ValueError):
                classes[i] = -1  # refused below, with the negative numbers
            if classes[i] < 0:
                raise ConfigError([f"dataset.target: member {info.name!r} of {path} holds {text[:40]!r}; "
                                   "allowed: a class number (an integer >= 0, as text)"])
    return classes
