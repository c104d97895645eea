"""timm train.py's options as this engine implements them, each checked by its effect on the pieces the engine
builds (model, optimizer, schedule, mixup, loss, EMA, gradient clipping) against timm's own objects or a closed
form; and each one's place on the command line, in recipes and in the one-line errors."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from support import REPO
from support.timm_train import timm_train_loss
from timm.loss import BinaryCrossEntropy
from timm.optim import param_groups_layer_decay
from timm.scheduler import CosineLRScheduler, MultiStepLRScheduler, create_scheduler_v2
from timm.utils import adaptive_clip_grad
from torch import nn

from convbias.base.errors import ConfigError
from convbias.engine import parse_config, validate
from convbias.engine.config.command_line import build_parser
from convbias.engine.config.options import Config, default_value, flag_name
from convbias.engine.config.parsing import config_warnings
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.engine.model import factory as modeling
from convbias.engine.model.build import create_ema
from convbias.engine.model.output_scale import OutputScale
from convbias.engine.optim import factory as recipe
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")

DEIT_RECIPE = yaml.safe_load((REPO / "configs" / "recipes" / "deit.yaml").read_text())
TINY_CONVIT = dict(patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8, img_size=8)
LR, MIN_LR, UPDATES = 1e-3, 1e-5, 4  # UPDATES: optimizer updates per epoch


@pytest.fixture(scope="module", autouse=True)
def families():
    load_families()


def config(tmp_path: Path, **options) -> Config:
    """A validated Config of the tiny ConViT on the digits (the DeiT recipe's values otherwise)."""
    base = {**DEIT_RECIPE, "model": "convit_tiny", "model_kwargs": dict(TINY_CONVIT), "dataset": "digits"}
    cfg = Config(**{**base, **options}, output=str(tmp_path / "run"))
    validate(cfg)
    return cfg


def build(cfg: Config, in_chans: int = 3) -> nn.Module:
    """The engine's model of ``cfg`` for 10 classes, from the same seed every time."""
    torch.manual_seed(0)
    return modeling.create_model(cfg, num_classes=10, in_chans=in_chans)


def schedule(cfg: Config, epochs: int, warmup: int, updates: int) -> list[float]:
    """The lr the engine's schedule gives after each of ``updates`` optimizer updates (0, 1, ...)."""
    optimizer = recipe.create_optimizer(cfg, nn.Linear(2, 2), LR)
    scheduler = recipe.create_scheduler(cfg, optimizer, epochs, warmup, UPDATES)
    return [_step(scheduler, optimizer, t) for t in range(updates)]


def timm_schedule(scheduler_class, updates: int, **arguments) -> list[float]:
    """The same from timm's scheduler class built directly, stepped per update as the engine steps it."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    scheduler = scheduler_class(optimizer, t_in_epochs=False, **arguments)
    return [_step(scheduler, optimizer, t) for t in range(updates)]


def _step(scheduler, optimizer, t: int) -> float:
    scheduler.step_update(t)
    return optimizer.param_groups[0]["lr"]


# ------------------------------------------------------------------------------------------------- model
def test_drop_sets_the_dropout_of_timms_model(tmp_path):
    assert build(config(tmp_path, drop=0.25)).head_drop.p == 0.25
    assert build(config(tmp_path)).head_drop.p == 0.0
    assert build(config(tmp_path, model="test_vit", model_kwargs={}, drop=0.25)).head_drop.p == 0.25
    with pytest.raises(ConfigError, match=r"^cannot build vanilla_cnn with \{'drop_rate': 0.25\}: .*'drop_rate'$"):
        build(config(tmp_path, model="vanilla_cnn", model_kwargs={}, drop_path=0.0, drop=0.25), in_chans=1)


def test_gp_and_drop_block_build_timms_model(tmp_path):
    """--gp max and --drop-block 0.1 on timm's resnet18: the model timm builds with global_pool='max' and
    drop_block_rate=0.1 (its DropBlock in the last two stages), the same outputs from the same weights;
    a model without them (ConViT) is a one-line error naming what was given."""
    from timm.layers import DropBlock2d

    cfg = config(tmp_path, model="resnet18", model_kwargs={}, drop_path=0.0, gp="max", drop_block=0.1)
    ours = build(cfg)
    torch.manual_seed(0)
    theirs = timm.create_model("resnet18", num_classes=10, global_pool="max", drop_block_rate=0.1)
    assert (
        ours.global_pool.pool_type == "max"
        and build(config(tmp_path, model="resnet18", model_kwargs={})).global_pool.pool_type == "avg"
    )
    blocks = [name for name, module in ours.named_modules() if isinstance(module, DropBlock2d)]
    assert blocks and all(name.startswith(("layer3", "layer4")) for name in blocks)
    assert blocks == [name for name, module in theirs.named_modules() if isinstance(module, DropBlock2d)]
    ours.eval(), theirs.eval()
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ours(images), theirs(images), rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"^cannot build convit_tiny with \{'drop_block_rate': 0.1"):
        build(config(tmp_path, drop_block=0.1))


def test_fast_norm_is_timms_for_the_runs_model_only(tmp_path):
    """--fast-norm builds the tiny ConViT as timm builds it under set_fast_norm(): every timm LayerNorm takes the
    fast path, which under bf16 autocast normalizes in bf16 (timm's default: fp32), the same outputs as timm's
    model; the switch is off again afterwards, so a model built later is not affected."""
    from timm.layers import LayerNorm, is_fast_norm, set_fast_norm

    fast = build(config(tmp_path, fast_norm=True)).eval()
    assert not is_fast_norm()  # restored

    def fast_path(norm: LayerNorm) -> bool:  # timm's fast path keeps bf16 under autocast, F.layer_norm fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return norm(torch.randn(1, *norm.normalized_shape)).dtype == torch.bfloat16

    norms = [module for module in fast.modules() if isinstance(module, LayerNorm)]
    assert norms and all(fast_path(norm) for norm in norms)
    plain = build(config(tmp_path)).eval()
    assert not any(fast_path(module) for module in plain.modules() if isinstance(module, LayerNorm))
    set_fast_norm(True)
    try:
        torch.manual_seed(0)  # as build() seeds
        oracle = timm.create_model("convit_tiny", num_classes=10, drop_path_rate=0.1, **TINY_CONVIT).eval()
    finally:
        set_fast_norm(False)
    assert all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), oracle.state_dict().values()))
    images = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        tokens = torch.randn(2, 5, *plain.norm.normalized_shape)
        assert fast.norm(tokens).dtype == torch.bfloat16 and plain.norm(tokens).dtype == torch.float32
        torch.testing.assert_close(fast(images), oracle(images), rtol=0, atol=0)
        assert not torch.equal(fast(images), plain(images))  # the same weights (same seed), another precision


def test_head_init_scale_scales_exactly_the_classifier(tmp_path):
    reference, scaled = build(config(tmp_path)), build(config(tmp_path, head_init_scale=0.01))
    for name, value in reference.state_dict().items():
        expected = value * 0.01 if name.startswith("head.") else value
        assert torch.equal(scaled.state_dict()[name], expected), name
    resnet = build(config(tmp_path, model="test_resnet", model_kwargs={}))
    scaled = build(config(tmp_path, model="test_resnet", model_kwargs={}, head_init_scale=3.0))
    assert resnet.fc.bias.abs().sum() > 0  # timm's ResNet head has a bias to scale, unlike the ConViT's (zeros)
    assert torch.equal(scaled.fc.bias, resnet.fc.bias * 3.0) and torch.equal(scaled.fc.weight, resnet.fc.weight * 3.0)
    with pytest.raises(ConfigError, match=r"^--head-init-scale: Linear \(m\) has no get_classifier\(\); run without"):
        modeling.classifier_tensors(nn.Linear(2, 2), ("weight",), "--head-init-scale", "m")


# --------------------------------------------------------------------------------------------- optimizer
def test_layer_decay_scales_each_layer_groups_lr_as_timm(tmp_path):
    cfg = config(tmp_path, layer_decay=0.75, warmup_epochs=0, param_group_lr={"gating_param": 0.1})
    model = build(cfg)
    timm_scale = {id(p): g["lr_scale"] for g in param_groups_layer_decay(model, layer_decay=0.75) for p in g["params"]}
    layers = {"cls_token": 0, "blocks.0.mlp.fc1.weight": 1, "blocks.1.attn.qkv.weight": 2, "head.weight": 3}
    optimizer = recipe.create_optimizer(cfg, model, LR)
    scheduler = recipe.create_scheduler(cfg, optimizer, epochs=10, warmup_epochs=0, updates_per_epoch=UPDATES)
    names = {name: group for group in optimizer.param_groups for name in group["param_names"]}
    for name, layer in layers.items():  # 4 layer groups: stem, block 0, block 1 (and the final norm), head
        scale = 0.75 ** (3 - layer)
        assert names[name]["lr_scale"] == scale and names[name]["lr"] == pytest.approx(LR * scale), name
    for group in optimizer.param_groups:  # from the first update on; --param-group-lr's lr scaled too
        assert all(timm_scale[id(p)] == group["lr_scale"] for p in group["params"])
        base = 0.1 if group["lr_pattern"] else LR
        assert group["lr"] == pytest.approx(base * group["lr_scale"])
    scheduler.step_update(20)  # the cosine's midpoint, per group
    for group in optimizer.param_groups:
        base = 0.1 if group["lr_pattern"] else LR
        assert group["lr"] == pytest.approx(group["lr_scale"] * (MIN_LR + 0.5 * (base - MIN_LR)))
    scaled = recipe.param_groups(OutputScale(model, 2.0), 0.05, {}, layer_decay=0.75)  # f_w0 is not trained
    assert {id(p): g["lr_scale"] for g in scaled for p in g["params"]} == timm_scale
    with pytest.raises(ConfigError, match=r"^--layer-decay: Sequential has no group_matcher\(\)"):
        recipe.create_optimizer(cfg, nn.Sequential(nn.Linear(2, 2)), LR)


def test_layer_decay_min_scale_and_no_opt_scale_as_timm(tmp_path):
    """--layer-decay 0.5 over 4 layer groups: scales 1/8, 1/4, 1/2, 1; --layer-decay-min-scale 0.2 lifts the
    stem's to 0.2 and --layer-decay-no-opt-scale 0.22 then freezes it: the stem is out of the optimizer and
    unchanged by a step, the rest train at timm's scales (timm's param_groups_layer_decay on the same model)."""
    cfg = config(tmp_path, layer_decay=0.5, layer_decay_min_scale=0.2, layer_decay_no_opt_scale=0.22)
    model, oracle = build(cfg), build(cfg)
    timm_groups = param_groups_layer_decay(oracle, layer_decay=0.5, min_scale=0.2, no_opt_scale=0.22)
    names = dict(oracle.named_parameters())
    timm_scale = {name: g["lr_scale"] for g in timm_groups for name, p in names.items() for q in g["params"] if p is q}
    optimizer = recipe.create_optimizer(cfg, model, LR)
    ours = {name: group["lr_scale"] for group in optimizer.param_groups for name in group["param_names"]}
    assert ours == timm_scale and sorted(set(ours.values())) == [0.25, 0.5, 1.0]
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert "cls_token" in frozen and "pos_embed" in frozen and frozen.isdisjoint(ours)
    assert frozen == {name for name, p in oracle.named_parameters() if not p.requires_grad}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model(torch.randn(2, 3, 8, 8)).logsumexp(-1).sum().backward()
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == (name in frozen), name
    lowest = recipe.create_optimizer(config(tmp_path, layer_decay=0.5, layer_decay_min_scale=0.2), build(cfg), LR)
    assert min(group["lr_scale"] for group in lowest.param_groups) == 0.2


def test_opt_betas_reach_the_optimizer(tmp_path):
    optimizer = recipe.create_optimizer(config(tmp_path, opt_betas=[0.8, 0.95]), nn.Linear(2, 2), LR)
    assert {group["betas"] for group in optimizer.param_groups} == {(0.8, 0.95)}
    default = recipe.create_optimizer(config(tmp_path), nn.Linear(2, 2), LR)
    assert default.param_groups[0]["betas"] == (0.9, 0.999)
    lamb = recipe.create_optimizer(config(tmp_path, opt="lamb", opt_betas=[0.5, 0.6]), nn.Linear(2, 2), LR)
    assert lamb.param_groups[0]["betas"] == (0.5, 0.6)


def test_opt_kwargs_reach_the_optimizer(tmp_path):
    model = nn.Linear(2, 2)
    cfg = config(tmp_path, opt_kwargs={"amsgrad": True})
    optimizer = recipe.create_optimizer(cfg, model, LR)
    assert all(group["amsgrad"] for group in optimizer.param_groups)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert "max_exp_avg_sq" in optimizer.state[model.weight]  # AMSGrad's own state
    with pytest.raises(ConfigError, match=r"^--opt adamw with --opt-kwargs \{'amsgrad_': True\}: .*amsgrad_"):
        recipe.create_optimizer(config(tmp_path, opt_kwargs={"amsgrad_": True}), model, LR)


def test_clip_mode_clips_through_timms_dispatch_clip_grad(tmp_path):
    accelerator = Accelerator(cpu=True)

    def clipped(mode: str, alpha: float | None = None) -> tuple[list[torch.Tensor], list[nn.Parameter]]:
        """The trained parameters' gradients before --clip-grad 0.1 --clip-mode MODE, and the parameters after."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        wrapped = OutputScale(model, alpha) if alpha else model  # f_w0: frozen parameters after the head
        (100 * wrapped(torch.randn(5, 4)) * torch.randn(5, 3)).sum().backward()  # linear: F = 0 at the start
        before = [p.grad.clone() for p in model.parameters()]
        recipe.clip_gradients(config(tmp_path, clip_grad=0.1, clip_mode=mode), accelerator, wrapped)
        return before, list(model.parameters())

    before, after = clipped("norm")
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in after])) == pytest.approx(0.1, rel=1e-5)
    before, after = clipped("value")
    assert all(torch.equal(p.grad, g.clamp(-0.1, 0.1)) for p, g in zip(after, before, strict=True))
    for alpha in (None, 2.0):
        before, after = clipped("agc", alpha)
        expected = [nn.Parameter(p.detach().clone()) for p in after]
        for parameter, grad in zip(expected, before, strict=True):
            parameter.grad = grad.clone()
        adaptive_clip_grad(expected[:-2], 0.1)  # timm's AGC on all but the classifier's weight and bias
        assert all(torch.equal(p.grad, e.grad) for p, e in zip(after, expected, strict=True))
        assert not torch.equal(after[0].grad, before[0]) and torch.equal(after[-1].grad, before[-1])


# ---------------------------------------------------------------------------------------------- schedule
def test_new_schedule_options_at_their_defaults_leave_the_schedule_as_it_was(tmp_path):
    for sched in ("cosine", "step", "constant"):
        cfg = config(tmp_path, sched=sched, decay_epochs=2, min_lr=MIN_LR)
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
        before, _ = create_scheduler_v2(  # the engine's call before these options existed
            optimizer, sched="step" if sched == "constant" else sched, num_epochs=10, decay_epochs=2,
            decay_rate=1.0 if sched == "constant" else 0.1, min_lr=MIN_LR, warmup_lr=cfg.warmup_lr, warmup_epochs=2,
            step_on_epochs=False, updates_per_epoch=UPDATES,
        )  # fmt: skip
        assert schedule(cfg, 10, 2, 44) == [_step(before, optimizer, t) for t in range(44)], sched
        assert recipe.scheduled_epochs(cfg, 10, 2) == 10


def test_cooldown_epochs_hold_min_lr_after_the_cosine_and_lengthen_the_run(tmp_path):
    cfg = config(tmp_path, epochs=10, warmup_epochs=2, cooldown_epochs=3, min_lr=MIN_LR)
    lrs = schedule(cfg, 10, 2, 13 * UPDATES)
    assert lrs == timm_schedule(CosineLRScheduler, 13 * UPDATES, t_initial=10 * UPDATES, lr_min=MIN_LR,
                                warmup_t=2 * UPDATES, warmup_lr_init=cfg.warmup_lr)  # fmt: skip
    assert lrs[10 * UPDATES - 1] > MIN_LR and set(lrs[10 * UPDATES :]) == {MIN_LR}
    assert recipe.scheduled_epochs(cfg, 10, 2) == 13 and recipe.scheduled_epochs(config(tmp_path), 10, 2) == 10


def test_lr_cycles_restart_the_cosine_and_lengthen_the_run(tmp_path):
    cycles = dict(lr_cycle_limit=3, lr_cycle_mul=2.0, lr_cycle_decay=0.5)
    cfg = config(tmp_path, epochs=4, warmup_epochs=0, min_lr=MIN_LR, **cycles)
    lrs = schedule(cfg, 4, 0, 28 * UPDATES)
    assert lrs == timm_schedule(CosineLRScheduler, 28 * UPDATES, t_initial=4 * UPDATES, lr_min=MIN_LR,
                                cycle_limit=3, cycle_mul=2.0, cycle_decay=0.5)  # fmt: skip
    for start, peak in ((0, LR), (4, LR * 0.5), (12, LR * 0.25)):  # cycles of 4, 8 and 16 epochs
        assert lrs[start * UPDATES] == pytest.approx(peak)
    assert recipe.scheduled_epochs(cfg, 4, 0) == 4 + 8 + 16
    fractional = config(tmp_path, epochs=10, lr_cycle_limit=3, lr_cycle_mul=1.25)
    assert recipe.scheduled_epochs(fractional, 10, 0) == math.floor(10 + 12.5 + 15.625)  # as timm's train.py


def test_lr_k_decay_follows_the_k_decay_cosine(tmp_path):
    cfg = config(tmp_path, epochs=10, warmup_epochs=0, lr_k_decay=2.0, min_lr=MIN_LR)
    lrs, total = schedule(cfg, 10, 0, 10 * UPDATES), 10 * UPDATES
    assert lrs == timm_schedule(CosineLRScheduler, total, t_initial=total, lr_min=MIN_LR, k_decay=2.0)
    for t in (1, 13, 20, 39):
        assert lrs[t] == pytest.approx(MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * t**2 / total**2)))


def test_warmup_prefix_warms_up_before_the_schedule(tmp_path):
    cfg = config(tmp_path, epochs=10, warmup_epochs=2, warmup_prefix=True, min_lr=MIN_LR)
    lrs = schedule(cfg, 10, 2, 12 * UPDATES)
    assert lrs == timm_schedule(CosineLRScheduler, 12 * UPDATES, t_initial=10 * UPDATES, lr_min=MIN_LR,
                                warmup_t=2 * UPDATES, warmup_lr_init=cfg.warmup_lr, warmup_prefix=True)  # fmt: skip
    assert lrs[2 * UPDATES] == LR and lrs[7 * UPDATES] == pytest.approx(MIN_LR + 0.5 * (LR - MIN_LR))
    assert recipe.scheduled_epochs(cfg, 10, 2) == 12
    step = config(tmp_path, sched="step", epochs=10, warmup_epochs=2, warmup_prefix=True)
    assert recipe.scheduled_epochs(step, 10, 2) == 12


def test_decay_milestones_give_the_multistep_schedule(tmp_path):
    cfg = config(tmp_path, sched="multistep", decay_milestones=[2, 5], decay_rate=0.1, epochs=6, warmup_epochs=0)
    lrs = schedule(cfg, 6, 0, 6 * UPDATES)
    assert lrs == timm_schedule(MultiStepLRScheduler, 6 * UPDATES, decay_t=[2 * UPDATES, 5 * UPDATES], decay_rate=0.1)
    for t, lr in enumerate(lrs):  # timm's convention: milestone M from the update after update M x UPDATES - 1 on
        assert lr == pytest.approx(LR * 0.1 ** sum(t + 1 >= m * UPDATES for m in (2, 5))), t
    assert recipe.scheduled_epochs(cfg, 6, 0) == 6


# ------------------------------------------------------------------------------------------ mixup, loss
def test_mixup_options_configure_timms_mixup(tmp_path):
    options = dict(mixup_prob=0.5, mixup_switch_prob=0.3, mixup_mode="elem", cutmix_minmax=[0.25, 0.5])
    mixup = recipe.create_mixup(config(tmp_path, **options), num_classes=10)
    assert (mixup.mix_prob, mixup.switch_prob, mixup.mode, mixup.cutmix_minmax) == (0.5, 0.3, "elem", [0.25, 0.5])
    assert mixup.cutmix_alpha == 1.0  # timm: a box size range stands in for cutmix's alpha

    images, labels = torch.randn(8, 3, 8, 8), torch.arange(8)
    never = recipe.create_mixup(config(tmp_path, mixup_prob=0.0, smoothing=0.0), num_classes=10)
    mixed, targets = never(images.clone(), labels)
    assert torch.equal(mixed, images) and torch.equal(targets, F.one_hot(labels, 10).float())

    np.random.seed(0)
    boxes = recipe.create_mixup(config(tmp_path, mixup=0.0, cutmix=0.0, cutmix_minmax=[0.25, 0.5], smoothing=0.0), 10)
    mixed, targets = boxes(images.clone(), labels)
    lam = targets[0, 0].item()  # label 0 mixed with label 7 (the batch reversed)
    assert lam in {1 - h * w / 64 for h in (2, 3) for w in (2, 3)}  # box sides in [8 x 0.25, 8 x 0.5)
    assert (mixed != images).any(dim=1).sum().item() == round((1 - lam) * 64 * 8)  # the box in every image


def bce(logits: torch.Tensor, targets: torch.Tensor, pos_weight: float = 1.0, sum_classes: bool = False):
    """Binary cross-entropy in closed form: -(p t log s(x) + (1 - t) log s(-x)), over classes then batch."""
    each = -(pos_weight * targets * F.logsigmoid(logits) + (1 - targets) * F.logsigmoid(-logits))
    return each.sum(-1).mean() if sum_classes else each.mean()


@pytest.mark.parametrize(
    "options, closed_form",
    [
        ({}, lambda x, t: bce(x, t)),
        ({"bce_target_thresh": 0.5}, lambda x, t: bce(x, (t > 0.5).float())),
        ({"bce_sum": True}, lambda x, t: bce(x, t, sum_classes=True)),
        ({"bce_pos_weight": 3.0}, lambda x, t: bce(x, t, pos_weight=3.0)),
    ],
)
def test_bce_loss_and_its_options_against_the_closed_form(tmp_path, options, closed_form):
    torch.manual_seed(0)
    logits, labels = torch.randn(8, 10), torch.randint(0, 10, (8,))
    smoothed = config(tmp_path, bce_loss=True, mixup=0.0, cutmix=0.0, smoothing=0.1, **options)
    loss = recipe.create_train_loss(smoothed, None)
    assert isinstance(loss, BinaryCrossEntropy) and loss.smoothing == 0.1
    one_hot = F.one_hot(labels, 10).float() * (1 - 0.1) + 0.1 / 10  # timm's BCE smoothing: on 1 - s + s/C
    assert loss(logits, labels).item() == pytest.approx(closed_form(logits, one_hot).item(), rel=1e-6)

    with_mixup = config(tmp_path, bce_loss=True, **options)  # mixup/cutmix's soft targets carry the smoothing
    mixup = recipe.create_mixup(with_mixup, num_classes=10)
    _, soft = mixup(torch.randn(8, 3, 8, 8), labels)
    loss = recipe.create_train_loss(with_mixup, mixup)
    assert isinstance(loss, BinaryCrossEntropy)  # timm's own smoothing argument, unused on dense targets
    assert loss(logits, soft).item() == pytest.approx(closed_form(logits, soft).item(), rel=1e-6)


def loss_state(loss: nn.Module) -> tuple:
    """A loss module's class and attributes (its smoothing, threshold, reductions, buffers)."""
    attributes = {k: v for k, v in vars(loss).items() if not k.startswith("_") and k != "training"}
    buffers = {k: v.tolist() for k, v in loss.named_buffers()}
    return type(loss), attributes, buffers


@pytest.mark.parametrize("bce_loss", [False, True], ids=["ce", "bce"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["unsmoothed", "smoothed"])
@pytest.mark.parametrize("mixup", [0.0, 0.8], ids=["plain", "mixup"])
def test_the_train_loss_is_the_one_timms_branches_choose(tmp_path, mixup, smoothing, bce_loss):
    """Every combination of mixup, --smoothing and --bce-loss (with the BCE options set): the loss timm's train.py
    builds, its class, attributes and value on the targets the step gives it. --bce-loss without mixup and
    smoothing is timm's plain cross-entropy, and its options are then ignored with a warning."""
    bce_options = dict(bce_target_thresh=0.2, bce_sum=True, bce_pos_weight=2.0) if bce_loss else {}
    cfg = config(tmp_path, mixup=mixup, cutmix=0.0, smoothing=smoothing, bce_loss=bce_loss, **bce_options)
    mixer = recipe.create_mixup(cfg, num_classes=10)
    ours = recipe.create_train_loss(cfg, mixer)
    args = {**TIMM_TRAIN_DEFAULTS, "mixup": mixup, "smoothing": smoothing, "bce_loss": bce_loss, **bce_options}
    theirs = timm_train_loss(args, torch.device("cpu"))
    assert loss_state(ours) == loss_state(theirs)
    torch.manual_seed(0)
    logits, labels = torch.randn(8, 10), torch.randint(0, 10, (8,))
    targets = mixer(torch.randn(8, 3, 8, 8), labels)[1] if mixer is not None else labels
    assert ours(logits, targets).item() == pytest.approx(theirs(logits, targets).item(), rel=1e-6)
    inert = [w for w in config_warnings(cfg) if w.startswith("--bce")]
    assert len(inert) == (bce_loss and not mixup and not smoothing) * 4, inert  # --bce-loss and its 3 options


def test_model_ema_warmup_warms_the_decay_up(tmp_path):
    model = nn.Linear(3, 2)
    cfg = config(tmp_path, model_ema=True, model_ema_decay=0.99, model_ema_warmup=True)
    ema = create_ema(cfg, model, torch.device("cpu"))
    for step in (2, 5, 50, 10**6):  # timm's warm-up: 1 - (1 + (step - 1))^(-2/3), capped at the decay
        assert ema.get_decay(step) == pytest.approx(min(1 - step ** (-2 / 3), 0.99))
    start = ema.module.weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model, step=5)
    decay = 1 - 5 ** (-2 / 3)
    assert torch.allclose(ema.module.weight, decay * start + (1 - decay) * model.weight, atol=1e-6)
    plain = create_ema(config(tmp_path, model_ema=True, model_ema_decay=0.99), model, torch.device("cpu"))
    assert plain.get_decay(5) == 0.99 and create_ema(config(tmp_path), model, torch.device("cpu")) is None


# --------------------------------------------------------------------------------------- options, errors
def test_initial_checkpoint_is_timms_name_for_checkpoint(tmp_path):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"")
    (tmp_path / "recipe.yaml").write_text(f"model: convit_tiny\ninitial_checkpoint: {weights}\n")
    output = ["--output", str(tmp_path / "run")]
    from_recipe = parse_config(["-c", str(tmp_path / "recipe.yaml"), *output])
    from_flag = parse_config(["--model", "convit_tiny", "--initial-checkpoint", str(weights), *output])
    assert from_recipe.checkpoint == from_flag.checkpoint == str(weights)
    assert Config.from_dict({"initial_checkpoint": str(weights)}).checkpoint == str(weights)
    with pytest.raises(ConfigError, match="^run.yaml: initial_checkpoint and checkpoint are two names of one option"):
        Config.from_dict({"initial_checkpoint": "a", "checkpoint": "b"}, source="run.yaml")
    action = next(a for a in build_parser()._actions if a.dest == "checkpoint")
    assert action.option_strings == ["--checkpoint", "--initial-checkpoint"]


NEW_OPTIONS = dict(  # every new option but --decay-milestones off its default (with --model-ema, --clip-grad)
    drop=0.1, head_init_scale=0.5, model_ema=True, model_ema_warmup=True, cutmix_minmax=[0.2, 0.8], mixup_prob=0.5,
    mixup_switch_prob=0.3, mixup_mode="pair", bce_loss=True, bce_target_thresh=0.2, bce_sum=True, bce_pos_weight=2.0,
    opt_betas=[0.8, 0.95], opt_kwargs={"amsgrad": True}, layer_decay=0.75, clip_grad=1.0, clip_mode="agc",
    warmup_prefix=True, cooldown_epochs=2, lr_cycle_limit=2, lr_cycle_mul=2.0, lr_cycle_decay=0.3, lr_k_decay=2.0,
    opt="adamw", mixup=0.8,  # (timm's defaults: SGD, which takes no betas, and no mixup)
)  # fmt: skip
MULTISTEP = dict(sched="multistep", decay_milestones=[2, 4], decay_rate=0.5)


@pytest.mark.parametrize("options", [NEW_OPTIONS, MULTISTEP], ids=["cosine", "multistep"])
def test_new_options_from_the_command_line_a_recipe_and_python_agree(tmp_path, cli_argv, options):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"")
    options = {**options, "model": "convit_tiny", "epochs": 5, "initial_checkpoint": str(weights)}
    output = ["--output", str(tmp_path / "run")]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(options))
    from_recipe = parse_config(["-c", str(tmp_path / "recipe.yaml"), *output])
    from_command_line = parse_config(cli_argv(options) + output)
    python = {("checkpoint" if k == "initial_checkpoint" else k): v for k, v in options.items()}
    from_python = Config(**python, output=str(tmp_path / "run"))
    validate(from_python)
    assert from_recipe.replace(config=None) == from_command_line == from_python
    assert all(getattr(from_recipe, k) == v for k, v in python.items())


def test_help_shows_every_new_option_with_its_default():
    parser = build_parser()
    for name in (*NEW_OPTIONS, "decay_milestones"):
        action = next(a for a in parser._actions if a.dest == name)
        text = " ".join(parser._get_formatter()._format_action(action).split())
        assert flag_name(name) in text and action.help, name
        if default_value(name) not in (None, {}):  # a K=V option's pairs merge with the recipe's: no default shown
            assert f"(default: {default_value(name)})" in text, text


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(drop=1.0), r"--drop must be in \[0, 1\), got 1.0"),
        (dict(head_init_scale=-1.0), "--head-init-scale must be >= 0, got -1.0"),
        (dict(layer_decay=1.5), r"--layer-decay must be in \(0, 1\], got 1.5"),
        (
            dict(log_wandb=True, wandb_resume_id="x1"),
            "--wandb-resume-id x1 continues a wandb run, so it needs --resume",
        ),
        (dict(layer_decay=0.5, layer_decay_no_opt_scale=0.0), r"--layer-decay-no-opt-scale must be in \(0, 1\]"),
        (dict(opt_betas=[0.9, 1.0]), r"--opt-betas must be one or more numbers in \[0, 1\)"),
        (dict(opt_betas=[0.9]), "--opt-betas: --opt adamw takes 2 betas, got 1"),
        (dict(opt="sgd", opt_betas=[0.9, 0.99]), "--opt-betas: --opt sgd takes no betas, got 2"),
        (dict(opt_kwargs={"lr": 0.1}), "--opt-kwargs must be free of the arguments set by their own options"),
        (dict(clip_mode="max"), "unknown --clip-mode 'max'; choices: norm, value, agc"),
        (dict(bce_loss=True, bce_target_thresh=1.0), r"--bce-target-thresh must be in \[0, 1\), got 1.0"),
        (dict(bce_loss=True, bce_pos_weight=0.0), "--bce-pos-weight must be positive, got 0.0"),
        (dict(mixup_prob=2.0), r"--mixup-prob must be in \[0, 1\], got 2.0"),
        (dict(mixup_mode="image"), "unknown --mixup-mode 'image'; choices: batch, pair, elem"),
        (dict(cutmix_minmax=[0.5, 0.2]), "--cutmix-minmax must be two fractions 0 <= MIN < MAX <= 1"),
        (dict(cutmix_minmax=[0.2, 0.5], no_aug=True), "--cutmix-minmax turns cutmix on and --no-aug turns it off"),
        (dict(cutmix_minmax=[0.2, 0.5], mixup=0.0, cutmix=0.0, batch_size=7), "mixup/cutmix need an even --batch"),
        (dict(lr_cycle_limit=0), "--lr-cycle-limit must be >= 1, got 0"),
        (dict(lr_k_decay=0.0), "--lr-k-decay must be positive, got 0.0"),
        (dict(sched="multistep", decay_milestones=[60, 30]), "--decay-milestones must be increasing positive epochs"),
        (dict(sched="linear"), "unknown --sched 'linear'; choices: cosine, step, constant, multistep"),
    ],
)
def test_a_bad_value_of_a_new_option_is_one_line(tmp_path, options, message):
    with pytest.raises(ConfigError, match=f"^{message}") as raised:
        config(tmp_path, **options)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(layer_decay_min_scale=0.1), "--layer-decay-min-scale 0.1 has no effect without --layer-decay"),
        (dict(wandb_tags=["a"]), r"--wandb-tags \['a'\] has no effect without --log-wandb"),
        (dict(clip_mode="agc"), "--clip-mode agc has no effect without --clip-grad"),
        (dict(model_ema_warmup=True), "--model-ema-warmup has no effect without --model-ema"),
        (dict(bce_sum=True), "--bce-sum has no effect without --bce-loss"),
        (dict(mixup=0.0, cutmix=0.0, mixup_prob=0.5), "--mixup-prob 0.5 has no effect without --mixup, --cutmix or"),
        (dict(mixup=0.0, cutmix=0.0, mixup_mode="elem"), "--mixup-mode elem has no effect without --mixup, --cutmix"),
        (dict(cutmix=0.0, mixup_switch_prob=0.2), "--mixup-switch-prob 0.2 has no effect without both --mixup and"),
        (dict(sched="step", cooldown_epochs=2), "--cooldown-epochs 2 has no effect without --sched cosine, tanh or"),
        (dict(lr_cycle_mul=2.0), "--lr-cycle-mul 2.0 has no effect without --sched cosine, tanh or poly and --lr-cycl"),
        (dict(decay_milestones=[30, 60]), r"--decay-milestones \[30, 60\] has no effect without --sched multistep"),
        (dict(patience_epochs=3), "--patience-epochs 3 has no effect without --sched plateau"),
    ],
)
def test_timms_inert_values_are_ignored_with_a_warning_as_timm_ignores_them(tmp_path, options, message):
    """timm's train.py takes these values and they change nothing (its factories read them only for the schedule,
    loss or mixing that uses them): accepted, the run's values unchanged, a warning names each."""
    cfg = config(tmp_path, **options)
    warned = [w for w in config_warnings(cfg) if w.endswith("ignored, as timm's train.py ignores it")]
    assert len(warned) == 1 and re.match(message, warned[0]), config_warnings(cfg)


def test_cooldown_epochs_count_for_save_epochs(tmp_path):
    assert config(tmp_path, epochs=3, cooldown_epochs=2, save_epochs=[5]).save_epochs == [5]
    with pytest.raises(ConfigError, match=r"--save-epochs 6 is outside 0\.\.5"):
        config(tmp_path, epochs=3, cooldown_epochs=2, save_epochs=[6])
