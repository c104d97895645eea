"""timm's augmentation options: --vflip, --color-jitter-prob, --grayscale-prob, --gaussian-blur-prob,
--train-interpolation, --remode, --recount.

The oracle is timm's own create_transform given the same values: the classic path's train transform draws the
same images for the same seed. Each option also changes what a run trains on (a vertical flip, gray pixels,
erased boxes filled with zeros), and the fast path keeps what it can do on the device (--remode) and names
what it cannot (the rest), then runs timm's transforms.
"""

import pytest
import torch
import yaml
from support import REPO
from support.images import sample_image
from timm.data import create_transform

from convbias.engine.config.options import Config
from convbias.engine.data.device_augment import DeviceAugment
from convbias.engine.data.factory import augment_spec, build_transforms, fast_path_reason
from convbias.engine.data.loaders import seeded_rngs

DEIT_RECIPE = yaml.safe_load((REPO / "configs" / "recipes" / "deit.yaml").read_text())


def deit_config(**options) -> Config:
    """A Config of the DeiT recipe (configs/recipes/deit.yaml: the device path's augmentation) with options."""
    return Config(**{**DEIT_RECIPE, **options})


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EVERY_OPTION = dict(
    vflip=0.5,
    color_jitter_prob=0.5,
    grayscale_prob=0.3,
    gaussian_blur_prob=0.3,
    train_interpolation="random",
    remode="const",
    recount=3,
)


def ours(**options):
    """This package's train transform (the classic path's) for options, on 32x32 RGB crops without RandAugment
    (timm drops color jitter with it)."""
    cfg = deit_config(**{"dataset": "imagenet", "img_size": 32, "aa": None, "reprob": 1.0, **options})
    return build_transforms(32, 3, MEAN, STD, cfg)[0]


def timms(**options):
    """timm's create_transform with the values a timm train.py run gives it for the same options."""
    return create_transform(
        (3, 32, 32),
        is_training=True,
        hflip=0.5,
        vflip=options.get("vflip", 0.0),
        color_jitter=0.3,
        color_jitter_prob=options.get("color_jitter_prob"),
        grayscale_prob=options.get("grayscale_prob", 0.0),
        gaussian_blur_prob=options.get("gaussian_blur_prob", 0.0),
        interpolation=options.get("train_interpolation", "bicubic"),
        mean=MEAN,
        std=STD,
        re_prob=1.0,
        re_mode=options.get("remode", "pixel"),
        re_count=options.get("recount", 1),
    )


def draws(transform, seeds=range(24)) -> list[torch.Tensor]:
    image = sample_image()
    out = []
    for seed in seeds:
        with seeded_rngs(seed):
            out.append(transform(image))
    return out


def test_the_classic_transform_is_timms_for_every_option():
    """All seven options at once: the same tensors as timm's transform for 24 seeds, and not those of the
    defaults (which match timm's without them)."""
    got, expected = draws(ours(**EVERY_OPTION)), draws(timms(**EVERY_OPTION))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    plain = draws(ours())
    assert all(torch.equal(a, b) for a, b in zip(plain, draws(timms()), strict=True))
    assert sum(not torch.equal(a, b) for a, b in zip(got, plain, strict=True)) >= 20


def test_vflip_flips_vertically():
    """--vflip 1 --hflip 0, crop fixed (scale 1, ratio 1 on a square image): the image upside down."""
    fixed = dict(hflip=0.0, scale=[1.0, 1.0], ratio=[1.0, 1.0], reprob=0.0, color_jitter=0.0, aa=None)
    image = sample_image((48, 48))
    kept, flipped = (
        build_transforms(32, 3, MEAN, STD, deit_config(dataset="imagenet", img_size=32, vflip=p, **fixed))[0](image)
        for p in (0.0, 1.0)
    )
    assert torch.equal(flipped, kept.flip(1)) and not torch.equal(flipped, kept)


def test_grayscale_prob_one_makes_every_image_gray():
    """--grayscale-prob 1: the three channels carry one gray level (equal after undoing the normalization)."""
    for image in draws(ours(grayscale_prob=1.0, reprob=0.0)):
        pixels = image * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1)
        assert torch.allclose(pixels[0], pixels[1], atol=1e-6) and torch.allclose(pixels[1], pixels[2], atol=1e-6)


@pytest.mark.parametrize("mode, zeros", [("const", True), ("pixel", False)])
def test_remode_fills_the_erased_box_on_the_device(mode, zeros):
    """Fast path (--remode is drawn on the device): every image erased (--reprob 1) from a uniform gray batch;
    const fills the boxes with exact zeros, pixel with normal noise (no exact zero)."""
    cfg = deit_config(dataset="imagenet", img_size=32, aa=None, color_jitter=0.0, reprob=1.0, remode=mode)
    assert fast_path_reason(cfg) is None
    recipe = augment_spec(cfg)
    assert recipe.re_mode == mode
    out = DeviceAugment(recipe)(torch.full((8, 3, 32, 32), 128, dtype=torch.uint8))
    erased = (out == 0).flatten(1).sum(1)
    assert (erased > 0).all() if zeros else (erased == 0).all()


@pytest.mark.parametrize(
    "option, value, reason",
    [
        ("vflip", 0.5, "--vflip 0.5: the device path flips horizontally only"),
        ("grayscale_prob", 0.2, "--grayscale-prob 0.2: the device path has no grayscale step"),
        ("gaussian_blur_prob", 0.2, "--gaussian-blur-prob 0.2: the device path has no blur"),
        ("recount", 2, "--recount 2: the device path erases one box per image"),
        ("train_interpolation", "random", "train interpolation random: the device path has bilinear and bicubic"),
    ],
)
def test_what_the_device_cannot_do_runs_timms_transforms(option, value, reason):
    """The fast path names the option it lacks; the run then serves timm's transform from the workers."""
    assert fast_path_reason(deit_config(dataset="imagenet", **{option: value})) == reason
    assert fast_path_reason(deit_config(dataset="imagenet", reprob=0.0, recount=2)) is None  # no erasing: no count


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--remode", "noise"], "unknown --remode 'noise'; choices: pixel, rand, const"),
        (["--recount", "0"], "--recount must be a positive integer, got 0"),
        (["--vflip", "1.5"], r"--vflip must be in \[0, 1\], got 1.5"),
        (["--train-interpolation", "cubic"], "unknown --train-interpolation 'cubic'"),
    ],
)
def test_bad_values_are_one_line_errors(argv, message):
    from convbias.base.errors import ConfigError
    from convbias.engine import parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(["--model", "vanilla_cnn", *argv])
