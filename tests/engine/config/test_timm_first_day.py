"""A timm user's first day, against timm's own code: --num-classes as timm's train.py reads it (the head's size,
the model's default when unset, a folder's classes as timm's ImageFolder maps them), the EMA's evaluation as the
epoch's metric (timm's train.py's branch, rebuilt from its CheckpointSaver and PlateauLRScheduler), every refusal
in one message and timm's inert values ignored, timm's positional data path, lookahead optimizers and its other
schedules through its factories, and timm's output folders in --eval-only, convbias-predict and convbias-export.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
import timm
import torch
import yaml
from support import DATA
from support.images import image_folder
from support.timm_train import TINY_RESNET, assert_timms_values, timm_args, timm_run, timm_train_args
from timm.data import ImageDataset, Mixup
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import CheckpointSaver

from convbias import engine
from convbias.base.errors import ConfigError
from convbias.engine import parse_config
from convbias.engine.config.parsing import config_warnings
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.engine.loop.records import startup_block
from convbias.families import load_families

PUBLISHED = DATA / "published_args"
TINY = ["--model", "resnet10t", "--model-kwargs", *(f"{k}={v}" for k, v in TINY_RESNET.items())]


@pytest.fixture
def folder(tmp_path):
    """DIR/<class>/<image>: 3 classes of 4 images, 32 px, named so that sorting reorders them."""
    root = image_folder(tmp_path, per_class=4, side=32)
    for old, new in (("c0", "zebra"), ("c1", "ant"), ("c2", "moth")):
        (root / old).rename(root / new)
    return root


def trainer_for(argv: list[str]):
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer

    return build_trainer(start_run(parse_config(argv), load_families(), None))


# ------------------------------------------------------------------------------------------- --num-classes
def test_without_num_classes_the_head_is_the_models_default_and_mixup_targets_it_as_timm(tmp_path, folder):
    """timm's train.py: create_model(args.model, num_classes=None) keeps the model's 1000 outputs on a 3-class
    folder, whose classes are timm ImageFolder's sorted indices 0..2, and Mixup(num_classes=args.num_classes)
    makes 1000-wide targets."""
    argv = [*TINY, "--data-dir", str(folder), "--mixup", "0.8", "-b", "4", "-j", "0", "--epochs", "1"]
    trainer = trainer_for([*argv, "--output", str(tmp_path / "run")])
    timm_model = timm.create_model("resnet10t", **TINY_RESNET)
    model = trainer.accelerator.unwrap_model(trainer.models.model)
    assert model.num_classes == timm_model.num_classes == 1000 and trainer.models.num_classes == 1000
    timm_classes = ImageDataset(str(folder)).reader.class_to_idx
    assert trainer.data.bundle.class_names == sorted(timm_classes, key=timm_classes.get) == ["ant", "moth", "zebra"]
    timm_mixup = Mixup(mixup_alpha=0.8, label_smoothing=0.1, num_classes=timm_model.num_classes)
    assert vars(trainer.optimization.mixup) == vars(timm_mixup)

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("num_classes: 3\n")
    for given, line in (
        ([], "num_classes: 1000 (model default, as timm)"),
        (["--num-classes", "5"], "num_classes: 5 (command line)"),
        (["-c", str(recipe)], "num_classes: 3 (recipe)"),
    ):
        shown = trainer_for([*argv, *given, "--output", str(tmp_path / f"shown{len(given)}")])
        model = shown.accelerator.unwrap_model(shown.models.model)
        assert line in startup_block(shown.start, shown.data, model, shown.built.weights)


def test_a_head_smaller_than_the_data_is_refused_naming_both_options(tmp_path, folder):
    with pytest.raises(ConfigError, match=r"has 3 classes and the model's head 2 outputs: pass --num-classes 3 "):
        trainer_for(
            [*TINY, "--data-dir", str(folder), "--num-classes", "2", "-b", "4", "--output", str(tmp_path / "a")]
        )
    trainer = trainer_for(
        [*TINY, "--data-dir", str(folder), "--num-classes", "2", "--first-classes", "2", "-j", "0", "-b", "4"]
        + ["--output", str(tmp_path / "two")]
    )
    assert trainer.data.bundle.class_names == ["ant", "moth"] and trainer.models.num_classes == 2


@pytest.mark.integration
def test_a_timm_run_trained_without_num_classes_resumes(tmp_path, folder):
    """timm's last.pth.tar of a run without --num-classes (a 1000-way head) continues here without it."""
    (tmp_path / "timm").mkdir()
    last = timm_run(tmp_path / "timm", timm_train_args(num_classes=None))
    assert torch.load(last, weights_only=False)["state_dict"]["fc.weight"].shape[0] == 1000
    argv = [*TINY, "--data-dir", str(folder), "--img-size", "32", "-b", "4", "-j", "0", "--epochs", "3"]
    argv += ["--warmup-epochs", "1", "--model-ema", "--model-ema-decay", "0.5", "--resume", str(last)]
    results = engine.run([*argv, "--output", str(tmp_path / "run")], load_families())
    assert results["epochs"] == 3 and results["best_epoch"] == 3


# ------------------------------------------------------------------------------------- the EMA's metric
@pytest.mark.integration
def test_with_an_ema_best_and_the_plateau_schedule_follow_timms_train_py(tmp_path, folder):
    """timm's train.py (commit aa4b5850, lines 1150-1201): with an EMA not forced to the CPU, eval_metrics is the
    EMA's evaluation (line 1174); its --eval-metric value is latest_metric (1191), which CheckpointSaver ranks
    for model_best (1197) and the plateau schedule is stepped with (1201). The oracle replays that branch with
    timm's own CheckpointSaver and scheduler over the evaluations this run logged."""
    output = tmp_path / "run"
    argv = [*TINY, "--data-dir", str(folder), "--img-size", "32", "-b", "4", "-j", "0", "--epochs", "4"]
    argv += ["--model-ema", "--model-ema-decay", "0.5", "--sched", "plateau", "--patience-epochs", "0"]
    argv += ["--eval-metric", "loss", "--warmup-epochs", "0", "--lr", "0.2", "--output", str(output)]
    results = engine.run(argv, load_families())
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    epochs = [record for record in log if "eval_loss" in record]
    assert len(epochs) == 4 and results["metric_of"] == "ema"
    assert any(r["model_eval_loss"] != pytest.approx(r["ema_eval_loss"]) for r in epochs)

    plateau = {"sched": "plateau", "patience_epochs": 0, "eval_metric": "loss", "lr": 0.2, "warmup_epochs": 0}
    args = argparse.Namespace(**{**TIMM_TRAIN_DEFAULTS, **plateau})
    model = timm.create_model("resnet10t", **TINY_RESNET)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scheduler, _ = create_scheduler_v2(optimizer, **scheduler_kwargs(args, decreasing_metric=True))
    (tmp_path / "timm").mkdir()
    saver = CheckpointSaver(model, optimizer, args=args, checkpoint_dir=str(tmp_path / "timm"), decreasing=True)
    for epoch, record in enumerate(epochs):
        eval_metrics = {"loss": record["ema_eval_loss"]}  # the EMA's validate(), line 1174
        latest_metric = eval_metrics["loss"]
        best_metric, best_epoch = saver.save_checkpoint(epoch, metric=latest_metric)
        assert record["eval_loss"] == latest_metric  # summary.csv's eval columns
        scheduler.step(epoch + 1, latest_metric)
        if epoch + 1 < len(epochs):  # the lr the next epoch trains with
            assert epochs[epoch + 1]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12)
    best = min(epochs, key=lambda r: r["eval_loss"])
    assert (results["best_epoch"], best["eval_loss"]) == (best_epoch + 1, best_metric)


# --------------------------------------------------------------------------- refusals and timm's spellings
def test_a_published_args_yaml_is_refused_in_one_message_naming_every_refusal(tmp_path, folder):
    """The MobileOne args.yaml as published (the author's model copy, a resume of an earlier stage, its kwargs),
    on a CPU (device: cpu) with a cooldown that timm applies: the model and the resume named at once."""
    values = yaml.safe_load((PUBLISHED / "mobileone_s1.yaml").read_text())
    values.update(model="custom_mobileone", resume="output/stage1/last.pth.tar", device="cpu", aug_splits=2)
    path = tmp_path / "args.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError) as raised:
        engine.parse_config(["-c", str(path), "--data-dir", str(folder)], models_registered=True)
    message = str(raised.value)
    assert "\n" not in message and "device" not in message
    for named in ("aug_splits: 2", "--resume output/stage1/last.pth.tar: path does not exist", "custom_mobileone"):
        assert named in message


@pytest.mark.integration
def test_a_published_args_yaml_trains_a_step_on_a_tiny_folder(tmp_path, folder):
    """mobileone_s1.yaml (num_classes 1000, device cuda, use_multi_epochs_loader, experiment) as published, on a
    3-class folder at 32 px for one epoch; its run goes to OUTPUT/EXPERIMENT, as timm's train.py writes it.
    channels_last is off: torch's CPU kernels of MobileOne's reparametrizable blocks abort in that layout."""
    argv = ["-c", str(PUBLISHED / "mobileone_s1.yaml"), "--data-dir", str(folder), "--output", str(tmp_path)]
    argv += ["--epochs", "1", "--warmup-epochs", "0", "--input-size", "3", "32", "32", "-b", "4", "-j", "0"]
    argv += ["--no-channels-last"]
    results = engine.run(argv, load_families())
    assert results["epochs"] == 1 and (tmp_path / "my_mobileone_s1" / "results.json").is_file()
    spec = engine.run_model_spec(engine.RunDir(tmp_path / "my_mobileone_s1"))
    assert spec["num_classes"] == 1000


def test_device_keys_and_inert_values_are_accepted_as_timm_takes_them(tmp_path, folder):
    base = [*TINY, "--data-dir", str(folder), "--output", str(tmp_path / "run")]
    plain = parse_config(base)
    for extra in (["--device", "cpu"], ["--device", "cuda"], ["--sched", "step", "--cooldown-epochs", "3"]):
        cfg = parse_config([*base, *extra])
        assert cfg.epochs == plain.epochs
    stepped = parse_config([*base, "--sched", "step", "--cooldown-epochs", "3", "--decay-milestones", "5", "9"])
    assert [w.split(" has no")[0] for w in config_warnings(stepped)] == [
        "--decay-milestones [5, 9]",
        "--cooldown-epochs 3",
    ]


def test_timms_positional_data_path_model_kwargs_clearing_and_experiment(tmp_path, folder):
    """train.py DIR (timm's deprecated positional, data_dir when --data-dir is unset); --model-kwargs with no
    pairs clears a recipe's (timm's ParseKwargs gives {}); a recipe's experiment under --output."""
    assert parse_config([str(folder), *TINY, "--output", str(tmp_path / "a")]).data_dir == str(folder)
    given = parse_config([str(tmp_path), *TINY, "--data-dir", str(folder), "--output", str(tmp_path / "b")])
    assert given.data_dir == str(folder)
    recipe = tmp_path / "args.yaml"
    recipe.write_text(yaml.safe_dump({**TIMM_TRAIN_DEFAULTS, "model_kwargs": {"stem_width": 8}, "experiment": "e1"}))
    cleared = parse_config(["-c", str(recipe), "--model-kwargs", "--data-dir", str(folder), "--output", "out"])
    assert cleared.model_kwargs == {} and Path(cleared.output) == Path("out") / "e1"
    kept = parse_config(["-c", str(recipe), "--data-dir", str(folder)])
    assert kept.model_kwargs == {"stem_width": 8} and Path(kept.output) == Path("output/train/e1")


@pytest.mark.parametrize(
    "command",
    [
        "--model resnet18 --opt lookahead_adamw --lr 1e-3 --weight-decay 0.05",
        "--model resnet18 --opt lookahead_sgd --sched step --decay-epochs 2",
        "--model resnet18 --sched poly --decay-rate 2 --epochs 40 --lr-k-decay 0.8 --cooldown-epochs 3",
        "--model resnet18 --sched tanh --epochs 30 --lr-cycle-limit 2",
        "--model resnet18 --sched wsd --decay-epochs 0.2 --epochs 50 --warmup-epochs 3",
        "--model resnet18 --sched rsqrt --decay-epochs 10 --epochs 60 --sched-on-updates",
    ],
)
def test_lookahead_and_timms_other_schedules_are_built_by_timms_factories(tmp_path, folder, command):
    cfg = parse_config([*shlex.split(command), "--data-dir", str(folder), "--output", str(tmp_path / "run")])
    assert_timms_values(cfg, timm_args(command))


# ----------------------------------------------------------------------------------- timm's output folders
def timm_output_folder(root: Path) -> Path:
    """What timm's train.py leaves in its output folder: last.pth.tar, model_best.pth.tar and args.yaml."""
    model = timm.create_model("resnet10t", num_classes=3, **TINY_RESNET)
    args = argparse.Namespace(
        **{**TIMM_TRAIN_DEFAULTS, "model": "resnet10t", "num_classes": 3, "model_kwargs": TINY_RESNET}
    )
    args.img_size = 32
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    root.mkdir()
    CheckpointSaver(model, optimizer, args=args, checkpoint_dir=str(root)).save_checkpoint(epoch=0, metric=1.0)
    listed = {key: list(value) if isinstance(value, tuple) else value for key, value in TINY_RESNET.items()}
    (root / "args.yaml").write_text(yaml.safe_dump({**vars(args), "model_kwargs": listed}))
    return root


def test_eval_only_predict_and_export_take_timms_output_folder_and_its_args(tmp_path, folder):
    from convbias.cli import export, predict

    timm_out = timm_output_folder(tmp_path / "timm_out")
    data = ["--data-dir", str(folder), "--workers", "0"]
    explicit = engine.run(["--eval-only", str(timm_out / "last.pth.tar"), *TINY, "--num-classes", "3", *data])
    for target in (timm_out, timm_out / "model_best.pth.tar"):
        cfg = parse_config(["--eval-only", str(target), *data])
        assert (cfg.model, cfg.num_classes, cfg.img_size) == ("resnet10t", 3, 32)
        assert engine.run(["--eval-only", str(target), *data], load_families()) == pytest.approx(explicit)

    (tmp_path / "images").mkdir()
    image = next(folder.rglob("*.png"))
    (tmp_path / "images" / image.name).write_bytes(image.read_bytes())
    predictions = {}
    for source in (timm_out, timm_out / "last.pth.tar"):
        output = tmp_path / f"{source.name}.json"
        argv = [str(source), str(tmp_path / "images"), "--topk", "2", "--output", str(output), "--device", "cpu"]
        assert predict.main(argv) == 0
        predictions[source.name] = json.loads(output.read_text())["predictions"]
    assert predictions["timm_out"] == predictions["last.pth.tar"]
    assert export.main([str(timm_out), "--which", "best", "--output", str(tmp_path / "exported")]) == 0
    exported = timm.create_model(f"local-dir:{tmp_path / 'exported'}", pretrained=True)
    assert exported.num_classes == 3
