"""The fast train input path: loader workers decode, crop and flip to uint8; the training device does the rest.

On PIL, timm's DeiT train transform costs its loader workers about 3 ms of CPU per ImageNet JPEG here:
decode 0.9, random resized crop 1.1 (Pillow's bicubic resize), RandAugment 1.0 (docs/input-pipeline.md).
This path splits it:

- worker, `CropFlip`: timm's crop box and flip, drawn by timm's own sampler with the same random calls
  in the same order (so the same box and flip as timm's transform for the same seed). A JPEG file is
  decoded at the largest DCT scale reduction (PIL's draft: 1/2, 1/4, 1/8) that keeps the box at least the
  output size (else by torchvision's decoder, straight into a tensor), and the box is resized by torch's uint8 antialiased interpolation (Pillow's filters, about
  4x less CPU than Pillow's resize). Out: a uint8 (C, size, size) tensor, a quarter of the float bytes.
- device, `DeviceAugment`: RandAugment as batched ops with choices per image (engine.batch_augment),
  normalization and random erasing, drawn from its own generators seeded by (seed, rank), whose state
  `state_dict()` holds for an exact resume.
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

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation, str_to_pil_interp

from .batch_augment import ErasingSpec, OpContext, RandAugmentSpec, apply_rand_augment, erase, rand_augment_groups

try:  # torchvision 0.29 deprecates its image decoders (for torchcodec's); without them Pillow decodes every file
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:
    decode_jpeg = None

AUGMENT_STREAM = 2  # keeps DeviceAugment's seeds apart from the sampler's streams of the same run seed
ERASING_MODES = ("pixel", "rand", "const")
INTERPOLATIONS = ("bilinear", "bicubic")


@dataclass(frozen=True)
class AugmentRecipe:
    """The train augmentation of timm's create_transform(is_training=True), as this path needs it."""

    img_size: int
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    hflip: float = 0.5
    interpolation: str = "bicubic"
    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    re_prob: float = 0.25
    re_mode: str = "pixel"

    def rand_augment(self) -> RandAugmentSpec | None:
        """The RandAugment of `auto_augment` with the hparams create_transform gives it (translate_const 45% of
        the size, fill color the mean in 0..255, the recipe's interpolation)."""
        if not self.auto_augment:
            return None
        hparams = dict(
            translate_const=int(self.img_size * 0.45),
            img_mean=tuple(min(255, round(255 * x)) for x in self.mean),
            interpolation=str_to_pil_interp(self.interpolation),
        )
        return RandAugmentSpec.from_timm(self.auto_augment, hparams)

    def worker_transform(self) -> CropFlip:
        return CropFlip(self.img_size, self.scale, self.ratio, self.hflip, self.interpolation)


def fast_path_reason(
    recipe: AugmentRecipe, no_prefetcher: bool = False, no_aug: bool = False, color_jitter: float | None = None
) -> str | None:
    """Why a training configuration keeps timm's PIL transforms in the loader workers, or None when it can take
    the fast path. Color jitter only counts without auto-augment, as in timm (which drops it then)."""
    if no_prefetcher:
        return "--no-prefetcher asks for timm's PIL transforms in the loader workers"
    if no_aug:
        return "--no-aug: no augmentation to move to the device"
    if recipe.interpolation not in INTERPOLATIONS:
        return f"--interpolation {recipe.interpolation}: the device path has {' and '.join(INTERPOLATIONS)}"
    if color_jitter and not recipe.auto_augment:
        return "color jitter without auto-augment has no device form"
    if recipe.re_prob > 0 and recipe.re_mode not in ERASING_MODES:
        return f"random erasing mode {recipe.re_mode!r} has no device form"
    try:
        recipe.rand_augment()
    except ValueError as error:
        return str(error)
    return None


class CropFlip:
    """Worker half of the fast path: image (PIL, or a file path) -> uint8 (C, size, size) crop, flipped or not."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        hflip: float = 0.5,
        interpolation: str = "bicubic",
    ):
        self.size = (int(size), int(size))
        self.scale, self.ratio, self.hflip, self.interpolation = tuple(scale), tuple(ratio), hflip, interpolation

    def __call__(self, image: Image.Image | str | os.PathLike) -> torch.Tensor:
        """An image in memory keeps its mode (L or RGB); a path is decoded as RGB (see `from_file`)."""
        if isinstance(image, str | os.PathLike):
            return self.from_file(image)
        box, flip = self.sample(image)
        return self.crop(image, box, flip)

    def from_file(self, path: str | os.PathLike) -> torch.Tensor:
        """A file as torchvision's default loader reads it (RGB), decoded at the crop's scale (see `region`).
        A file that does not decode raises (OSError, RuntimeError)."""
        return self._resize_flip(*self.decode(path))

    def decode(self, path: str | os.PathLike) -> tuple[torch.Tensor, bool]:
        """The crop box of a file, uint8 (C, h, w) at the decode's scale, and the flip draw. A JPEG whose box
        allows a DCT scale reduction goes through Pillow's draft (`region`); another RGB JPEG through
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
            and self.reduction(image, box) == 1
        ):
            top, left, height, width = box
            pixels = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
            return pixels[:, top : top + height, left : left + width], flip
        return _chw(self.region(image, box)), flip

    def sample(self, image: Image.Image) -> tuple[tuple[int, int, int, int], bool]:
        """(top, left, height, width) and flip, by timm's draws in timm's order: RandomResizedCropAndInterpolation's
        get_params (Python's random), then torchvision's RandomHorizontalFlip (torch.rand(1)) when hflip > 0."""
        box = RandomResizedCropAndInterpolation.get_params(image, self.scale, self.ratio)
        flip = self.hflip > 0 and bool(torch.rand(1) < self.hflip)
        return box, flip

    def reduction(self, image: Image.Image, box: tuple[int, int, int, int]) -> int:
        """The DCT scale reduction Pillow's draft takes for this box (`region`): the largest of 8, 4, 2 that keeps
        the box at least the output size, else 1."""
        wanted = self._draft_size(image, box)
        fits = min(image.width // wanted[0], image.height // wanted[1])
        return next((s for s in (8, 4, 2) if fits >= s), 1)

    def _draft_size(self, image: Image.Image, box: tuple[int, int, int, int]) -> tuple[int, int]:
        """The size to ask Pillow's draft for: the image scaled as the box is to the output size."""
        _, _, height, width = box
        return math.ceil(image.width * self.size[1] / width), math.ceil(image.height * self.size[0] / height)

    def crop(self, image: Image.Image, box: tuple[int, int, int, int], flip: bool) -> torch.Tensor:
        return self._resize_flip(_chw(self.region(image, box)), flip)

    def _resize_flip(self, chw: torch.Tensor, flip: bool) -> torch.Tensor:
        """torch's uint8 antialiased resize (fastest on channels-last memory, which HWC pixels permuted are)."""
        if tuple(chw.shape[-2:]) != self.size:
            chw = F.interpolate(chw[None], size=self.size, mode=self.interpolation, antialias=True)[0]
        return chw.flip(-1) if flip else chw.contiguous()

    def region(self, image: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
        """The box's pixels (L or RGB). A JPEG not decoded yet is decoded at the DCT scale reduction that keeps
        the box at least the output size; the box is then rounded to that scale's pixels (< 1/2 pixel)."""
        top, left, height, width = box
        undecoded = bool(getattr(image, "tile", None))  # opened from a file, pixels not read yet
        corners = (left, top, left + width, top + height)
        if image.format == "JPEG" and undecoded:
            original = image.width
            drafted = image.draft(None, self._draft_size(image, box))  # (mode, (0, 0, width / scale, ...))
            reduction = original / drafted[1][2] if drafted else 1.0
            if reduction > 1:
                corners = tuple(round(c / reduction) for c in corners)
        region = image.crop(corners)
        rgb = undecoded or region.mode not in ("L", "RGB")  # a file reads as RGB, as default_loader does
        return region.convert("RGB") if rgb and region.mode != "RGB" else region


def _chw(image: Image.Image) -> torch.Tensor:
    """uint8 (C, H, W) over the image's (H, W, C) pixels (channels-last memory: torch's fast resize input)."""
    pixels = torch.from_numpy(np.array(image))
    return pixels.permute(2, 0, 1) if pixels.ndim == 3 else pixels[None]


class DeviceAugment:
    """Device half of the fast path: uint8 (N, C, H, W) batch -> float32 normalized batch, with RandAugment and
    random erasing drawn per image as timm draws them. Choices come from a CPU generator (no device sync), the
    erasing noise from one on the device; both are seeded by (seed, rank) and saved by `state_dict`."""

    def __init__(self, recipe: AugmentRecipe, device: torch.device | str = "cpu", seed: int = 0, rank: int = 0):
        self.device = torch.device(device)
        self.recipe = recipe
        self.rand_augment = recipe.rand_augment()
        self.erasing = ErasingSpec(recipe.re_prob, recipe.re_mode) if recipe.re_prob > 0 else None
        shape = (1, len(recipe.mean), 1, 1)
        self.mean = torch.tensor(recipe.mean, dtype=torch.float32, device=self.device).view(shape)
        self.std = torch.tensor(recipe.std, dtype=torch.float32, device=self.device).view(shape)
        self.context = None
        if self.rand_augment is not None:
            fill = torch.tensor(self.rand_augment.fill, dtype=torch.float32, device=self.device)
            self.context = OpContext(fill.view(1, -1, 1, 1), self.rand_augment.interpolation)
        self.plan_generator, self.noise_generator = torch.Generator(), torch.Generator(device=self.device)
        self.reseed(seed, rank)

    def reseed(self, seed: int, rank: int, epoch: int = 0) -> None:
        """Fresh streams from (seed, rank, epoch): for a resume whose point was written by another number of
        processes, which cannot replay its ranks' streams (as engine.resume_state's RandomStreams does)."""
        plan_seed, noise_seed = np.random.SeedSequence([seed, rank, AUGMENT_STREAM, epoch]).generate_state(2)
        self.plan_generator.manual_seed(int(plan_seed))
        self.noise_generator.manual_seed(int(noise_seed))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, C, H, W), on the device or pinned on the host -> float32 normalized (N, C, H, W) on the device."""
        images = images.to(self.device, non_blocking=True)
        n, _, height, width = images.shape
        groups = []
        if self.rand_augment is not None:
            groups = rand_augment_groups(*self.rand_augment.sample(n, self.plan_generator))
        boxes = self.erasing.sample(n, height, width, self.plan_generator) if self.erasing else np.zeros((0, 4))
        moved = self._to_device([boxes] + [a for _, rows, args in groups for a in (rows, args)])
        out = images.float()
        if groups:
            on_device = [(k, moved[1 + 2 * i].long(), moved[2 + 2 * i].float()) for i, (k, _, _) in enumerate(groups)]
            out = apply_rand_augment(out, self.rand_augment.names, on_device, self.context)
        out = out.div_(255.0).sub_(self.mean).div_(self.std)
        pixels = int((boxes[:, 2] * boxes[:, 3]).sum()) * out.shape[1]
        if pixels:
            out = erase(out, moved[0].long().view(n, 4), self.erasing, pixels, self.noise_generator)
        return out

    def _to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The plan's small arrays in one copy; pinned on CUDA so that the copy does not wait for queued work."""
        host = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return list(host.to(self.device, non_blocking=True).split([np.size(a) for a in arrays]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The generators' states (CPU byte tensors): what an exact resume needs besides the recipe and seed."""
        return {"plan_generator": self.plan_generator.get_state(), "noise_generator": self.noise_generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continues the streams `state_dict` saved (ValueError if they were another kind of device's)."""
        try:
            self.plan_generator.set_state(state["plan_generator"])
            self.noise_generator.set_state(state["noise_generator"])
        except (KeyError, RuntimeError) as error:
            raise ValueError(
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
        iterator = iter(self.batches)  # starting the loader's workers is waiting for data too
        while True:
            try:
                images, targets = next(iterator)
            except StopIteration:
                self.wait_seconds += time.perf_counter() - started
                return
            self.wait_seconds += time.perf_counter() - started
            images = self.augment(images) if self.augment else images.to(self.device, non_blocking=True)
            yield images, targets.to(self.device, non_blocking=True)
            started = time.perf_counter()

    def wait_fraction(self, seconds: float) -> float:
        """The share of `seconds` (the epoch's wall time) the loop spent waiting for the loader."""
        return self.wait_seconds / seconds if seconds > 0 else 0.0
