"""``--eval-only`` of timm's output folder gives timm's validate.py's numbers: by default at the model's
test_input_size and test_crop_pct (resnet10t: 224 px and 0.95, where train.py trains at 176 and 0.875),
``--use-train-size`` at train.py's, ``--use-ema`` on the EMA's weights; the start-up lines say which. The oracle is
validate.py's ``validate`` (at TIMM_TRAIN_COMMIT) on one process: timm's create_model, load_checkpoint,
resolve_data_config(use_test_size=not use_train_size), create_dataset, create_loader and accuracy."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from timm.data import create_dataset, create_loader, resolve_data_config
from timm.models import load_checkpoint
from timm.utils import AverageMeter, CheckpointSaver, accuracy

from convbias import engine
from convbias.base.errors import ConfigError
from convbias.engine.config.parsing import option_source
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = {"channels": (8, 16, 32, 64), "stem_width": 8}  # resnet10t's layers at 1/8 of its width


@pytest.fixture(scope="module")
def timm_output(tmp_path_factory):
    """timm's output folder (model_best.pth.tar, last.pth.tar with an EMA, args.yaml at timm's input defaults) and
    a folder of 3 classes of 4 noise images to evaluate on."""
    root = tmp_path_factory.mktemp("timm")
    rng = np.random.default_rng(0)
    for label in range(3):
        (root / "data" / f"c{label}").mkdir(parents=True)
        for index in range(4):
            pixels = rng.integers(0, 256, (48 + 4 * index, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "data" / f"c{label}" / f"{index}.png")
    torch.manual_seed(0)
    model, ema = (timm.create_model("resnet10t", num_classes=3, **SMALL) for _ in range(2))
    for module in (model, ema):  # BatchNorm statistics of their own, so that every crop gives other logits
        for norm in (m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            norm.running_var.uniform_(0.5, 2.0), norm.running_mean.normal_(0, 0.2)
        with torch.no_grad():
            module.get_classifier().weight.mul_(50.0)  # confident logits: the size and crop show in the loss
    args = argparse.Namespace(**{**TIMM_TRAIN_DEFAULTS, "model": "resnet10t", "num_classes": 3, "model_kwargs": SMALL})
    output = root / "output"
    output.mkdir()
    saver = CheckpointSaver(model, torch.optim.SGD(model.parameters(), lr=0.1), args=args, model_ema=ema,
                            checkpoint_dir=str(output))  # fmt: skip
    saver.save_checkpoint(epoch=0, metric=1.0)
    (output / "args.yaml").write_text(yaml.safe_dump({**vars(args), "model_kwargs": {"channels": [8, 16, 32, 64],
                                                                                     "stem_width": 8}}))  # fmt: skip
    return output, root / "data"


def timm_validate(checkpoint, data_dir, use_ema: bool, use_train_size: bool) -> dict[str, float]:
    """timm's validate.py's ``validate`` for ``validate.py DIR --model resnet10t --num-classes 3 --model-kwargs ...
    --checkpoint FILE [--use-ema] [--use-train-size] -j 0 --device cpu``."""
    args = argparse.Namespace(model="resnet10t", num_classes=3, model_kwargs=SMALL, img_size=None, input_size=None,
                              crop_pct=None, mean=None, std=None, interpolation="", crop_mode=None)  # fmt: skip
    model = timm.create_model(args.model, pretrained=False, num_classes=args.num_classes, in_chans=3,
                              global_pool=None, **args.model_kwargs)  # fmt: skip
    load_checkpoint(model, str(checkpoint), use_ema)
    data_config = resolve_data_config(vars(args), model=model, use_test_size=not use_train_size)
    dataset = create_dataset(root=str(data_dir), name="", split="validation", input_img_mode="RGB")
    loader = create_loader(
        dataset, input_size=data_config["input_size"], batch_size=256, use_prefetcher=False,
        interpolation=data_config["interpolation"], mean=data_config["mean"], std=data_config["std"], num_workers=0,
        crop_pct=data_config["crop_pct"], crop_mode=data_config["crop_mode"], device=torch.device("cpu"),
    )  # fmt: skip
    criterion, losses, top1, top5 = torch.nn.CrossEntropyLoss(), AverageMeter(), AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for images, target in loader:
            output = model(images)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(criterion(output, target).item(), images.size(0))
            top1.update(acc1.item(), images.size(0)), top5.update(acc5.item(), images.size(0))
    return {"eval_top1": top1.avg, "eval_top5": top5.avg, "eval_loss": losses.avg, "size": data_config["input_size"]}


@pytest.mark.parametrize(
    "flags, line",
    [
        ((), "input: 224 [model resnet10t's test_input_size] px, crop 0.95 [model resnet10t's test_crop_pct]"),
        (("--use-ema",), "input: 224 [model resnet10t's test_input_size] px"),
        (("--use-train-size",), "input: 176 [model resnet10t's config] px, crop 0.875 [model resnet10t's config]"),
    ],
    ids=["validate", "use_ema", "use_train_size"],
)
def test_eval_only_of_timms_folder_gives_validate_pys_numbers(timm_output, capsys, flags, line):
    output, data = timm_output
    metrics = engine.run(["--eval-only", str(output), "--data-dir", str(data), "--workers", "0", *flags],
                         load_families())  # fmt: skip
    expected = timm_validate(output / "last.pth.tar", data, "--use-ema" in flags, "--use-train-size" in flags)
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-4)
    other = timm_validate(output / "last.pth.tar", data, "--use-ema" in flags, "--use-train-size" not in flags)
    assert other["eval_loss"] != pytest.approx(expected["eval_loss"], rel=1e-3)  # the other size and crop differ
    assert (metrics["eval_top1"], metrics["eval_top5"]) == pytest.approx((expected["eval_top1"], expected["eval_top5"]))
    printed = capsys.readouterr().out.splitlines()
    weights = "its EMA's weights (--use-ema)" if flags == ("--use-ema",) else "its model weights"
    assert printed[0].startswith(f"evaluating: {output / 'last.pth.tar'}") and weights in printed[0]
    assert printed[1].startswith(line)
    rule = "train.py's size and crop (--use-train-size)" if "--use-train-size" in flags else "timm's validate.py"
    assert f"; as {rule}" in printed[1]


def test_use_ema_and_use_train_size_are_for_eval_only_and_a_file_with_an_ema(timm_output, tmp_path):
    data = timm_output[1]
    with pytest.raises(ConfigError, match="^--use-ema has no effect without --eval-only"):
        engine.parse_config(["--model", "resnet10t", "--use-ema", "--output", str(tmp_path / "run")])
    weights = tmp_path / "weights.safetensors"
    from safetensors.torch import save_file

    save_file(timm.create_model("resnet10t", num_classes=3, **SMALL).state_dict(), weights)
    argv = ["--eval-only", str(weights), "--model", "resnet10t", "--num-classes", "3", "--data-dir", str(data),
            "--use-ema", "--workers", "0", "--model-kwargs", "channels=(8,16,32,64)", "stem_width=8"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"--use-ema takes the EMA of a run directory's checkpoint or of timm's"):
        engine.run(argv, load_families())


def test_the_options_taken_from_timms_folder_or_file_are_credited_to_it(timm_output, tmp_path):
    """--eval-only of timm's folder takes the model from its args.yaml, of one of its checkpoints from the args saved
    in it, of a run from its config.yaml: the start-up block names which."""
    output, data = timm_output
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "resnet10t", "num_classes": 3}))
    for target, source in (
        (output, "the evaluated folder's args.yaml"),
        (output / "last.pth.tar", "the evaluated checkpoint's saved args"),
        (run, "the evaluated run's config.yaml"),
    ):
        cfg = engine.parse_config(["--eval-only", str(target), "--data-dir", str(data)])
        assert (cfg.model, option_source(cfg, "model"), option_source(cfg, "num_classes")) == (
            "resnet10t",
            source,
            source,
        )
