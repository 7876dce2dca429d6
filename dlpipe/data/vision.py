"""Image datasets whose per-item cost is real CPU work: JPEG/PNG decode, crop, flip, normalise.

Both datasets share one decode/augment path (`load_rgb` + `to_tensor`), so a loader setting that
helps one helps the other. No torchvision: Pillow does the pixel work, torch only the last step.

Per-item randomness comes from dlpipe.sample_rng.sample_generator(): in training, a generator that
depends on (seed, epoch, sample index) only, so a sample is augmented the same way whichever worker
process or thread fetches it, and a run resumed with other loader settings sees the same batches.
Outside training's fetch it is torch's global RNG, drawn at call time: never an RNG built in
`__init__`, which every forked worker would copy and repeat.
"""

from __future__ import annotations

import colorsys
import io
import math
import os
import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from dlpipe.errors import DataError, first_line
from dlpipe.sample_rng import sample_generator

# ImageNet statistics: the usual choice, and close enough for synthetic images that nothing depends on it.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# The same statistics for grayscale images (of ImageNet converted to luminance), as commonly used.
GRAY_MEAN, GRAY_STD = (0.449,), (0.226,)
MODES = {1: "L", 3: "RGB"}  # channels -> Pillow mode

# torchvision's RandomResizedCrop range for aspect ratios; the area range comes from the spec.
_SCALE = (0.6, 1.0)
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))

DEFAULT_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def load_rgb(source: bytes | str, mode: str = "RGB") -> Image.Image:
    """Decode encoded bytes or a file path to an RGB (or `mode`) image (forces the full decode now)."""
    with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
        # convert() loads every pixel, so a truncated file fails here and not later in a worker.
        return img.convert(mode)


def resize_shorter(img: Image.Image, size: int) -> Image.Image:
    w, h = img.size
    if min(w, h) == size:
        return img
    scale = size / min(w, h)
    return img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BILINEAR)


def _random_box(w: int, h: int, rng: random.Random) -> tuple[int, int, int, int]:
    """A crop box covering 60-100% of the area with aspect 3/4-4/3 (torchvision's algorithm)."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(*_SCALE)
        ratio = math.exp(rng.uniform(*_LOG_RATIO))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return left, top, left + cw, top + ch
    side = min(w, h)  # fallback after unlucky draws: the largest centred square
    left, top = (w - side) // 2, (h - side) // 2
    return left, top, left + side, top + side


def to_tensor(img: Image.Image, crop_size: int, augment: bool, mean: Sequence[float] = MEAN,
              std: Sequence[float] = STD) -> torch.Tensor:
    """Crop (random-resized or centred) to crop_size, maybe flip, and normalise per channel to
    float32 [C, c, c] (C = 3 for RGB, 1 for grayscale). The augmentation draws from the sample's
    sample_generator()."""
    w, h = img.size
    if augment:
        # One 62-bit draw from the sample's generator seeds a local RNG: the few numbers below cost one
        # torch call instead of five.
        draw = torch.randint(0, 2**62, (), generator=sample_generator())
        rng = random.Random(int(draw.item()))
        # resize(box=...) crops and scales in one pass over the pixels.
        img = img.resize((crop_size, crop_size), Image.Resampling.BILINEAR, box=_random_box(w, h, rng))
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    else:
        left, top = (w - crop_size) // 2, (h - crop_size) // 2
        img = img.crop((left, top, left + crop_size, top + crop_size))
    array = np.array(img, dtype=np.float32)
    pixels = torch.from_numpy(array[:, :, None] if array.ndim == 2 else array).permute(2, 0, 1)  # HWC -> CHW
    channels = pixels.shape[0]
    mean = torch.tensor(mean, dtype=torch.float32).mul_(255.0).view(channels, 1, 1)
    std = torch.tensor(std, dtype=torch.float32).mul_(255.0).view(channels, 1, 1)
    return pixels.sub_(mean).div_(std).contiguous()


def check_sizes(image_size: int, crop_size: int) -> None:
    if image_size < 1:
        raise DataError(f"dataset.image_size={image_size}: must be >= 1")
    if not 1 <= crop_size <= image_size:
        raise DataError(f"dataset.crop_size={crop_size}: must be between 1 and dataset.image_size={image_size}")


def check_channels(channels: int, mean, std) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """(channels, mean, std) as plain tuples (Hydra may hand over ListConfigs, which should not travel
    to workers), with the defaults for the channel count."""
    if channels not in MODES:
        raise DataError(f"dataset.channels={channels}: allowed: 1 (grayscale), 3 (RGB)")
    defaults = (MEAN, STD) if channels == 3 else (GRAY_MEAN, GRAY_STD)
    mean = tuple(float(v) for v in mean) if mean is not None else defaults[0]
    std = tuple(float(v) for v in std) if std is not None else defaults[1]
    for key, values in (("mean", mean), ("std", std)):
        if len(values) != channels:
            raise DataError(f"dataset.{key}={list(values)}: needs {channels} value(s), one per channel")
    if not all(v > 0 for v in std):
        raise DataError(f"dataset.std={list(std)}: every value must be > 0")
    return channels, mean, std


class SyntheticJPEGDataset(Dataset):
    """Generated images stored as real JPEG bytes, decoded and augmented on every access.

    The class decides the stripe colour and frequency; orientation, phase and noise are random per
    image. Both class cues survive flips and crops, so a small CNN learns them with augmentation on.

    Args:
        size: number of images (generated once in ``__init__``), >= 1.
        image_size: side of the square stored images in pixels, >= 1.
        crop_size: side of the returned tensors, 1..image_size.
        num_classes: number of classes, >= 2; labels are balanced (index modulo num_classes).
        quality: JPEG quality passed to Pillow, 1..95 (above 95 Pillow only grows the files).
        augment: random resized crop (60-100% of the area) plus horizontal flip when true,
            a centre crop when false (deterministic).
        seed: seed of the image generator (not of the augmentations), >= 0.
    """

    def __init__(
        self,
        size: int = 2048,
        image_size: int = 64,
        crop_size: int = 56,
        num_classes: int = 10,
        quality: int = 90,
        augment: bool = True,
        seed: int = 0,
    ):
        if size < 1:
            raise DataError(f"dataset.size={size}: must be >= 1")
        check_sizes(image_size, crop_size)
        if num_classes < 2:
            raise DataError(f"dataset.num_classes={num_classes}: must be >= 2")
        if not 1 <= quality <= 95:
            raise DataError(f"dataset.quality={quality}: must be between 1 and 95")
        if seed < 0:
            raise DataError(f"dataset.seed={seed}: must be >= 0")
        self.crop_size = int(crop_size)
        self.num_classes = int(num_classes)
        self.augment = bool(augment)
        self.labels = [i % num_classes for i in range(size)]
        self.jpegs = [
            _encode_jpeg(img, quality)
            for img in _stripe_images(np.array(self.labels), image_size, num_classes, seed)
        ]

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return to_tensor(load_rgb(self.jpegs[index]), self.crop_size, self.augment), self.labels[index]


def _stripe_images(labels: np.ndarray, image_size: int, num_classes: int, seed: int) -> np.ndarray:
    """uint8 [N, S, S, 3] sine stripes: class -> hue and frequency; random angle, phase and noise."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    coords = np.linspace(0.0, 1.0, image_size, dtype=np.float32)
    yy, xx = np.meshgrid(coords, coords, indexing="ij")
    angle = rng.uniform(0, np.pi, n).astype(np.float32)[:, None, None]
    phase = rng.uniform(0, 2 * np.pi, n).astype(np.float32)[:, None, None]
    # Frequency cycles through 3 values (periods per side) so neighbouring hues also differ in texture.
    freq = (2 * np.pi * (2.0 + 2.0 * (labels % 3))).astype(np.float32)[:, None, None]
    # Work on one grey channel in float32 and colour it last through a lookup table: the same
    # arithmetic on all three channels was most of the generation time.
    grey = np.sin(freq * (xx * np.cos(angle) + yy * np.sin(angle)) + phase)
    grey *= 100.0
    grey += 128.0 + rng.integers(-40, 41, grey.shape, dtype=np.int16)  # uniform noise: cheap to draw
    grey = np.clip(grey, 0, 255).astype(np.uint8)
    hues = np.array([colorsys.hsv_to_rgb(c / num_classes, 0.8, 1.0) for c in range(num_classes)], np.float32)
    luts = (np.arange(256, dtype=np.float32)[None, :, None] * hues[:, None, :]).astype(np.uint8)
    return luts[labels[:, None, None], grey]  # [N, S, S] class and grey level -> [N, S, S, 3]


def _encode_jpeg(pixels: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


class ImageFolderDataset(Dataset):
    """Images on disk laid out as ``root/<class name>/**/<image>``, like torchvision's ImageFolder.

    Class indices follow the sorted subfolder names; hidden folders and files are ignored. Each
    access decodes the file, resizes its shorter side to image_size and crops to crop_size.

    Args:
        root: dataset folder with one subfolder per class (``~`` is expanded).
        image_size: the shorter image side is resized to this many pixels before cropping, >= 1.
        crop_size: side of the returned tensors, 1..image_size.
        augment: random resized crop plus horizontal flip when true, a centre crop when false.
        extensions: file name endings counted as images, matched case-insensitively.
        channels: 3 decodes every image as RGB, 1 as grayscale (the model's in_channels must match).
        mean, std: per-channel normalisation in [0, 1] units, one value per channel; None uses
            ImageNet's statistics (their luminance values for grayscale).
    """

    def __init__(
        self,
        root: str,
        image_size: int = 64,
        crop_size: int = 56,
        augment: bool = True,
        extensions: Sequence[str] = DEFAULT_EXTENSIONS,
        channels: int = 3,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ):
        check_sizes(image_size, crop_size)
        self.channels, self.mean, self.std = check_channels(channels, mean, std)
        if isinstance(extensions, str):
            extensions = (extensions,)
        # A plain tuple of str: Hydra may hand over a ListConfig, which should not travel to workers.
        self.extensions = tuple(str(e).lower() for e in extensions)
        if not self.extensions or not all(e.startswith(".") and len(e) > 1 for e in self.extensions):
            raise DataError(f"dataset.extensions={list(extensions)}: must be a non-empty list like ['.jpg', '.png']")
        self.root = os.path.expanduser(str(root))
        self.image_size = int(image_size)
        self.crop_size = int(crop_size)
        self.augment = bool(augment)
        self.classes = self._find_classes()
        self.num_classes = len(self.classes)
        self.samples = self._find_samples()

    def _find_classes(self) -> list[str]:
        if not os.path.exists(self.root):
            raise DataError(f"dataset.root={self.root!r}: folder does not exist")
        if not os.path.isdir(self.root):
            raise DataError(f"dataset.root={self.root!r}: is a file, expected a folder with one subfolder per class")
        try:
            entries = list(os.scandir(self.root))
        except PermissionError:
            raise DataError(f"dataset.root={self.root!r}: folder is not readable (permission denied)") from None
        classes = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise DataError(
                f"dataset.root={self.root!r}: no class subfolders; expected root/<class name>/<image file>"
            )
        return classes

    def _find_samples(self) -> list[tuple[str, int]]:
        def fail(err: OSError) -> None:  # os.walk swallows errors unless told otherwise
            raise DataError(f"dataset.root={self.root!r}: cannot read {err.filename!r} ({err.strerror})")

        samples, empty = [], []
        for label, name in enumerate(self.classes):
            found = []
            for folder, dirs, files in os.walk(os.path.join(self.root, name), onerror=fail, followlinks=True):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # deterministic order
                found += [
                    (os.path.join(folder, f), label)
                    for f in sorted(files)
                    if not f.startswith(".") and f.lower().endswith(self.extensions)
                ]
            if not found:
                empty.append(name)
            samples += found
        allowed = ", ".join(self.extensions)
        if not samples:
            raise DataError(f"dataset.root={self.root!r}: no images with extensions {allowed} in any class subfolder")
        if empty:
            # A class without images would still get an output unit and silently never be trained.
            raise DataError(
                f"dataset.root={self.root!r}: class subfolders without images ({allowed}): {', '.join(empty)}"
            )
        return samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:
            img = load_rgb(path, MODES[self.channels])
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            # Pillow reports truncated/corrupt files with several types; the first line is enough.
            raise DataError(f"dataset.root={self.root!r}: cannot decode image {path!r} (index {index}): "
                            f"{first_line(exc)}") from exc
        image = to_tensor(resize_shorter(img, self.image_size), self.crop_size, self.augment, self.mean, self.std)
        return image, label
