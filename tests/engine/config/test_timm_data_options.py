"""timm's data options --class-map, --in-chans, --input-size and --mean/--std: what reaches the images, labels and
model (on the classic and the fast input path), the one-line refusals, and a run's options honored again by
convbias-predict."""

import csv
import json
import pickle
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from support import REPO

from convbias.base.class_map import read_class_map
from convbias.engine import Config, ConfigError, build_datasets, build_run_model, parse_config, run_model_spec
from convbias.engine.data.datasets import DIGITS_MEAN, DIGITS_STD
from convbias.engine.data.device_augment import DeviceAugment
from convbias.engine.data.factory import augment_spec
from convbias.engine.model.factory import create_model

DEIT_RECIPE = yaml.safe_load((REPO / "configs" / "recipes" / "deit.yaml").read_text())


def deit_config(**options) -> Config:
    """A Config of the DeiT recipe (configs/recipes/deit.yaml: the device path's augmentation) with options."""
    return Config(**{**DEIT_RECIPE, **options})


SIZE = 8
# solid colors (one per class) and the classes in the order the folders are written
COLORS = {"ant": (200, 40, 10), "bee": (20, 180, 60), "cat": (90, 30, 220)}
# the eval transform and the fast path's crop as identities on 8x8 images: native size, no crop, no draws
IDENTITY = dict(img_size=SIZE, crop_pct=1.0, aa=None, reprob=0.0, color_jitter=0.0, hflip=0.0, scale=[1.0, 1.0])
RAW = dict(mean=[0.0], std=[1.0])  # normalization off: tensors are the pixels / 255


def write_folders(root, per_class=3, val_per_class=2):
    """DIR/train and DIR/val of the COLORS classes, each image its class's color plus a little seeded noise."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for name, color in COLORS.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                noise = rng.integers(0, 20, (SIZE, SIZE, 3))
                pixels = np.clip(np.array(color) + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def color_class(image: torch.Tensor) -> str:
    """The COLORS class nearest to an RGB image tensor of pixels / 255."""
    mean = image.mean((1, 2)).numpy() * 255
    return min(COLORS, key=lambda name: np.abs(mean - np.array(COLORS[name])).sum())


def config(tmp_path, *argv: str) -> Config:
    """The command line's Config with the DeiT recipe (as deit_config) and the test model."""
    recipe = REPO / "configs" / "recipes" / "deit.yaml"
    return parse_config(["-c", str(recipe), "--model", "test_resnet", "--output", str(tmp_path / "run"), *argv])


def first_conv(model: torch.nn.Module) -> torch.nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))


# ------------------------------------------------------------------------------------------------ class map
def test_class_map_files_read_as_timms_reader_reads_them(tmp_path):
    """Both of timm's forms, against timm's own reader (timm.data.readers.class_map.load_class_map): the same
    {name: label}, whitespace around names and CRLF line ends included."""
    from timm.data.readers.class_map import load_class_map

    text = tmp_path / "classes.txt"
    text.write_bytes(b"  zebra \r\napple\nmango\t\n")
    pickled = tmp_path / "classes.pkl"
    pickled.write_bytes(pickle.dumps({"b": 1, "a": 0, "c": 2}))
    for path in (text, pickled):
        assert read_class_map(path) == load_class_map(str(path)), path
    assert read_class_map(text) == {"zebra": 0, "apple": 1, "mango": 2}


def test_a_txt_class_map_keeps_its_classes_in_its_order_and_leaves_the_others_out(tmp_path, monkeypatch):
    root = write_folders(tmp_path / "data")
    (root / "classes.txt").write_text("cat\nant\n")
    monkeypatch.chdir(tmp_path)  # the map is found under --data-dir, as timm finds it
    cfg = deit_config(
        dataset="imagenet", data_dir=str(root), class_map="classes.txt", no_prefetcher=True, **IDENTITY, **RAW
    )
    bundle = build_datasets(cfg)
    assert (bundle.class_names, bundle.num_classes) == (["cat", "ant"], 2)
    for split, count in ((bundle.train, 3), (bundle.val, 2)):
        folders = [Path(path).parent.name for path, _ in split.samples]
        assert sorted(folders) == ["ant"] * count + ["cat"] * count  # no bee
        assert split.targets == [{"cat": 0, "ant": 1}[folder] for folder in folders]
        for image, label in split:
            assert color_class(image) == bundle.class_names[label]


def test_a_pkl_class_map_relabels_digits_and_first_classes_keeps_its_first_classes(tmp_path):
    path = tmp_path / "map.pkl"
    path.write_bytes(pickle.dumps({"7": 0, "3": 1, "5": 2}))
    plain = build_datasets(deit_config(dataset="digits"))
    for first_classes, kept in ((None, ["7", "3", "5"]), (2, ["7", "3"])):
        bundle = build_datasets(deit_config(dataset="digits", class_map=str(path), first_classes=first_classes))
        assert (bundle.class_names, bundle.num_classes) == (kept, len(kept))
        for split, mapped in ((plain.train, bundle.train), (plain.val, bundle.val)):
            targets = np.array(split.targets)
            chosen = np.flatnonzero(np.isin(targets, [int(name) for name in kept]))
            assert np.array_equal(mapped.images, split.images[chosen])
            assert mapped.targets == [kept.index(str(t)) for t in targets[chosen]]


# ----------------------------------------------------------------------------------------------- channels
def test_in_chans_3_on_digits_serves_three_equal_channels_to_a_3_channel_model(tmp_path):
    cfg = config(tmp_path, "--dataset", "digits", "--in-chans", "3", "--img-size", "8", "--crop-pct", "1")
    bundle, gray = build_datasets(cfg), build_datasets(cfg.replace(in_chans=None))
    assert (bundle.in_chans, bundle.mean, bundle.std) == (3, DIGITS_MEAN * 3, DIGITS_STD * 3)
    image, three = gray.val[0][0], bundle.val[0][0]
    assert image.shape == (1, SIZE, SIZE) and three.shape == (3, SIZE, SIZE)
    assert all(torch.equal(channel, image[0]) for channel in three)  # L -> RGB: the same pixels, the same stats
    model = create_model(cfg, bundle.num_classes, bundle.in_chans)
    assert first_conv(model).in_channels == 3 and first_conv(create_model(cfg, 10, gray.in_chans)).in_channels == 1
    assert model(torch.stack([bundle.val[i][0] for i in range(4)])).shape == (4, 10)


def test_in_chans_1_on_rgb_files_is_pils_l_conversion_on_both_paths(tmp_path):
    root = write_folders(tmp_path / "data")
    jpeg = root / "train" / "ant" / "0.jpg"  # a JPEG too: the fast path decodes files itself
    Image.open(root / "train" / "ant" / "0.png").save(jpeg, quality=90)
    cfg = deit_config(dataset="imagenet", data_dir=str(root), in_chans=1, **IDENTITY, **RAW)
    classic, fast = build_datasets(cfg.replace(no_prefetcher=True)), build_datasets(cfg)
    assert classic.in_chans == fast.in_chans == fast.device_spec.in_chans == 1 and classic.device_spec is None
    assert (classic.mean, classic.std) == ((0.0,), (1.0,))
    for index, (path, _) in enumerate(classic.train.samples):
        gray = np.array(Image.open(path).convert("L"))
        assert torch.equal(classic.train[index][0], torch.from_numpy(gray).float().div(255)[None])
        assert torch.equal(fast.train[index][0], torch.from_numpy(gray)[None])  # the worker's uint8 crop
    assert any(path.endswith(".jpg") for path, _ in fast.train.samples)
    path, _ = classic.val.samples[0]
    gray = np.array(Image.open(path).convert("L"))
    assert torch.equal(classic.val[0][0], torch.from_numpy(gray).float().div(255)[None])


def test_the_datasets_own_statistics_follow_the_channels(tmp_path):
    """A 3-channel dataset seen in gray: its per-channel statistics weighted as PIL's L conversion weights them."""
    write_folders(tmp_path / "data")
    bundle = build_datasets(deit_config(dataset="folder", data_dir=str(tmp_path / "data"), in_chans=1))
    imagenet = build_datasets(deit_config(dataset="folder", data_dir=str(tmp_path / "data")))
    weights = np.array([0.299, 0.587, 0.114])
    assert bundle.mean == pytest.approx((weights @ np.array(imagenet.mean),)) and len(bundle.std) == 1
    assert bundle.std == pytest.approx((weights @ np.array(imagenet.std),))


# ---------------------------------------------------------------------------------------------- mean / std
@pytest.mark.parametrize(
    ("in_chans", "mean", "std"), [(None, [0.5], [0.25]), (3, [0.5, 0.4, 0.3], [0.2, 0.25, 0.5]), (3, [0.5], [0.25])]
)
def test_mean_and_std_normalize_exactly_on_the_classic_and_the_fast_path(in_chans, mean, std):
    cfg = deit_config(dataset="digits", in_chans=in_chans, mean=mean, std=std, **IDENTITY)
    channels = in_chans or 1
    expected_mean, expected_std = (mean * channels)[:channels], (std * channels)[:channels]
    shape = (channels, 1, 1)

    def normalized(pixels: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(pixels).float().div(255).expand(channels, SIZE, SIZE)
        return (x - torch.tensor(expected_mean).view(shape)) / torch.tensor(expected_std).view(shape)

    classic = build_datasets(cfg.replace(no_prefetcher=True))
    assert (classic.mean, classic.std) == (tuple(expected_mean), tuple(expected_std))
    for split in (classic.train, classic.val):  # the train transform too: no draw changes an 8x8 image here
        for index in range(3):
            assert torch.equal(split[index][0], normalized(split.images[index]))
    fast = build_datasets(cfg)
    recipe = fast.device_spec
    assert (recipe.in_chans, recipe.mean, recipe.std) == (channels, tuple(expected_mean), tuple(expected_std))
    crops = torch.stack([fast.train[index][0] for index in range(3)])
    assert crops.dtype == torch.uint8 and crops.shape == (3, channels, SIZE, SIZE)
    out = DeviceAugment(recipe)(crops)
    for index in range(3):
        assert torch.equal(out[index], normalized(fast.train.images[index]))


def test_input_size_is_in_chans_and_img_size(tmp_path):
    given = config(tmp_path, "--dataset", "digits", "--input-size", "3", "16", "16")
    spelled = config(tmp_path, "--dataset", "digits", "--in-chans", "3", "--img-size", "16")
    assert (given.in_chans, given.img_size) == (3, 16)
    unvalidated = deit_config(dataset="digits", input_size=[3, 16, 16])  # the data layer resolves it alone too
    bundles = [build_datasets(cfg) for cfg in (given, spelled, unvalidated)]
    for bundle in bundles:
        assert (bundle.in_chans, bundle.mean, bundle.std) == (3, DIGITS_MEAN * 3, DIGITS_STD * 3)
        assert torch.equal(bundle.val[0][0], bundles[1].val[0][0]) and bundle.val[0][0].shape == (3, 16, 16)
    assert augment_spec(given) == augment_spec(spelled) == augment_spec(unvalidated)


@pytest.mark.parametrize("mode, in_chans", [("L", 1), ("RGB", 3)])
def test_input_img_mode_is_in_chans(tmp_path, mode, in_chans):
    """timm's --input-img-mode L / RGB: the digits served in 1 / 3 channels, as --in-chans 1 / 3 serves them."""
    given = config(tmp_path, "--dataset", "digits", "--input-img-mode", mode)
    spelled = config(tmp_path, "--dataset", "digits", "--in-chans", str(in_chans))
    unvalidated = deit_config(dataset="digits", input_img_mode=mode)
    assert given.in_chans == in_chans
    bundles = [build_datasets(cfg) for cfg in (given, spelled, unvalidated)]
    for bundle in bundles:
        assert bundle.in_chans == in_chans and bundle.val[0][0].shape[0] == in_chans
        assert torch.equal(bundle.val[0][0], bundles[1].val[0][0])


# ------------------------------------------------------------------------------------------------- refusals
BAD_MAPS = [
    ("missing.txt", None, r"--class-map not found: \S+missing\.txt; expected \.txt"),
    ("empty.txt", b"", r"--class-map \S+empty\.txt names no classes; classification needs at least 2; expected"),
    ("one.txt", b"3\n\n", r"names 1 class; classification needs at least 2"),
    ("blank.txt", b"3\n\n5\n", r"blank\.txt: line 2 is empty; expected \.txt"),
    ("twice.txt", b"3\n5\n3\n", r"twice\.txt: class '3' is on lines 1 and 3; expected"),
    ("latin.txt", "é\n3\n".encode("latin-1"), r"latin\.txt: 'utf-8' codec can't decode"),
    ("map.json", b"{}", r"map\.json: unknown file type \.json; expected \.txt \(one class name per line"),
    ("garbage.pkl", b"not a pickle", r"garbage\.pkl: not a pickled mapping \(.+\); expected .+\.pkl \(a pickled"),
    ("list.pkl", pickle.dumps(["3", "5"]), r"list\.pkl: holds a list, not a mapping"),
    ("global.pkl", pickle.dumps(OrderedDict(a=0, b=1)), r"global\.pkl: not a pickled mapping \(it names collections"),
    ("labels.pkl", pickle.dumps({"3": 0, "5": 2}), r"labels\.pkl: labels \[0, 2\] are not 0\.\.1 each once"),
    ("types.pkl", pickle.dumps({"3": 0, 5: 1}), r"types\.pkl: entry 5: 1 is not a class name and an integer label"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_MAPS, ids=[m[0] for m in BAD_MAPS])
def test_a_bad_class_map_file_is_one_line_naming_it_before_any_data_is_read(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as error:
        config(tmp_path, "--dataset", "digits", "--class-map", str(path))
    assert "\n" not in str(error.value)


def test_a_class_map_naming_classes_the_dataset_lacks_or_too_few_for_first_classes(tmp_path):
    (tmp_path / "map.txt").write_text("3\nseven\n5\neight\n")
    with pytest.raises(ConfigError, match=r"map\.txt names classes that --dataset digits lacks: seven, eight; "):
        build_datasets(config(tmp_path, "--dataset", "digits", "--class-map", str(tmp_path / "map.txt")))
    (tmp_path / "map.txt").write_text("3\n5\n")
    with pytest.raises(ConfigError, match=r"^--first-classes 3: --class-map \S+map\.txt names only 2 classes$"):
        build_datasets(
            config(tmp_path, "--dataset", "digits", "--class-map", str(tmp_path / "map.txt"), "--first-classes", "3")
        )


@pytest.mark.parametrize("dataset", ["wds/shards", "hfids/toy", "hfds/toy"])
def test_a_class_map_on_a_source_labelled_by_timms_reader_is_refused(tmp_path, dataset):
    (tmp_path / "map.txt").write_text("a\nb\n")
    argv = ["--dataset", dataset, "--data-dir", str(tmp_path), "--class-map", str(tmp_path / "map.txt")]
    with pytest.raises(
        ConfigError, match=rf"^--class-map \S+: --dataset {dataset} takes its labels from timm's reader"
    ):
        config(tmp_path, *argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--input-size", "3", "16", "16", "--img-size", "32"], r"^--input-size 3 16 16 and --img-size 32 disagree"),
        (["--input-size", "3", "16", "16", "--in-chans", "1"], r"^--input-size 3 16 16 and --in-chans 1 disagree"),
        (["--input-size", "3", "16", "8"], r"^--input-size must be C H W with C 1 or 3 and H = W >= 1"),
        (["--in-chans", "2"], r"^--in-chans must be 1 or 3"),
        (["--mean", "0.5", "0.5"], r"^--mean 0\.5 0\.5: 2 values for 1-channel images; give one value or 1 "),
        (["--in-chans", "3", "--std", "0.2", "0.3"], r"^--std 0\.2 0\.3: 2 values for 3-channel images; give one"),
        (["--input-size", "1", "8", "8", "--mean", "0.1", "0.2", "0.3"], r"^--mean 0\.1 0\.2 0\.3: 3 values for 1-ch"),
        (["--std", "0"], r"^--std must be positive"),
        (["--input-img-mode", "L", "--in-chans", "3"], r"^--input-img-mode L and --in-chans 3 disagree"),
        (["--input-img-mode", "RGBA"], r"^unknown --input-img-mode 'RGBA'; choices: RGB, L"),
    ],
)
def test_input_options_that_disagree_are_one_line(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        config(tmp_path, "--dataset", "digits", *argv)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.integration
def test_a_run_with_these_options_predicts_with_them(tmp_path):
    """train.py on digits in 3 channels (--input-size 3 8 8), normalized by 0.5/0.5, three classes in the map's order;
    convbias-predict on the run gives the run's model on those images normalized by hand; convbias-export
    records the run's input format, and convbias-robustness's clean accuracy is the run's own top-1."""
    from convbias.cli import export, predict, train
    from convbias.engine import RunDir
    from convbias.families import load_families
    from convbias.studies.robustness import command as robustness

    (tmp_path / "classes.txt").write_text("7\n3\n5\n")
    run = tmp_path / "run"
    train.run(
        ["--model", "vanilla_cnn", "--model-kwargs", "channels=4", "--input-size", "3", "8", "8", "--crop-pct", "1"]
        + ["--mean", "0.5", "--std", "0.5", "--class-map", str(tmp_path / "classes.txt"), "--num-classes", "3"]
        + ["--epochs", "3", "--lr", "0.02", "--drop-path", "0", "--dataset", "digits", "--batch-size", "64", "--no-aug"]
        + ["--workers", "0", "--warmup-epochs", "0", "--no-diagnostics", "--output", str(run)]
    )
    model, _ = build_run_model(RunDir(run), "last", load_families())
    assert first_conv(model).in_channels == 3 and run_model_spec(RunDir(run))["num_classes"] == 3
    evaluated = parse_config(["--eval-only", str(run)])  # --eval-only RUN takes the run's data options too
    assert (evaluated.in_chans, evaluated.mean, evaluated.std) == (3, [0.5], [0.5])
    assert evaluated.class_map == str(tmp_path / "classes.txt") and evaluated.img_size == 8
    resized = parse_config(["--eval-only", str(run), "--img-size", "16"])  # the run's --input-size, resolved
    assert (resized.img_size, resized.in_chans, resized.input_size) == (16, 3, None)

    plain = build_datasets(deit_config(dataset="digits"))
    labels = np.array(plain.val.targets)
    picks = [int(np.flatnonzero(labels == digit)[k]) for digit in (7, 3, 5) for k in range(2)]
    (tmp_path / "images").mkdir()
    paths = []
    for index in picks:
        paths.append(str(tmp_path / "images" / f"val{index}.png"))
        Image.fromarray(plain.val.images[index]).save(paths[-1])  # 8x8 grayscale, as the dataset holds it
    pixels = torch.from_numpy(plain.val.images[picks]).float().div(255)
    with torch.no_grad():
        expected = model(((pixels - 0.5) / 0.5)[:, None].expand(-1, 3, -1, -1)).softmax(-1)

    output = tmp_path / "preds.csv"
    argv = [str(run), str(tmp_path / "images"), "--topk", "3", "--output", str(output), "--device", "cpu"]
    assert predict.main(argv) == 0
    with open(output, newline="") as file:
        rows = {row["path"]: row for row in csv.DictReader(file)}
    for path, probabilities in zip(paths, expected):
        row = rows[path]
        indices = [int(row[f"index_{k}"]) for k in (1, 2, 3)]
        assert sorted(indices) == [0, 1, 2]
        assert [row[f"label_{k}"] for k in (1, 2, 3)] == [["7", "3", "5"][i] for i in indices]
        got = torch.tensor([float(row[f"probability_{k}"]) for k in (1, 2, 3)])
        torch.testing.assert_close(got, probabilities[indices], rtol=1e-5, atol=1e-6)

    exported = tmp_path / "exported"
    assert export.main([str(run), "--output", str(exported)]) == 0
    pretrained_cfg = json.loads((exported / "config.json").read_text())["pretrained_cfg"]
    assert pretrained_cfg["input_size"] == [3, 8, 8]
    assert pretrained_cfg["mean"] == [0.5] * 3 and pretrained_cfg["std"] == [0.5] * 3

    studied = tmp_path / "robustness"
    argv = [str(run), "--attacks", "none", "--corruptions", "none", "--workers", "0", "--output", str(studied)]
    assert robustness.main(argv) == 0
    with open(studied / "robustness.csv", newline="") as file:
        clean = float(next(csv.DictReader(file))["clean"])
    final_top1 = json.loads((run / "results.json").read_text())["final_top1"]
    assert clean == pytest.approx(final_top1, abs=0.01)
