"""Real timm recipes read as timm's train.py reads them: the training commands of timm's documentation
(hfdocs/source/training_script.mdx, timm commit aa4b5850), with only the data path changed, parsed here and
compared with what timm's own factories build from the same arguments (create_optimizer_v2 with
optimizer_kwargs, create_scheduler_v2 with scheduler_kwargs, resolve_data_config, create_transform, Mixup).

timm's side: its train.py's defaults (TIMM_TRAIN_DEFAULTS, generated from its parser) with the recipe's
values read token by token, as its argparse would (its short flags -b, -j; lists for nargs='+' options).
"""

import shlex
from types import SimpleNamespace

import pytest
import torch
import yaml
from PIL import Image
from support import DATA
from timm.data import Mixup, create_transform, resolve_data_config
from timm.models import get_pretrained_cfg
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from torch import nn

from convbias.base.errors import ConfigError
from convbias.cli import train
from convbias.engine import parse_config
from convbias.engine.config.derived import scaled_lr
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.engine.data.factory import build_transforms, input_format
from convbias.engine.optim.factory import create_mixup, create_optimizer, create_scheduler

# training_script.mdx, each after `./distributed_train.sh N` (the process count is accelerate's launch option)
DOCUMENTED = {
    "seresnet34": "--model seresnet34 --sched cosine --epochs 150 --warmup-epochs 5 --lr 0.4 --reprob 0.5 "
    "--remode pixel --batch-size 256 --amp -j 4",
    "efficientnet_b2": "--model efficientnet_b2 -b 128 --sched step --epochs 450 --decay-epochs 2.4 --decay-rate .97 "
    "--opt rmsproptf --opt-eps .001 -j 8 --warmup-lr 1e-6 --weight-decay 1e-5 --drop 0.3 --drop-path 0.2 "
    "--model-ema --model-ema-decay 0.9999 --aa rand-m9-mstd0.5 --remode pixel --reprob 0.2 --amp --lr .016",
    "mixnet_xl": "--model mixnet_xl -b 128 --sched step --epochs 450 --decay-epochs 2.4 --decay-rate .969 "
    "--opt rmsproptf --opt-eps .001 -j 8 --warmup-lr 1e-6 --weight-decay 1e-5 --drop 0.3 --drop-path 0.2 "
    "--model-ema --model-ema-decay 0.9999 --aa rand-m9-mstd0.5 --remode pixel --reprob 0.3 --amp --lr .016 "
    "--dist-bn reduce",
    "seresnext26t": "--model seresnext26t_32x4d --lr 0.1 --warmup-epochs 5 --epochs 160 --weight-decay 1e-4 "
    "--sched cosine --reprob 0.4 --remode pixel -b 112",
    "efficientnet_b0": "--model efficientnet_b0 -b 384 --sched step --epochs 450 --decay-epochs 2.4 --decay-rate .97 "
    "--opt rmsproptf --opt-eps .001 -j 8 --warmup-lr 1e-6 --weight-decay 1e-5 --drop 0.2 --drop-path 0.2 "
    "--model-ema --model-ema-decay 0.9999 --aa rand-m9-mstd0.5 --remode pixel --reprob 0.2 --amp --lr .048",
    "efficientnet_es": "--model efficientnet_es -b 128 --sched step --epochs 450 --decay-epochs 2.4 --decay-rate .97 "
    "--opt rmsproptf --opt-eps .001 -j 8 --warmup-lr 1e-6 --weight-decay 1e-5 --drop 0.2 --drop-path 0.2  "
    "--aa rand-m9-mstd0.5 --remode pixel --reprob 0.2 --amp --lr .064",
    "mobilenetv3_large_100": "--model mobilenetv3_large_100 -b 512 --sched step --epochs 600 --decay-epochs 2.4 "
    "--decay-rate .973 --opt rmsproptf --opt-eps .001 -j 7 --warmup-lr 1e-6 --weight-decay 1e-5 --drop 0.2 "
    "--drop-path 0.2 --model-ema --model-ema-decay 0.9999 --aa rand-m9-mstd0.5 --remode pixel --reprob 0.2 --amp "
    "--lr .064 --lr-noise 0.42 0.9",
    "resnext50": "--model resnext50_32x4d --lr 0.6 --warmup-epochs 5 --epochs 240 --weight-decay 1e-4 --sched cosine "
    "--reprob 0.4 --recount 3 --remode pixel --aa rand-m7-mstd0.5-inc1 -b 192 -j 6 --amp --dist-bn reduce",
    # no --lr: timm's lr_base x batch / 256 (linear for SGD), and timm's defaults for everything else
    "defaults_sgd": "--model resnet18 -b 64",
    "adamw_betas": "--model resnet18 --opt adamw --opt-betas 0.9 0.95 --lr-base 5e-4 --warmup-epochs 2 --mixup 0.8 "
    "--cutmix 1.0 --smoothing 0.1 --sched-on-updates --color-jitter 0.3 --img-size 160 --crop-pct 0.9",
}
# the documented ResNet-50 with JSD and AugMix splits: refused, every unsupported option named with its reason
JSD_RECIPE = (
    "-b 64 --model resnet50 --sched cosine --epochs 200 --lr 0.05 --amp --remode pixel --reprob 0.6 --aug-splits 3 "
    "--aa rand-m9-mstd0.5-inc1 --resplit --split-bn --jsd --dist-bn reduce"
)
# args.yaml files published with weights trained by timm's train.py (each names its source)
PUBLISHED = DATA / "published_args"
SHORT_FLAGS = {"-b": "batch_size", "-j": "workers", "-vb": "validation_batch_size"}
LISTS = ("lr_noise", "opt_betas", "mean", "std", "input_size", "scale", "ratio", "decay_milestones", "cutmix_minmax")
UPDATES_PER_EPOCH = 7
NUM_CLASSES = 3


def _literal(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def timm_args(command: str) -> SimpleNamespace:
    """timm's train.py arguments for a command line: its defaults, then each flag's value(s)."""
    values, tokens, i = dict(TIMM_TRAIN_DEFAULTS), shlex.split(command), 0
    while i < len(tokens):
        flag, i = tokens[i], i + 1
        name = SHORT_FLAGS.get(flag) or flag[2:].replace("-", "_")
        given = []
        while i < len(tokens) and not tokens[i].startswith("-"):
            given, i = [*given, _literal(tokens[i])], i + 1
        values[name] = True if not given else given if name in LISTS else given[0]
    return SimpleNamespace(**values)


def timm_yaml_args(values: dict) -> SimpleNamespace:
    """timm's train.py arguments for an args.yaml: it sets the file's values as its parser's defaults, and
    argparse converts a string default with the option's type (YAML reads 1e-6, without a dot, as a string)."""
    numeric = {key for key, value in TIMM_TRAIN_DEFAULTS.items() if type(value) in (int, float)}
    converted = {
        key: _literal(value) if isinstance(value, str) and key in numeric else value for key, value in values.items()
    }
    return SimpleNamespace(**{**TIMM_TRAIN_DEFAULTS, **converted})


def timm_lr(args: SimpleNamespace, global_batch: int) -> float:
    """timm's train.py: --lr, else lr_base scaled to the global batch (sqrt for 'ada'/'lamb' optimizers)."""
    if args.lr is not None:
        return args.lr
    ratio = global_batch / args.lr_base_size
    scale = args.lr_base_scale or ("sqrt" if any(o in args.opt.lower() for o in ("ada", "lamb")) else "linear")
    return args.lr_base * (ratio**0.5 if scale == "sqrt" else ratio)


def tiny_net() -> nn.Module:
    """Weights, biases and a norm: the weight-decay groups both factories make."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(NUM_CLASSES))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    for label in range(NUM_CLASSES):
        (root / f"c{label}").mkdir()
        for index in range(4):
            color = (40 * label, 20 * index, 100)
            Image.new("RGB", (20, 16), color).save(root / f"c{label}" / f"{index}.jpg")
    return root


def ours(command: str, folder, tmp_path):
    return parse_config([*shlex.split(command), "--data-dir", str(folder), "--output", str(tmp_path / "run")])


def groups_by_parameter(optimizer: torch.optim.Optimizer, names: dict) -> dict:
    """Each parameter's hyper-parameters (its group's, 'params', the engine's bookkeeping and 'foreach' left out:
    the engine asks for torch's multi-tensor code on every device, which torch takes by itself on CUDA; the same
    update, tests/engine/loop/test_train_loop.py)."""
    left_out = ("params", "lr_scale", "lr_pattern", "param_names", "foreach")
    return {
        names[id(p)]: {k: v for k, v in group.items() if k not in left_out}
        for group in optimizer.param_groups
        for p in group["params"]
    }


@pytest.mark.parametrize("recipe", sorted(DOCUMENTED))
def test_a_documented_recipe_gets_timms_values(recipe, folder, tmp_path):
    command = DOCUMENTED[recipe]
    assert_timms_values(ours(command, folder, tmp_path), timm_args(command))


@pytest.mark.parametrize("name", sorted(p.stem for p in PUBLISHED.glob("*.yaml")))
def test_a_published_args_yaml_gets_timms_values(name, folder, tmp_path):
    """An args.yaml as published with trained weights, run with -c and only the data folder and output given."""
    path = PUBLISHED / f"{name}.yaml"
    cfg = parse_config(["-c", str(path), "--data-dir", str(folder), "--output", str(tmp_path / "run")])
    args = timm_yaml_args({**yaml.safe_load(path.read_text()), "data_dir": str(folder)})
    assert_timms_values(cfg, args, num_classes=args.num_classes)


def assert_timms_values(cfg, args: SimpleNamespace, num_classes: int = NUM_CLASSES) -> None:
    """The engine's lr, optimizer, schedule, data config, transforms and batch augmentation for `cfg` equal
    what timm's own factories build from timm's train.py arguments `args`."""
    global_batch = cfg.batch_size  # one process
    lr, _ = scaled_lr(cfg, global_batch)
    assert lr == pytest.approx(timm_lr(args, global_batch), rel=1e-12)

    # optimizer: class and every parameter's hyper-parameters
    model = tiny_net()
    model(torch.zeros(1, 3, 8, 8))
    names = {id(p): n for n, p in model.named_parameters()}
    mine = create_optimizer(cfg, model, lr)
    timms = create_optimizer_v2(model, **optimizer_kwargs(SimpleNamespace(**{**vars(args), "lr": lr})))
    assert type(mine) is type(timms)
    assert groups_by_parameter(mine, names) == groups_by_parameter(timms, names)

    # schedule: the lr at every epoch (and update) of the run
    timm_sched, timm_epochs = create_scheduler_v2(timms, **scheduler_kwargs(args), updates_per_epoch=UPDATES_PER_EPOCH)
    sched = create_scheduler(cfg, mine, cfg.epochs, cfg.warmup_epochs, UPDATES_PER_EPOCH)
    assert type(sched) is type(timm_sched) and sched.t_in_epochs == timm_sched.t_in_epochs
    steps = range(0, timm_epochs * (1 if timm_sched.t_in_epochs else UPDATES_PER_EPOCH), 13)
    flat = [lr for t in steps for lr in sched._get_lr(t)]  # one lr per parameter group
    assert flat == pytest.approx([lr for t in steps for lr in timm_sched._get_lr(t)], rel=1e-12)

    # data config and transforms, from the model's pretrained config as timm's train.py resolves them
    data_config = resolve_data_config(vars(args), pretrained_cfg=get_pretrained_cfg(args.model).to_dict())
    shape = input_format(cfg)
    assert (shape.in_chans, shape.img_size, shape.img_size) == data_config["input_size"]
    assert (shape.crop_pct, shape.interpolation) == (data_config["crop_pct"], data_config["interpolation"])
    assert (shape.mean, shape.std) == (tuple(data_config["mean"]), tuple(data_config["std"]))
    train_interpolation = args.train_interpolation or data_config["interpolation"]
    timm_train = create_transform(
        data_config["input_size"],
        is_training=True,
        train_crop_mode=args.train_crop_mode,
        scale=args.scale,
        ratio=args.ratio,
        hflip=args.hflip,
        vflip=args.vflip,
        color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob,
        grayscale_prob=args.grayscale_prob or 0.0,
        gaussian_blur_prob=args.gaussian_blur_prob or 0.0,
        auto_augment=args.aa,
        interpolation=train_interpolation,
        mean=data_config["mean"],
        std=data_config["std"],
        re_prob=args.reprob,
        re_mode=args.remode,
        re_count=args.recount,
    )
    timm_eval = create_transform(
        data_config["input_size"],
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
        crop_pct=data_config["crop_pct"],
        crop_mode=data_config["crop_mode"],
    )
    train_transform, eval_transform = build_transforms(shape.img_size, shape.in_chans, shape.mean, shape.std, cfg)
    assert repr(train_transform.transforms[1:]) == repr(timm_train.transforms)  # [0]: the image mode
    assert repr(eval_transform.transforms[1:]) == repr(timm_eval.transforms)

    # batch augmentation and regularization
    mixing = args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None
    timm_mixup = (
        Mixup(
            mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix,
            cutmix_minmax=args.cutmix_minmax,
            prob=args.mixup_prob,
            switch_prob=args.mixup_switch_prob,
            mode=args.mixup_mode,
            label_smoothing=args.smoothing,
            num_classes=num_classes,
        )
        if mixing
        else None
    )
    mixup = create_mixup(cfg, num_classes)
    assert vars(mixup) == vars(timm_mixup) if mixing else mixup is None
    assert cfg.repeated_aug == max(1, args.aug_repeats) and cfg.drop_path == args.drop_path and cfg.drop == args.drop
    assert (cfg.model_ema, cfg.model_ema_decay, cfg.smoothing) == (args.model_ema, args.model_ema_decay, args.smoothing)
    assert cfg.mixed_precision == ("fp16" if args.amp else "no") and cfg.workers == args.workers


def test_the_jsd_recipe_is_refused_naming_every_unsupported_option(folder, tmp_path):
    with pytest.raises(ConfigError) as error:
        ours(JSD_RECIPE, folder, tmp_path)
    message = str(error.value)
    assert "\n" not in message
    for flag in ("--aug-splits: 3", "--resplit: True", "--split-bn: True", "--jsd-loss: True"):
        assert flag in message
    assert message.count("JSD loss and AugMix splits are not implemented") == 4


@pytest.mark.integration
def test_a_documented_recipe_trains_a_step_unchanged(folder, tmp_path, single_thread):
    """The SE-ResNeXt-26t command of timm's documentation as it is (no --amp on a CPU), on 16-px images: one
    epoch of one step, from timm's folder dataset at --data-dir."""
    command = DOCUMENTED["seresnext26t"].replace("-b 112", "-b 8") + " --epochs 1 --img-size 16 -j 0"
    argv = [*shlex.split(command), "--data-dir", str(folder), "--output", str(tmp_path / "run")]
    assert train.main(argv) == 0
