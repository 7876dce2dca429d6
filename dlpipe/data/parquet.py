"""Rows of parquet files as a stream (a torch IterableDataset), read with pyarrow.

A folder of parquet files larger than memory has no cheap index by row, but reads well in row
groups. The shards are (file, row group) pairs and their row counts come from the files' footers, so
the epoch's order is computed before anything is read (dlpipe.data.shards.ShardedStream): row groups
in an order drawn from (seed, epoch), their rows mixed in windows of `shuffle_buffer` rows. That
order is the same on any number of DataLoader workers and ranks, so a resumed run sees the samples
the interrupted one would have seen next. A window's rows and the row groups being read take
`buffer_bytes()` (per worker), for the loader's memory budget.

Everything a model or a bad config needs is read from the footers (or one column) when the stream is
built: a missing file or column, or a file that is not parquet, fails there, in one line, before
anything trains.
"""

from __future__ import annotations

import glob
import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dlpipe.data.generated import write_missing
from dlpipe.data.shards import ShardedStream
from dlpipe.data.tabular import TabularDataset
from dlpipe.errors import ConfigError, DataError, first_line
from dlpipe.machine.disk import atomic_file

GLOB_CHARS = frozenset("*?[")


def find_files(files: str | list[str], suffix: str = ".parquet") -> list[str]:
    """The sorted paths `files` names (a glob pattern, a folder: its `suffix` files in it and below,
    or a list of these); a pattern that matches nothing is an error naming the folder it looked in
    (a typo must not drop data)."""
    found: set[str] = set()
    for pattern in [files] if isinstance(files, str) else list(files):
        pattern = os.path.expanduser(str(pattern))
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*" + suffix)
        matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matches:
            fixed = pattern[:min((pattern.index(c) for c in GLOB_CHARS if c in pattern), default=len(pattern))]
            folder = os.path.abspath(os.path.dirname(fixed) or ".")
            raise ConfigError([f"dataset.files={pattern!r}: no file matches it in {folder}; "
                               f"expected {suffix.lstrip('.')} files (a glob pattern or a list of paths and patterns)"])
        found.update(os.path.abspath(p) for p in matches)
    return sorted(found)


def open_parquet(path: str) -> pq.ParquetFile:
    """The file's footer (schema, row groups), or pyarrow's reason it is not a parquet file."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError([f"dataset.files: {path} is not a readable parquet file: {first_line(e)}"]) from e


def is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def is_vector(kind: pa.DataType) -> bool:
    """A list column of numbers: one row holds several features (an embedding, say)."""
    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return lists and is_number(kind.value_type)


def check_column(key: str, name: str, path: str, schema: pa.Schema, allowed) -> pa.DataType:
    """The column's type, or one line naming the key, the column, the file and what it holds."""
    if name not in schema.names:
        raise ConfigError([f"dataset.{key}: column {name!r} is not in {path}; its columns: {', '.join(schema.names)}"])
    kind = schema.field(name).type
    if not allowed(kind):
        what = "numbers or lists of numbers" if key == "input" else "integers (classes) or floats (a regression)"
        raise ConfigError([f"dataset.{key}: column {name!r} of {path} holds {kind}; allowed: {what}"])
    return kind


def features_of(table: pa.Table, columns: list[str]) -> np.ndarray:
    """float32 [rows, features]: number columns side by side, a list column spread over its length."""
    parts = []
    for name in columns:
        column = table.column(name).combine_chunks()
        if is_vector(column.type):
            parts.append(column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), -1))
        else:
            parts.append(column.to_numpy(zero_copy_only=False).reshape(-1, 1))
    return np.concatenate(parts, axis=1).astype(np.float32, copy=False)


def read_group(path: str, group: int, columns: list[str], opened: dict, convert):
    """`convert` of one row group's columns; a row group that cannot be read (a file cut short or
    changed since the stream was built, a missing value) is a DataError naming the file and the row
    group. `opened` keeps the last file's footer, read once for its row groups in a row."""
    try:
        if path not in opened:
            opened.clear()
            opened[path] = pq.ParquetFile(path)
        table = opened[path].read_row_group(group, columns=columns)
        missing = [name for name in columns if table.column(name).null_count]
        if missing:
            raise ValueError(f"missing values in column {missing[0]!r}")
        return convert(table)
    except Exception as e:
        raise DataError(f"dataset.files: {path} row group {group} cannot be read: "
                        f"{type(e).__name__}: {first_line(e)}") from e


class ParquetStream(ShardedStream):
    """Rows of parquet files, each `(features, target)`: a float32 vector of the `input` columns and,
    for an integer `target` column, a 0-d int64 tensor (a float one: float32); with `target: null`,
    the features alone.

    Args:
        files: a glob pattern, or a list of paths and patterns; read in sorted order.
        input: a column name, or a list of them stacked into one feature vector (a column may be a
            list of numbers: it adds its length).
        target: the target column, or null.
        shuffle_buffer: rows mixed together across row groups (and the row groups' order drawn each
            epoch); 0 reads the files in order.
        seed: seed of the row groups' order and the rows' mixing, with the epoch.
    """

    def __init__(self, files: str | list[str], input: str | list[str], target: str | None = None,
                 shuffle_buffer: int = 0, seed: int = 0):
        if not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise ConfigError([f"dataset.shuffle_buffer={shuffle_buffer!r}: must be an integer >= 0 (0: file order)"])
        self.files = find_files(files)
        self.input = [input] if isinstance(input, str) else [str(c) for c in input]
        if not self.input:
            raise ConfigError(["dataset.input=[]: name a column, or a list of columns for the feature vector"])
        self.target = target
        self.shuffle_buffer, self.seed, self.epoch = shuffle_buffer, int(seed), 0
        self.shards: list[tuple[str, int]] = []
        self.shard_rows: list[int] = []
        for path in self.files:
            footer = open_parquet(path)
            schema = self._check_columns(path, footer.schema_arrow)
            self.shards += [(path, group) for group in range(footer.metadata.num_row_groups)]
            self.shard_rows += [footer.metadata.row_group(group).num_rows
                                for group in range(footer.metadata.num_row_groups)]
        self._decoded: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self._opened: dict = {}  # the last file's footer, for its row groups in a row
        self._lock = threading.Lock()  # thread workers share the two caches (dlpipe.loader.stream_threads)
        if self.num_rows == 0:
            raise ConfigError([f"dataset.files: no rows in {len(self.files)} parquet file(s) ({self.files[0]}, ...)"])
        self.num_features = self._feature_count(schema)
        if self.target is not None and self.target_is_class:
            self.num_classes = self._largest_class() + 1

    @property
    def in_features(self) -> int:
        """The feature vector's length (the MLP's in_features; dlpipe fills it from num_features)."""
        return self.num_features

    def _check_columns(self, path: str, schema: pa.Schema) -> pa.Schema:
        for name in self.input:
            check_column("input", name, path, schema, lambda kind: is_number(kind) or is_vector(kind))
        if self.target is not None:
            kind = check_column("target", self.target, path, schema, is_number)
            self.target_is_class = not pa.types.is_floating(kind)  # booleans are classes 0 and 1
        return schema

    def _feature_count(self, schema: pa.Schema) -> int:
        """From the schema; a list column of varying length by its first row (that column alone)."""
        path, group = self.shards[0]
        count = 0
        for name in self.input:
            kind = schema.field(name).type
            if pa.types.is_fixed_size_list(kind):
                count += kind.list_size
            elif is_vector(kind):
                count += read_group(path, group, [name], {}, lambda rows, name=name: len(rows.column(name)[0].as_py()))
            else:
                count += 1
        return count

    def _largest_class(self) -> int:
        """The largest target over all files, reading the target column only."""
        def largest_in(table: pa.Table):
            return pc.max(table.column(self.target)).as_py()

        largest, opened = -1, {}
        for path, group in self.shards:
            top = read_group(path, group, [self.target], opened, largest_in)
            largest = max(largest, -1 if top is None else int(top))  # None: a row group without rows
        return largest

    def record_bytes(self) -> int:
        """Bytes one row takes once read: the float32 features and the target's one number."""
        target = 0 if self.target is None else 8 if self.target_is_class else 4
        return 4 * self.num_features + target

    def buffer_bytes(self) -> int:
        """A window of rows, and the two decoded row groups kept for the windows that take rows of them."""
        return super().buffer_bytes() + 2 * max(self.shard_rows) * self.record_bytes()

    def read_rows(self, shard: int, rows: np.ndarray) -> list:
        features, targets = self._row_group(shard)
        if targets is None:
            return [torch.from_numpy(features[row].copy()) for row in rows]
        dtype = torch.int64 if self.target_is_class else torch.float32
        return [(torch.from_numpy(features[row].copy()), torch.tensor(targets[row], dtype=dtype)) for row in rows]

    def _row_group(self, shard: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(features, targets) of one row group, decoded once for the windows in a row that take rows
        of it (the last two kept: a window ends in one row group and the next starts there)."""
        with self._lock:  # one decode of a row group for the threads that want it at once
            if shard not in self._decoded:
                if len(self._decoded) == 2:
                    del self._decoded[next(iter(self._decoded))]
                path, group = self.shards[shard]
                columns = self.input + ([self.target] if self.target is not None else [])
                self._decoded[shard] = read_group(path, group, columns, self._opened, self._arrays)
            return self._decoded[shard]

    def __getstate__(self) -> dict:
        # a worker reads its own: an open file does not travel, nor rows decoded in the main process
        return {key: value for key, value in self.__dict__.items() if key != "_lock"} | {"_decoded": {}, "_opened": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _arrays(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray | None]:
        targets = None
        if self.target is not None:  # booleans as classes 0 and 1
            kind = np.int64 if self.target_is_class else np.float32
            targets = table.column(self.target).to_numpy().astype(kind)
        features = features_of(table, self.input)
        if features.shape[1] != self.num_features:  # a list column longer or shorter here
            raise ValueError(f"{features.shape[1]} features a row, {self.num_features} in the first row group")
        return features, targets


class SyntheticTabularParquet(ParquetStream):
    """TabularDataset's rows (Gaussian class clusters) written once as parquet files and streamed:
    a parquet recipe that runs on a fresh machine.

    The files go to a folder of `root` named by every argument that shapes them, so other arguments
    never reuse files written for these; each file is written whole or not at all (a temp name, then
    renamed), and only when it is missing.

    Args:
        root: folder of the generated files (``~`` is expanded).
        size, num_features, num_classes, noise, seed: as TabularDataset (seed also draws the stream's
            shard order and shuffle buffer).
        files_count: number of files the rows are split into, in order, >= 1.
        row_group_size: rows per row group (a shard), >= 1.
        shuffle_buffer: as ParquetStream.
    """

    def __init__(self, root: str, size: int = 8192, num_features: int = 32, num_classes: int = 4,
                 noise: float = 0.5, seed: int = 0, files_count: int = 4, row_group_size: int = 512,
                 shuffle_buffer: int = 1024):
        for key, value in (("files_count", files_count), ("row_group_size", row_group_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError([f"dataset.{key}={value!r}: must be an integer >= 1"])
        if files_count > size:  # a file without rows
            raise ConfigError([f"dataset.files_count={files_count}: must be <= dataset.size ({size})"])
        args = dict(size=size, num_features=num_features, num_classes=num_classes, noise=noise, seed=seed)
        name = f"size{size}-features{num_features}-classes{num_classes}-noise{noise}-seed{seed}"
        folder = Path(os.path.expanduser(str(root))) / f"{name}-files{files_count}-rows{row_group_size}"
        paths = [folder / f"part-{i:05d}.parquet" for i in range(files_count)]
        write_missing(root, folder, paths, lambda: write_tables(paths, args, row_group_size))
        columns = [f"f{i}" for i in range(num_features)]
        super().__init__([str(p) for p in paths], columns, "label", shuffle_buffer, seed)


def write_tables(paths: list[Path], args: dict, row_group_size: int) -> None:
    """TabularDataset(**args)'s rows, split in order over `paths` (columns f0..fN-1 and label), each
    file that is missing written to a temp name of its own and renamed: a reader (or a second writer,
    a sweep's other job) sees no file or a whole one."""
    data = TabularDataset(**args)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for path, rows in zip(paths, np.array_split(np.arange(len(data)), len(paths)), strict=True):
        if path.is_file():
            continue
        columns = {f"f{i}": data.features[rows, i].numpy() for i in range(data.num_features)}
        table = pa.table({**columns, "label": data.labels[rows].numpy()})
        with atomic_file(path, binary=True) as f:
            pq.write_table(table, f, row_group_size=row_group_size)
