"""Built-in datasets and the train/val split: real JPEG bytes, real files on disk, real DataLoader workers."""

import io
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from dlpipe.data.sequences import TokenSequenceDataset
from dlpipe.data.tabular import TabularDataset
from dlpipe.data.vision import ImageFolderDataset, SyntheticJPEGDataset
from dlpipe.errors import DataError
from dlpipe.loader.split import train_val_split


def small_jpeg(**kwargs) -> SyntheticJPEGDataset:
    return SyntheticJPEGDataset(**{"size": 16, "image_size": 32, "crop_size": 24, "num_classes": 4, **kwargs})


def raises_data_error(match: str, fn, *args, **kwargs) -> str:
    """Call fn, expect a one-line DataError containing `match`, return its message."""
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert match in message
    assert "\n" not in message
    return message


# --- SyntheticJPEGDataset -------------------------------------------------------------------------


def test_synthetic_stores_real_jpeg_bytes_that_decode_to_the_image_size():
    ds = small_jpeg()
    assert len(ds) == 16 and len(ds.jpegs) == 16
    assert all(isinstance(b, bytes) and b.startswith(b"\xff\xd8") for b in ds.jpegs)
    with Image.open(io.BytesIO(ds.jpegs[0])) as img:
        assert img.format == "JPEG" and img.size == (32, 32)


def test_synthetic_item_shape_dtype_label_and_normalisation():
    ds = small_jpeg(augment=False)
    assert ds.num_classes == 4
    labels = set()
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == (3, 24, 24) and x.dtype == torch.float32
        assert type(y) is int and 0 <= y < 4
        labels.add(y)
        # Normalised, not raw [0, 255] or [0, 1] pixels: ImageNet stats bound values to about [-2.2, 2.7].
        assert x.min() >= -2.2 and x.max() <= 2.7 and x.min() < 0
    assert labels == {0, 1, 2, 3}


def test_synthetic_generation_is_seeded():
    assert small_jpeg(seed=3).jpegs == small_jpeg(seed=3).jpegs
    assert small_jpeg(seed=3).jpegs != small_jpeg(seed=4).jpegs


def test_augment_false_is_deterministic_and_augment_true_varies():
    plain = small_jpeg(augment=False)
    assert torch.equal(plain[5][0], plain[5][0])
    augmented = small_jpeg(augment=True)
    draws = [augmented[5][0] for _ in range(4)]
    assert any(not torch.equal(draws[0], d) for d in draws[1:])
    # Augmentation follows torch's RNG, so a seeded run repeats exactly.
    torch.manual_seed(11)
    first = augmented[5][0]
    torch.manual_seed(11)
    assert torch.equal(first, augmented[5][0])


def load_index_zero_in_two_workers(ds) -> list[torch.Tensor]:
    # batch_size=1 and sampler [0, 0]: batch 0 goes to worker 0 and batch 1 to worker 1.
    loader = DataLoader(ds, batch_size=1, sampler=[0, 0], num_workers=2)
    return [x[0] for x, _ in loader]


def test_dataloader_workers_augment_differently_and_reproducibly():
    ds = small_jpeg(augment=True)
    torch.manual_seed(0)
    first = load_index_zero_in_two_workers(ds)
    assert first[0].shape == (3, 24, 24)
    # An RNG created in __init__ would be forked into both workers and give identical crops here.
    assert not torch.equal(first[0], first[1])
    torch.manual_seed(0)
    again = load_index_zero_in_two_workers(ds)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_synthetic_dataset_is_picklable():
    ds = small_jpeg(augment=False)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.jpegs == ds.jpegs and copy.labels == ds.labels
    assert torch.equal(copy[3][0], ds[3][0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"crop_size": 40}, "dataset.crop_size=40"),
        ({"size": 0}, "dataset.size=0"),
        ({"num_classes": 1}, "dataset.num_classes=1"),
        ({"quality": 0}, "dataset.quality=0"),
    ],
)
def test_synthetic_rejects_bad_parameters(kwargs, match):
    raises_data_error(match, small_jpeg, **kwargs)


# --- ImageFolderDataset ---------------------------------------------------------------------------


def write_image(path, size=(40, 30), colour=(200, 30, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


@pytest.fixture
def image_tree(tmp_path):
    root = tmp_path / "images"
    write_image(root / "dog" / "b.png", size=(30, 60))  # portrait: resize must handle either side
    write_image(root / "cat" / "a.JPG")  # upper-case extension still counts
    write_image(root / "cat" / "nested" / "c.jpeg")
    (root / "cat" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_classes_samples_and_items(image_tree):
    ds = ImageFolderDataset(str(image_tree), image_size=32, crop_size=24, augment=False)
    assert ds.classes == ["cat", "dog"] and ds.num_classes == 2
    assert len(ds) == 3
    assert [os.path.basename(p) for p, _ in ds.samples] == ["a.JPG", "c.jpeg", "b.png"]
    assert [label for _, label in ds.samples] == [0, 0, 1]
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == (3, 24, 24) and x.dtype == torch.float32 and y == ds.samples[i][1]
    red = ds[0][0].mean(dim=(1, 2))
    assert red[0] > red[1] and red[0] > red[2]  # pixels really come from the file
    augmented = ImageFolderDataset(str(image_tree), image_size=32, crop_size=24, augment=True)
    assert augmented[2][0].shape == (3, 24, 24)
    assert pickle.loads(pickle.dumps(ds)).samples == ds.samples


def test_image_folder_extensions_filter(image_tree):
    ds = ImageFolderDataset(str(image_tree), extensions=[".PNG", ".jpeg"], image_size=32, crop_size=24)
    assert ds.extensions == (".png", ".jpeg")
    assert sorted(os.path.basename(p) for p, _ in ds.samples) == ["b.png", "c.jpeg"]


def test_image_folder_missing_root(tmp_path):
    missing = tmp_path / "nope"
    message = raises_data_error("does not exist", ImageFolderDataset, str(missing))
    assert f"dataset.root={str(missing)!r}" in message


def test_image_folder_root_is_a_file(tmp_path):
    file = tmp_path / "file.jpg"
    file.write_bytes(b"x")
    raises_data_error("is a file", ImageFolderDataset, str(file))


def test_image_folder_without_class_subfolders(tmp_path):
    write_image(tmp_path / "loose.png")  # an image directly in root is not a class
    raises_data_error("no class subfolders", ImageFolderDataset, str(tmp_path))


def test_image_folder_without_matching_images(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.txt").write_text("x")
    write_image(tmp_path / "dog" / "b.png")
    message = raises_data_error("no images with extensions", ImageFolderDataset, str(tmp_path), extensions=[".jpg"])
    assert ".jpg" in message


def test_image_folder_with_an_empty_class(tmp_path):
    write_image(tmp_path / "cat" / "a.png")
    (tmp_path / "dog").mkdir()
    raises_data_error("without images", ImageFolderDataset, str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads folders regardless of permissions")
def test_image_folder_unreadable_root(tmp_path):
    write_image(tmp_path / "cat" / "a.png")
    tmp_path.chmod(0)
    try:
        raises_data_error("permission denied", ImageFolderDataset, str(tmp_path))
    finally:
        tmp_path.chmod(0o755)


@pytest.mark.parametrize("content", ["garbage", "truncated"])
def test_image_folder_corrupt_file_names_path_and_index(tmp_path, content):
    write_image(tmp_path / "cat" / "a.png")
    bad = tmp_path / "dog" / "bad.jpg"
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    bad.parent.mkdir()
    bad.write_bytes(b"not a jpeg at all" if content == "garbage" else buf.getvalue()[:600])
    ds = ImageFolderDataset(str(tmp_path), image_size=32, crop_size=24)  # listing does not decode
    message = raises_data_error(str(bad), ds.__getitem__, 1)
    assert "index 1" in message


def test_image_folder_rejects_crop_larger_than_image(image_tree):
    raises_data_error("dataset.crop_size=64", ImageFolderDataset, str(image_tree), image_size=32, crop_size=64)


# --- TokenSequenceDataset and TabularDataset ------------------------------------------------------


def test_token_sequences_shift_by_one():
    ds = TokenSequenceDataset(size=10, seq_len=16, vocab_size=20)
    assert len(ds) == 10 and ds.num_classes == 20
    x, y = ds[3]
    assert x.shape == y.shape == (16,) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])
    assert int(ds.tokens.min()) >= 0 and int(ds.tokens.max()) < 20
    assert torch.equal(TokenSequenceDataset(size=10, seq_len=16, vocab_size=20).tokens, ds.tokens)


def test_token_sequences_follow_a_sparse_chain():
    ds = TokenSequenceDataset(size=200, seq_len=32, vocab_size=64)
    pairs = torch.stack([ds.tokens[:, :-1].flatten(), ds.tokens[:, 1:].flatten()], dim=1)
    successors = {}
    for a, b in pairs.unique(dim=0).tolist():
        successors.setdefault(a, set()).add(b)
    # Learnable: every token has at most a handful of successors out of 64.
    assert max(len(s) for s in successors.values()) <= 4


def test_token_sequences_reject_bad_parameters():
    raises_data_error("dataset.vocab_size=1", TokenSequenceDataset, vocab_size=1)
    raises_data_error("dataset.seq_len=0", TokenSequenceDataset, seq_len=0)
    raises_data_error("dataset.min_seq_len=0", TokenSequenceDataset, seq_len=8, min_seq_len=0)
    raises_data_error("dataset.min_seq_len=9: must be from 1 to dataset.seq_len=8", TokenSequenceDataset,
                      seq_len=8, min_seq_len=9)


def test_ragged_token_sequences_are_prefixes_of_the_fixed_ones():
    """min_seq_len: lengths spread over [min_seq_len, seq_len], seeded; each item the prefix of its
    fixed-length twin, still shifted by one; as_dict gives the same tensors under Hugging Face names."""
    fixed = TokenSequenceDataset(size=200, seq_len=16, vocab_size=20, seed=3)
    ragged = TokenSequenceDataset(size=200, seq_len=16, vocab_size=20, seed=3, min_seq_len=4)
    lengths = [len(ragged[i][0]) for i in range(len(ragged))]
    assert min(lengths) == 4 and max(lengths) == 16 and len(set(lengths)) == 13  # every length occurs
    for i in (0, 7, 199):
        x, y = ragged[i]
        assert len(x) == len(y) == lengths[i] and torch.equal(x[1:], y[:-1])
        assert torch.equal(x, fixed[i][0][:lengths[i]]) and torch.equal(y, fixed[i][1][:lengths[i]])
    again = TokenSequenceDataset(size=200, seq_len=16, vocab_size=20, seed=3, min_seq_len=4)
    assert torch.equal(again.lengths, ragged.lengths)
    item = TokenSequenceDataset(size=200, seq_len=16, vocab_size=20, seed=3, min_seq_len=4, as_dict=True)[7]
    assert set(item) == {"input_ids", "labels"}
    assert torch.equal(item["input_ids"], ragged[7][0]) and torch.equal(item["labels"], ragged[7][1])
    assert len(pickle.loads(pickle.dumps(ragged))[7][0]) == lengths[7]  # workers get the same lengths


def test_tabular_shapes_and_labels():
    ds = TabularDataset(size=100, num_features=8, num_classes=3)
    assert len(ds) == 100 and ds.num_classes == 3
    x, y = ds[0]
    assert x.shape == (8,) and x.dtype == torch.float32
    assert type(y) is int
    assert set(ds.labels.tolist()) == {0, 1, 2}
    assert pickle.loads(pickle.dumps(ds))[7][1] == ds[7][1]
    raises_data_error("dataset.noise=-1", TabularDataset, noise=-1)


# --- train_val_split ------------------------------------------------------------------------------


def test_split_sizes_and_disjointness():
    ds = TabularDataset(size=100, num_features=4)
    train, val = train_val_split(ds, 0.2, seed=0)
    assert (len(train), len(val)) == (80, 20)
    assert set(train.indices).isdisjoint(val.indices) and len(set(train.indices) | set(val.indices)) == 100
    _, tiny_val = train_val_split(ds, 0.001, seed=0)
    assert len(tiny_val) == 1  # never an empty validation set


def test_split_is_deterministic_per_seed_and_ignores_global_rng():
    ds = TabularDataset(size=50, num_features=4)
    torch.manual_seed(1)
    a = train_val_split(ds, 0.3, seed=7)[1].indices
    torch.manual_seed(2)
    assert train_val_split(ds, 0.3, seed=7)[1].indices == a
    assert train_val_split(ds, 0.3, seed=8)[1].indices != a


def test_split_zero_returns_the_dataset():
    ds = TabularDataset(size=10, num_features=4)
    train, val = train_val_split(ds, 0.0, seed=0)
    assert train is ds and val is None


def test_split_errors_name_the_key():
    ds = TabularDataset(size=1, num_features=4)
    raises_data_error("trainer.val_fraction=0.5", train_val_split, ds, 0.5, 0)
    raises_data_error("trainer.val_fraction=1.0", train_val_split, ds, 1.0, 0)


def test_tabular_regression_is_seeded_float_targets_a_linear_model_mostly_explains():
    from dlpipe.data.tabular import TabularRegression

    a, b = TabularRegression(size=512, num_features=8, seed=3), TabularRegression(size=512, num_features=8, seed=3)
    x, y = a[5]
    assert x.shape == (8,) and y.dtype == torch.float32 and y.dim() == 0
    assert torch.equal(a.targets, b.targets) and not torch.equal(a.targets, TabularRegression(512, 8, seed=4).targets)
    solution = torch.linalg.lstsq(a.features, a.targets.unsqueeze(1)).solution
    residual = a.targets - (a.features @ solution).squeeze(1)
    assert 0.7 < 1 - residual.var() / a.targets.var() < 0.99  # linear explains most, the sine term the rest
    with pytest.raises(DataError, match="dataset.noise=-1: must be >= 0"):
        TabularRegression(noise=-1)


def test_image_folder_grayscale_and_its_own_normalisation(tmp_path):
    """channels=1 decodes to one channel; mean/std are per channel, in [0, 1] units."""
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (40, 40), (128, 128, 128)).save(tmp_path / cls / "0.png")
    gray = ImageFolderDataset(str(tmp_path), image_size=32, crop_size=24, augment=False, channels=1,
                              mean=[0.5], std=[0.25])
    image, _ = gray[0]
    assert image.shape == (1, 24, 24)
    assert torch.allclose(image, torch.full_like(image, (128 / 255 - 0.5) / 0.25), atol=1e-5)
    rgb, _ = ImageFolderDataset(str(tmp_path), image_size=32, crop_size=24, augment=False)[0]
    assert rgb.shape == (3, 24, 24)
    with pytest.raises(DataError, match=r"dataset.channels=2: allowed: 1 \(grayscale\), 3 \(RGB\)"):
        ImageFolderDataset(str(tmp_path), channels=2)
    with pytest.raises(DataError, match=r"dataset.mean=\[0.5\]: needs 3 value\(s\), one per channel"):
        ImageFolderDataset(str(tmp_path), mean=[0.5])
