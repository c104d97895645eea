"""Data for the training engine: datasets with timm's transforms, a self-sharding train sampler
(plain shuffle or repeated augmentation) and the loaders.

    bundle = build_datasets(cfg)   # cfg: an engine Config (its data options)
    # bundle.device_spec not None: the train set yields uint8 crops (engine.data.device_augment's fast path);
    # DeviceAugment(bundle.device_spec, device, seed, rank) finishes them on the device
    train_loader = build_train_loader(bundle.train, batch_size, workers, repeated_aug, seed,
                                      num_replicas, rank)
    eval_loader = build_eval_loader(bundle.val, batch_size, workers)
    for epoch in ...: train_loader.sampler.set_epoch(epoch)

Sources and their on-disk layouts are in engine/datasets.py (`DATASETS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.data.auto_augment import posterize as timm_posterize
from timm.data.constants import DEFAULT_CROP_PCT
from timm.models import get_pretrained_cfg

from convbias.base.class_map import apply_class_map, read_class_map
from convbias.base.errors import ConfigError

from ..config.options import IMAGE_MODE_CHANNELS, Config, flag_name
from ..config.parsing import check_option
from .datasets import (
    DATASETS,
    EMBEDDED_SOURCES,
    DatasetInfo,
    ImageFolderDataset,
    fraction_per_class,
    load_cifar,
    load_image_folders,
    select_classes,
    split_dir,
)
from .device_augment import AugmentSpec, image_mode
from .device_augment import fast_path_reason as device_fast_path_reason
from .streams import (
    Columns,
    check_stream,
    create_streams,
    factory_layout,
    is_factory_source,
    is_hfds,
    is_stream,
    load_hfds,
)

# `wds/`, `hfids/` and `hfds/` sources (engine.data.streams): RGB, normalized with ImageNet's statistics, 224 by default.
FACTORY_INFO = DatasetInfo(3, DATASETS["imagenet"].mean, DATASETS["imagenet"].std, 224, layout="")

LUMA = (0.299, 0.587, 0.114)  # PIL's RGB -> L weights: a 3-channel statistic seen through --in-chans 1


@dataclass
class DataBundle:
    train: Any
    val: Any
    num_classes: int
    in_chans: int
    class_names: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # the fast path's train augmentation: the train set yields uint8 crops to be finished on the device by
    # engine.data.device_augment.DeviceAugment(device_spec, ...); None: timm's transforms did everything
    device_spec: AugmentSpec | None = None

    def unreadable_files(self) -> list[str]:
        """Image files skipped so far because they could not be decoded (folder datasets only)."""
        return [path for split in (self.train, self.val) for path in getattr(split, "unreadable_files", list)()]


# The engine's own small datasets (not timm's): their native size, channels and statistics stand in for the model's
# pretrained config, which describes ImageNet-sized RGB images
NATIVE_DATASETS = ("digits", "mnist", "cifar10", "cifar100")


@dataclass(frozen=True)
class InputFormat:
    """The model's input as timm's resolve_data_config gives it: (in_chans, img_size, img_size), mean, std,
    the eval resize interpolation and center-crop fraction; ``sources`` names where each came from."""

    in_chans: int
    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bicubic"
    crop_pct: float = DEFAULT_CROP_PCT
    sources: dict[str, str] = field(default_factory=dict, compare=False)


def model_pretrained_cfg(name: str | None) -> dict[str, Any]:
    """The data fields of a registered model's pretrained config (its default tag's, as timm.create_model attaches
    it); {} for a name timm does not know."""
    try:
        pretrained = get_pretrained_cfg(name) if name else None
    except RuntimeError:  # an unknown pretrained tag: check_model_name names it
        pretrained = None
    return pretrained.to_dict() if pretrained is not None else {}


def input_format(cfg: Config) -> InputFormat:
    """As timm's train.py (its resolve_data_config over the model's pretrained config): the image size
    --img-size, else --input-size's H, else the model's; --interpolation, --crop-pct, --mean and --std, else
    the model's. --eval-only evaluates as timm's validate.py: at the model's test_input_size and test_crop_pct where
    its pretrained config has them, unless --use-train-size. On the engine's own datasets (NATIVE_DATASETS) their
    size, channels and statistics stand in for the model's. in_chans = --in-chans or --input-size's C or
    --input-img-mode's or the dataset's (one value of --mean/--std is repeated, three are luma-weighted for one
    channel: _per_channel)."""
    info = dataset_info(cfg.dataset)
    pretrained = model_pretrained_cfg(cfg.model)
    model_source = f"model {cfg.model}'s config" if pretrained else "timm's default"
    native = cfg.dataset in NATIVE_DATASETS
    if native:
        size = info.default_img_size
        pretrained = {**pretrained, "input_size": (info.in_chans, size, size), "mean": info.mean, "std": info.std}
        pretrained.pop("test_input_size", None)  # the data set's size stands in for the model's sizes
    use_test_size = bool(cfg.eval_only) and not cfg.use_train_size
    channels, size = (cfg.input_size or (None, None))[:2]
    mode_channels = IMAGE_MODE_CHANNELS.get(cfg.input_img_mode)
    in_chans = int(cfg.in_chans or channels or mode_channels or info.in_chans)
    resolved = resolve_data_config(
        {
            "img_size": cfg.img_size or size,
            "interpolation": cfg.interpolation,
            "crop_pct": cfg.crop_pct,
            "mean": None,  # per channel below, as the engine converts images to in_chans
            "std": None,
        },
        pretrained_cfg=pretrained or {"input_size": (3, 224, 224)},
        use_test_size=use_test_size,
    )
    default_source = f"dataset {cfg.dataset}" if native else model_source
    given = {
        "img_size": cfg.img_size or size,
        "interpolation": cfg.interpolation,
        "crop_pct": cfg.crop_pct,
        "mean": cfg.mean,
        "std": cfg.std,
    }
    sources = {name: "set" if value else default_source for name, value in given.items()}
    if native:
        sources["interpolation"] = "set" if cfg.interpolation else model_source
        sources["crop_pct"] = "set" if cfg.crop_pct else model_source
    for name, key in (("img_size", "test_input_size"), ("crop_pct", "test_crop_pct")):  # validate.py's choice
        if use_test_size and not given[name] and pretrained.get(key):
            sources[name] = f"model {cfg.model}'s {key}"
    return InputFormat(
        in_chans,
        int(resolved["input_size"][-1]),
        _per_channel("mean", cfg.mean, tuple(resolved["mean"]), in_chans),
        _per_channel("std", cfg.std, tuple(resolved["std"]), in_chans),
        resolved["interpolation"],
        float(resolved["crop_pct"]),
        sources,
    )


def _per_channel(name: str, given: Any, dataset: tuple[float, ...], in_chans: int) -> tuple[float, ...]:
    """One value per channel: --mean/--std (one value is repeated, as timm does), else the dataset's statistics,
    repeated from one channel or luma-weighted from three (exact for the mean, an upper bound for the std)."""
    values = tuple(float(v) for v in (dataset if given is None else given))
    if len(values) == in_chans:
        return values
    if len(values) == 1:
        return values * in_chans
    if given is None and in_chans == 1:
        return (sum(w * v for w, v in zip(LUMA, values)),)
    raise ConfigError(
        f"--{name} {' '.join(f'{v:g}' for v in values)}: {len(values)} values for {in_chans}-channel images; "
        f"give one value or {in_chans} (one per channel)"
    )


def class_map(cfg: Config) -> dict[str, int] | None:
    """--class-map as {class name: label} (base.class_map.read_class_map), found as timm finds it (the path, else
    under --data-dir); None without one. A source whose labels timm's readers assign has no class index to map."""
    if not cfg.class_map:  # timm's unset value is ''
        return None
    if is_factory_source(cfg.dataset):
        raise ConfigError(
            f"--class-map {cfg.class_map}: --dataset {cfg.dataset} takes its labels from timm's reader, which a class "
            f"map cannot relabel; a class map needs one of {', '.join(DATASETS)}"
        )
    path = Path(cfg.class_map).expanduser()
    if not path.exists() and cfg.data_dir and (Path(cfg.data_dir).expanduser() / cfg.class_map).exists():
        path = Path(cfg.data_dir).expanduser() / cfg.class_map
    return read_class_map(path)


def _check_data_options(
    dataset: str, data_dir: str | None, train_fraction: float, first_classes: int | None, img_size: int | None
) -> Path | None:
    """Cheap checks made before any file is read; returns the data dir as a Path."""
    if dataset not in DATASETS and not is_hfds(dataset):
        raise ConfigError(f"unknown dataset {dataset!r}; choices: {', '.join(DATASETS)}, hfds/NAME")
    for name, value in (("train_fraction", train_fraction), ("first_classes", first_classes), ("img_size", img_size)):
        check_option(name, value)
    if dataset in EMBEDDED_SOURCES:
        return None  # embedded in an installed package, no files
    layout = dataset_info(dataset).layout
    if not data_dir:
        raise ConfigError(f"--dataset {dataset} needs --data-dir; expected layout: {layout}")
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--data-dir {path} is not a directory; expected layout for --dataset {dataset}: {layout}")
    if not is_hfds(dataset) and not any(path.iterdir()):  # an hfds/ cache starts empty
        raise ConfigError(f"--data-dir {path} is empty; expected layout for --dataset {dataset}: {layout}")
    return path


def _posterize_zero_bits(img: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    """timm's posterize, where keeping 0 bits gives a black image as with older Pillow.

    timm's 'PosterizeIncreasing' asks for 0 bits at magnitude 10, which the magnitude noise of
    'mstd0.5' reaches for a few samples in a thousand; Pillow 13 rejects bits < 1 with a ValueError
    that would stop a run.
    """
    if bits_to_keep < 1:
        return Image.new(img.mode, img.size)
    return timm_posterize(img, bits_to_keep, **kwargs)


def _patch_posterize(transform: Callable) -> None:
    """Routes the posterize ops of timm's RandAugment/AugMix/AutoAugment inside `transform`."""
    for step in getattr(transform, "transforms", []):
        ops = list(getattr(step, "ops", []))
        ops += [op for sub_policy in getattr(step, "policy", []) for op in sub_policy]
        for op in ops:
            if op.name.startswith("Posterize"):
                op.aug_fn = _posterize_zero_bits


def build_transforms(
    img_size: int, in_chans: int, mean, std, cfg: Config, shape: InputFormat | None = None
) -> tuple[Callable, Callable]:
    """timm's train transform (random resized crop, flip, RandAugment, random erasing) and eval
    transform (resize to img_size / crop_pct, center crop), normalized with mean/std. Works for any source size
    (8x8 digits are upsampled to img_size) and mode: images are first converted to in_chans channels (L or RGB)."""
    input_size = (in_chans, img_size, img_size)
    shape = shape or input_format(cfg)
    interpolation = shape.interpolation
    scale = cfg.scale
    train = create_transform(
        input_size,
        is_training=True,
        no_aug=bool(cfg.no_aug),
        scale=tuple(scale) if scale is not None else None,
        ratio=tuple(cfg.ratio) if cfg.ratio is not None else None,
        train_crop_mode=cfg.train_crop_mode,
        hflip=cfg.hflip,
        vflip=cfg.vflip,
        color_jitter=cfg.color_jitter,
        color_jitter_prob=cfg.color_jitter_prob,
        grayscale_prob=cfg.grayscale_prob or 0.0,
        gaussian_blur_prob=cfg.gaussian_blur_prob or 0.0,
        auto_augment=cfg.aa or None,
        interpolation=train_interpolation(cfg, interpolation),
        mean=mean,
        std=std,
        re_prob=cfg.reprob,
        re_mode=cfg.remode,
        re_count=cfg.recount,
    )
    _patch_posterize(train)
    val = create_transform(
        input_size,
        is_training=False,
        interpolation=interpolation,
        crop_pct=shape.crop_pct,
        mean=mean,
        std=std,
    )
    for transform in (train, val):  # as timm's datasets serve images in --in-chans' mode (their input_img_mode)
        transform.transforms.insert(0, ConvertImage(image_mode(in_chans)))
    return train, val


def color_jitter_off_by_aa(cfg: Config) -> bool:
    """Whether --aa turns timm's colour jitter off (timm's create_transform keeps it only for a '3a' policy)."""
    return bool(cfg.aa) and "3a" not in cfg.aa


def train_interpolation(cfg: Config, interpolation: str) -> str:
    """As timm's train.py: --train-interpolation, else (unset, or --no-aug) the eval interpolation."""
    return interpolation if cfg.no_aug or not cfg.train_interpolation else cfg.train_interpolation


class ConvertImage:
    """A PIL image in ``mode`` (L or RGB); unchanged when already in it."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, image: Image.Image) -> Image.Image:
        return image if image.mode == self.mode else image.convert(self.mode)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r})"


def augment_spec(cfg: Config) -> AugmentSpec:
    """cfg's train augmentation as the fast path reads it (the options build_transforms gives timm)."""
    shape = input_format(cfg)
    scale = cfg.scale
    return AugmentSpec(
        img_size=shape.img_size,
        in_chans=shape.in_chans,
        mean=shape.mean,
        std=shape.std,
        scale=tuple(scale) if scale is not None else None,
        ratio=tuple(cfg.ratio) if cfg.ratio is not None else None,
        crop_mode=cfg.train_crop_mode or "rrc",
        hflip=float(cfg.hflip),
        interpolation=train_interpolation(cfg, shape.interpolation),
        auto_augment=cfg.aa or None,
        re_prob=float(cfg.reprob),
        re_mode=cfg.remode,
    )


def fast_path_reason(cfg: Config) -> str | None:
    """Why cfg's training data keeps timm's PIL transforms in the loader workers; None: it takes the fast path
    (uint8 crops from the workers, RandAugment, normalization and random erasing on the device)."""
    reason = device_fast_path_reason(
        augment_spec(cfg),
        no_prefetcher=bool(cfg.no_prefetcher),
        no_aug=bool(cfg.no_aug),
        color_jitter=cfg.color_jitter,
    )
    if reason is not None:
        return reason
    classic_only = {  # timm's steps with no device form: (set, what the device path lacks)
        "vflip": (cfg.vflip > 0, "flips horizontally only"),
        "grayscale_prob": (bool(cfg.grayscale_prob), "has no grayscale step"),
        "gaussian_blur_prob": (bool(cfg.gaussian_blur_prob), "has no blur"),
        "recount": (cfg.reprob > 0 and cfg.recount > 1, "erases one box per image"),
    }
    for name, (applies, missing) in classic_only.items():
        if applies:
            return f"{flag_name(name)} {getattr(cfg, name)}: the device path {missing}"
    return None


def _fast_train_transform(cfg: Config, train: Any) -> AugmentSpec | None:
    """On the fast path, puts its worker half on the train set in place of timm's transform (an image folder
    decodes files through it, at the crop's JPEG scale) and returns the device half's spec; else None."""
    if fast_path_reason(cfg) is not None:
        return None
    spec = augment_spec(cfg)
    if isinstance(train, ImageFolderDataset):
        train.loader, train.transform = spec.worker_transform(), None
    else:
        train.transform = spec.worker_transform()
    return spec


def _has_splits(data_dir: Path, cfg: Config) -> bool:
    """Whether a folder dataset has a train or validation split folder (else DIR/<class>/<image>)."""
    return any(split_dir(data_dir, split).is_dir() for split in (cfg.train_split, cfg.val_split))


def dataset_info(name: str) -> DatasetInfo:
    """What the engine needs to know about a source before reading it (wds/, hfids/, hfds/: ImageNet's statistics)."""
    if is_factory_source(name):
        return replace(FACTORY_INFO, layout=factory_layout(name))
    return DATASETS[name or "folder"]  # timm's '': the image folder at --data-dir


def _world_size() -> int:
    """Processes of the run: timm's stream readers split shards by torch.distributed's world, so do we."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def columns(cfg: Config) -> Columns:
    """The image and label columns of an hfds/ or hfids/ dataset (--input-key, --target-key)."""
    return Columns(cfg.input_key, cfg.target_key)


def build_streams(cfg: Config) -> DataBundle:
    """Train and val streams of a `wds/` shard set or an `hfids/` dataset (engine.data.streams), with the engine's
    transforms."""
    name, data_dir, keys = cfg.dataset, cfg.data_dir, columns(cfg)
    shape = input_format(cfg)
    class_map(cfg)  # refused on a stream
    info = check_stream(
        name,
        data_dir,
        cfg.train_fraction,
        cfg.first_classes,
        int(cfg.workers),
        _world_size(),
        cfg.train_num_samples,
        keys,
    )
    train, val = create_streams(
        name,
        data_dir,
        int(cfg.seed),
        batch_size=1,
        splits=info["splits"],
        train_num_samples=cfg.train_num_samples,
        columns=keys,
    )
    train.transform, val.transform = build_transforms(shape.img_size, shape.in_chans, shape.mean, shape.std, cfg, shape)
    spec = _fast_train_transform(cfg, train)  # a stream's reader decodes whole images: no JPEG draft
    return DataBundle(train, val, info["num_classes"], shape.in_chans, info["classes"], shape.mean, shape.std, spec)


def build_datasets(cfg: Config) -> DataBundle:
    """Train and val datasets of cfg.dataset with transforms, after the class map and the class subset (train and
    val: --class-map first, then --first-classes keeps the map's first K) and the per-class train fraction (train
    only: validation is never subsampled)."""
    name = cfg.dataset
    if is_stream(name):
        return build_streams(cfg)
    first_classes, img_size = cfg.first_classes, cfg.img_size
    fraction = cfg.train_fraction
    data_dir = _check_data_options(name, cfg.data_dir, fraction, first_classes, img_size)
    shape, mapping = input_format(cfg), class_map(cfg)

    if name in EMBEDDED_SOURCES:
        train, val = EMBEDDED_SOURCES[name]()
    elif is_hfds(name):
        train, val = load_hfds(name, str(data_dir), columns(cfg))
    elif name in ("cifar10", "cifar100"):
        train, val = load_cifar(name, data_dir)
    elif cfg.eval_only and name == "folder" and not _has_splits(data_dir, cfg):
        # timm's validate.py scores every image of DIR/<class>/<image>: no held-out split to evaluate
        train = val = ImageFolderDataset.scan(data_dir, dataset_info(name).layout, skip_unreadable=cfg.skip_unreadable)
    else:
        train, val = load_image_folders(name, data_dir, cfg.skip_unreadable, cfg.train_split, cfg.val_split)

    if mapping is not None:
        missing = [label for label in mapping if label not in train.classes]
        if missing:
            raise ConfigError(
                f"--class-map {cfg.class_map} names classes that --dataset {name} lacks: {', '.join(missing[:5])}; "
                f"expected names among its classes: {', '.join(map(str, train.classes[:10]))}"
                f"{', ...' if len(train.classes) > 10 else ''}"
            )
        train, val = apply_class_map(train, mapping), apply_class_map(val, mapping)
    if first_classes is not None:
        if int(first_classes) > len(train.classes):
            source = f"--class-map {cfg.class_map} names" if mapping else f"--dataset {name} has"
            raise ConfigError(f"--first-classes {first_classes}: {source} only {len(train.classes)} classes")
        train, val = select_classes(train, int(first_classes)), select_classes(val, int(first_classes))
    if len(train.classes) < 2:  # one class trains to a meaningless 100%
        raise ConfigError(
            f"--dataset {name}{f' at {data_dir}' if data_dir else ''} has {len(train.classes)} class "
            f"({', '.join(map(str, train.classes)) or 'none'}); classification needs at least 2; "
            f"expected layout: {dataset_info(name).layout}"
        )
    if float(fraction) < 1.0:
        train = train.subset(fraction_per_class(train.targets, float(fraction), int(cfg.seed)))

    train.transform, val.transform = build_transforms(shape.img_size, shape.in_chans, shape.mean, shape.std, cfg, shape)
    spec = _fast_train_transform(cfg, train)
    classes = list(train.classes)
    return DataBundle(train, val, len(classes), shape.in_chans, classes, shape.mean, shape.std, spec)
