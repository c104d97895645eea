"""Images the tests make: a natural crop, a JPEG, image folders, PNGs, webdataset shards; and PSNR."""

import importlib.util
import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image


def sample_image(size=(96, 72), offset=(180, 120)) -> Image.Image:
    """A natural RGB image (scikit-learn's china.jpg, read without importing scikit-learn), non-square."""
    root = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    image = Image.open(root / "datasets" / "images" / "china.jpg").convert("RGB")
    return image.crop((offset[0], offset[1], offset[0] + size[0], offset[1] + size[1]))


def jpeg_file(tmp_path: Path, size: tuple[int, int]) -> Path:
    """A quality-90 JPEG of a natural image, upscaled to `size`."""
    path = tmp_path / f"image_{size[0]}x{size[1]}.jpg"
    sample_image((420, 315), (100, 60)).resize(size, Image.Resampling.BICUBIC).save(path, quality=90)
    return path


def psnr(a, b) -> float:
    """The peak signal-to-noise ratio of two uint8-range images, in dB (inf when they are equal)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = np.mean((a - b) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def png(path, value: int = 0) -> None:
    """A 4x4 grey PNG at ``path`` (its folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (value, value, value)).save(path)


def image_folder(root: Path, per_class: int, side: int) -> Path:
    """root/data/<class>/<image>.png: 3 classes of `per_class` plain images, each its own colour."""
    for label in range(3):
        (root / "data" / f"c{label}").mkdir(parents=True)
        for index in range(per_class):
            Image.new("RGB", (side, side), (80 * label, 40 * index, 30)).save(
                root / "data" / f"c{label}" / f"{index}.png"
            )
    return root / "data"


SHARD_SIDE = 16  # the side of write_shards' images


def write_shards(root: Path, per_split: dict[str, int], shards: int = 2) -> None:
    """Two classes of RGB PNGs (bright left half vs bright right half) in `shards` tars per split, and
    timm's _info.json listing them."""
    rng = np.random.default_rng(0)
    info = {"num_classes": 2, "splits": {}}
    for split, count in per_split.items():
        names, lengths = [], []
        for shard in range(shards):
            name, members = f"toy-{split}-{shard:04d}.tar", range(shard, count, shards)
            with tarfile.open(root / name, "w") as tar:
                for i in members:
                    label = (i // shards) % 2
                    image = rng.integers(0, 90, (SHARD_SIDE, SHARD_SIDE, 3), dtype=np.uint8)
                    image[:, label * SHARD_SIDE // 2 : (label + 1) * SHARD_SIDE // 2] += 150
                    encoded = io.BytesIO()
                    Image.fromarray(image).save(encoded, format="PNG")
                    for ext, data in (("png", encoded.getvalue()), ("cls", str(label).encode())):
                        member = tarfile.TarInfo(f"{split}_{i:05d}.{ext}")
                        member.size = len(data)
                        tar.addfile(member, io.BytesIO(data))
            names.append(name)
            lengths.append(len(members))
        info["splits"][split] = {"name": split, "num_samples": count, "filenames": names, "shard_lengths": lengths}
    (root / "_info.json").write_text(json.dumps(info))
