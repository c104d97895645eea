"""T-CNN recipes: the YAML files are valid engine configs with the paper's values, and train.py
fine-tunes a T-CNN from a local pretrained file and reparametrizes a CNN during training."""

import json

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from support import REPO

from convbias.cli import train
from convbias.engine import parse_config

pytestmark = pytest.mark.integration

CONFIGS = REPO / "configs"


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "resnet18.safetensors"
    torch.manual_seed(0)
    save_file(timm.create_model("resnet18").state_dict(), str(path))
    return path


def test_recipes_hold_the_paper_values(resnet18_file, tmp_path):
    paths = ["--pretrained-file", str(resnet18_file), "--data-dir", str(tmp_path)]
    finetune = parse_config(["-c", str(CONFIGS / "train" / "tcnn_finetune.yaml"), *paths])
    assert (finetune.model, finetune.opt, finetune.lr, finetune.epochs, finetune.sched) == (
        "tcnn_resnetrs50",
        "adamw",
        1e-4,
        50,
        "cosine",
    )
    assert finetune.param_group_lr == {"gating_param": 0.1}
    assert finetune.img_size == 224 > timm.get_pretrained_cfg("resnetrs50").input_size[-1]  # above pretraining
    assert (finetune.drop_path, finetune.mixup, finetune.cutmix, finetune.aa) == (0.1, 0.8, 1.0, "rand-m9-mstd0.5-inc1")
    # stated in the recipe, left at their plain setting: one lr (no layer decay), per-process BatchNorm, the
    # running statistics averaged before evaluation (timm's default), the default memory layout
    plain = {"layer_decay": None, "sync_bn": False, "dist_bn": "reduce", "channels_last": False}
    assert {k: getattr(finetune, k) for k in plain} == plain
    baseline = parse_config(["-c", str(CONFIGS / "train" / "tcnn_finetune_without_sa.yaml"), *paths])
    assert baseline.model == "resnetrs50" and baseline.param_group_lr == {}
    assert {
        k: v for k, v in baseline.to_dict().items() if k not in ("model", "param_group_lr", "output", "config")
    } == {k: v for k, v in finetune.to_dict().items() if k not in ("model", "param_group_lr", "output", "config")}
    reparam = parse_config(["-c", str(CONFIGS / "train" / "tcnn_reparametrize.yaml"), "--data-dir", str(tmp_path)])
    assert (reparam.model, reparam.opt, reparam.epochs, reparam.reparametrize_at_epoch) == ("resnet50", "sgd", 400, 100)
    assert reparam.reparametrize_kwargs == {"init": "paper", "keep_stride": False} and reparam.reparametrize == "tcnn"


SMALL_RUN = [
    "--dataset",
    "digits",
    "--img-size",
    "32",
    "--batch-size",
    "32",
    "--train-fraction",
    "0.1",
    "--no-aug",
    "--repeated-aug",
    "1",
    "--workers",
    "0",
    "--warmup-epochs",
    "0",
    "--no-diagnostics",
]


def test_train_py_fine_tunes_a_tcnn_from_a_local_pretrained_file(resnet18_file, tmp_path):
    results = train.run(
        [
            "--model",
            "tcnn_resnet18",
            "--pretrained",
            "--pretrained-file",
            str(resnet18_file),
            "--epochs",
            "1",
            "--lr",
            "1e-4",
            "--param-group-lr",
            "gating_param=0.1",
            "--save-epochs",
            "0",
            "--output",
            str(tmp_path / "run"),
            *SMALL_RUN,
        ]
    )
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == results
    # the run started from the file's CNN: kept layers as they were, each GPSA output projection holds its filter
    cnn, start = load_file(str(resnet18_file)), load_file(str(tmp_path / "run" / "checkpoints" / "epoch_0.safetensors"))
    assert torch.equal(start["layer3.1.conv2.weight"], cnn["layer3.1.conv2.weight"])
    filter_taps = cnn["layer4.0.conv2.weight"].permute(0, 2, 3, 1).reshape(512, -1)  # (C_out, 9 taps x C_in)
    assert torch.equal(start["layer4.0.conv2.proj.weight"], filter_taps)
