"""The device augmentation's Triton kernels against their reference under Triton's interpreter: the child
process of tests/engine/data/test_augment_passes.py (`interpreted.interpreted_results`). A module of its own, importing
only the passes and the ops they run: the test module's others (DeviceAugment's timm transforms) would only
lengthen the child's start."""

import os

import numpy as np
import torch

from convbias.engine.data import augment_kernels, augment_passes
from convbias.engine.data.rand_augment import LEVELS, Kind, erasing_noise, layer_plans

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as the DeiT recipe normalizes
# ops of rand-m9-mstd0.5-inc1 (timm's names; the plans index them directly: RandAugmentSpec.from_timm would
# import timm for the list alone)
INTERPRETED_OPS = (
    "Rotate", "ShearX", "TranslateYRel", "Equalize", "AutoContrast", "ColorIncreasing", "SharpnessIncreasing",
    "ContrastIncreasing", "BrightnessIncreasing", "PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd", "Invert",
)  # fmt: skip
# two programs per image (augment_passes.INTERPRETER_BLOCK pixels each), the second a partial block: the
# interpreter's cost is its programs
HEIGHT, WIDTH = 9, 13
# erased boxes (top, left, height, width): one inside, none, one over the full width down to the last row
BOXES = [[2, 3, 5, 6], [0, 0, 0, 0], [1, 0, HEIGHT - 1, WIDTH]]
# Equalize changes an image only when it has more than 255 pixels outside its last level (PIL's step is
# their count // 255): a case of its own at a size that takes that branch
EQUALIZE_HEIGHT, EQUALIZE_WIDTH = 16, 20
CASES = [(3, "bicubic", "pixel"), (3, "bilinear", "rand"), (1, "bicubic", "const")]


def _plan(ops: np.ndarray, channels: int, height: int, width: int) -> tuple:
    """The plan and tables of INTERPRETED_OPS indexed by `ops` (one layer), each at magnitude 7."""
    names = INTERPRETED_OPS
    hparams = dict(translate_const=5, img_mean=(124, 116, 104)[:channels], interpolation=3)
    args = np.array(
        [[LEVELS[names[k]](np.array([7.0]), np.array([i % 2 == 0]), hparams)[0] for i, k in enumerate(ops[0])]]
    )
    plans, tables = layer_plans(names, ops, args, width, height)
    return plans[0], tables[0]


def _case(channels: int, seed: int) -> tuple:
    """Images (one of narrow range, one flat) and a plan with every kind of op, both signs, and an unaugmented image."""
    generator = torch.Generator().manual_seed(seed)
    n = 16
    images = torch.randint(0, 256, (n, channels, HEIGHT, WIDTH), dtype=torch.uint8, generator=generator)
    images[3] = images[3] // 4 + 100
    images[4] = 77
    ops = np.array([[i % len(INTERPRETED_OPS) for i in range(n)]])
    ops[0, -2] = -1
    boxes = np.array(BOXES + [[0, 0, 0, 0]] * (n - len(BOXES)))
    return (images, *_plan(ops, channels, HEIGHT, WIDTH), boxes)


def _equalize_case(channels: int, seed: int) -> tuple:
    """Two images large enough for Equalize to change them, one of full range and one of narrow range."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(
        0, 256, (2, channels, EQUALIZE_HEIGHT, EQUALIZE_WIDTH), dtype=torch.uint8, generator=generator
    )
    images[1] = images[1] // 4 + 100
    ops = np.full((1, 2), INTERPRETED_OPS.index("Equalize"))
    boxes = np.zeros((2, 4), dtype=int)
    return (images, *_plan(ops, channels, EQUALIZE_HEIGHT, EQUALIZE_WIDTH), boxes)


def _compare(images, plans, tables, boxes, interpolation: str, erasing: str) -> dict:
    """The reference's and the kernels' histograms, uint8 layer and normalized erased output, compared."""
    channels = images.shape[1]
    area = boxes[:, 2] * boxes[:, 3] * channels
    first = np.cumsum(area) - area
    box_table = torch.from_numpy(np.concatenate([boxes, first[:, None]], 1).astype(np.float64))
    noise = erasing_noise(erasing, boxes, channels, torch.Generator().manual_seed(0))
    fill = torch.tensor((124.0, 116.0, 104.0)[:channels])
    mean, std = torch.tensor(MEAN[:channels]), torch.tensor(STD[:channels])
    plans, tables = torch.from_numpy(plans), torch.from_numpy(tables)
    outputs = {}
    for kernel in (False, True):
        os.environ["TRITON_INTERPRET"] = "1" if kernel else "0"
        histograms = augment_passes.augment_histograms(images, plans)
        cumulative = histograms.cumsum(-1, dtype=torch.int32)
        common = (plans, tables, histograms, cumulative, box_table, noise, fill, mean, std, interpolation)
        layer = augment_passes.augment_pass(images, *common, False, "none")
        final = augment_passes.augment_pass(images, *common, True, erasing)
        outputs[kernel] = (histograms, layer.float(), final)
    (hist, layer, final), (hist_k, layer_k, final_k) = outputs[False], outputs[True]
    warp = plans[:, 0] == Kind.WARP
    levels_off = (layer_k - layer).abs()
    final_off = (final_k - final).abs().flatten(1).amax(1)
    erased = [(i, *box) for i, box in enumerate(boxes.tolist()) if box[2] and box[3]]
    return {
        "histograms_equal": bool(torch.equal(hist, hist_k)),
        "others_max_levels_off": levels_off[~warp].max().item(),
        "others_final_max_off": final_off[~warp].max().item(),
        "warp_max_levels_off": levels_off[warp].max().item() if warp.any() else 0.0,
        "warp_pixels_off": (levels_off[warp] > 0).float().mean().item() if warp.any() else 0.0,
        # every erased box, a warp's too: the erasing overwrites what the warp interpolated
        "erased_equal": all(
            torch.equal(final_k[i, :, top : top + h, left : left + w], final[i, :, top : top + h, left : left + w])
            for i, top, left, h, w in erased
        ),
        "erased_boxes": len(erased),
        "unchanged_images": int((layer == images.float()).flatten(1).all(1).sum()),
    }


class _Launches:
    """A Triton kernel that counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def interpreted_checks() -> dict:
    """Run in the child process (TRITON_INTERPRET=1): the kernels' differences from the reference."""
    full_blocks, tail = divmod(HEIGHT * WIDTH, augment_passes.INTERPRETER_BLOCK)
    assert full_blocks and tail, "each image should span a full block and a partial one"
    torch.set_num_threads(1)
    launches = _Launches(augment_kernels.pass_kernel)
    augment_kernels.pass_kernel = launches  # the name the pass launches
    results = {}
    for channels, interpolation, erasing in CASES:
        results[f"{channels} {interpolation} {erasing}"] = _compare(*_case(channels, channels), interpolation, erasing)
    results["3 bicubic none, Equalize"] = _compare(*_equalize_case(3, 4), "bicubic", "none")
    augment_kernels.pass_kernel = launches.kernel
    results["kernel_runs"] = launches.count  # 2 per case: the kernels ran, not the reference
    return results
