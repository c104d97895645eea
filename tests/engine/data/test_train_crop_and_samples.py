"""`--train-crop-mode` (timm's rrc, rkrc, rkrr) on both train input paths, and `--train-num-samples` (the epoch
length of a wds/ or hfids/ stream).

The fast path's worker crop draws timm's crop with timm's own samplers (same seed, same crop and flip as
timm's transform; the pixels differ only by torch's vs Pillow's bicubic resize); the classic path holds timm's
crop classes. A stream's epoch, its loader's length and the run's steps per epoch follow --train-num-samples
as timm's create_dataset(num_samples=...) makes them, else the split's size.
"""

from types import SimpleNamespace

import pytest
import torch
import yaml
from PIL import Image
from support import REPO
from support.images import jpeg_file, psnr, sample_image, write_shards
from timm.data import create_transform
from timm.data.transforms import (
    CenterCropOrPad,
    RandomCropOrPad,
    RandomResizedCropAndInterpolation,
    ResizeKeepRatio,
)

from convbias.engine.config.options import Config
from convbias.engine.data.build import build_training_data
from convbias.engine.data.device_augment import CropFlip
from convbias.engine.data.factory import augment_spec, build_datasets, build_transforms, fast_path_reason
from convbias.engine.data.loaders import seeded_rngs

DEIT_RECIPE = yaml.safe_load((REPO / "configs" / "recipes" / "deit.yaml").read_text())


def deit_config(**options) -> Config:
    """A Config of the DeiT recipe (configs/recipes/deit.yaml: the device path's augmentation) with options."""
    return Config(**{**DEIT_RECIPE, **options})


# torchvision 0.29 deprecates the JPEG decoder CropFlip uses (without it, engine.data.device_augment uses Pillow)
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

# timm's crop classes per mode, in create_transform's order
CROP_CLASSES = {
    "rrc": (RandomResizedCropAndInterpolation,),
    "rkrc": (ResizeKeepRatio, CenterCropOrPad),
    "rkrr": (ResizeKeepRatio, RandomCropOrPad),
}


def timm_crop_flip(size: int, mode: str, scale=None, ratio=None):
    """timm's train transform with crop and flip only, serving uint8 tensors (its prefetcher's form)."""
    return create_transform(
        (3, size, size),
        is_training=True,
        train_crop_mode=mode,
        scale=scale,
        ratio=ratio,
        interpolation="bicubic",
        color_jitter=None,
        auto_augment=None,
        re_prob=0.0,
        use_prefetcher=True,
    )


def same_seed_draws(timm_transform, ours: CropFlip, image, seeds):
    """Per seed: (seed, timm's output, our worker's (crop, flip) draw, our worker's output), each from that seed."""
    for seed in seeds:
        with seeded_rngs(seed):
            expected = timm_transform(image)
        with seeded_rngs(seed):
            drawn = ours.sample(image)
        with seeded_rngs(seed):
            got = ours(image)
        yield seed, expected, drawn, got


@pytest.mark.parametrize("scale", [None, (0.5, 1.5)], ids=["timm-default", "zoom-out"])
@pytest.mark.parametrize("mode", ["rkrc", "rkrr"])
def test_rkr_crop_and_flip_are_timms_for_the_same_seed(mode, scale):
    """Same seed, same resize, window, reflect padding and flip as timm's ResizeKeepRatio + Center/RandomCropOrPad
    + RandomHorizontalFlip; PSNR >= 45 dB as for rrc (measured 70 dB and more). Some crops pad (the aspect
    jitter; more with --scale above 1), some are flipped."""
    image = sample_image((200, 150))
    cfg = deit_config(dataset="imagenet", img_size=64, train_crop_mode=mode, scale=list(scale) if scale else None)
    ours = augment_spec(cfg).worker_transform()
    assert ours.crop_mode == mode and fast_path_reason(cfg) is None
    timm_transform = timm_crop_flip(64, mode, scale)
    flips = padded = 0
    for seed, expected, (crop, flip), got in same_seed_draws(timm_transform, ours, image, range(40)):
        flips += flip
        padded += min(crop.resized) < 64
        assert got.dtype == torch.uint8 and got.shape == (3, 64, 64)
        assert psnr(expected, got) >= 45, (seed, psnr(expected, got))
    assert 10 < flips < 30 and padded > 0


def test_an_rkrr_file_is_timms_crop_of_the_decoded_file(tmp_path):
    """A JPEG file through the worker (decoded at 1/2 DCT scale: the resized image is under half its size)
    against timm's transform of the fully decoded file: the draft decode's bound (>= 30 dB), same draws."""
    path = jpeg_file(tmp_path, (1000, 750))
    ours, timm_transform = CropFlip(224, crop_mode="rkrr"), timm_crop_flip(224, "rkrr")
    for seed in range(4):
        with seeded_rngs(seed):
            expected = timm_transform(Image.open(path).convert("RGB"))
        with seeded_rngs(seed):
            crop, _ = ours.sample(Image.open(path))
        with seeded_rngs(seed):
            got = ours(path)
        assert ours.reduction(Image.open(path), crop) == 2
        assert psnr(expected, got) >= 30.0, (seed, psnr(expected, got))


@pytest.mark.parametrize("mode", ["rrc", "rkrc", "rkrr"])
def test_each_path_takes_the_crop_mode(mode):
    """Classic path (--no-prefetcher): timm's transform holds the mode's crop classes. Fast path: the worker
    serves uint8 crops drawn in the mode."""
    cfg = dict(dataset="digits", img_size=16, train_crop_mode=mode)
    classic = build_datasets(deit_config(**cfg, no_prefetcher=True))
    steps = [type(step) for step in classic.train.transform.transforms]
    start = next(i for i, step in enumerate(steps) if step in CROP_CLASSES[mode])
    assert tuple(steps[start : start + len(CROP_CLASSES[mode])]) == CROP_CLASSES[mode]
    fast = build_datasets(deit_config(**cfg))
    assert fast.device_spec.crop_mode == mode and fast.train.transform.crop_mode == mode
    image, _ = fast.train[0]
    assert image.dtype == torch.uint8 and image.shape == (1, 16, 16)


@pytest.mark.parametrize("mode", ["rrc", "rkrc"])
def test_ratio_reaches_timms_crop_on_both_paths(mode):
    """--ratio 0.3 0.4: only tall crops (rrc), or that aspect jitter (rkrc). The classic path's crop class holds
    the range; the fast path draws timm's crops with it (same seed, same box, PSNR >= 45 dB), boxes that timm's
    default range would not give."""
    ratio = (0.3, 0.4)
    cfg = deit_config(dataset="imagenet", img_size=64, train_crop_mode=mode, ratio=list(ratio))
    classic_crop = build_transforms(64, 3, (0.5,) * 3, (0.5,) * 3, cfg)[0].transforms[1]
    assert tuple(classic_crop.ratio if mode == "rrc" else classic_crop.random_aspect_range) == ratio
    ours, default = augment_spec(cfg).worker_transform(), augment_spec(deit_config(**{**vars(cfg), "ratio": None}))
    assert ours.ratio == ratio and default.worker_transform().ratio != ratio
    image, timm_transform = sample_image((200, 150)), timm_crop_flip(64, mode, ratio=ratio)
    for seed, expected, (crop, _), got in same_seed_draws(timm_transform, ours, image, range(20)):
        assert psnr(expected, got) >= 45, (seed, psnr(expected, got))
        if mode == "rrc":  # a tall box (width / height in the range, up to rounding)
            assert 0.25 < crop.width / crop.height < 0.45, crop


@pytest.mark.parametrize("ratio", [[2.0, 1.0], [0.0, 1.0]])
def test_bad_ratio_is_a_one_line_error(ratio):
    """A reversed or non-positive range is refused before any work, naming the option and the expected form."""
    from convbias.base.errors import ConfigError
    from convbias.engine import parse_config

    with pytest.raises(ConfigError, match=r"--ratio must be two positive numbers, MIN <= MAX, got \["):
        parse_config(["--model", "vanilla_cnn", "--ratio", *map(str, ratio)])


def test_rkr_zoom_out_past_torchs_reflect_padding_keeps_timms_transforms():
    """Reflect padding wider than the resized image (Pillow's does it, torch's cannot): the classic path runs."""
    wide = dict(dataset="imagenet", scale=[0.5, 3.0])
    assert "--train-crop-mode rkrr" in fast_path_reason(deit_config(**wide, train_crop_mode="rkrr"))
    assert fast_path_reason(deit_config(**wide)) is None  # rrc's crop never pads


def stream_data(cfg: Config):
    """engine.data.build for one CPU process: the bundle, its train loader and steps per epoch."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)
    return build_training_data(cfg, accelerator, worker_init_fn=None, train=True)


def epoch_images(stream) -> int:
    """What the stream's reader yields in epoch 0."""
    stream.set_epoch(0)
    return sum(1 for _ in stream)


@pytest.mark.parametrize("num_samples", [None, 20, 50])
def test_train_num_samples_sets_a_wds_epoch(tmp_path, num_samples):
    """32 training images in the shards: --train-num-samples 20 or 50 (the shards cycled) images per epoch,
    else the _info.json count; the loader's length and steps per epoch follow (batches of 4, the last partial
    one dropped)."""
    pytest.importorskip("webdataset")
    write_shards(tmp_path, {"train": 32, "validation": 8})
    cfg = deit_config(
        dataset="wds/toy", data_dir=str(tmp_path), img_size=16, workers=0, batch_size=4, train_num_samples=num_samples
    )
    data = stream_data(cfg)
    expected = num_samples or 32
    assert len(data.bundle.train) == expected and epoch_images(data.bundle.train) == expected
    assert data.steps_per_epoch == len(data.train_loader) == expected // 4
    assert len(data.bundle.val) == 8  # validation is read whole


def test_train_num_samples_sets_an_hfids_epoch_without_a_train_size(tmp_path, hf_toy, monkeypatch):
    """An hfids/ card without the train split's size is refused (its length is unknown), unless
    --train-num-samples gives the epoch's length."""
    pytest.importorskip("datasets")
    from convbias.base.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = hf_toy.write(tmp_path / "toy", {"train": 12, "validation": 6})
    hf_toy.write_card(root, {"validation": 6})
    (tmp_path / "cache").mkdir()
    cfg = dict(dataset=f"hfids/{root}", data_dir=str(tmp_path / "cache"), img_size=8, workers=0, batch_size=4)
    with pytest.raises(ConfigError, match="--train-num-samples for 'train'"):
        stream_data(deit_config(**cfg))
    data = stream_data(deit_config(**cfg, train_num_samples=18))
    assert len(data.bundle.train) == 18 and epoch_images(data.bundle.train) == 18
    assert data.steps_per_epoch == 4
