"""timm's train.py as the oracle: its args, what its factories build from them, its loss and a short run."""

import argparse
import shlex
from types import SimpleNamespace

import pytest
import timm
import torch
from timm.data import Mixup, create_transform, resolve_data_config
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import get_pretrained_cfg
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import CheckpointSaver, ModelEmaV3
from torch import nn

from convbias.engine.config.derived import scaled_lr
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.engine.data.factory import build_transforms, input_format
from convbias.engine.optim.factory import create_mixup, create_optimizer, create_scheduler

NUM_CLASSES = 3  # the classes of the tests' tiny runs, the engine's and timm's
# ---------------------------------------------------------------- timm's train.py arguments and its factories
SHORT_FLAGS = {"-b": "batch_size", "-j": "workers", "-vb": "validation_batch_size"}
LISTS = ("lr_noise", "opt_betas", "mean", "std", "input_size", "scale", "ratio", "decay_milestones", "cutmix_minmax")
SCHEDULE_UPDATES_PER_EPOCH = 7  # the updates per epoch of the schedules compared


def _literal(text: str):
    """A token as argparse's type would read it: an int, else a float, else the text."""
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


def scheduled_lrs(scheduler, t: int) -> list[float]:
    """The lr of each of the scheduler's optimizer's groups once stepped to `t` (an epoch, or an update when it
    steps per update), as a run steps it (its lr noise and groups' scales included)."""
    if scheduler.t_in_epochs:
        scheduler.step(t)
    else:
        scheduler.step_update(t)
    return [group["lr"] for group in scheduler.optimizer.param_groups]


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
    timm_sched, timm_epochs = create_scheduler_v2(
        timms, **scheduler_kwargs(args), updates_per_epoch=SCHEDULE_UPDATES_PER_EPOCH
    )
    sched = create_scheduler(cfg, mine, cfg.epochs, cfg.warmup_epochs, SCHEDULE_UPDATES_PER_EPOCH)
    assert type(sched) is type(timm_sched) and sched.t_in_epochs == timm_sched.t_in_epochs
    steps = range(0, timm_epochs * (1 if timm_sched.t_in_epochs else SCHEDULE_UPDATES_PER_EPOCH), 13)
    flat = [lr for t in steps for lr in scheduled_lrs(sched, t)]  # one lr per parameter group
    assert flat == pytest.approx([lr for t in steps for lr in scheduled_lrs(timm_sched, t)], rel=1e-12)

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


def timm_train_loss(args: dict, device: torch.device) -> nn.Module:
    """The training loss timm's train.py builds for ``args`` (train.py at TIMM_TRAIN_COMMIT, its "setup loss
    function" block, JSD aside): ``mixup_active`` first, then ``args.smoothing``, else CrossEntropyLoss."""
    mixup_active = args["mixup"] > 0 or args["cutmix"] > 0.0 or args["cutmix_minmax"] is not None
    bce = dict(
        target_threshold=args["bce_target_thresh"], sum_classes=args["bce_sum"], pos_weight=args["bce_pos_weight"]
    )
    if mixup_active:
        loss = BinaryCrossEntropy(**bce) if args["bce_loss"] else SoftTargetCrossEntropy()
    elif args["smoothing"]:
        if args["bce_loss"]:
            loss = BinaryCrossEntropy(smoothing=args["smoothing"], **bce)
        else:
            loss = LabelSmoothingCrossEntropy(smoothing=args["smoothing"])
    else:
        loss = nn.CrossEntropyLoss()
    return loss.to(device=device)


# ------------------------------------------------------------- a short run of timm's train.py's loop
TIMM_EPOCHS = 3  # timm's run: 3 epochs, stopped after its second (saved epoch 1); resumed for the third
TIMM_UPDATES_PER_EPOCH = 2
TINY_RESNET = {"channels": (8, 16, 32, 64), "stem_width": 8}  # resnet10t's layers at 1/8 of its width


def timm_train_args(**overrides):
    """timm's train.py arguments (its parser's defaults) with a small run's values."""
    # lr: what train.py sets from --lr-base for its global batch before it builds the optimizer
    values = {
        **TIMM_TRAIN_DEFAULTS,
        "model": "resnet10t",
        "num_classes": NUM_CLASSES,
        "epochs": TIMM_EPOCHS,
        "lr": 0.05,
    }
    values["model_kwargs"] = TINY_RESNET  # as timm's --model-kwargs parses them
    return argparse.Namespace(**{**values, "warmup_epochs": 1, "model_ema": True, **overrides})


def timm_run(tmp_path, args):
    """Two epochs of timm's train.py's loop (its optimizer, schedule stepped per epoch, EMA and CheckpointSaver),
    a few real SGD steps with momentum on random images; returns last.pth.tar."""
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=args.num_classes, **args.model_kwargs)
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(args))
    scheduler, _ = create_scheduler_v2(optimizer, **scheduler_kwargs(args), updates_per_epoch=TIMM_UPDATES_PER_EPOCH)
    ema = ModelEmaV3(model, decay=0.5)
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(tmp_path))
    for epoch in range(2):
        for step in range(TIMM_UPDATES_PER_EPOCH):
            images, targets = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, step])
            torch.nn.functional.cross_entropy(model(images), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update(model, step=epoch * TIMM_UPDATES_PER_EPOCH + step + 1)
        scheduler.step(epoch + 1)
        saver.save_checkpoint(epoch=epoch, metric=float(epoch))
    return tmp_path / "last.pth.tar"
