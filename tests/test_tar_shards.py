"""The built-in tar-shard stream (dlpipe.data.tar_shards), on small webdataset-format tars written here
with tarfile: every sample once an epoch on any number of DataLoader workers, epochs drawn from
(seed, epoch), only the samples asked for decoded, each bad input one line naming its file and member,
and the vision_shards recipe through the real `dlpipe` command."""

import io
import math
import os
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import runs_of
from PIL import Image
from torch.utils.data import DataLoader

from dlpipe.data.tar_shards import SyntheticJPEGShards, TarShards
from dlpipe.data.vision import SyntheticJPEGDataset
from dlpipe.errors import ConfigError, DataError
from dlpipe.loader.streams import shares_itself

# this machine may have fewer CPUs than the 3 workers a test starts: that is the point, not a problem
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SAMPLES, TARS, SIDE = 30, 3, 8  # 10 samples a tar, 8 x 8 images


def jpeg(shade: int) -> bytes:
    """Red `shade`, green 255 - shade, blue a gradient from left to right: a crop or a flip shows."""
    pixels = np.empty((SIDE, SIDE, 3), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = shade, 255 - shade, np.linspace(0, 255, SIDE)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tars(folder, tars: int = TARS, samples: int = SAMPLES, members=("jpg", "cls")) -> list[str]:
    """Samples 0..samples-1 split in order over `tars` tars, webdataset's layout: `s000007.jpg` (a
    plain image, one shade a sample), `s000007.cls` = the sample's number, as text."""
    folder.mkdir(exist_ok=True)
    paths = []
    for part, numbers in enumerate(np.array_split(np.arange(samples), tars)):
        path = folder / f"shard-{part}.tar"
        with tarfile.open(path, "w") as tar:
            for n in numbers:
                data = {"jpg": jpeg(int(n) * 8), "cls": str(n).encode(), "npy": npy([float(n), 1.0])}
                for extension in members:
                    add(tar, f"part{part}/s{n:06d}.{extension}", data[extension])
        paths.append(str(path))
    return paths


def npy(values) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.array(values, np.float32))
    return buf.getvalue()


def stream(folder, **args) -> TarShards:
    return TarShards(str(folder), **{"image_size": SIDE, "crop_size": SIDE, "augment": False, **args})


def numbers(shards, workers: int = 0) -> list[int]:
    """The class (= the sample's number) of each sample, in the order a DataLoader with `workers` hands them out."""
    return [int(target) for _, target in DataLoader(shards, batch_size=None, num_workers=workers)]


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("buffer", [0, 8])
def test_every_sample_once_an_epoch_on_any_number_of_workers(tmp_path, buffer):
    write_tars(tmp_path / "tars")
    shards = stream(tmp_path / "tars", shuffle_buffer=buffer)
    assert shards.shard_rows == [10, 10, 10] and shards.num_rows == SAMPLES
    for workers in (0, 2, 3):
        assert Counter(numbers(shards, workers)) == Counter(range(SAMPLES)), workers
    if buffer == 0:  # no buffer: the files' order
        assert numbers(shards) == list(range(SAMPLES))
    assert shares_itself(shards, None, 60)[0] is True


def test_items_are_normalised_images_or_stored_tensors_and_a_class(tmp_path):
    write_tars(tmp_path / "tars")
    shards = stream(tmp_path / "tars", shuffle_buffer=4)
    image, target = next(iter(TarShards(str(tmp_path / "tars" / "shard-0.tar"), image_size=SIDE, crop_size=6,
                                        augment=False)))
    assert image.dtype == torch.float32 and image.shape == (3, 6, 6) and target == 0
    assert image[0].mean() < -1.5 < 1.5 < image[1].mean()  # red 0, green 255, normalised by ImageNet's statistics
    assert shards.num_classes == SAMPLES
    jpegs = [m.size for path in sorted((tmp_path / "tars").glob("*.tar")) for m in tarfile.open(path)
             if m.name.endswith(".jpg")]
    assert shards.buffer_bytes() == 4 * (math.ceil(sum(jpegs) / len(jpegs)) + 8)  # a window: JPEG bytes and a class
    alone = next(iter(stream(tmp_path / "tars", target=None)))
    assert isinstance(alone, torch.Tensor) and not hasattr(stream(tmp_path / "tars", target=None), "num_classes")

    write_tars(tmp_path / "tensors", members=("npy", "cls"))
    tensors = TarShards(str(tmp_path / "tensors"), input="npy", target=".cls")
    assert [(x.tolist(), y) for x, y in tensors][:2] == [([0.0, 1.0], 0), ([1.0, 1.0], 1)]
    either = TarShards(str(tmp_path / "tensors"), input="png;npy")  # the first extension a sample has
    assert next(iter(either))[0].tolist() == [0.0, 1.0]


def test_epochs_are_drawn_from_the_seed_and_the_epoch(tmp_path):
    write_tars(tmp_path / "tars")

    orders = {}
    for seed, epoch, workers in ((7, 0, 0), (7, 0, 0), (7, 0, 2), (7, 0, 3), (7, 1, 0), (8, 0, 0)):
        shards = stream(tmp_path / "tars", shuffle_buffer=8, seed=seed)
        shards.set_epoch(epoch)
        orders.setdefault((seed, epoch), []).append(numbers(shards, workers))
    first = orders[7, 0][0]
    assert orders[7, 0] == [first] * 4  # the order is computed: the same again, and on 2 or 3 workers
    assert first != list(range(SAMPLES)) and first != orders[7, 1][0] and first != orders[8, 0][0]
    assert sorted(orders[7, 1][0]) == list(range(SAMPLES))


def test_augmentations_follow_the_sample_and_epoch_not_the_worker(tmp_path):
    write_tars(tmp_path / "tars")
    shards = TarShards(str(tmp_path / "tars"), image_size=SIDE, crop_size=6, augment=True, shuffle_buffer=8, seed=3)

    def images(workers: int) -> dict[int, torch.Tensor]:
        return {int(y): x for x, y in DataLoader(shards, batch_size=None, num_workers=workers)}

    alone, shared = images(0), images(2)
    assert all(torch.equal(alone[n], shared[n]) for n in range(SAMPLES))
    shards.set_epoch(1)
    assert not all(torch.equal(alone[n], x) for n, x in images(0).items())


def test_only_the_samples_asked_for_are_decoded(tmp_path, monkeypatch):
    write_tars(tmp_path / "tars")
    shards = stream(tmp_path / "tars", shuffle_buffer=8, seed=1)
    decoded = []
    real = TarShards._decode
    monkeypatch.setattr(TarShards, "_decode", lambda self, name, *rest: decoded.append(name) or real(self, name, *rest))
    kept = [int(y) for _, y in shards.read_positions(lambda positions: positions % 5 == 2)]
    assert decoded == [f"part{n // 10}/s{n:06d}.jpg" for n in kept]  # those and no other
    assert kept == numbers(shards)[2::5]


def test_bad_files_and_samples_are_one_line_each_before_anything_is_read(tmp_path):
    paths = write_tars(tmp_path / "tars")
    with pytest.raises(ConfigError) as e:
        TarShards(str(tmp_path / "tars" / "*.tgz"))
    assert one_line(e) == (f"dataset.files={str(tmp_path / 'tars' / '*.tgz')!r}: no file matches it in "
                           f"{tmp_path / 'tars'}; expected tar files (a glob pattern or a list of paths and patterns)")
    (tmp_path / "notes.tar").write_text("not a tar\n" * 100)
    with pytest.raises(ConfigError) as e:
        TarShards([paths[0], str(tmp_path / "notes.tar")])
    assert one_line(e).startswith(f"dataset.files: {tmp_path / 'notes.tar'} is not a readable tar file "
                                  "(an uncompressed tar, as webdataset writes them): ")
    with tarfile.open(tmp_path / "packed.tar", "w:gz") as tar:
        add(tar, "a.cls", b"1")
    with pytest.raises(ConfigError, match="packed.tar is not a readable tar file"):
        TarShards(str(tmp_path / "packed.tar"))

    write_tars(tmp_path / "images", members=("jpg",))
    with pytest.raises(ConfigError) as e:
        TarShards(str(tmp_path / "images"))
    assert one_line(e) == (f"dataset.files: {tmp_path / 'images' / 'shard-0.tar'} sample 'part0/s000000' has no "
                           "cls member (dataset.target); its members: jpg")
    with pytest.raises(ConfigError) as e:
        TarShards(str(tmp_path / "tars"), input="png;webp")
    assert one_line(e) == (f"dataset.files: {paths[0]} sample 'part0/s000000' has no png|webp member "
                           "(dataset.input); its members: cls, jpg")
    with tarfile.open(tmp_path / "words.tar", "w") as tar:
        add(tar, "a.jpg", jpeg(0))
        add(tar, "a.cls", b"cat")
    with pytest.raises(ConfigError) as e:
        TarShards(str(tmp_path / "words.tar"))
    assert one_line(e) == (f"dataset.target: member 'a.cls' of {tmp_path / 'words.tar'} holds b'cat'; "
                           "allowed: a class number (an integer >= 0, as text)")
    for args, line in ((dict(shuffle_buffer=-1), "dataset.shuffle_buffer=-1: must be an integer >= 0 (0: file order)"),
                       (dict(input=";"), "dataset.input=';': name a member extension, like jpg (or jpg;png: "
                                         "the first a sample has)")):
        with pytest.raises(ConfigError) as e:
            TarShards(paths, **args)
        assert one_line(e) == line


def member(path: str, name: str) -> tarfile.TarInfo:
    with tarfile.open(path) as tar:
        return tar.getmember(name)


def test_a_tar_cut_short_names_its_file_and_member(tmp_path):
    paths = write_tars(tmp_path / "tars")
    cut = member(paths[1], "part1/s000014.jpg")
    os.truncate(paths[1], cut.offset_data + cut.size // 2)  # in the middle of a member's data
    with pytest.raises(ConfigError) as e:
        TarShards(str(tmp_path / "tars"))
    assert one_line(e).startswith(f"dataset.files: {paths[1]} is cut short: member 'part1/s000014.jpg' needs bytes ")

    whole = member(paths[2], "part2/s000025.cls")
    os.truncate(paths[2], whole.offset_data + 512)  # at a member's end: tarfile reads on as if the tar ended there
    with pytest.raises(ConfigError) as e:
        TarShards(paths[2])
    assert one_line(e) == (f"dataset.files: {paths[2]} is cut short after member 'part2/s000025.cls': the tar's "
                           "end blocks do not follow it (later members lost?)")
    os.truncate(paths[0], member(paths[0], "part0/s000003.jpg").offset + 100)  # in the middle of a header
    with pytest.raises(ConfigError, match=f"{paths[0]} is cut short after member 'part0/s000002.cls'"):
        TarShards(paths[0])


def error_of(loader: DataLoader) -> str:
    """The DataError reading `loader` ends with; caught here, so that the failed loader's workers stop
    as it goes (a test's record of the error would keep them waiting until the test ends)."""
    try:
        list(loader)
    except DataError as e:
        return str(e)
    return "no error"


def test_a_member_that_cannot_be_decoded_names_its_file_and_member(tmp_path):
    paths = write_tars(tmp_path / "tars")
    shards = stream(tmp_path / "tars")
    broken = member(paths[1], "part1/s000012.jpg")
    with open(paths[1], "r+b") as f:  # overwritten after the stream was built, the tar's layout intact
        f.seek(broken.offset_data)
        f.write(b"\xab" * broken.size)
    first_tar = shards.read_positions(lambda positions: positions < 10)
    assert [int(y) for _, y in first_tar] == list(range(10))  # the other tars' samples are not read
    with pytest.raises(DataError) as e:
        list(shards)
    assert one_line(e).startswith(f"dataset.files: {paths[1]} member 'part1/s000012.jpg' cannot be decoded: "
                                  "UnidentifiedImageError: ")
    assert f"{paths[1]} member 'part1/s000012.jpg' cannot be decoded" in error_of(
        DataLoader(shards, batch_size=None, num_workers=2))
    os.truncate(paths[2], 1024)  # the first member's data runs past the new end
    with pytest.raises(DataError, match=f"{paths[2]} member 'part2/s000020.jpg' cannot be decoded: EOFError: "):
        list(shards.read_positions(lambda positions: positions >= 20))


def test_the_synthetic_shards_are_written_once_and_hold_the_vision_datasets_images(tmp_path):
    args = dict(size=40, image_size=16, crop_size=12, num_classes=3, quality=80, seed=4)
    shards = SyntheticJPEGShards(str(tmp_path / "cache"), **args, shard_size=16, shuffle_buffer=8)
    files = sorted((tmp_path / "cache").rglob("*.tar"))
    assert [f.name for f in files] == ["shard-00000.tar", "shard-00001.tar", "shard-00002.tar"]
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # renamed into place, nothing left half-written
    assert (shards.shard_rows, shards.num_classes) == ([16, 16, 8], 3)
    assert next(iter(shards))[0].shape == (3, 12, 12)
    written = {f: f.stat().st_mtime_ns for f in files}

    again = SyntheticJPEGShards(str(tmp_path / "cache"), **args, shard_size=16)
    assert {f: f.stat().st_mtime_ns for f in files} == written  # reused, not rewritten
    vision = SyntheticJPEGDataset(**args)
    stored = []
    for path in again.files:
        with tarfile.open(path) as tar:
            stored += [tar.extractfile(info).read() for info in tar]
    assert stored[0::2] == vision.jpegs and [int(c) for c in stored[1::2]] == vision.labels

    files[1].unlink()
    SyntheticJPEGShards(str(tmp_path / "cache"), **args, shard_size=16)
    assert files[1].is_file() and {f: f.stat().st_mtime_ns for f in files if f != files[1]} == {
        f: t for f, t in written.items() if f != files[1]}  # only the missing tar written again
    SyntheticJPEGShards(str(tmp_path / "cache"), **{**args, "seed": 5}, shard_size=16)
    assert len(list((tmp_path / "cache").rglob("*.tar"))) == 6  # other images: tars of their own


def test_bad_synthetic_shards_arguments_and_roots_are_one_line(tmp_path):
    for key in ("size", "shard_size"):
        with pytest.raises(ConfigError) as e:
            SyntheticJPEGShards(str(tmp_path / "cache"), **{key: 0})
        assert one_line(e) == f"dataset.{key}=0: must be an integer >= 1"
    (tmp_path / "file").write_text("")  # a file where the cache's folder would go
    with pytest.raises(DataError) as e:
        SyntheticJPEGShards(str(tmp_path / "file" / "cache"), size=4, image_size=8, crop_size=8)
    assert one_line(e).startswith(f"dataset.root={str(tmp_path / 'file' / 'cache')!r}: cannot write ")
    assert not (tmp_path / "cache").exists()


def test_the_vision_shards_recipe_trains_on_a_fresh_machine(dlpipe, mlflow_store, mlflow_client):
    r = dlpipe("+recipe=vision_shards", "dataset.size=64", "dataset.shard_size=16", "trainer.epochs=1",
               "loader.num_workers=2", "val_dataset.size=32", "trainer.progress=false",
               f"tracking.uri={mlflow_store}", "tracking.experiment=vision-shards")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "vision-shards")
    assert run.info.status == "FINISHED" and {"val/loss", "val/accuracy"} <= set(run.data.metrics)


def test_a_truncated_tar_is_one_line_before_anything_is_tracked(dlpipe, tmp_path, mlflow_store, mlflow_client):
    paths = write_tars(tmp_path / "tars")
    cut = member(paths[2], "part2/s000021.jpg")
    os.truncate(paths[2], cut.offset_data + 10)
    r = dlpipe("dataset=tar_shards", f"dataset.files={tmp_path / 'tars'}", "model=cnn", "trainer.val_fraction=0",
               f"tracking.uri={mlflow_store}", "tracking.experiment=tar-cut")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"dlpipe: error: dataset.files: {paths[2]} is cut short: member 'part2/s000021.jpg' needs bytes "
        f"{cut.offset_data}..{cut.offset_data + cut.size} and the file ends at {cut.offset_data + 10}"]
    assert runs_of(mlflow_client, "tar-cut") == [] and not (tmp_path / "outputs").exists()
