"""Loader-worker CPU time per training image: the engine's fast input path against timm's create_loader with
its prefetcher, and the engine's old (all-PIL) path, on the same ImageNet-sized JPEGs and the DeiT recipe at
224 (random resized crop bicubic (0.08, 1), flip 0.5, RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25
'pixel'; color jitter off, as timm turns it off under auto-augment).

    python benchmarks/input_pipeline.py                  # 500x375 quality-90 JPEGs (ImageNet's typical size)
    python benchmarks/input_pipeline.py --size 1000x750  # larger files: the JPEG draft decode kicks in
    python benchmarks/input_pipeline.py --device cuda    # the device half (and timm's prefetcher) on a GPU
    python benchmarks/input_pipeline.py --cost           # only the device half's cost on a GPU, counted here

The JPEGs are made from the images scikit-learn ships (no download) into a temporary directory. Each loader
runs with one worker process; the worker's CPU time (time.process_time: all its threads) is read inside it
at the start of two batches, so the measured span covers whole batches: transform, collate, seeding and
sending. The loaders are measured in turn, `--rounds` times, and each reports its median. The main
process's CPU per image is reported too: on a CPU it runs the fast path's device half (RandAugment,
normalize, erasing) and timm's prefetcher (normalize, erasing). The stage tables time each stage alone in
this process. The last line is the headline: images per worker CPU-second, ours and timm's, their ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import PIL
import timm
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, ImageDataset, create_loader
from timm.data.auto_augment import rand_augment_transform
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import MaybePILToTensor, MaybeToTensor, RandomResizedCropAndInterpolation
from torch.utils.data import Dataset
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dispatch_cost import DispatchCost

from convbias.engine.config.options import Config
from convbias.engine.data.datasets import DATASETS, ImageFolderDataset
from convbias.engine.data.device_augment import AugmentSpec, DeviceAugment, DeviceBatches
from convbias.engine.data.factory import _patch_posterize, build_transforms
from convbias.engine.data.loaders import build_train_loader

AA = "rand-m9-mstd0.5-inc1"
# the DeiT recipe the fast path's RECIPE mirrors (train.py's own defaults are timm's)
DEIT_RECIPE = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "recipes" / "deit.yaml").read_text())
SIZE = 224
RECIPE = AugmentSpec(SIZE, 3, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, auto_augment=AA, re_prob=0.25)


def make_jpegs(root: Path, count: int, size: tuple[int, int], quality: int) -> None:
    """`count` JPEGs of `size` in root/<class>/: random 4:3 crops of scikit-learn's two sample photos."""
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(0)
    for k in range(count):
        photo = photos[k % len(photos)]
        height = int(photo.height * rng.uniform(0.6, 1.0))
        width = min(photo.width, height * 4 // 3)
        left, top = rng.integers(0, photo.width - width + 1), rng.integers(0, photo.height - height + 1)
        image = photo.crop((left, top, left + width, top + height)).resize(size, Image.Resampling.BICUBIC)
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        folder = root / f"class{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{k:05d}.jpg", quality=quality)


class CpuClock(Dataset):
    """Reads the worker's CPU time at the start of the items numbered `marks` (with one worker, batch
    boundaries: the previous batch is transformed, collated and sent by then)."""

    def __init__(self, dataset, marks: tuple[int, int]):
        self.dataset, self.marks, self.served = dataset, marks, 0
        self.times = torch.zeros(len(marks), dtype=torch.float64).share_memory_()

    @property
    def transform(self):
        return self.dataset.transform

    @transform.setter
    def transform(self, value):  # timm's create_loader sets the dataset's transform
        self.dataset.transform = value

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if self.served in self.marks:
            self.times[self.marks.index(self.served)] = time.process_time()
        self.served += 1
        return self.dataset[index]


def measure(make_loader: Callable[[Dataset], object], dataset, batch: int, warmup: int) -> dict[str, float]:
    """Worker and main-process CPU seconds per image over the batches after `warmup`, but for the last."""
    batches = len(dataset) // batch
    clock = CpuClock(dataset, (warmup * batch, (batches - 1) * batch))
    images, main, started = 0, 0.0, 0.0
    for step, (x, _) in enumerate(make_loader(clock)):
        if step == warmup:
            started = time.process_time()
        if warmup <= step < batches - 1:
            images += x.shape[0]
        if step == batches - 2:
            main = time.process_time() - started
    measured = (batches - 1 - warmup) * batch
    assert images == measured, (images, measured)
    worker = float(clock.times[1] - clock.times[0])
    return {"worker": worker / measured, "main": main / measured}


def engine_loader(dataset, batch: int, device: torch.device, augment: DeviceAugment | None):
    return DeviceBatches(build_train_loader(dataset, batch, workers=1, seed=0), device, augment)


def timm_loader(dataset, batch: int, device: torch.device):
    """timm's loader; its posterize gets the engine's fix (Pillow 13 rejects the 0 bits that M10 asks for), same cost."""
    loader = create_loader(
        dataset,
        (3, SIZE, SIZE),
        batch,
        is_training=True,
        re_prob=0.25,
        re_mode="pixel",
        auto_augment=AA,
        color_jitter=0.3,
        interpolation="bicubic",
        num_workers=1,
        device=device,
        pin_memory=device.type == "cuda",
        use_prefetcher=True,
        persistent_workers=False,
    )
    _patch_posterize(dataset.transform)
    return loader


def folder_dataset(root: Path, fast: bool) -> ImageFolderDataset:
    """The engine's folder dataset with the fast path's worker half, or the old engine's timm transform."""
    dataset = ImageFolderDataset.scan(root, "DIR/<class>/<image>")
    if fast:
        dataset.loader = RECIPE.worker_transform()
    else:
        info = DATASETS["imagenet"]
        dataset.transform = build_transforms(SIZE, 3, info.mean, info.std, Config(**{**DEIT_RECIPE, "aa": AA}))[0]
    return dataset


def per_image(step: Callable[[object], object], inputs: list, repeats: int = 1) -> tuple[float, list]:
    """Mean CPU ms per call of `step` over `inputs`, and its outputs."""
    outputs = []
    started = time.process_time()
    for _ in range(repeats):
        outputs = [step(x) for x in inputs]
    return (time.process_time() - started) * 1e3 / (repeats * len(inputs)), outputs


def pil_stages(paths: list[Path]) -> dict[str, float]:
    """timm's (and the old engine's) PIL stages, one after the other on each image, in ms per image."""
    hparams = dict(
        translate_const=int(SIZE * 0.45),
        img_mean=tuple(min(255, round(255 * x)) for x in IMAGENET_DEFAULT_MEAN),
        interpolation=Image.Resampling.BICUBIC,
    )
    ms = {}
    ms["read + decode (Pillow)"], images = per_image(lambda p: Image.open(p).convert("RGB"), paths)
    ms["random resized crop (Pillow bicubic)"], crops = per_image(
        RandomResizedCropAndInterpolation(SIZE, interpolation="bicubic"), images
    )
    ms["flip"], crops = per_image(transforms.RandomHorizontalFlip(0.5), crops)
    rand_augment = transforms.Compose([rand_augment_transform(AA, hparams)])
    _patch_posterize(rand_augment)
    ms["RandAugment (PIL)"], crops = per_image(rand_augment, crops)
    ms["to uint8 tensor (timm prefetcher)"], _ = per_image(MaybePILToTensor(), crops)
    normalize = transforms.Compose([MaybeToTensor(), transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])
    ms["to float tensor + normalize (old engine)"], tensors = per_image(normalize, crops)
    ms["random erasing (old engine, per image)"], _ = per_image(
        RandomErasing(0.25, mode="pixel", device="cpu"), tensors
    )
    return ms


def fast_stages(paths: list[Path], batch: int, device: torch.device) -> dict[str, float]:
    """The fast path's stages in ms per image: the worker's, then the device half's on `device`."""
    crop = RECIPE.worker_transform()
    ms = {}
    ms["read + decode + crop box, uint8 (torchvision; PIL draft when the box allows)"], decoded = per_image(
        crop.decode, paths
    )
    ms["resize (torch uint8 antialiased bicubic)"], resized = per_image(
        lambda pair: F.interpolate(pair[0][None], size=(SIZE, SIZE), mode="bicubic", antialias=True)[0], decoded
    )
    ms["flip"], resized = per_image(lambda x: x.flip(-1) if torch.rand(1) < 0.5 else x.contiguous(), resized)
    batches = [torch.stack(resized[i : i + batch]) for i in range(0, len(resized) - batch + 1, batch)]
    half = {
        name: device_ms(replace(RECIPE, **changes), batches, device) / batch
        for name, changes in (
            ("normalize", dict(auto_augment=None, re_prob=0.0)),
            ("erasing", dict(auto_augment=None)),
            ("all", {}),
        )
    }
    where = f"on {device.type}, {'wall' if device.type == 'cuda' else 'CPU'} ms"
    ms[f"device: RandAugment (batched; {where})"] = half["all"] - half["erasing"]
    ms[f"device: to float + normalize ({where})"] = half["normalize"]
    ms[f"device: random erasing ({where})"] = half["erasing"] - half["normalize"]
    return ms


def device_ms(recipe: AugmentSpec, batches: list[torch.Tensor], device: torch.device) -> float:
    """ms per batch of DeviceAugment: CPU time on a CPU, synchronized wall time on a GPU."""
    augment, batches = DeviceAugment(recipe, device), [b.to(device) for b in batches]
    augment(batches[0])  # warm-up (allocator, kernels)
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize(device)
    started = clock()
    for images in batches:
        augment(images)
    if cuda:
        torch.cuda.synchronize(device)
    return (clock() - started) * 1e3 / len(batches)


def print_cost(batch: int, seeds: int) -> None:
    """The device half's aten ops and bytes written for one batch of random uint8 images at 224 (the DeiT
    recipe), per seed: dispatch_cost's count of what a GPU launches and writes, on this CPU."""
    images = torch.randint(
        0, 256, (batch, 3, SIZE, SIZE), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    print(f"\n| seed | aten ops | bytes written / the batch's fp32 bytes |  (batch {batch} at {SIZE})\n|---|---|---|")
    for seed in range(seeds):
        augment = DeviceAugment(RECIPE, "cpu", seed=seed)
        with DispatchCost() as cost:
            augment(images)
        print(f"| {seed} | {cost.ops} | {cost.bytes_written / (images.numel() * 4):.2f} |")


def print_table(title: str, stages: dict[str, float]) -> None:
    print(f"\n{title}")
    print("| stage | CPU ms per image |\n|---|---|")
    for name, value in stages.items():
        print(f"| {name} | {value:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512, help="JPEGs generated (and images per loader run)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2, help="batches left out at the start")
    parser.add_argument("--size", default="500x375", help="JPEG size WxH")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each loader, taken in turn")
    parser.add_argument("--device", default="cpu", help="where the stage table runs the device half (cuda: a GPU)")
    parser.add_argument("--cost", action="store_true", help="only the device half's ops and bytes, seeds 0-4")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # CPU seconds, not spinning threads; the loader workers have one thread each
    if args.cost:
        print_cost(args.batch_size, seeds=5)
        return
    size = tuple(int(v) for v in args.size.split("x"))
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), "?")
    print(
        f"machine: {os.cpu_count()} cores ({cpu}), load average {os.getloadavg()[0]:.1f}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, timm {timm.__version__}, "
        f"Pillow {PIL.__version__}; {args.images} JPEGs {args.size} q{args.quality}, batch {args.batch_size}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_jpegs(root, args.images, size, args.quality)
        paths = sorted(root.glob("*/*.jpg"))[:128]
        torch.manual_seed(0)
        per_image(lambda p: Image.open(p).convert("RGB"), paths)  # warm the file cache and the decoders
        print_table("timm / old engine, PIL stages (one process, one thread)", pil_stages(paths))
        device = torch.device(args.device)
        print_table("fast path stages (one process, one thread)", fast_stages(paths, args.batch_size, device))
        bs, warm = args.batch_size, args.warmup
        loaders = {
            "ours (fast path)": (
                lambda d: engine_loader(d, bs, device, DeviceAugment(RECIPE, device)),
                lambda: folder_dataset(root, True),
            ),
            "timm create_loader + prefetcher": (lambda d: timm_loader(d, bs, device), lambda: ImageDataset(str(root))),
            "old engine (timm transform in the worker)": (
                lambda d: engine_loader(d, bs, device, None),
                lambda: folder_dataset(root, False),
            ),
        }
        rounds = {name: [] for name in loaders}
        for _ in range(args.rounds):  # in turn, so that the machine's drifts hit every loader alike
            for name, (make_loader, dataset) in loaders.items():
                rounds[name].append(measure(make_loader, dataset(), bs, warm))
    results = {
        name: {key: float(np.median([r[key] for r in runs])) for key in runs[0]} for name, runs in rounds.items()
    }
    print(f"\n| loader | worker CPU ms per image (median of {args.rounds}) | main-process CPU ms per image |")
    print("|---|---|---|")
    for name, r in results.items():
        spread = ", ".join(f"{x['worker'] * 1e3:.2f}" for x in rounds[name])
        print(f"| {name} | {r['worker'] * 1e3:.3f} ({spread}) | {r['main'] * 1e3:.3f} |")
    ours, reference = (
        1 / results["ours (fast path)"]["worker"],
        1 / results["timm create_loader + prefetcher"]["worker"],
    )
    ratio = ours / reference
    print(
        f"input pipeline, DeiT recipe at 224: ours {ours:.0f} images per CPU-second, timm {reference:.0f}, ratio {ratio:.2f}"
    )


if __name__ == "__main__":
    main()
