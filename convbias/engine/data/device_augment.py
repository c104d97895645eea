"""The fast train input path: loader workers decode, crop and flip to uint8; the training device does the rest.

On PIL, timm's DeiT train transform costs its loader workers about 3 ms of CPU per ImageNet JPEG here:
decode 0.9, random resized crop 1.1 (Pillow's bicubic resize), RandAugment 1.0 (docs/input-pipeline.md).
This path splits it:

- worker, `CropFlip`: timm's crop (each --train-crop-mode: rrc, rkrc, rkrr) and flip, drawn by timm's own
  samplers with the same random calls in the same order (so the same crop and flip as timm's transform for
  the same seed). A JPEG file is decoded at the largest DCT scale reduction (PIL's draft: 1/2, 1/4, 1/8)
  that keeps the box at least the size it is resized to (else by torchvision's decoder, straight into a
  tensor), and the box is resized by torch's uint8 antialiased interpolation (Pillow's filters, about 4x
  less CPU than Pillow's resize). Out: a uint8 (C, size, size) tensor, a quarter of the float bytes.
- device, `DeviceAugment`: RandAugment with choices per image (engine.data.rand_augment), normalization and
  random erasing, drawn from its own generators seeded by (seed, rank), whose state `state_dict()` holds
  for an exact resume; applied in two passes over the batch per layer (engine.data.augment_passes).
- `DeviceBatches`: the loader's batches moved to the device (pinned, non-blocking), augmented there, and
  the seconds the training loop waited for the loader counted (the epoch's data-wait fraction).

`fast_path_reason` says why a configuration cannot take this path (it then keeps timm's PIL transforms).
"""

from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data.transforms import (
    RandomCropOrPad,
    RandomResizedCropAndInterpolation,
    center_crop_or_pad,
    crop_or_pad,
    str_to_pil_interp,
)
from timm.data.transforms_factory import transforms_imagenet_train
from torch.profiler import record_function

from convbias.base.errors import ConfigError

from .augment_passes import augment_histograms, augment_pass
from .rand_augment import ErasingSpec, RandAugmentSpec, erasing_noise, layer_plans

try:  # torchvision 0.29 deprecates its image decoders (for torchcodec's); without them Pillow decodes every file
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:
    decode_jpeg = None

AUGMENT_STREAM = 2  # keeps DeviceAugment's seeds apart from the sampler's streams of the same run seed
ERASING_MODES = ("pixel", "rand", "const")
INTERPOLATIONS = ("bilinear", "bicubic")
CROP_MODES = ("rrc", "rkrc", "rkrr")  # timm's train_crop_mode
# rkrc/rkrr zoom out (--scale above 1, aspect jitter) by reflect padding of the resized image; torch's reflect
# padding (unlike Pillow's, numpy's) must be narrower than the image: at most this area zoom-out keeps every
# side resized to >= 0.63 of the output size, so that any output of 4 pixels or more pads within the image
RKR_MAX_ZOOM_OUT = 2.5


def image_mode(in_chans: int) -> str:
    """The PIL mode images are served in for ``in_chans`` channels (timm's input_img_mode): L for one, else RGB."""
    return "L" if in_chans == 1 else "RGB"


@dataclass(frozen=True)
class AugmentSpec:
    """The train augmentation of timm's create_transform(is_training=True), as this path needs it."""

    img_size: int
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: tuple[float, float] | None = None  # None: timm's default for crop_mode
    ratio: tuple[float, float] | None = None
    crop_mode: str = "rrc"
    hflip: float = 0.5
    interpolation: str = "bicubic"
    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    re_prob: float = 0.25
    re_mode: str = "pixel"

    def rand_augment(self) -> RandAugmentSpec | None:
        """The RandAugment of `auto_augment` with the hparams create_transform gives it (translate_const 45% of
        the size, fill color the mean in 0..255, the spec's interpolation)."""
        if not self.auto_augment:
            return None
        hparams = dict(
            translate_const=int(self.img_size * 0.45),
            img_mean=tuple(min(255, round(255 * x)) for x in self.mean),
            interpolation=str_to_pil_interp(self.interpolation),
        )
        return RandAugmentSpec.from_timm(self.auto_augment, hparams)

    def worker_transform(self) -> CropFlip:
        return CropFlip(
            self.img_size,
            self.scale,
            self.ratio,
            self.hflip,
            self.interpolation,
            image_mode(self.in_chans),
            crop_mode=self.crop_mode,
        )


def fast_path_reason(
    spec: AugmentSpec, no_prefetcher: bool = False, no_aug: bool = False, color_jitter: float | None = None
) -> str | None:
    """Why a training configuration keeps timm's PIL transforms in the loader workers, or None when it can take
    the fast path. Color jitter only counts without auto-augment, as in timm (which drops it then)."""
    if no_prefetcher:
        return "--no-prefetcher asks for timm's PIL transforms in the loader workers"
    if no_aug:
        return "--no-aug: no augmentation to move to the device"
    if spec.interpolation not in INTERPOLATIONS:
        return f"train interpolation {spec.interpolation}: the device path has {' and '.join(INTERPOLATIONS)}"
    if color_jitter and not spec.auto_augment:
        return "color jitter without auto-augment has no device form"
    if spec.re_prob > 0 and spec.re_mode not in ERASING_MODES:
        return f"random erasing mode {spec.re_mode!r} has no device form"
    try:
        spec.rand_augment()
    except ValueError as error:
        return str(error)
    crop = spec.worker_transform()
    if crop.crop_mode != "rrc" and crop.zoom_out() > RKR_MAX_ZOOM_OUT:
        return (
            f"--train-crop-mode {crop.crop_mode} with --scale up to {crop.scale[1]}: zooms out to reflect padding "
            "wider than the resized image, which the worker's torch padding cannot do"
        )
    return None


class Crop(NamedTuple):
    """One training crop as timm's transform makes it: the source box (top, left, height, width) resized to
    `resized` (height, width; None: the output size), then timm's crop-or-pad to the output size at `window`
    ((top, left) in the resized box; None: centered), reflect-padded where it overhangs (rkrc, rkrr)."""

    top: int
    left: int
    height: int
    width: int
    resized: tuple[int, int] | None = None
    window: tuple[int, int] | None = None


class CropFlip:
    """Worker half of the fast path: image (PIL, or a file path) -> uint8 (C, size, size) crop, flipped or not.
    ``mode`` (L or RGB) converts every crop to the run's channels; None keeps an image's own mode (a file: RGB).
    ``crop_mode`` is timm's train_crop_mode: rrc (random resized crop), rkrc / rkrr (the whole image resized
    keeping its aspect ratio, with random scale and aspect jitter, then a center / random crop, reflect-padded
    where the resized image is smaller). scale, ratio None: timm's defaults for the crop mode."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] | None = None,
        ratio: tuple[float, float] | None = None,
        hflip: float = 0.5,
        interpolation: str = "bicubic",
        mode: str | None = None,
        crop_mode: str = "rrc",
    ):
        if crop_mode not in CROP_MODES:
            raise ConfigError(f"crop mode {crop_mode!r}: expected one of {', '.join(CROP_MODES)}")
        self.size = (int(size), int(size))
        self.hflip, self.interpolation, self.crop_mode = hflip, interpolation, crop_mode
        self.mode = mode
        # timm's own crop transform, built as create_transform builds it (with its defaults for the crop mode)
        self.resize = transforms_imagenet_train(
            self.size,
            scale=tuple(scale) if scale is not None else None,
            ratio=tuple(ratio) if ratio is not None else None,
            train_crop_mode=crop_mode,
            hflip=0.0,
            color_jitter=None,
            interpolation=interpolation,
            separate=True,
        )[0].transforms[0]  # RandomResizedCropAndInterpolation or ResizeKeepRatio
        if crop_mode == "rrc":
            self.scale, self.ratio = tuple(self.resize.scale), tuple(self.resize.ratio)
        else:
            self.scale, self.ratio = tuple(self.resize.random_scale_range), tuple(self.resize.random_aspect_range)

    def zoom_out(self) -> float:
        """rkrc/rkrr: the largest factor by which the resized image can fall short of the output size, squared
        (a side shrinks by 1/sqrt(scale) and by the square root of the aspect factor)."""
        return max(1.0, self.scale[1]) * max(1.0, self.ratio[1], 1.0 / self.ratio[0])

    def __call__(self, image: Image.Image | str | os.PathLike) -> torch.Tensor:
        """An image in memory keeps its mode (L or RGB); a path is decoded as RGB (see `from_file`); then `mode`."""
        if isinstance(image, str | os.PathLike):
            return self.from_file(image)
        box, flip = self.sample(image)
        return self.crop(image, box, flip)

    def from_file(self, path: str | os.PathLike) -> torch.Tensor:
        """A file as torchvision's default loader reads it (RGB, then `mode`), decoded at the crop's scale (see
        `region`). A file that does not decode raises (OSError, RuntimeError)."""
        return self._finish(*self.decode(path))

    def decode(self, path: str | os.PathLike) -> tuple[torch.Tensor, Crop, bool]:
        """The crop's box of a file, uint8 (C, h, w) at the decode's scale, the crop and the flip draw. A JPEG
        whose box allows a DCT scale reduction goes through Pillow's draft (`region`); another RGB JPEG through
        torchvision's decoder: the same libjpeg-turbo pixels as Pillow's, straight into a tensor (about 0.2 ms
        less per ImageNet image than Pillow's decode and conversion). The file is read whole first (Pillow
        reads a file in small pieces)."""
        data = Path(path).read_bytes()
        image = Image.open(io.BytesIO(data))  # the header only, so far
        box, flip = self.sample(image)
        if (
            decode_jpeg is not None
            and image.format == "JPEG"
            and image.mode == "RGB"
            and self.mode in (None, "RGB")
            and self.reduction(image, box) == 1
        ):
            top, left, height, width = box[:4]
            pixels = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
            return pixels[:, top : top + height, left : left + width], box, flip
        return _chw(self.region(image, box)), box, flip

    def sample(self, image: Image.Image) -> tuple[Crop, bool]:
        """The crop and flip, by timm's draws in timm's order (Python's random, then torch.rand(1) for
        torchvision's RandomHorizontalFlip when hflip > 0). rrc: RandomResizedCropAndInterpolation's get_params;
        rkrc, rkrr: ResizeKeepRatio's (the size the whole image is resized to), then for rkrr RandomCropOrPad's
        (the window's corner in the resized image)."""
        if self.crop_mode == "rrc":
            crop = Crop(*RandomResizedCropAndInterpolation.get_params(image, self.scale, self.ratio))
        else:
            keep_ratio = self.resize  # timm's ResizeKeepRatio: the draws of its __call__
            resized = keep_ratio.get_params(
                image,
                keep_ratio.size,
                keep_ratio.longest,
                keep_ratio.random_scale_prob,
                keep_ratio.random_scale_range,
                keep_ratio.random_scale_area,
                keep_ratio.random_aspect_prob,
                keep_ratio.random_aspect_range,
            )
            resized = (int(resized[0]), int(resized[1]))
            shape = torch.empty(()).expand(resized)  # the resized image's dimensions, no pixels
            window = RandomCropOrPad.get_params(shape, self.size) if self.crop_mode == "rkrr" else None
            crop = Crop(0, 0, image.height, image.width, resized, window)
        flip = self.hflip > 0 and bool(torch.rand(1) < self.hflip)
        return crop, flip

    def reduction(self, image: Image.Image, box: Crop | tuple[int, int, int, int]) -> int:
        """The DCT scale reduction Pillow's draft takes for this box (`region`): the largest of 8, 4, 2 that keeps
        the box at least the size it is resized to, else 1."""
        wanted = self._draft_size(image, box)
        fits = min(image.width // wanted[0], image.height // wanted[1])
        return next((s for s in (8, 4, 2) if fits >= s), 1)

    def _draft_size(self, image: Image.Image, box: Crop | tuple[int, int, int, int]) -> tuple[int, int]:
        """The size to ask Pillow's draft for: the image scaled as the box is to the size it is resized to."""
        box = Crop(*box)
        height, width = box.resized or self.size
        return math.ceil(image.width * width / box.width), math.ceil(image.height * height / box.height)

    def crop(self, image: Image.Image, box: Crop | tuple[int, int, int, int], flip: bool) -> torch.Tensor:
        return self._finish(_chw(self.region(image, box)), Crop(*box), flip)

    def _finish(self, chw: torch.Tensor, crop: Crop, flip: bool) -> torch.Tensor:
        """The box's pixels resized by torch's uint8 antialiased resize (fastest on channels-last memory, which
        HWC pixels permuted are), cropped or padded to the output size by timm's own functions, flipped."""
        resized = crop.resized or self.size
        if tuple(chw.shape[-2:]) != resized:
            chw = F.interpolate(chw[None], size=resized, mode=self.interpolation, antialias=True)[0]
        if resized != self.size:
            if crop.window is None:
                chw = center_crop_or_pad(chw, self.size, padding_mode="reflect")
            else:
                chw = crop_or_pad(chw, *crop.window, *self.size, padding_mode="reflect")
        return chw.flip(-1) if flip else chw.contiguous()

    def region(self, image: Image.Image, box: Crop | tuple[int, int, int, int]) -> Image.Image:
        """The box's pixels (L or RGB: `mode`). A JPEG not decoded yet is decoded at the DCT scale reduction that
        keeps the box at least the size it is resized to; the box is then rounded to that scale's pixels (< 1/2
        pixel)."""
        top, left, height, width = box[:4]
        undecoded = bool(getattr(image, "tile", None))  # opened from a file, pixels not read yet
        corners = (left, top, left + width, top + height)
        if image.format == "JPEG" and undecoded:
            original = image.width
            drafted = image.draft(None, self._draft_size(image, box))  # (mode, (0, 0, width / scale, ...))
            reduction = original / drafted[1][2] if drafted else 1.0
            if reduction > 1:
                corners = tuple(round(c / reduction) for c in corners)
        region = image.crop(corners)
        if (undecoded or region.mode not in ("L", "RGB")) and region.mode != "RGB":
            region = region.convert("RGB")  # a file reads as RGB, as default_loader does (then `mode`, as timm's)
        return region if region.mode == (self.mode or region.mode) else region.convert(self.mode)


def _chw(image: Image.Image) -> torch.Tensor:
    """uint8 (C, H, W) over the image's (H, W, C) pixels (channels-last memory: torch's fast resize input)."""
    pixels = torch.from_numpy(np.array(image))
    return pixels.permute(2, 0, 1) if pixels.ndim == 3 else pixels[None]


class DeviceAugment:
    """Device half of the fast path: uint8 (N, C, H, W) batch -> float32 normalized batch, with RandAugment and
    random erasing drawn per image as timm draws them. Choices come from a CPU generator (no device sync), the
    erasing noise from one on the device; both are seeded by (seed, rank) and saved by `state_dict`."""

    def __init__(self, spec: AugmentSpec, device: torch.device | str = "cpu", seed: int = 0, rank: int = 0):
        self.device = torch.device(device)
        self.spec = spec
        self.rand_augment = spec.rand_augment()
        self.erasing = ErasingSpec(spec.re_prob, spec.re_mode) if spec.re_prob > 0 else None
        shape = (1, len(spec.mean), 1, 1)
        self.mean = torch.tensor(spec.mean, dtype=torch.float32, device=self.device).view(shape)
        self.std = torch.tensor(spec.std, dtype=torch.float32, device=self.device).view(shape)
        fill = self.rand_augment.fill if self.rand_augment else (0,)
        self.fill = torch.tensor(fill, dtype=torch.float32, device=self.device).expand(len(spec.mean)).contiguous()
        self.interpolation = self.rand_augment.interpolation if self.rand_augment else "bilinear"
        self.plan_generator, self.noise_generator = torch.Generator(), torch.Generator(device=self.device)
        self.reseed(seed, rank)

    def reseed(self, seed: int, rank: int, epoch: int = 0) -> None:
        """Fresh streams from (seed, rank, epoch): for a resume whose point was written by another number of
        processes, which cannot replay its ranks' streams (as engine.checkpoint.parts's RandomStreams does)."""
        plan_seed, noise_seed = np.random.SeedSequence([seed, rank, AUGMENT_STREAM, epoch]).generate_state(2)
        self.plan_generator.manual_seed(int(plan_seed))
        self.noise_generator.manual_seed(int(noise_seed))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, C, H, W), on the device or pinned on the host -> float32 normalized (N, C, H, W) on the device."""
        images = images.to(self.device, non_blocking=True)
        n, channels, height, width = images.shape
        if self.rand_augment is not None:
            ops, args = self.rand_augment.sample(n, self.plan_generator)
            plans, tables = layer_plans(self.rand_augment.names, ops, args, width, height)
        else:  # one pass of no op: normalization and erasing
            plans, tables = layer_plans((), np.full((1, n), -1), np.zeros((1, n)), width, height)
        boxes = self.erasing.sample(n, height, width, self.plan_generator) if self.erasing else np.zeros((n, 4), int)
        noise_start = np.cumsum(boxes[:, 2] * boxes[:, 3] * channels) - boxes[:, 2] * boxes[:, 3] * channels
        on_device = self._to_device([np.concatenate([boxes, noise_start[:, None]], 1), plans, tables])
        boxes_on_device, plans_on_device, tables_on_device = on_device
        erasing = self.erasing.mode if self.erasing else "none"
        noise = erasing_noise(erasing, boxes, channels, self.noise_generator)
        for layer in range(len(plans)):
            histograms = augment_histograms(images, plans_on_device[layer])
            cumulative = histograms.cumsum(-1, dtype=torch.int32)
            images = augment_pass(
                images, plans_on_device[layer], tables_on_device[layer], histograms, cumulative, boxes_on_device,
                noise, self.fill, self.mean, self.std, self.interpolation, layer == len(plans) - 1, erasing,
            )  # fmt: skip
        return images

    def _to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The plan's small arrays in one fp64 copy (each its shape); pinned on CUDA so that the copy does not
        wait for queued work."""
        host = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        parts = host.to(self.device, non_blocking=True).split([np.size(a) for a in arrays])
        return [part.view(np.shape(a)) for part, a in zip(parts, arrays)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The generators' states (CPU byte tensors): what an exact resume needs besides the spec and seed."""
        return {"plan_generator": self.plan_generator.get_state(), "noise_generator": self.noise_generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continues the streams `state_dict` saved (ConfigError if they were another kind of device's)."""
        try:
            self.plan_generator.set_state(state["plan_generator"])
            self.noise_generator.set_state(state["noise_generator"])
        except (KeyError, RuntimeError) as error:
            raise ConfigError(
                f"DeviceAugment state does not fit this device ({self.device.type}): {error}; a resume on another "
                "kind of device cannot replay the same augmentations"
            ) from None


class DeviceBatches:
    """A train loader's (images, targets) batches on the device, through `augment` when given (the fast path;
    the classic path's batches are only moved), counting the seconds spent waiting for the loader."""

    def __init__(self, batches: Iterable, device: torch.device | str, augment: DeviceAugment | None = None):
        self.batches, self.device, self.augment = batches, torch.device(device), augment
        self.wait_seconds = 0.0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        started = time.perf_counter()
        with record_function("loader_wait"):
            iterator = iter(self.batches)  # starting the loader's workers is waiting for data too
        while True:
            try:
                with record_function("loader_wait"):
                    images, targets = next(iterator)
            except StopIteration:
                self.wait_seconds += time.perf_counter() - started
                return
            self.wait_seconds += time.perf_counter() - started
            with record_function("device_augment"):
                images = self.augment(images) if self.augment else images.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
            yield images, targets
            started = time.perf_counter()

    def wait_fraction(self, seconds: float) -> float:
        """The share of `seconds` (the epoch's wall time) the loop spent waiting for the loader."""
        return self.wait_seconds / seconds if seconds > 0 else 0.0
