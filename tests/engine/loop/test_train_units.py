"""Engine pieces on their own: config precedence, parameter groups, optimizer rebuild, checkpoint files."""

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
from support import REPO

import convit  # noqa: F401  (registers the project's models)
from convbias.base.weights import load_weights
from convbias.engine import parse_config
from convbias.engine.checkpoint.points import CheckpointDir
from convbias.engine.checkpoint.resume import find_resume_point, load_training_state
from convbias.engine.config.derived import effective_epochs
from convbias.engine.config.parsing import ConfigError
from convbias.engine.optim.factory import create_optimizer, create_scheduler, param_groups, rebuild_optimizer

DEIT_RECIPE = REPO / "configs" / "recipes" / "deit.yaml"


def test_yaml_base_and_command_line_precedence(tmp_path):
    (tmp_path / "base.yaml").write_text("epochs: 30\nlr: 0.01\nmodel_kwargs: {patch_size: 4, depth: 6}\n")
    (tmp_path / "run.yaml").write_text("_base_: base.yaml\nmodel: convit_tiny\nepochs: 40\nbatch_size: 8\n")
    cfg = parse_config(
        [
            "-c",
            str(tmp_path / "run.yaml"),
            "--epochs",
            "50",
            "--model-kwargs",
            "depth=2",
            "locality_strength=0.5",
            "--param-group-lr",
            "gating_param=0.1",
        ]
    )
    assert cfg.epochs == 50 and cfg.batch_size == 8 and cfg.lr == 0.01  # CLI > file > _base_ > defaults
    assert cfg.model_kwargs == {"patch_size": 4, "depth": 2, "locality_strength": 0.5}  # merged key by key
    assert cfg.param_group_lr == {"gating_param": 0.1}
    assert cfg.weight_decay == 2e-5 and cfg.aa is None and cfg.opt == "sgd"  # timm's train.py's defaults


def test_yaml_errors_are_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: convit_tiny\nbatch_sise: 8\n")
    with pytest.raises(ConfigError, match="batch_sise: unknown option.*batch_size"):
        parse_config(["-c", str(tmp_path / "bad.yaml")])
    (tmp_path / "typed.yaml").write_text("model: convit_tiny\nepochs: many\n")
    with pytest.raises(ConfigError, match=r"^recipe \S+typed\.yaml, line 2: epochs expects int, got .many.$"):
        parse_config(["-c", str(tmp_path / "typed.yaml")])


def test_no_aug_and_scale_epochs():
    cfg = parse_config(["--model", "convit_tiny", "--no-aug"])
    assert (cfg.aa, cfg.mixup, cfg.cutmix, cfg.reprob, cfg.smoothing, cfg.hflip) == (None, 0, 0, 0, 0, 0)
    cfg = parse_config(["--model", "convit_tiny", "--train-fraction", "0.1", "--scale-epochs", "--epochs", "300"])
    assert effective_epochs(cfg) == (3000, 50)


def test_deit_param_groups_exclude_norms_biases_tokens_and_gating():
    model = timm.create_model("convit_tiny", img_size=32, patch_size=8, depth=3, local_up_to_layer=2)
    groups = param_groups(model, 0.05, {"gating_param": 0.1})
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]}
    gating = [g for g in groups if g["lr_pattern"] == "gating_param"]
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.proj.bias"}.isdisjoint(decayed)
    assert "blocks.0.attn.qk.weight" in decayed and "head.weight" in decayed
    assert len(gating) == 1 and gating[0]["lr"] == 0.1 and gating[0]["weight_decay"] == 0
    assert sorted(gating[0]["param_names"]) == ["blocks.0.attn.gating_param", "blocks.1.attn.gating_param"]
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())

    argv = ["-c", str(DEIT_RECIPE), "--model", "convit_tiny", "--param-group-lr", "gating_param=0.1"]
    cfg = parse_config([*argv, "--warmup-epochs", "0"])  # the schedule stepped per update
    optimizer = create_optimizer(cfg, model, lr=1e-3)
    scheduler = create_scheduler(cfg, optimizer, epochs=10, warmup_epochs=0, updates_per_epoch=5)
    scheduler.step_update(25)  # half way: cosine at its midpoint for every group, from each group's own lr
    for group in optimizer.param_groups:
        base = 0.1 if group["lr_pattern"] else 1e-3
        assert group["lr"] == pytest.approx(cfg.min_lr + 0.5 * (base - cfg.min_lr))


def test_build_optimization_gives_timms_optimizer_schedule_and_mixup():
    """engine.optim: the optimizer is timm's AdamW with the param groups above (prepared by accelerate with the
    model, as the trainer does); the schedule built around it is cosine after a linear warm-up, in closed form per
    update; mixup targets the head's outputs, and the loss is timm's soft-target cross-entropy."""
    from accelerate import Accelerator
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    from convbias.engine.optim.build import build_optimization
    from convbias.engine.optim.factory import create_optimizer

    model = timm.create_model("convit_tiny", img_size=32, patch_size=8, depth=3, local_up_to_layer=2, num_classes=7)
    cfg = parse_config(["-c", str(DEIT_RECIPE), "--model", "convit_tiny", "--sched-on-updates"])
    values = SimpleNamespace(lr=1e-3, schedule_epochs=10, warmup_epochs=2)
    accelerator = Accelerator(cpu=True)
    prepared, optimizer = accelerator.prepare(model, create_optimizer(cfg, model, values.lr))
    optimization = build_optimization(cfg, optimizer, values, 5, 7, accelerator.device)
    assert prepared is model and isinstance(optimization.optimizer.optimizer, torch.optim.AdamW)
    groups = param_groups(model, cfg.weight_decay, {})
    assert [g["params"] for g in optimization.optimizer.param_groups] == [g["params"] for g in groups]
    for update in (0, 5, 10, 30, 50):
        optimization.scheduler.step_update(update)
        lr = optimization.optimizer.param_groups[0]["lr"]
        if update < 10:  # warm-up over 2 epochs of 5 updates, from --warmup-lr
            expected = cfg.warmup_lr + update * (1e-3 - cfg.warmup_lr) / 10
        else:  # timm's cosine over the 10 epochs, the warm-up included in its cycle
            expected = cfg.min_lr + 0.5 * (1e-3 - cfg.min_lr) * (1 + math.cos(math.pi * update / 50))
        assert lr == pytest.approx(expected, rel=1e-6), update
    assert isinstance(optimization.mixup, Mixup) and optimization.mixup.num_classes == 7
    assert isinstance(optimization.train_loss, SoftTargetCrossEntropy)


def test_setup_warnings_name_a_low_scaled_lr_and_heavy_augmentation_on_small_images():
    """engine.loop.setup's warnings: valid settings likely unintended, each named with the option that fixes it;
    none for the same recipe at its own image size and lr."""
    from convbias.engine.loop.setup import LOW_LR, SMALL_IMAGES, setup_warnings

    small = parse_config(["-c", str(DEIT_RECIPE), "--img-size", str(SMALL_IMAGES // 2), "--workers", "0"])
    low = SimpleNamespace(lr=LOW_LR / 10, lr_rule="--lr-base 0.0005 x 8 / 512")
    lr_warning, augment_warning = setup_warnings(small, low)
    assert "below 1e-05" in lr_warning and "set --lr" in lr_warning
    assert f"on {SMALL_IMAGES // 2}-px images" in augment_warning and "--aa rand-m9-mstd0.5-inc1" in augment_warning
    assert setup_warnings(small.replace(img_size=224), SimpleNamespace(lr=LOW_LR * 10, lr_rule="")) == []


def test_rebuild_optimizer_keeps_state_of_surviving_parameters():
    cfg = parse_config(["-c", str(DEIT_RECIPE), "--model", "resnet18"])  # AdamW: state per parameter
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    optimizer = create_optimizer(cfg, model, lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    kept = optimizer.state[model[0].weight]["exp_avg"].clone()
    model[1] = torch.nn.Linear(8, 5)  # a replaced layer: same names, new shapes
    new = rebuild_optimizer(cfg, model, 1e-2, optimizer)
    assert torch.equal(new.state[model[0].weight]["exp_avg"], kept)
    assert model[1].weight not in new.state


def test_checkpoint_kill_during_save_keeps_last_and_load_errors(tmp_path, killed_at, file_faults):
    model = torch.nn.Linear(3, 2)
    ckpt = CheckpointDir(tmp_path, keep=1)  # the newest point and best
    ckpt.stage(1)
    ckpt.save(
        1, model.state_dict(), {"model": "m", "epoch": 1, "best": {"epoch": 1}}, None, {"epoch": "1"}, is_best=True
    )
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)

    killed_at("save_torch")  # while the training state is written
    ckpt.stage(2)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(
            2, model.state_dict(), {"model": "m", "epoch": 2, "best": {"epoch": 1}}, None, {"epoch": "2"}, is_best=False
        )
    file_faults.clear()
    point = find_resume_point("auto", tmp_path)
    assert point.name == "epoch_0001" and load_training_state(point)["epoch"] == 1
    restored = load_weights(torch.nn.Linear(3, 2), point)
    assert torch.equal(restored.weight, first["weight"])

    ckpt.stage(2)
    ckpt.save(
        2, model.state_dict(), {"model": "m", "epoch": 2, "best": {"epoch": 1}}, None, {"epoch": "2"}, is_best=False
    )
    assert os.readlink(ckpt.root / "last") == "epoch_0002" and os.readlink(ckpt.root / "best") == "epoch_0001"
    staged = ckpt.stage(3)
    (staged / "sharded").mkdir()
    (staged / "sharded" / "__5_0.distcp").write_bytes(b"left by a killed save")
    assert ckpt.stage(3) == staged and not any(staged.iterdir())  # a fresh start: no stale shard survives
    ckpt.save(
        3, model.state_dict(), {"model": "m", "epoch": 3, "best": {"epoch": 1}}, None, {"epoch": "3"}, is_best=False
    )
    with pytest.raises(FileNotFoundError, match=r"stage\(4, 0\) first"):
        ckpt.save(
            4, model.state_dict(), {"model": "m", "epoch": 4, "best": {"epoch": 1}}, None, {"epoch": "4"}, is_best=False
        )
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("epoch_*")) == ["epoch_0001", "epoch_0003"]

    with pytest.raises(ValueError, match=r"missing keys: 1\.weight.*unexpected keys: bias, weight"):
        load_weights(torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(3, 2)), point)
    with pytest.raises(ValueError, match=r"mismatched shapes: weight \(2, 3\) vs model \(4, 3\)"):
        load_weights(torch.nn.Linear(3, 4), point)


def test_load_weights_reads_torch_files_without_unpickling_objects(tmp_path):
    model = torch.nn.Linear(3, 2)
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 3}, tmp_path / "ok.pth")
    assert torch.equal(load_weights(torch.nn.Linear(3, 2), tmp_path / "ok.pth").weight, model.weight)
    torch.save({"model": model.state_dict(), "extra": Path("x")}, tmp_path / "pickled.pth")  # an arbitrary object
    with pytest.raises(ValueError, match="weights_only=True"):
        load_weights(torch.nn.Linear(3, 2), tmp_path / "pickled.pth")


def test_hard_distillation_loss_is_deit_average():
    from convbias.engine.optim.factory import HardDistillationLoss

    teacher = torch.nn.Linear(6, 4)
    images, targets = torch.randn(8, 6), torch.randint(0, 4, (8,))
    class_logits, distill_logits = torch.randn(8, 4), torch.randn(8, 4)
    loss = HardDistillationLoss(torch.nn.CrossEntropyLoss(), teacher)
    teacher_labels = teacher(images).argmax(-1)
    expected = 0.5 * torch.nn.functional.cross_entropy(class_logits, targets) + 0.5 * torch.nn.functional.cross_entropy(
        distill_logits, teacher_labels
    )
    assert torch.allclose(loss(images, (class_logits, distill_logits), targets), expected)
    single = 0.5 * torch.nn.functional.cross_entropy(class_logits, targets) + 0.5 * torch.nn.functional.cross_entropy(
        class_logits, teacher_labels
    )
    assert torch.allclose(loss(images, class_logits, targets), single)  # no distillation token


@pytest.mark.parametrize(
    "recipe",
    sorted(str(p.relative_to(REPO)) for p in REPO.glob("configs/train/convit/*/*.yaml") if not p.name.startswith("_"))
    + ["configs/train/demo_digits.yaml"],
)
def test_recipes_parse_and_name_registered_models(recipe):
    cfg = parse_config(["-c", str(REPO / recipe)])
    assert timm.is_model(cfg.model), cfg.model
    if "imagenet" in recipe or "cifar100" in recipe:
        plus = cfg.model.endswith("_plus")
        assert (cfg.lr_base, cfg.batch_size) == ((4e-4, 64) if plus else (5e-4, 128))
        assert (cfg.weight_decay, cfg.warmup_epochs, cfg.min_lr, cfg.repeated_aug) == (
            0.05,
            50 if "cifar100" in recipe else 5,
            1e-5,
            3,
        )
        assert cfg.img_size == 224 and cfg.epochs == (3000 if "cifar100" in recipe else 300)
    if "cifar100" in recipe:  # App. F.3 trains from scratch: no fine-tuning option on, stated in the recipe
        plain = {"layer_decay": None, "sync_bn": False, "dist_bn": "reduce", "channels_last": False}
        assert {k: getattr(cfg, k) for k in plain} == plain


@pytest.mark.parametrize("streamed", [False, True], ids=["prepared", "streamed"])
def test_evaluation_is_exact_over_uneven_batches(streamed):
    """engine.loop.metrics.evaluate against the whole set at once: mean cross-entropy, top-1 and top-5 (in %),
    over batches of uneven sizes; the model's training mode is given back."""
    from accelerate import Accelerator

    from convbias.engine.loop.metrics import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Dropout(0.5)).train()
    images, targets = torch.randn(53, 6), torch.randint(0, 7, (53,))
    batches = [(images[a:b], targets[a:b]) for a, b in ((0, 20), (20, 40), (40, 53))]
    acc = Accelerator(cpu=True)
    metrics = evaluate(acc, model, batches, streamed=streamed)
    assert model.training
    logits = model.eval()(images)
    top5 = logits.topk(5, dim=1).indices
    assert metrics["eval_loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, targets).item(), rel=1e-6)
    assert metrics["eval_top1"] == pytest.approx(100 * (top5[:, 0] == targets).double().mean().item())
    assert metrics["eval_top5"] == pytest.approx(100 * (top5 == targets[:, None]).any(1).double().mean().item())
