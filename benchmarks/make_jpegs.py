"""An ImageNet-shaped JPEG folder (ROOT/train/cNN/*.jpg, ROOT/val/cNN/*.jpg) for timing the engine end to end.

Each image is a smooth random texture (noise upsampled from a coarse grid, with a per-class tint) at
``--size`` (default 500x375, the median ImageNet photo), saved at JPEG quality 90: what matters is the cost
of decoding and augmenting, not what the images show.

    python benchmarks/make_jpegs.py /tmp/jpegs --classes 10 --per-class 4000 --val-per-class 20
"""

from __future__ import annotations

import argparse
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image

COARSE = 12  # the texture's grid before upsampling (cells per side): JPEG-compressible, not flat
QUALITY = 90


def make(job: tuple[str, int, int, int, int, int]) -> None:
    """One image: (root, split index (0 train, 1 val), class, number, width, height)."""
    root, split_index, c, i, width, height = job
    split = ("train", "val")[split_index]
    rng = np.random.default_rng([split_index, c, int(i)])
    coarse = rng.integers(0, 256, (COARSE, COARSE, 3), dtype=np.uint8)
    tint = np.random.default_rng(c).integers(-40, 40, 3)
    image = Image.fromarray(np.clip(coarse.astype(int) + tint, 0, 255).astype(np.uint8)).resize(
        (width, height), Image.BICUBIC
    )
    image.save(Path(root) / split / f"c{c:02d}" / f"{int(i):05d}.jpg", quality=QUALITY)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=4000, help="train images per class")
    parser.add_argument("--val-per-class", type=int, default=20)
    parser.add_argument("--size", type=int, nargs=2, default=(500, 375), metavar=("WIDTH", "HEIGHT"))
    args = parser.parse_args(argv)
    if args.classes < 2 or args.per_class < 1 or args.val_per_class < 1 or min(args.size) < 8:
        parser.error("expected at least 2 classes, 1 image per class and split, and sides of 8 pixels or more")
    jobs = []
    for split_index, count in enumerate((args.per_class, args.val_per_class)):
        for c in range(args.classes):
            (args.root / ("train", "val")[split_index] / f"c{c:02d}").mkdir(parents=True, exist_ok=True)
            jobs += [(str(args.root), split_index, c, i, *args.size) for i in range(count)]
    with Pool() as pool:
        pool.map(make, jobs, chunksize=64)
    print(f"{len(jobs)} JPEGs in {args.root}")


if __name__ == "__main__":
    main()
