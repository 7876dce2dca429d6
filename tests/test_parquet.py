"""The built-in parquet stream (dlpipe.data.parquet), on small files written here with pyarrow: every
row once an epoch on any number of DataLoader workers, epochs drawn from (seed, epoch), a shuffle
buffer bounded by its rows, the sizes a model needs read from the footers, and each bad input one line."""

import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from dlpipe.data.parquet import ParquetStream, SyntheticTabularParquet
from dlpipe.data.shards import WINDOW_ROWS
from dlpipe.data.tabular import TabularDataset
from dlpipe.errors import ConfigError, DataError
from dlpipe.loader.streams import shares_itself

# this machine may have fewer CPUs than the 3 workers a test starts: that is the point, not a problem
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

ROWS, FILES, GROUP = 90, 3, 8  # 30 rows a file in row groups of 8: 4 shards a file, the last short


def write_rows(folder, files: int = FILES, rows: int = ROWS, group: int = GROUP) -> list[str]:
    """Rows `id` 0..rows-1 split in order over `files` files: columns id, x = 2 * id, label = id % 3."""
    folder.mkdir(exist_ok=True)
    paths = []
    for part, ids in enumerate(np.array_split(np.arange(rows), files)):
        path = folder / f"part-{part}.parquet"
        table = pa.table({"id": ids, "x": (2 * ids).astype(np.float32), "label": ids % 3, "y": ids / 10.0})
        pq.write_table(table, path, row_group_size=group)
        paths.append(str(path))
    return paths


def ids(stream, workers: int = 0) -> list[int]:
    """The `id` of each row the stream yields, in the order a DataLoader with `workers` hands them out."""
    loader = DataLoader(stream, batch_size=None, num_workers=workers)
    return [int(features[0]) for features, _ in loader]


@pytest.mark.parametrize("buffer", [0, 16])
def test_every_row_once_an_epoch_on_any_number_of_workers(tmp_path, buffer):
    write_rows(tmp_path / "rows")
    stream = ParquetStream(str(tmp_path / "rows" / "*.parquet"), ["id", "x"], "label", shuffle_buffer=buffer)
    assert len(stream.shards) == FILES * 4
    for workers in (0, 2, 3):
        assert Counter(ids(stream, workers)) == Counter(range(ROWS)), workers
    if buffer == 0:  # no buffer: the files' order
        assert ids(stream) == list(range(ROWS))


def test_items_are_float32_features_and_an_int64_or_float32_target(tmp_path):
    write_rows(tmp_path / "rows")
    features, label = next(iter(ParquetStream(str(tmp_path / "rows"), ["id", "x"], "label")))
    assert features.dtype == torch.float32 and features.tolist() == [0.0, 0.0]
    assert label.dtype == torch.int64 and label.shape == () and int(label) == 0
    pq.write_table(pa.table({"x": [1.0, 2.0], "yes": [False, True]}), tmp_path / "flags.parquet")
    flags = ParquetStream(str(tmp_path / "flags.parquet"), "x", "yes")
    assert flags.num_classes == 2 and [(int(y), y.dtype) for _, y in flags] == [(0, torch.int64), (1, torch.int64)]
    features, y = list(ParquetStream(str(tmp_path / "rows"), "x", "y"))[5]
    assert features.tolist() == [10.0] and y.dtype == torch.float32 and y.shape == () and float(y) == pytest.approx(0.5)
    only = next(iter(ParquetStream(str(tmp_path / "rows"), "x", None)))
    assert isinstance(only, torch.Tensor) and only.shape == (1,)


def test_epochs_are_drawn_from_the_seed_and_the_epoch(tmp_path):
    write_rows(tmp_path / "rows")

    def epoch(n: int, seed: int = 7, workers: int = 0) -> list[int]:
        files = [str(tmp_path / "rows" / "part-*.parquet")]
        stream = ParquetStream(files, ["id"], "label", shuffle_buffer=16, seed=seed)
        stream.set_epoch(n)
        return ids(stream, workers)

    first = epoch(0)
    assert first == epoch(0) and epoch(0, workers=2) == epoch(0, workers=2)
    assert first != list(range(ROWS)) and first != epoch(1) and first != epoch(0, seed=8)
    assert sorted(epoch(1)) == list(range(ROWS))


def test_the_shuffle_buffer_holds_at_most_its_rows(tmp_path):
    write_rows(tmp_path / "one", files=1, group=ROWS)  # one shard: rows are read in id order
    stream = ParquetStream(str(tmp_path / "one" / "*.parquet"), ["id", "x"], "label", shuffle_buffer=10)
    out = ids(stream)
    assert sorted(out) == list(range(ROWS)) and out != list(range(ROWS))
    # the k-th row out is drawn from the 10 held before the (k + 10)-th row was read: never a later one
    assert max(row - k for k, row in enumerate(out)) == 10 - 1
    # a window of 10 rows and two decoded row groups (of 90 rows): 2 float32 features and an int64 target a row
    assert stream.buffer_bytes() == (10 + 2 * ROWS) * (2 * 4 + 8)
    float_target = ParquetStream(str(tmp_path / "one" / "*.parquet"), "x", "y", shuffle_buffer=10)
    assert float_target.buffer_bytes() == (10 + 2 * ROWS) * (4 + 4)
    in_order = ParquetStream(str(tmp_path / "one" / "*.parquet"), "x", "y")  # read in windows of WINDOW_ROWS
    assert in_order.buffer_bytes() == (WINDOW_ROWS + 2 * ROWS) * (4 + 4)


def test_sizes_come_from_the_footers_and_the_target_column(tmp_path):
    write_rows(tmp_path / "rows")
    stream = ParquetStream(str(tmp_path / "rows" / "*.parquet"), ["id", "x"], "label")
    assert (stream.num_rows, stream.num_classes, stream.in_features, stream.num_features) == (ROWS, 3, 2, 2)
    assert not hasattr(stream, "__len__")  # a stream: no length for a sampler to use
    assert not hasattr(ParquetStream(str(tmp_path / "rows"), "x", "y"), "num_classes")  # a regression

    vectors = pa.array([[float(i), float(i + 1), 0.0] for i in range(6)], type=pa.list_(pa.float32(), 3))
    labels = [0, 1, 0, 1, 4, 1]
    pq.write_table(pa.table({"v": vectors, "extra": list(range(6)), "label": labels}), tmp_path / "v.parquet")
    wide = ParquetStream(str(tmp_path / "v.parquet"), ["v", "extra"], "label")
    assert (wide.in_features, wide.num_classes, wide.num_rows) == (4, 5, 6)
    assert next(iter(wide))[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    listed = pa.array([[1.0, 2.0]] * 4)  # a list of varying length type: its length from the first row
    pq.write_table(pa.table({"v": listed, "label": [0, 1, 1, 0]}), tmp_path / "l.parquet")
    assert ParquetStream(str(tmp_path / "l.parquet"), "v", "label").in_features == 2


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_bad_files_and_columns_are_one_line_each_before_any_row_is_read(tmp_path):
    paths = write_rows(tmp_path / "rows")
    with pytest.raises(ConfigError) as e:
        ParquetStream(str(tmp_path / "rows" / "*.parq"), "x", "label")
    assert one_line(e) == (f"dataset.files={str(tmp_path / 'rows' / '*.parq')!r}: no file matches it in "
                           f"{tmp_path / 'rows'}; expected parquet files "
                           "(a glob pattern or a list of paths and patterns)")
    with pytest.raises(ConfigError) as e:
        ParquetStream([paths[0], str(tmp_path / "gone.parquet")], "x", "label")
    gone = str(tmp_path / "gone.parquet")
    assert one_line(e).startswith(f"dataset.files={gone!r}: no file matches it in {tmp_path}; expected parquet")

    with pytest.raises(ConfigError) as e:
        ParquetStream(paths, ["x", "z"], "label")
    assert one_line(e) == f"dataset.input: column 'z' is not in {paths[0]}; its columns: id, x, label, y"
    with pytest.raises(ConfigError) as e:
        ParquetStream(paths, "x", "labels")
    assert one_line(e) == f"dataset.target: column 'labels' is not in {paths[0]}; its columns: id, x, label, y"
    pq.write_table(pa.table({"x": [1.0], "name": ["a"]}), tmp_path / "names.parquet")
    with pytest.raises(ConfigError) as e:
        ParquetStream(str(tmp_path / "names.parquet"), "x", "name")
    assert one_line(e) == (f"dataset.target: column 'name' of {tmp_path / 'names.parquet'} holds string; "
                           "allowed: integers (classes) or floats (a regression)")

    (tmp_path / "rows.csv").write_text("id,x,label\n0,0,0\n")
    with pytest.raises(ConfigError) as e:
        ParquetStream([paths[0], str(tmp_path / "rows.csv")], "x", "label")
    assert one_line(e) == (f"dataset.files: {tmp_path / 'rows.csv'} is not a readable parquet file: "
                           "Parquet magic bytes not found in footer. "
                           "Either the file is corrupted or this is not a parquet file.")
    with pytest.raises(ConfigError) as e:
        ParquetStream(paths, "x", "label", shuffle_buffer=-1)
    assert one_line(e) == "dataset.shuffle_buffer=-1: must be an integer >= 0 (0: file order)"


def test_a_row_group_that_cannot_be_read_names_its_file_and_row_group(tmp_path):
    paths = write_rows(tmp_path / "rows")
    stream = ParquetStream(paths, ["id", "x"], "label")
    data = open(paths[1], "rb").read()
    open(paths[1], "wb").write(data[: len(data) // 2])  # cut short after the stream was built
    with pytest.raises(DataError) as e:
        list(stream)
    assert one_line(e).startswith(f"dataset.files: {paths[1]} row group 0 cannot be read: ")
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    with pytest.raises(DataError, match=f"{paths[1]} row group [0-3] cannot be read"):
        list(loader)

    data = bytearray(open(paths[2], "rb").read())
    label = pq.ParquetFile(paths[2]).metadata.row_group(0).column(2)  # the label column's first chunk
    start = label.dictionary_page_offset or label.data_page_offset
    data[start:start + 16] = b"\xab" * 16  # overwritten; the footer intact
    open(paths[2], "wb").write(bytes(data))
    with pytest.raises(DataError) as e:
        ParquetStream(paths[2], "x", "label")  # found when the target column is read for num_classes
    assert one_line(e).startswith(f"dataset.files: {paths[2]} row group 0 cannot be read: OSError: ")
    pq.write_table(pa.table({"x": [1.0, None, 3.0], "label": [0, 1, 0]}), tmp_path / "gaps.parquet")
    with pytest.raises(DataError) as e:
        list(ParquetStream(str(tmp_path / "gaps.parquet"), "x", "label"))
    assert one_line(e) == (f"dataset.files: {tmp_path / 'gaps.parquet'} row group 0 cannot be read: "
                           "ValueError: missing values in column 'x'")


def test_the_stream_shares_itself_out_among_workers(tmp_path):
    write_rows(tmp_path / "rows")
    for buffer in (0, 16):
        stream = ParquetStream(str(tmp_path / "rows" / "*.parquet"), ["id", "x"], "label", shuffle_buffer=buffer)
        shares, why = shares_itself(stream, None, 60)
        assert shares is True, why


def test_the_synthetic_tables_are_written_once_and_hold_tabular_datasets_rows(tmp_path):
    args = dict(size=300, num_features=5, num_classes=3, noise=0.5, seed=4)
    shape = dict(files_count=3, row_group_size=40, shuffle_buffer=32)
    stream = SyntheticTabularParquet(str(tmp_path / "cache"), **args, **shape)
    files = sorted((tmp_path / "cache").rglob("*.parquet"))
    assert len(files) == 3 and [os.path.basename(f) for f in stream.files] == [f.name for f in files]
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # renamed into place, nothing left half-written
    assert (stream.num_rows, stream.num_classes, stream.in_features, len(stream.shards)) == (300, 3, 5, 9)
    written = {f: f.stat().st_mtime_ns for f in files}

    again = SyntheticTabularParquet(str(tmp_path / "cache"), **args, **shape)
    assert {f: f.stat().st_mtime_ns for f in files} == written  # reused, not rewritten
    table = TabularDataset(**args)
    expected = Counter((tuple(x.tolist()), int(y)) for x, y in zip(table.features, table.labels, strict=True))
    assert Counter((tuple(x.tolist()), int(y)) for x, y in again) == expected

    SyntheticTabularParquet(str(tmp_path / "cache"), **{**args, "seed": 5}, files_count=3, row_group_size=40)
    assert len(list((tmp_path / "cache").rglob("*.parquet"))) == 6  # other rows: files of their own
    with pytest.raises(ConfigError) as e:
        SyntheticTabularParquet(str(tmp_path / "cache"), **args, files_count=0)
    assert one_line(e) == "dataset.files_count=0: must be an integer >= 1"
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError) as e:
        SyntheticTabularParquet(str(tmp_path / "file" / "cache"), **args)
    assert one_line(e).startswith(f"dataset.root={str(tmp_path / 'file' / 'cache')!r}: cannot write ")
