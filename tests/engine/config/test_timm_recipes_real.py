"""Real timm recipes read as timm's train.py reads them: the training commands of timm's documentation
(hfdocs/source/training_script.mdx, timm commit aa4b5850), with only the data path changed, parsed here and
compared with what timm's own factories build from the same arguments (create_optimizer_v2 with
optimizer_kwargs, create_scheduler_v2 with scheduler_kwargs, resolve_data_config, create_transform, Mixup).

timm's side: its train.py's defaults (TIMM_TRAIN_DEFAULTS, generated from its parser) with the recipe's
values read token by token, as its argparse would (its short flags -b, -j; lists for nargs='+' options): tests/support/
timm_train.py's timm_args and assert_timms_values.
"""

import shlex

import pytest
import yaml
from PIL import Image
from support import DATA
from support.timm_train import NUM_CLASSES, assert_timms_values, timm_args, timm_yaml_args

from convbias.base.errors import ConfigError
from convbias.cli import train
from convbias.engine import parse_config

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
