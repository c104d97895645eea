"""The run configuration, declared once: every option of ``train.py`` is one field below, with its type,
default, help and check. The command line, YAML recipes, ``--help``, validation and ``engine.run(cfg)``
from Python all derive from these declarations.

Options are grouped in sections (``ModelOptions``, ``DataOptions``, ...) that a reader can find; ``Config``
holds them all as flat fields (``cfg.lr``), named as in timm's ``train.py``. A YAML key is the option name
with ``_`` (``batch_size: 64``). Every option timm's train.py has defaults to timm's value; the DeiT recipe
(Touvron et al. 2021), which the ConViT keeps, is a recipe file (configs/recipes/deit.yaml).

Light to import: ``train.py --help`` builds the parser from this module and loads no torch.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from itertools import pairwise
from typing import Any, NamedTuple

from convbias.base.errors import EXIT_REQUEUE, ConfigError

DESCRIPTION = "Run configuration: command-line options, YAML recipes (``-c``), and validation."  # first line of --help
DATASETS = ("digits", "mnist", "cifar10", "cifar100", "imagenet", "folder")
SCHEDULES = ("cosine", "step", "constant", "multistep", "plateau", "tanh", "poly", "wsd", "rsqrt")  # timm's
CYCLIC_SCHEDULES = ("cosine", "tanh", "poly")  # with cycles and a cooldown (timm's get_cycle_length)
MIXUP_MODES = ("batch", "pair", "elem")
CLIP_MODES = ("norm", "value", "agc")
# timm's optimizer arguments set by their own options (--opt, --lr, ..., --opt-eps): --opt-kwargs leaves them alone
OWN_OPTIMIZER_ARGUMENTS = ("opt", "lr", "weight_decay", "momentum", "eps", "betas", "layer_decay")
PRECISIONS = ("no", "bf16", "fp16")
DIST_BN = ("reduce", "broadcast", "")
EVAL_METRICS = ("top1", "top5", "loss")
TRAIN_CROP_MODES = ("rrc", "rkrc", "rkrr")
LR_BASE_SCALES = ("linear", "sqrt", "")
RANDOM_ERASING_MODES = ("pixel", "rand", "const")  # timm's RandomErasing fills
IMAGE_MODE_CHANNELS = {"RGB": 3, "L": 1}  # --input-img-mode -> --in-chans
STREAM_PREFIXES = ("wds/", "hfids/")  # engine.data.streams' iterable sources
HF_PREFIXES = ("hfds/", "hfids/")  # Hugging Face datasets: columns named by --input-key and --target-key
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGHUP")  # --preempt-signals; SIGHUP: the terminal or ssh session closed
WHICH = ("last", "best")  # --which: the checkpoints of a run directory a command picks from
DEFAULT_WHICH = "last"  # the run's final weights: what its final top-1 measured
DEFAULT_KEEP_CHECKPOINTS = 2  # resume points kept: one to fall back to when the newest is damaged


class Check(NamedTuple):
    """A declared option's rule: ``valid(value)``, else ``--name must be {expected}, got {value}``; with
    ``reason``, ``--name VALUE: {reason(value)}`` (what is wrong in a value with parts)."""

    valid: Callable[[Any], bool]
    expected: str
    reason: Callable[[Any], str] | None = None


class Needs(NamedTuple):
    """An option that acts only with others: set to anything but its default while ``met(cfg)`` is false, it is
    ``--name VALUE has no effect without {what}``."""

    met: Callable[[Any], bool]
    what: str


CYCLIC = Needs(lambda c: c.sched in CYCLIC_SCHEDULES, "--sched cosine, tanh or poly")
K_DECAY = Needs(lambda c: c.sched in ("cosine", "poly"), "--sched cosine or poly")
CYCLES = Needs(
    lambda c: c.sched in CYCLIC_SCHEDULES and c.lr_cycle_limit > 1,
    "--sched cosine, tanh or poly and --lr-cycle-limit above 1",
)
# --no-aug turns the mixup options off silently, as it does --mixup and --cutmix
MIXING = Needs(
    lambda c: c.no_aug or c.mixup > 0 or c.cutmix > 0 or c.cutmix_minmax is not None,
    "--mixup, --cutmix or --cutmix-minmax",
)
# timm's train.py picks its loss by mixup, then smoothing: without either it trains with plain cross-entropy
SOFT_TARGETS = Needs(lambda c: MIXING.met(c) or c.smoothing > 0, "mixup/cutmix or --smoothing")
BCE = Needs(lambda c: c.bce_loss and SOFT_TARGETS.met(c), "--bce-loss (with mixup/cutmix or --smoothing)")
EVALUATING = Needs(lambda c: bool(c.eval_only), "--eval-only")
LR_NOISE = Needs(lambda c: c.lr_noise is not None, "--lr-noise")
LAYER_DECAY = Needs(lambda c: c.layer_decay is not None, "--layer-decay")
WANDB = Needs(lambda c: c.log_wandb, "--log-wandb")
HF_DATASET = Needs(lambda c: c.dataset.startswith(HF_PREFIXES), "an hfds/ or hfids/ --dataset")
COLUMN = Check(lambda v: bool(v) and "," not in v, "one column name (multi-label targets are not supported)")

# timm's interpolations: a Pillow filter name (timm.data.transforms.str_to_interp_mode), '' for the model's at
# evaluation, 'random' (bilinear or bicubic per image) in training
FILTERS = ("bilinear", "bicubic", "nearest", "box", "hamming", "lanczos")
EVAL_INTERPOLATIONS = ("", *FILTERS)
TRAIN_INTERPOLATIONS = ("random", *FILTERS)

# timm's auto-augment policies (timm.data.auto_augment): NAME-SECTION-SECTION..., each section a key and its
# number (m9, mstd0.5), for RandAugment also t and a transform set (tweights); the type each key's number has
AUTO_AUGMENT_SECTIONS: dict[str, dict[str, type]] = {
    "rand": {"m": int, "n": int, "p": float, "mstd": float, "mmax": int, "inc": int},
    "augmix": {"m": int, "w": int, "d": int, "a": float, "b": int, "mstd": float},
    **{name: {"mstd": float} for name in ("original", "originalr", "v0", "v0r", "3a")},  # AutoAugment's policies
}
RAND_AUGMENT_SETS = ("weights", "3aw", "3a")  # rand-t<SET>: timm's transform sets (any other name is its default)


def auto_augment_problem(policy: str) -> str | None:
    """What timm's auto-augment parser would refuse in ``policy`` (an AssertionError or a ValueError when the
    transform is built) or skip without a word (a section without a number, an unknown transform set), else
    None; 'none' or '' (no auto-augment) is not a policy to parse."""
    if policy.lower() in ("none", ""):
        return None
    name, *sections = policy.split("-")
    if name not in AUTO_AUGMENT_SECTIONS:
        return f"unknown policy {name!r}; timm's: rand-..., augmix-..., {', '.join(list(AUTO_AUGMENT_SECTIONS)[2:])}"
    keys = AUTO_AUGMENT_SECTIONS[name]
    for section in sections:
        if name == "rand" and section.startswith("t"):
            if section[1:] not in RAND_AUGMENT_SETS:
                return f"section {section!r}: the transform set is one of {', '.join(RAND_AUGMENT_SETS)}"
            continue
        key, number = re.fullmatch(r"(\D*)(.*)", section).groups()  # as timm splits it: at the first digit
        if key not in keys or not number:
            shown = ", ".join(f"{k}<{kind.__name__}>" for k, kind in keys.items()) + (
                ", t<set>" if name == "rand" else ""
            )
            return f"section {section!r} is not one of the {name} policy's sections ({shown})"
        try:
            value = keys[key](number)
        except ValueError:
            article = "an" if keys[key] is int else "a"
            return f"section {section!r}: {key} takes {article} {keys[key].__name__}, got {number!r}"
        if not math.isfinite(value):
            return f"section {section!r}: {key} must be finite"
    return None


AUTO_AUGMENT = Check(
    lambda v: auto_augment_problem(v) is None, "one of timm's auto-augment policies", auto_augment_problem
)

POSITIVE = Check(lambda v: v > 0, "positive")
POSITIVE_INT = Check(lambda v: v >= 1, "a positive integer")
NON_NEGATIVE = Check(lambda v: v >= 0, ">= 0")
AT_LEAST_ONE = Check(lambda v: v >= 1, ">= 1")
PROBABILITY = Check(lambda v: 0 <= v <= 1, "in [0, 1]")
FRACTION = Check(lambda v: 0 < v <= 1, "in (0, 1]")
BELOW_ONE = Check(lambda v: 0 <= v < 1, "in [0, 1)")
# numpy takes seeds below 2**32; the engine seeds each epoch and rank with --seed + 1000 x epoch + rank, so half
# of that range is left for what it adds
SEED_LIMIT = 2**31


def option(
    default: Any,
    help: str = "",
    *,
    check: Check | None = None,
    choices: tuple[str, ...] | None = None,
    nargs: int | str | None = None,
    metavar: str | tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    needs: Needs | None = None,
) -> Any:
    """One option's declaration: a dataclass field whose metadata gives the parser and the checks. ``aliases``:
    other names of the same option (timm's spelling), accepted as flags and as recipe keys; ``needs``: the
    options without which it has no effect."""
    metadata = dict(help=help, check=check, choices=choices, nargs=nargs, metavar=metavar, aliases=aliases, needs=needs)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelOptions:
    model: str = option("resnet50", "any model in timm's registry (train.py registers this project's families)")
    pretrained: bool = option(False, "start from pretrained weights")
    pretrained_file: str | None = option(None, "local weights file for --pretrained (no download)")
    allow_partial: bool = option(
        False,
        "train from a --pretrained-file that lacks tensors of the model (left at their initialization) or holds "
        "others; without it such a file is refused (a classifier timm resets for new classes is not counted)",
    )
    model_kwargs: dict[str, Any] = option(
        {}, "extra model constructor arguments, values parsed as YAML scalars (patch_size=4)", metavar="K=V"
    )
    drop: float = option(
        0.0, "dropout rate (timm's drop_rate: most models drop the classifier's input)", check=BELOW_ONE
    )
    drop_path: float | None = option(None, "stochastic depth rate; default the model's", check=BELOW_ONE)
    drop_block: float | None = option(
        None, "DropBlock rate (timm's drop_block_rate: ResNets' last two stages); default none", check=BELOW_ONE
    )
    gp: str | None = option(
        None,
        "the classifier's global pool (timm's global_pool: avg, max, avgmax, catavgmax, token...); default the model's",
    )
    num_classes: int | None = option(
        None,
        "the classifier's outputs, as timm's --num-classes; default the model's (1000 for an ImageNet model, as "
        "timm); the data set's labels 0..K-1 must fit (--first-classes keeps fewer classes)",
        check=Check(lambda v: v >= 2, "at least 2"),
    )
    head_init_scale: float | None = option(
        None,
        "multiply the classifier's initial weight and bias by this (timm's init or --pretrained weights; "
        "--checkpoint weights load as they are)",
        check=NON_NEGATIVE,
    )
    head_init_bias: float | None = option(None, "set the classifier's initial bias to this value (as timm)")
    img_size: int | None = option(
        None,
        "default: the model's (timm's resolve_data_config), or the dataset's for digits, mnist, cifar10/100",
        check=POSITIVE_INT,
    )
    in_chans: int | None = option(
        None,
        "image channels: 1 (grayscale, images converted to L) or 3 (RGB); default the dataset's",
        check=Check(lambda v: v in (1, 3), "1 or 3 (grayscale or RGB images)"),
    )
    input_img_mode: str | None = option(
        None,
        "timm's image mode: RGB (--in-chans 3) or L (--in-chans 1); default from --in-chans",
        choices=tuple(IMAGE_MODE_CHANNELS),
    )
    input_size: list[int] | None = option(
        None,
        "channels and image size at once, as timm's --input-size C H W (this engine trains square images: H = W)",
        check=Check(lambda v: v[0] in (1, 3) and v[1] == v[2] >= 1, "C H W with C 1 or 3 and H = W >= 1"),
        nargs=3,
        metavar=("C", "H", "W"),
    )
    bn_eps: float | None = option(
        None, "epsilon of every BatchNorm layer (timm passes it to the models that take it)", check=POSITIVE
    )
    bn_momentum: float | None = option(None, "momentum of every BatchNorm layer's running statistics", check=FRACTION)
    output_scale: float | None = option(
        None,
        "train alpha (f_w - f_w0) with the loss / alpha^2 (the alpha-trick: large alpha = lazy, small = feature "
        "learning; the lr is not rescaled: see convbias.engine.model.output_scale for Adam)",
        check=Check(lambda v: 0 < v < math.inf, "a positive finite number (the output scale alpha)"),
        metavar="ALPHA",
    )
    reparametrize: str | None = option(
        None, "a change of architecture registered by the entry point (train.py registers tcnn)", metavar="NAME"
    )
    reparametrize_at_epoch: int | None = option(
        None,
        "apply --reparametrize NAME with --reparametrize-kwargs at the start of this epoch (0-based)",
        check=NON_NEGATIVE,
    )
    reparametrize_kwargs: dict[str, Any] = option({}, metavar="K=V")
    distill_teacher: str | None = option(None, "timm name of a CNN teacher (hard distillation)")
    distill_teacher_file: str | None = option(None, "local weights of the teacher")
    model_ema: bool = option(False, "keep and evaluate an EMA of the weights")
    model_ema_decay: float = option(0.9998, check=BELOW_ONE)
    model_ema_warmup: bool = option(
        False,
        "warm the EMA decay up from 0: 1 - (1 + update)^(-2/3), capped at --model-ema-decay (timm's ModelEmaV3 "
        "use_warmup, counted in optimizer updates)",
        needs=Needs(lambda c: c.model_ema, "--model-ema"),
    )
    model_ema_metric: bool = option(
        True,
        "with --model-ema, the EMA's evaluation is the epoch's metric (eval_* columns, best, the plateau schedule, "
        "the end line) and the model's is logged as model_eval_*, as timm's train.py; off: the model's (timm's "
        "--model-ema-force-cpu, which skips the EMA's evaluation)",
        needs=Needs(lambda c: c.model_ema, "--model-ema"),
    )
    grad_checkpointing: bool = option(
        False, "recompute block activations in backward (timm's set_grad_checkpointing): less memory"
    )


@dataclass
class DataOptions:
    dataset: str = option(
        "",
        f"'' (timm's: the image folder at --data-dir, as folder), one of {', '.join(DATASETS)}, wds/NAME, "
        "hfids/NAME, hfds/NAME",
    )
    data_dir: str | None = option(None)
    train_split: str = option(
        "train", "folder of the training images under --data-dir (imagenet, folder; 'training' is found too)"
    )
    val_split: str = option(
        "validation",
        "folder of the validation images under --data-dir (imagenet, folder): as timm, val, valid, eval or "
        "evaluation is found too",
    )
    class_map: str | None = option(
        None,
        "file naming the classes to train, one per line, in label order (timm's class map: .txt, or .pkl of "
        "{name: index}); images of other classes are left out, and --first-classes K keeps the map's first K "
        "(digits, mnist, cifar10, cifar100, imagenet, folder; not wds/, hfids/, hfds/)",
        metavar="FILE",
    )
    first_classes: int | None = option(
        None,
        "keep only the data set's first K classes (sorted names, or --class-map's order), labels 0..K-1; "
        "not wds/, hfids/",
        check=Check(lambda v: v >= 2, "at least 2"),
        metavar="K",
    )
    input_key: str | None = option(
        None, "the image column of an hfds/ or hfids/ dataset (default timm's: image)", check=COLUMN, needs=HF_DATASET
    )
    target_key: str | None = option(
        None,
        "the label column of an hfds/ or hfids/ dataset, a ClassLabel for class names (default timm's: label)",
        check=COLUMN,
        needs=HF_DATASET,
    )
    train_num_samples: int | None = option(
        None,
        "images in one epoch of a wds/ or hfids/ stream (default: the split's num_samples)",
        check=POSITIVE_INT,
        needs=Needs(lambda c: c.dataset.startswith(STREAM_PREFIXES), "a wds/ or hfids/ --dataset"),
    )
    train_fraction: float = option(1.0, "keep this fraction of each class, in (0, 1]", check=FRACTION)
    workers: int = option(4, "data loader processes per training process", check=NON_NEGATIVE)
    aa: str | None = option(
        None,
        "timm auto-augment policy (rand-m9-mstd0.5-inc1: DeiT's; augmix-..., original, v0, 3a, ...); none to disable",
        check=AUTO_AUGMENT,
    )
    reprob: float = option(0.0, "random erasing probability", check=PROBABILITY)
    remode: str = option(
        "pixel",
        "random erasing fill: pixel (normal noise per pixel, DeiT's), rand (one normal color per box) or const (0)",
        choices=RANDOM_ERASING_MODES,
    )
    recount: int = option(1, "random erasing: up to this many boxes per image", check=POSITIVE_INT)
    color_jitter: float | None = option(0.4, "color jitter strength (timm's None: 0)", check=NON_NEGATIVE)
    color_jitter_prob: float | None = option(
        None,
        "probability of the color jitter (default: every image; as timm, no color jitter with --aa)",
        check=PROBABILITY,
    )
    grayscale_prob: float | None = option(None, "probability of turning an image gray", check=PROBABILITY)
    gaussian_blur_prob: float | None = option(
        None, "probability of a Gaussian blur (kernel 23, as timm's)", check=PROBABILITY
    )
    interpolation: str = option(
        "",
        "eval resize interpolation (bilinear, bicubic, ...); '' the model's (timm's resolve_data_config)",
        choices=EVAL_INTERPOLATIONS,
    )
    train_interpolation: str | None = option(
        "random",
        "training resize interpolation: random (bilinear or bicubic per image) or one of them (none or '': the "
        "eval --interpolation)",
        choices=TRAIN_INTERPOLATIONS,
    )
    crop_pct: float | None = option(
        None, "eval center-crop fraction; default the model's (timm's resolve_data_config)", check=FRACTION
    )
    hflip: float = option(0.5, "horizontal flip probability", check=PROBABILITY)
    vflip: float = option(0.0, "vertical flip probability", check=PROBABILITY)
    scale: list[float] | None = option(
        [0.08, 1.0],
        "random-resized-crop area range; default timm's: (0.08, 1), or (0.8, 1) with --train-crop-mode rkrc/rkrr",
        check=Check(lambda v: 0 < v[0] <= v[1], "two positive numbers, MIN <= MAX"),
        nargs=2,
        metavar=("MIN", "MAX"),
    )
    ratio: list[float] | None = option(
        [3 / 4, 4 / 3],
        "random-resized-crop aspect-ratio range (width / height); default timm's: (3/4, 4/3), or the aspect jitter "
        "(0.9, 1/0.9) with --train-crop-mode rkrc/rkrr",
        check=Check(lambda v: 0 < v[0] <= v[1], "two positive numbers, MIN <= MAX"),
        nargs=2,
        metavar=("MIN", "MAX"),
    )
    train_crop_mode: str | None = option(
        None,
        "training crop, as timm's: rrc (random resized crop, the default), rkrc or rkrr (the whole image resized "
        "keeping its aspect ratio, with random scale and aspect jitter, then a center (rkrc) or random (rkrr) crop, "
        "reflect-padded where smaller)",
        choices=TRAIN_CROP_MODES,
    )
    mean: list[float] | None = option(
        None, "normalization mean, one per channel or one for all (default: the dataset's)", nargs="+"
    )
    std: list[float] | None = option(
        None,
        "normalization std, one per channel or one for all (default: the dataset's)",
        check=Check(lambda v: all(x > 0 for x in v), "positive"),
        nargs="+",
    )
    pin_mem: bool = option(False, "pin the loaders' batches in page-locked memory when a GPU trains")
    skip_unreadable: bool = option(True, "skip (and count) unreadable images instead of stopping")
    repeated_aug: int = option(
        1,
        "repeated augmentation: copies of each image (timm's --aug-repeats)",
        check=Check(lambda v: v >= 1, ">= 1 (1: each image once)"),
    )
    mixup: float = option(0.0, "mixup alpha; 0 disables", check=NON_NEGATIVE)
    cutmix: float = option(0.0, "cutmix alpha; 0 disables", check=NON_NEGATIVE)
    cutmix_minmax: list[float] | None = option(
        None,
        "cutmix box side range, as fractions of the image's; turns cutmix on (in place of --cutmix's alpha)",
        check=Check(lambda v: 0 <= v[0] < v[1] <= 1, "two fractions 0 <= MIN < MAX <= 1"),
        nargs=2,
        metavar=("MIN", "MAX"),
    )
    mixup_prob: float = option(
        1.0, "probability of mixing a batch (or pair, or image: --mixup-mode)", check=PROBABILITY, needs=MIXING
    )
    mixup_switch_prob: float = option(
        0.5,
        "probability of cutmix rather than mixup when both are on",
        check=PROBABILITY,
        needs=Needs(
            lambda c: c.no_aug or (c.mixup > 0 and (c.cutmix > 0 or c.cutmix_minmax is not None)),
            "both --mixup and --cutmix (or --cutmix-minmax)",
        ),
    )
    mixup_mode: str = option(
        "batch",
        f"draw mixup/cutmix per batch, pair or element; one of {', '.join(MIXUP_MODES)}",
        choices=MIXUP_MODES,
        needs=MIXING,
    )
    mixup_off_epoch: int = option(
        0, "no mixup/cutmix from this epoch on (0-based; 0: never off)", check=NON_NEGATIVE, needs=MIXING
    )
    smoothing: float = option(0.1, "label smoothing", check=BELOW_ONE)
    bce_loss: bool = option(
        False,
        "train with binary cross-entropy (timm's BinaryCrossEntropy) on mixup/cutmix's soft targets, or on "
        "--smoothing's targets without them (without either, timm's train.py trains with cross-entropy)",
        needs=SOFT_TARGETS,
    )
    bce_target_thresh: float | None = option(
        None, "binarize the BCE targets: 1 above this threshold, else 0", check=BELOW_ONE, needs=BCE
    )
    bce_sum: bool = option(False, "sum the BCE loss over classes before averaging over the batch", needs=BCE)
    bce_pos_weight: float | None = option(
        None, "weight of the positive targets in the BCE loss", check=POSITIVE, needs=BCE
    )
    no_aug: bool = option(False, "no augmentation at all (crop/flip, aa, mixup, cutmix, erasing, smoothing)")
    no_prefetcher: bool = option(
        False,
        "the loader workers run timm's whole PIL transform; by default they decode (at reduced JPEG scale where the "
        "crop allows), crop, resize and flip, and RandAugment, normalization and random erasing run batched on the "
        "training device (docs/input-pipeline.md)",
    )


@dataclass
class OptimizationOptions:
    opt: str = option("sgd", "timm optimizer name")
    lr: float | None = option(
        None, "absolute lr; default lr-base x global batch / lr-base-size (--lr-base-scale)", check=POSITIVE
    )
    lr_base: float = option(0.1, check=POSITIVE)
    lr_base_size: int = option(256, check=POSITIVE_INT)
    lr_base_scale: str = option(
        "",
        "how --lr-base follows the global batch: linear (DeiT's), sqrt (x sqrt(global batch / lr-base-size)), or '' "
        "for timm's choice (sqrt for an --opt containing 'ada' or 'lamb', else linear)",
        choices=LR_BASE_SCALES,
    )
    weight_decay: float = option(2e-5, check=NON_NEGATIVE)
    momentum: float = option(0.9, "momentum of the optimizers that take one", check=BELOW_ONE)
    opt_eps: float | None = option(
        None, "optimizer epsilon, for every optimizer that takes one (default: the optimizer's own)", check=POSITIVE
    )
    opt_betas: list[float] | None = option(
        None,
        "optimizer betas (default: the optimizer's own)",
        check=Check(lambda v: len(v) >= 1 and all(0 <= b < 1 for b in v), "one or more numbers in [0, 1)"),
        nargs="+",
        metavar="BETA",
    )
    opt_kwargs: dict[str, Any] = option(
        {},
        "extra optimizer arguments, values parsed as YAML scalars (amsgrad=true)",
        check=Check(
            lambda v: not set(v) & set(OWN_OPTIMIZER_ARGUMENTS),
            f"free of the arguments set by their own options ({', '.join(OWN_OPTIMIZER_ARGUMENTS)})",
        ),
        metavar="K=V",
    )
    layer_decay: float | None = option(
        None,
        "layer-wise lr decay: layer group g of the model's L (its group_matcher(); the classifier last) trains "
        "at lr x LAYER_DECAY^(L-1-g)",
        check=FRACTION,
    )
    layer_decay_min_scale: float = option(
        0.0,
        "the lowest lr scale --layer-decay gives a layer group",
        check=PROBABILITY,
        needs=LAYER_DECAY,
    )
    layer_decay_no_opt_scale: float | None = option(
        None,
        "layer groups whose --layer-decay scale falls below this are frozen (left out of the optimizer)",
        check=FRACTION,
        needs=LAYER_DECAY,
    )
    clip_grad: float | None = option(None, "clip the gradients (--clip-mode) with this value", check=POSITIVE)
    clip_mode: str = option(
        "norm",
        "how --clip-grad clips (timm's dispatch_clip_grad): norm (the total norm), value (each value) or agc "
        "(adaptive, unit-wise relative to the weights; the classifier left out, as timm's train.py does)",
        choices=CLIP_MODES,
        needs=Needs(lambda c: c.clip_grad is not None, "--clip-grad"),
    )
    param_group_lr: dict[str, Any] = option(
        {}, "absolute lr for parameters whose name matches REGEX (gating_param=0.1)", metavar="REGEX=LR"
    )
    batch_size: int = option(128, "per process", check=POSITIVE_INT)
    eval_batch_size: int | None = option(
        None, "per process; default --batch-size", check=POSITIVE_INT, aliases=("validation_batch_size",)
    )
    grad_accum_steps: int = option(1, check=AT_LEAST_ONE)
    seed: int = option(42, check=Check(lambda v: 0 <= v < SEED_LIMIT, f"in [0, 2**{SEED_LIMIT.bit_length() - 1})"))


@dataclass
class ScheduleOptions:
    sched: str = option(
        "cosine",
        f"one of {', '.join(SCHEDULES)} (timm's schedulers; plateau: decay by --decay-rate when --eval-metric "
        "stops improving)",
        choices=SCHEDULES,
    )
    epochs: int = option(300)
    scale_epochs: bool = option(False, "multiply epochs and warmup by 1/train-fraction (same number of images seen)")
    warmup_epochs: int = option(5, check=NON_NEGATIVE)
    warmup_lr: float = option(1e-5, check=NON_NEGATIVE)
    warmup_prefix: bool = option(
        False, "warm up before the --epochs of schedule (the run trains --warmup-epochs more), not within them"
    )
    min_lr: float = option(0.0, check=NON_NEGATIVE)
    decay_epochs: float = option(
        90,
        "step schedule: epochs between decays; wsd, rsqrt: epochs of the decay phase (below 1: a fraction)",
        check=POSITIVE,
    )
    decay_rate: float = option(
        0.1, "step, multistep, plateau schedules: lr factor per decay; poly: the power", check=POSITIVE, aliases=("dr",)
    )
    decay_milestones: list[int] = option(
        [90, 180, 270],
        "multistep schedule: the lr decays at these epochs (timm's convention, per update: milestone M from the "
        "last update of epoch M on)",
        check=Check(
            lambda v: len(v) >= 1 and v[0] > 0 and all(a < b for a, b in pairwise(v)), "increasing positive epochs"
        ),
        metavar="EPOCH",
        needs=Needs(lambda c: c.sched == "multistep", "--sched multistep"),
    )
    patience_epochs: int = option(
        10,
        "plateau schedule: epochs without a better --eval-metric before the lr decays by --decay-rate",
        check=NON_NEGATIVE,
        needs=Needs(lambda c: c.sched == "plateau", "--sched plateau"),
    )
    sched_on_updates: bool = option(
        False,
        "step the schedule after every optimizer update; by default once per epoch (the plateau schedule steps "
        "per evaluation either way)",
    )
    cooldown_epochs: int = option(
        0,
        "cosine, tanh, poly schedules: epochs at --min-lr after the last cycle, trained after --epochs",
        check=NON_NEGATIVE,
        needs=CYCLIC,
    )
    lr_cycle_limit: int = option(
        1,
        "cosine, tanh, poly schedules: cycles (warm restarts, each trained in full after --epochs)",
        check=AT_LEAST_ONE,
        needs=CYCLIC,
    )
    lr_cycle_mul: float = option(
        1.0, "cyclic schedules: each cycle this many times as long as the one before", check=POSITIVE, needs=CYCLES
    )
    lr_cycle_decay: float = option(
        0.5, "cyclic schedules: each cycle's peak lr this many times the one before", check=POSITIVE, needs=CYCLES
    )
    lr_k_decay: float = option(
        1.0, "cosine and poly schedules: k-decay exponent (1: plain cosine)", check=POSITIVE, needs=K_DECAY
    )
    lr_noise: list[float] | None = option(
        None,
        "lr noise from START (to END) as fractions of the schedule's length: timm's, the lr times 1 + a normal "
        "draw seeded by (--seed, step), kept within --lr-noise-pct",
        check=Check(lambda v: len(v) <= 2 and all(x >= 0 for x in v) and v == sorted(v), "START [END], ordered, >= 0"),
        nargs="+",
        metavar="FRACTION",
    )
    lr_noise_pct: float = option(
        0.67,
        "lr noise: the largest relative change (at most 1: the lr stays positive)",
        check=FRACTION,
        needs=LR_NOISE,
    )
    lr_noise_std: float = option(1.0, "lr noise: the normal draw's standard deviation", check=POSITIVE, needs=LR_NOISE)


@dataclass
class DistributionOptions:
    mixed_precision: str = option("no", f"one of {', '.join(PRECISIONS)}", choices=PRECISIONS)
    compile: bool = option(
        False, "torch.compile the training and evaluation forwards (checkpoints keep the model's own keys)"
    )
    compile_mode: str = option("default", f"one of {', '.join(COMPILE_MODES)}", choices=COMPILE_MODES)
    compile_backend: str = option(
        "inductor", "torch.compile backend (aot_eager: dynamo's graphs and autograd without code generation)"
    )
    preempt_signals: list[str] = option(
        list(DEFAULT_SIGNALS),
        f"signals that stop the run after the current step with a resume point, exit code {EXIT_REQUEUE} (none: off)",
        metavar="SIG",
    )
    channels_last: bool = option(False, "model and batches in channels-last memory format (CNNs on GPUs)")
    fast_norm: bool = option(
        False,
        "timm's fast norm in the model's timm norm layers (ConViT's LayerNorms): under mixed precision they "
        "run in bf16/fp16 instead of fp32",
    )
    sync_bn: bool = option(
        False, "synchronized BatchNorm across processes (torch's SyncBatchNorm; GPUs, more than one process)"
    )
    dist_bn: str = option(
        "reduce",
        "BatchNorm statistics before each evaluation with more than one process: 'reduce' (averaged across "
        "processes), 'broadcast' (rank 0's), '' (each process its own), as timm's --dist-bn",
        choices=DIST_BN,
    )


@dataclass
class CheckpointingOptions:
    output: str | None = option(None, "output dir; default runs/<model>-<dataset>")
    resume: str | None = option(None, "'auto' (the output dir's latest checkpoint) or a path")
    eval_only: bool | str = option(
        False,
        "evaluate a run directory (its config.yaml gives the model, data and --workers; options given override "
        "them) or --checkpoint, and print top-1/top-5",
        metavar="RUN_OR_WEIGHTS",
    )
    which: str | None = option(
        None,
        f"checkpoint of a run directory to evaluate or start from (default: {DEFAULT_WHICH})",
        choices=WHICH,
        metavar="{" + ",".join(WHICH) + "}",
    )
    checkpoint: str | None = option(
        None,
        "weights to evaluate or start from (a file or a run dir); --initial-checkpoint is timm's name for it",
        aliases=("initial_checkpoint",),
    )
    use_ema: bool = option(
        False,
        "evaluate the EMA's weights (timm's validate.py --use-ema): a run directory's point's, timm's checkpoint's "
        "state_dict_ema",
        needs=EVALUATING,
    )
    use_train_size: bool = option(
        False,
        "evaluate at train.py's input size and crop (timm's validate.py --use-train-size); by default, as validate.py, "
        "at the model's test_input_size and test_crop_pct where its pretrained config has them",
        needs=EVALUATING,
    )
    save_epochs: list[int] = option(
        [],
        "also keep checkpoints/epoch_E.safetensors after E epochs (0 = the initial weights)",
        check=Check(lambda v: all(e >= 0 for e in v), "epochs >= 0"),
        metavar="E",
    )
    checkpoint_interval: int = option(
        0,
        "also write a mid-epoch resume point every STEPS optimizer updates (0: at epoch ends only)",
        check=Check(lambda v: v >= 0, ">= 0 (0: off)"),
        metavar="STEPS",
    )
    keep_checkpoints: int = option(
        DEFAULT_KEEP_CHECKPOINTS,
        "resume points kept (the newest K, and best); --resume auto falls back to an older one when the newest is "
        "damaged",
        check=AT_LEAST_ONE,
        metavar="K",
    )
    checkpoint_hist: int = option(
        10,
        "also keep the resume points of the K best evaluations by --eval-metric",
        check=AT_LEAST_ONE,
        metavar="K",
    )
    accept_resume_changes: bool = option(
        False,
        "continue a mid-epoch resume point with another batch size, seed, data set or model options (not exact; "
        "recorded in log.jsonl)",
    )


@dataclass
class LoggingOptions:
    eval_interval: int = option(1, "evaluate every N epochs (and after the last)", check=AT_LEAST_ONE)
    eval_metric: str = option(
        "top1",
        "the evaluation that picks the best checkpoint: top1, top5 (highest) or loss (lowest)",
        choices=EVAL_METRICS,
    )
    log_interval: int = option(
        50, "without a terminal, a progress line every N steps (0: epoch lines only)", check=NON_NEGATIVE
    )
    diagnostics: bool = option(True, "log model diagnostics every evaluation")
    diagnostics_images: int = option(16, "fixed eval images used by diagnostics", check=POSITIVE_INT)
    log_wandb: bool = option(False, "log to wandb (honors WANDB_MODE)")
    wandb_project: str | None = option(None, "wandb project (default: wandb's)")
    wandb_tags: list[str] = option([], "tags of the wandb run", nargs="+", needs=WANDB)
    wandb_resume_id: str | None = option(
        None, "with --resume: continue this wandb run (its id) instead of starting one", needs=WANDB
    )


_FROZEN = "_frozen"  # set in a checked Config's __dict__: its options no longer change

# (section title in --help, its options), in the order --help and config.yaml show them
SECTIONS: tuple[tuple[str, type], ...] = (
    ("model", ModelOptions),
    ("data and augmentation", DataOptions),
    ("optimization", OptimizationOptions),
    ("schedule", ScheduleOptions),
    ("distribution and speed", DistributionOptions),
    ("checkpointing", CheckpointingOptions),
    ("logging", LoggingOptions),
)


@dataclass
class Config(
    LoggingOptions,
    CheckpointingOptions,
    DistributionOptions,
    ScheduleOptions,
    OptimizationOptions,
    DataOptions,
    ModelOptions,
):
    """A run's options, every section's fields flat (the dataclass order lists the model section first).
    ``Config(model=..., epochs=...)`` from Python, ``parse_config(argv)`` from the command line; both are
    checked before a run starts (``convbias.engine.validate``: this package's checks, then every package's), and
    frozen then: setting an option raises, ``replace`` gives a changed copy."""

    config: str | None = option(None, "YAML recipe; command-line options override it")

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get(_FROZEN):
            raise AttributeError(
                f"cfg.{name} cannot be set: the run's options are checked and frozen; "
                f"cfg.replace({name}=...) gives a changed copy"
            )
        super().__setattr__(name, value)

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get(_FROZEN))

    def freeze(self) -> Config:
        """No option changes after this (the checks have passed); returns the Config itself."""
        self.__dict__[_FROZEN] = True
        return self

    def to_dict(self) -> dict[str, Any]:
        """The options as config.yaml and the trackers record them (plain values, declaration order)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "the options") -> Config:
        """A Config from a mapping such as a run's config.yaml (an alias names its option); an unknown key is a
        ConfigError naming it."""
        values = with_option_names(values, source)
        unknown = sorted(set(values) - set(option_names()))
        if unknown:
            raise ConfigError(f"unknown option '{unknown[0]}' in {source}{did_you_mean(unknown[0])}")
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        """A copy with some options changed, not frozen: a new Config, to be checked as one built in Python (the
        original is left as it is)."""
        return dataclasses.replace(copy.deepcopy(self), **changes)

    def resolved(self, **changes: Any) -> Config:
        """A frozen copy in which the run's set-up has filled options the checks leave open (the weights file
        of a run directory, the data set's image size, a checkpoint's reparametrization and output scale); the
        record of where each option came from is kept."""
        copied = self.replace(**changes)
        copied.__dict__.update({key: copy.deepcopy(value) for key, value in self.__dict__.items() if key[0] == "_"})
        return copied.freeze()


@cache
def option_types() -> dict[str, Any]:
    """Every option's declared type (the annotations resolved)."""
    return typing.get_type_hints(Config)


@cache
def option_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config))


@cache
def option_aliases() -> dict[str, str]:
    """Every alias and the option it names (``initial_checkpoint`` -> ``checkpoint``)."""
    return {alias: f.name for f in dataclasses.fields(Config) for alias in f.metadata["aliases"]}


def with_option_names(values: dict[str, Any], source: str = "the options") -> dict[str, Any]:
    """A recipe's mapping with each alias key renamed to its option; both names given is a ConfigError."""
    renamed = {option_aliases().get(key, key): value for key, value in values.items()}
    if len(renamed) < len(values):
        both = next(key for key in values if key in option_aliases() and option_aliases()[key] in values)
        raise ConfigError(f"{source}: {both} and {option_aliases()[both]} are two names of one option; keep one")
    return renamed


def declaration(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(Config) if f.name == name)


def default_value(name: str) -> Any:
    """Option ``name``'s declared default (a fresh copy of a list or mapping)."""
    spec = declaration(name)
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def flag_name(name: str) -> str:
    """'batch_size' -> '--batch-size'."""
    return f"--{name.replace('_', '-')}"


def did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, option_names(), n=3)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def key_value_options() -> tuple[str, ...]:
    """The K=V options (mappings): a recipe and the command line merge them key by key."""
    return tuple(name for name, kind in option_types().items() if typing.get_origin(kind) is dict)
