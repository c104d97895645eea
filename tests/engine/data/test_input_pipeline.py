"""The fast train input path (engine.data.device_augment, engine.data.rand_augment) against timm's PIL transforms:
each batched op on the same image and parameters, the distributions of the random choices against timm's
own samplers, JPEG draft decoding against a full decode, reproducibility and resume of the device half."""

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from scipy import stats
from support import REPO
from support.images import jpeg_file, psnr, sample_image, write_shards
from timm.data import auto_augment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms

from convbias.engine.config.options import Config
from convbias.engine.data.device_augment import AugmentSpec, CropFlip, DeviceAugment, DeviceBatches
from convbias.engine.data.factory import build_datasets, build_transforms, fast_path_reason
from convbias.engine.data.loaders import seeded_rngs
from convbias.engine.data.rand_augment import LEVELS, OPS, ErasingSpec, OpContext, RandAugmentSpec, erase, erasing_noise

DEIT_RECIPE = yaml.safe_load((REPO / "configs" / "recipes" / "deit.yaml").read_text())


def deit_config(**options) -> Config:
    """A Config of the DeiT recipe (configs/recipes/deit.yaml: the device path's augmentation) with options."""
    return Config(**{**DEIT_RECIPE, **options})


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FILL = tuple(min(255, round(255 * x)) for x in IMAGENET_MEAN)  # timm's img_mean for the affine ops' fill
HPARAMS = dict(translate_const=100, img_mean=FILL, interpolation=Image.Resampling.BICUBIC)
GEOMETRIC = {"Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY", "TranslateXRel", "TranslateYRel"}
# the RandAugment op sets of timm ('rand-...' and 'rand-...-inc1'), plus the absolute translations
RAND_OPS = sorted(
    set(auto_augment.rand_augment_choices("", increasing=True))
    | set(auto_augment.rand_augment_choices("", increasing=False))
    | {"TranslateX", "TranslateY"}
)
# grid_sample's bicubic (Keys' a=-0.75) vs Pillow's affine bicubic (a cubic close to a=-1): measured 39.7 dB
# (rotations of this small textured crop) to 51 dB, and exact for whole-pixel translations
GEOMETRIC_MIN_PSNR = 38.0
# torchvision 0.29 deprecates the JPEG decoder CropFlip uses (without it, engine.data.device_augment uses Pillow)
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


def to_tensor(image: Image.Image) -> torch.Tensor:
    """uint8 PIL (L or RGB) -> float (C, H, W) holding 0..255."""
    array = np.array(image, dtype=np.float32)
    return torch.from_numpy(array[None] if array.ndim == 2 else array.transpose(2, 0, 1))


def timm_argument(name: str, magnitude: float, negate: bool, monkeypatch) -> tuple:
    """timm's level arguments for `name`, with its random sign draw (_randomly_negate) forced."""
    level = auto_augment.LEVEL_TO_ARG[name]
    if level is None:
        return ()
    monkeypatch.setattr(auto_augment.random, "random", lambda: 1.0 if negate else 0.0)
    try:
        return level(magnitude, HPARAMS)
    finally:
        monkeypatch.undo()


VARIANTS = [(m, negate) for m in (3.0, 9.0, 9.6, 10.0) for negate in (False, True)]


@pytest.mark.parametrize("name", RAND_OPS)
def test_level_arguments_are_timms(name, monkeypatch):
    magnitudes = np.array([m for m, _ in VARIANTS])
    negates = np.array([n for _, n in VARIANTS])
    ours = LEVELS[name](magnitudes, negates, HPARAMS)
    for (magnitude, negate), value in zip(VARIANTS, ours):
        expected = timm_argument(name, magnitude, negate, monkeypatch)
        assert (expected[0] if expected else 0.0) == value, (name, magnitude, negate)


def engine_posterize(name: str):
    """The PIL function the engine's RandAugment runs for timm's posterize op `name` (build_transforms routes it
    to one that takes 0 bits: timm's own raises with Pillow 13)."""
    policy = "rand-m9-mstd0.5-inc1" if name.endswith("Increasing") else "rand-m9-mstd0.5"
    train, _ = build_transforms(16, 3, IMAGENET_MEAN, IMAGENET_STD, Config(aa=policy))
    rand_augment = next(t for t in train.transforms if hasattr(t, "ops"))
    return next(op.aug_fn for op in rand_augment.ops if op.name == name)


def run_both(name: str, image: Image.Image, monkeypatch) -> list[tuple[np.ndarray, np.ndarray]]:
    """(timm's PIL result, ours) for each (magnitude, sign) variant, ours computed as one batch."""
    op = auto_augment.AugmentOp(name, prob=1.0, magnitude=10, hparams=HPARAMS)
    pil_fn = engine_posterize(name) if name.startswith("Posterize") else op.aug_fn
    arguments = LEVELS[name](np.array([m for m, _ in VARIANTS]), np.array([n for _, n in VARIANTS]), HPARAMS)
    channels = len(image.getbands())
    fill = torch.tensor(FILL[:channels], dtype=torch.float32).view(1, channels, 1, 1)
    batch = to_tensor(image).expand(len(VARIANTS), -1, -1, -1).contiguous()
    ours = OPS[name](batch, torch.tensor(arguments, dtype=torch.float32), OpContext(fill, "bicubic"))
    results = []
    for i, (magnitude, negate) in enumerate(VARIANTS):
        kwargs = dict(op.kwargs, fillcolor=FILL[:channels] if channels > 1 else FILL[0])
        expected = pil_fn(image, *timm_argument(name, magnitude, negate, monkeypatch), **kwargs)
        results.append((to_tensor(expected).numpy(), ours[i].numpy()))
    return results


@pytest.mark.parametrize("name", RAND_OPS)
def test_batched_op_matches_timms_pil_op(name, monkeypatch):
    """Exact for every lookup-table and blend op; >= GEOMETRIC_MIN_PSNR dB for the geometric ones."""
    for expected, ours in run_both(name, sample_image(), monkeypatch):
        if name in GEOMETRIC:
            assert psnr(expected, ours) >= GEOMETRIC_MIN_PSNR, (name, psnr(expected, ours))
        else:
            assert np.array_equal(expected, ours), (name, np.abs(expected - ours).max())


@pytest.mark.parametrize("name", ["ColorIncreasing", "ContrastIncreasing", "SharpnessIncreasing", "Equalize", "Rotate"])
def test_batched_op_matches_timms_pil_op_on_grayscale(name, monkeypatch):
    for expected, ours in run_both(name, sample_image().convert("L"), monkeypatch):
        assert psnr(expected, ours) >= (GEOMETRIC_MIN_PSNR if name in GEOMETRIC else math.inf)


def test_crop_and_flip_are_timms_for_the_same_seed():
    """Same seed, same box and flip as timm's RandomResizedCropAndInterpolation + RandomHorizontalFlip;
    the pixels differ only by torch's vs Pillow's bicubic resize (PSNR >= 45 dB; measured 54 to 79 dB)."""
    image = sample_image((200, 150))
    timm_crop = transforms.Compose(
        [RandomResizedCropAndInterpolation(64, interpolation="bicubic"), transforms.RandomHorizontalFlip(0.5)]
    )
    ours = CropFlip(64, interpolation="bicubic")
    flips = 0
    for seed in range(40):
        with seeded_rngs(seed):
            expected = to_tensor(timm_crop(image))
        with seeded_rngs(seed):
            _, flip = ours.sample(image)
        with seeded_rngs(seed):
            got = ours(image)
        flips += flip
        assert got.dtype == torch.uint8 and got.shape == (3, 64, 64)
        assert psnr(expected, got) >= 45, (seed, psnr(expected, got))
    assert 10 < flips < 30


def test_crop_box_distribution_is_timms_sampler():
    """KS tests of the crop's area fraction and log aspect ratio: ours (seeds 0..) vs timm's sampler (seeds 10^6..)."""
    image = Image.new("RGB", (500, 375))
    ours = CropFlip(224)
    boxes, reference = [], []
    for seed in range(3000):
        random.seed(seed)
        boxes.append(ours.sample(image)[0])
        random.seed(10**6 + seed)
        reference.append(RandomResizedCropAndInterpolation.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3)))
    for statistic in (lambda b: b[2] * b[3] / (500 * 375), lambda b: math.log(b[3] / b[2])):
        result = stats.ks_2samp([statistic(b) for b in boxes], [statistic(b) for b in reference])
        assert result.pvalue > 0.01, result


def record_timm_rand_augment(count: int) -> list[list[tuple[str, float]]]:
    """timm's RandAugment('rand-m9-mstd0.5-inc1') run `count` times, each op's call recorded as (name, argument);
    per image the applied ops in order (timm's own sampler: np.random for the ops, random for the rest)."""
    transform = auto_augment.rand_augment_transform("rand-m9-mstd0.5-inc1", dict(HPARAMS))
    calls: list[tuple[str, float]] = []
    for op in transform.ops:
        op.aug_fn = lambda img, *args, _name=op.name, **kw: calls.append((_name, args[0] if args else 0.0)) or img
    random.seed(0)
    np.random.seed(0)
    image, per_image = Image.new("RGB", (1, 1)), []
    for _ in range(count):
        calls.clear()
        transform(image)
        per_image.append(list(calls))
    return per_image


def test_rand_augment_choices_follow_timms_sampler():
    """Chi-square on how many ops apply per image and on which op is applied; KS on the rotation angle and
    the shear; our sampler (its own generator) against timm's (seeded global RNGs)."""
    count = 4000
    timm_calls = record_timm_rand_augment(count)
    spec = RandAugmentSpec.from_timm("rand-m9-mstd0.5-inc1", HPARAMS)
    ops, args = spec.sample(count, torch.Generator().manual_seed(0))
    ours_calls = [[(spec.names[k], a) for k, a in zip(ops[:, i], args[:, i]) if k >= 0] for i in range(count)]
    applied = [[sum(len(c) == n for c in calls) for n in range(3)] for calls in (timm_calls, ours_calls)]
    assert stats.chi2_contingency(applied).pvalue > 0.01, applied
    names = spec.names
    chosen = [[sum(name == n for c in calls for n, _ in c) for name in names] for calls in (timm_calls, ours_calls)]
    assert stats.chi2_contingency(chosen).pvalue > 0.01, chosen
    for name in ("Rotate", "ShearX", "PosterizeIncreasing", "ColorIncreasing"):
        values = [[a for c in calls for n, a in c if n == name] for calls in (timm_calls, ours_calls)]
        assert stats.ks_2samp(*values).pvalue > 0.01, name


def test_random_erasing_boxes_follow_timms():
    """timm's RandomErasing on zeros (its box is where the noise went) against ErasingSpec.sample: chi-square on
    the erase rate, KS on the box's area and aspect ratio."""
    count, height, width = 2000, 48, 64
    random.seed(0)
    images = RandomErasing(0.25, mode="pixel", device="cpu")(torch.zeros(count, 3, height, width))
    timm_boxes = []
    for image in images:
        rows, cols = torch.nonzero(image.abs().sum(0), as_tuple=True)
        if len(rows):
            timm_boxes.append((int(rows.max() - rows.min()) + 1, int(cols.max() - cols.min()) + 1))
    ours = ErasingSpec(0.25).sample(count, height, width, torch.Generator().manual_seed(0))
    ours_boxes = [(h, w) for _, _, h, w in ours if h]
    rates = [[len(timm_boxes), count - len(timm_boxes)], [len(ours_boxes), count - len(ours_boxes)]]
    assert stats.chi2_contingency(rates).pvalue > 0.01, rates
    for statistic in (lambda b: b[0] * b[1], lambda b: b[0] / b[1]):
        result = stats.ks_2samp([statistic(b) for b in timm_boxes], [statistic(b) for b in ours_boxes])
        assert result.pvalue > 0.01, result
    assert all(0 <= top <= height - h and 0 <= left <= width - w for top, left, h, w in ours)


def test_erase_fills_exactly_the_boxes():
    images = torch.zeros(3, 2, 10, 12)
    boxes = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [5, 7, 5, 5]])
    noise = erasing_noise("pixel", boxes.numpy(), 2, torch.Generator().manual_seed(0))
    assert noise.numel() == 2 * (12 + 25)
    out = erase(images, boxes, "pixel", noise)
    erased = out != 0
    assert erased[0, :, 1:4, 2:6].all() and erased[0].sum() == 2 * 12 and not erased[1].any()
    assert erased[2, :, 5:10, 7:12].all() and erased[2].sum() == 2 * 25


@pytest.mark.parametrize("box, reduction", [((40, 100, 700, 900), 2), ((0, 0, 1000, 1250), 4)])
def test_draft_decode_agrees_with_full_decode_and_resize(tmp_path, box, reduction):
    """A large box decodes at 1/2 or 1/4 DCT scale; timm decodes fully, crops and resizes with Pillow's bicubic."""
    path = jpeg_file(tmp_path, (1280, 1000))
    top, left, height, width = box
    expected = Image.open(path).convert("RGB").crop((left, top, left + width, top + height))
    expected = expected.resize((224, 224), Image.Resampling.BICUBIC)
    lazy = Image.open(path)
    region = CropFlip(224).region(lazy, box)
    assert lazy.size == (1280 // reduction, 1000 // reduction)  # the decoder really ran at the reduced scale
    assert min(region.size) >= 224
    got = CropFlip(224).crop(Image.open(path), box, flip=False)
    assert psnr(to_tensor(expected), got) >= 30.0, psnr(to_tensor(expected), got)


def test_a_file_gives_what_its_lazily_opened_image_gives(tmp_path):
    """CropFlip on a path (read into memory, then decoded) and on the lazily opened PIL image: same box, flip
    and pixels for the same seed, over boxes decoded at full and at half DCT scale."""
    path = jpeg_file(tmp_path, (1000, 750))
    transform = CropFlip(224)
    decoded_sizes = set()
    for seed in range(24):
        with seeded_rngs(seed):
            from_file = transform(path)
        with seeded_rngs(seed):
            lazy = Image.open(path)
            assert torch.equal(from_file, transform(lazy)), seed
        decoded_sizes.add(lazy.size)
    assert decoded_sizes == {(1000, 750), (500, 375)}


def recipe(**changes) -> AugmentSpec:
    return AugmentSpec(**dict(dict(img_size=32, in_chans=3, mean=IMAGENET_MEAN, std=IMAGENET_STD), **changes))


def test_device_augment_is_reproducible_and_its_state_round_trips():
    batch = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    augment = DeviceAugment(recipe(), "cpu", seed=3, rank=0)
    state = augment.state_dict()
    first, second = augment(batch), augment(batch)
    assert first.dtype == torch.float32 and first.shape == batch.shape and not torch.equal(first, second)
    augment.load_state_dict(state)
    assert torch.equal(augment(batch), first)
    resumed = DeviceAugment(recipe(), "cpu", seed=3, rank=0)
    resumed.load_state_dict(augment.state_dict())
    assert torch.equal(resumed(batch), augment(batch))
    assert torch.equal(DeviceAugment(recipe(), "cpu", seed=3, rank=0)(batch), first)
    assert not torch.equal(DeviceAugment(recipe(), "cpu", seed=3, rank=1)(batch), first)
    augment.reseed(3, 0)
    assert torch.equal(augment(batch), first)


def test_device_augment_without_augmentation_normalizes_as_timms_to_tensor():
    batch = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    out = DeviceAugment(recipe(auto_augment=None, re_prob=0.0))(batch)
    expected = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)(batch.float() / 255)
    assert torch.allclose(out, expected, atol=1e-6)


def test_device_batches_count_the_wait():
    def slow_loader():
        for _ in range(3):
            time.sleep(0.05)
            yield torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, dtype=torch.long)

    batches = DeviceBatches(slow_loader(), "cpu", DeviceAugment(recipe(auto_augment=None)))
    started = time.perf_counter()
    out = [images for images, _ in batches]
    assert len(out) == 3 and out[0].dtype == torch.float32
    assert 0.15 <= batches.wait_seconds <= time.perf_counter() - started
    assert 0 < batches.wait_fraction(time.perf_counter() - started) <= 1


def test_fast_path_reasons():
    deit = dict(dataset="imagenet")
    assert fast_path_reason(deit_config(**deit)) is None  # the default
    assert "--no-prefetcher" in fast_path_reason(deit_config(**deit, no_prefetcher=True))
    assert "--no-aug" in fast_path_reason(deit_config(**deit, no_aug=True))
    assert "random" in fast_path_reason(deit_config(**deit, train_interpolation="random"))
    assert "RandAugment" in fast_path_reason(deit_config(**deit, aa="original-mstd0.5"))
    assert "Desaturate" in fast_path_reason(deit_config(**deit, aa="rand-m9-t3a"))
    assert "color jitter" in fast_path_reason(deit_config(**deit, aa=None))
    assert fast_path_reason(deit_config(**deit, aa=None, color_jitter=0)) is None


def test_build_datasets_serves_uint8_crops_on_the_fast_path():
    bundle = build_datasets(deit_config(dataset="digits", img_size=16, no_prefetcher=False))
    image, _ = bundle.train[0]
    assert image.dtype == torch.uint8 and image.shape == (1, 16, 16) and bundle.device_spec.in_chans == 1
    assert bundle.val[0][0].dtype == torch.float32  # evaluation keeps timm's transform
    classic = build_datasets(deit_config(dataset="digits", img_size=16, no_prefetcher=True))
    assert classic.device_spec is None and classic.train[0][0].dtype == torch.float32


def test_image_folder_decodes_through_the_worker_and_skips_unreadable_files(tmp_path):
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for k in range(3):
            jpeg_file(tmp_path / label, (300 + k, 200)).rename(tmp_path / label / f"{k}.jpg")
    (tmp_path / "a" / "1.jpg").write_bytes((tmp_path / "a" / "0.jpg").read_bytes()[:2000])  # truncated
    bundle = build_datasets(deit_config(dataset="folder", data_dir=str(tmp_path), img_size=24, no_prefetcher=False))
    with pytest.warns(UserWarning, match="skipping unreadable image"):
        images = [bundle.train[i][0] for i in range(len(bundle.train))]
    assert all(image.dtype == torch.uint8 and image.shape == (3, 24, 24) for image in images)
    assert [Path(p).name for p in bundle.unreadable_files()] == ["1.jpg"]


# timm's tiny test ResNet learns the 16-px digits to 92-96% in 5 epochs under the full DeiT recipe
# (RandAugment m9, random erasing; no flip: digits are not mirror-symmetric); batches of 64 (lr scaled
# linearly) halve the per-update cost of a model this small
PAIRED_RUN = dict(
    model="test_resnet",
    dataset="digits",
    img_size=16,
    crop_pct=1,
    hflip=0,
    scale=[0.5, 1.0],
    epochs=5,
    eval_interval=5,
    batch_size=64,
    lr=1e-2,
    weight_decay=0,
    warmup_epochs=0,
    mixup=0,
    cutmix=0,
    repeated_aug=1,
    workers=0,
)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.usefixtures("single_thread")
def test_fast_path_trains_digits_as_well_as_the_classic_path(tmp_path, cli_argv):
    """Paired by seed (4 seeds), the fast path's final top-1 against the classic path's: the 95% t-interval of
    the mean paired difference lies inside +-5 points (measured: differences -0.3, +1.1, -1.7, +1.7 points,
    interval -2.2..+2.6; seeds 4 and 5 gave +2.5 and -0.8). Every epoch logs its data-wait fraction."""
    from convbias.cli import train

    differences = []
    for seed in range(4):
        tops = []
        for classic in (True, False):
            output = tmp_path / f"seed{seed}_{'classic' if classic else 'fast'}"
            tops.append(
                train.run(cli_argv(cli_argv.DEIT_RECIPE, PAIRED_RUN, seed=seed, no_prefetcher=classic, output=output))[
                    "final_top1"
                ]
            )
            records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
            assert all(0 <= record["data_wait_fraction"] <= 1 for record in records)
        differences.append(tops[1] - tops[0])
    mean, sem = np.mean(differences), np.std(differences, ddof=1) / math.sqrt(len(differences))
    half_width = stats.t.ppf(0.975, len(differences) - 1) * sem
    assert mean - half_width >= -5.0 and mean + half_width <= 5.0, differences


def test_a_webdataset_stream_takes_the_fast_path(tmp_path):
    """timm's stream reader decodes whole images (no JPEG draft there); crop, flip and uint8 work the same."""
    pytest.importorskip("webdataset")
    from convbias.engine.data.loaders import build_stream_loader

    write_shards(tmp_path, {"train": 32, "validation": 8})
    bundle = build_datasets(deit_config(dataset="wds/toy", data_dir=str(tmp_path), img_size=16, workers=0))
    images, targets = next(iter(build_stream_loader(bundle.train, 8, workers=0, drop_last=True)))
    assert images.dtype == torch.uint8 and images.shape == (8, 3, 16, 16) and targets.shape == (8,)
    out = DeviceAugment(bundle.device_spec)(images)
    assert out.dtype == torch.float32 and out.shape == (8, 3, 16, 16)
