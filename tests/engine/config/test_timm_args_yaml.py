"""A run's args.yaml, as timm's train.py would have written it, read both ways: timm's parser semantics (its
defaults with the file's values over them, tests/support/timm_train.py's timm_yaml_args) and timm's factories
give the run's optimizer, schedule, transforms and mixup, its keys are exactly timm's, and ``-c`` reads it back to
the same run. Keys of an args file that timm's train.py takes and never reads (a fork's, the runtime attributes of
its saved arguments) are ignored with one warning; a typo of an option's name is refused; this package's own
recipes stay strict."""

from __future__ import annotations

import argparse

import pytest
import timm
import yaml
from PIL import Image
from support.timm_train import assert_timms_values, timm_yaml_args
from timm.utils import CheckpointSaver

from convbias.base.errors import ConfigError
from convbias.base.run_layout import CONFIG_FILE, TIMM_ARGS_FILE, TIMM_ARGS_MARKER
from convbias.engine import parse_config
from convbias.engine.config.parsing import config_warnings
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.engine.loop.records import write_timm_args
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")

# options that timm's train.py holds under other keys: mixed precision (amp), repeated augmentation (aug_repeats),
# the starting weights (initial_checkpoint), evaluation batch and interval, the EMA that is not the metric
RENAMED = (
    "--model resnet18 --opt adamw --lr-base 5e-4 --mixup 0.8 --cutmix 1.0 --sched-on-updates --mixed-precision fp16 "
    "--repeated-aug 3 --eval-batch-size 24 --eval-interval 2 --model-ema --no-model-ema-metric --compile "
    "--compile-mode max-autotune --img-size 160 --epochs 40 --warmup-epochs 2 -b 64"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    for label in range(3):
        (root / f"c{label}").mkdir()
        for index in range(4):
            Image.new("RGB", (20, 16), (40 * label, 20 * index, 100)).save(root / f"c{label}" / f"{index}.jpg")
    return root


def written(cfg, tmp_path, initial_checkpoint=None) -> tuple[dict, list[str]]:
    """The args.yaml train.py writes for ``cfg``: its values and its comment lines."""
    path = tmp_path / TIMM_ARGS_FILE
    write_timm_args(cfg, path, initial_checkpoint)
    text = path.read_text()
    return yaml.safe_load(text), [line for line in text.splitlines() if line.startswith("#")]


def test_the_args_yaml_is_timms_for_the_same_run_and_reads_back_to_it(tmp_path, folder):
    weights, pretrained = tmp_path / "start.safetensors", tmp_path / "pretrained.safetensors"
    weights.write_bytes(b""), pretrained.write_bytes(b"")
    argv = [*RENAMED.split(), "--checkpoint", str(weights), "--pretrained-file", str(pretrained)]
    cfg = parse_config([*argv, "--data-dir", str(folder), "--output", str(tmp_path / "runs" / "r1")])
    values, comments = written(cfg, tmp_path)
    assert comments == [TIMM_ARGS_MARKER, "# timm's train.py expresses every option of this run"]
    assert list(values) == sorted(TIMM_TRAIN_DEFAULTS)  # timm's keys, in the order its yaml.safe_dump writes them
    args = timm_yaml_args(values)  # what timm's train.py parses from it
    assert_timms_values(cfg, args)  # lr, every parameter's optimizer values, schedule, data config, transforms, mixup
    assert (args.amp, args.amp_dtype, args.aug_repeats) == (True, "float16", 3)  # timm's native AMP, its sampler
    assert (args.initial_checkpoint, args.pretrained, args.pretrained_path) == (str(weights), True, str(pretrained))
    assert (args.validation_batch_size, args.val_interval, args.model_ema, args.model_ema_force_cpu) == (24, 2, 1, 1)
    assert (args.torchcompile, args.torchcompile_mode) == ("inductor", "max-autotune")
    assert (args.output, args.experiment, args.dataset, args.data_dir) == (
        str(tmp_path / "runs"),
        "r1",
        "",
        str(folder),
    )
    assert args.class_map == "" and args.resume == ""  # timm's "unset"
    again = parse_config(["-c", str(tmp_path / TIMM_ARGS_FILE)])
    assert again.replace(config=None) == cfg.replace(config=None)


def test_what_timm_cannot_express_is_listed_at_the_top(tmp_path, folder):
    cfg = parse_config(
        ["--model", "resnet18", "--data-dir", str(folder), "--train-fraction", "0.5", "--param-group-lr", "bias=0.1",
         "--scale-epochs", "--epochs", "3", "--no-skip-unreadable", "--output", str(tmp_path / "run")]
    )  # fmt: skip
    values, comments = written(cfg, tmp_path)
    assert comments[1] == (
        f"# what timm's train.py cannot express ({CONFIG_FILE} has it): --train-fraction 0.5; "
        "--no-skip-unreadable; --param-group-lr bias=0.1"
    )
    assert values["epochs"] == 6 and values["warmup_epochs"] == 10  # --scale-epochs: as timm's train.py runs them
    load_families()  # the package's convit_tiny, not timm's
    digits = parse_config(["--model", "convit_tiny", "--dataset", "digits", "--output", str(tmp_path / "d")])
    values, comments = written(digits.resolved(img_size=32), tmp_path)
    assert "--dataset digits (this engine's embedded data set)" in comments[1]
    assert (
        "--model convit_tiny (registered by convit.models: timm's train.py needs that module imported)" in comments[1]
    )
    assert (values["img_size"], values["mean"], values["std"]) == (32, [0.3053], [0.3759])  # the data set's, resolved


# ------------------------------------------------------------------------- keys that timm's train.py ignores
FORK_KEYS = {"DDP": True, "K": 5, "embed_dim": [48, 96], "port": 29500}  # the published iFormer args files' own


def timm_args_file(tmp_path, folder, name: str = "args.yaml", **keys) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**TIMM_TRAIN_DEFAULTS, "model": "resnet18", "data_dir": str(folder), **keys}))
    return str(path)


def test_a_forks_keys_are_ignored_with_one_warning_as_timm_ignores_them(tmp_path, folder):
    output = ["--output", str(tmp_path / "run")]
    cfg = parse_config(["-c", timm_args_file(tmp_path, folder, "fork.yaml", **FORK_KEYS), *output])
    plain = parse_config(["-c", timm_args_file(tmp_path, folder), *output])
    assert cfg.replace(config=None) == plain.replace(config=None)
    assert [w for w in config_warnings(cfg) if "no option reads" in w] == [
        f"{tmp_path / 'fork.yaml'}: 4 keys that no option reads (a fork's own, or attributes timm's train.py sets at "
        "run time): DDP, K, embed_dim, port; ignored, as timm's train.py ignores them"
    ]
    assert not any("no option reads" in w for w in config_warnings(plain))


def test_a_typo_of_an_option_in_an_args_file_is_still_refused_naming_it(tmp_path, folder):
    path = timm_args_file(tmp_path, folder, smothing=0.2, DDP=True)
    with pytest.raises(ConfigError, match=r"smothing: unknown option \(did you mean smoothing\?\)") as refused:
        parse_config(["-c", path, "--output", str(tmp_path / "run")])
    assert "DDP" not in str(refused.value)


def test_the_packages_own_recipes_stay_strict(tmp_path, repo):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"_base_: {repo / 'configs' / 'recipes' / 'deit.yaml'}\nmodel: convit_tiny\nDDP: true\n")
    with pytest.raises(ConfigError, match="DDP: unknown option"):
        parse_config(["-c", str(recipe), "--output", str(tmp_path / "run")])


def test_the_args_yaml_export_writes_from_a_timm_checkpoint_reads_with_its_runtime_attributes(tmp_path, folder):
    """timm's train.py sets prefetcher, distributed, world_size and rank on its arguments, which its checkpoints
    save: convbias-export's args.yaml holds them, and -c takes it, as timm's train.py would."""
    from convbias.cli.export import main as export

    small = {"channels": (8, 16, 32, 64), "stem_width": 8}
    model = timm.create_model("resnet10t", num_classes=3, **small)
    runtime = dict(prefetcher=True, distributed=False, world_size=1, rank=0)  # as timm's main() sets them
    args = argparse.Namespace(**{**TIMM_TRAIN_DEFAULTS, "model": "resnet10t", "num_classes": 3, "model_kwargs": small})
    vars(args).update(runtime)
    saver = CheckpointSaver(model, timm.optim.create_optimizer_v2(model), args=args, checkpoint_dir=str(tmp_path))
    saver.save_checkpoint(epoch=0, metric=1.0)
    assert export([str(tmp_path / "last.pth.tar"), "--output", str(tmp_path / "exported")]) == 0
    exported = tmp_path / "exported" / TIMM_ARGS_FILE
    assert runtime.items() <= yaml.safe_load(exported.read_text()).items()
    cfg = parse_config(["-c", str(exported), "--data-dir", str(folder), "--output", str(tmp_path / "run")])
    assert (cfg.model, cfg.num_classes) == ("resnet10t", 3)
    assert [w.split(": ", 2)[2] for w in config_warnings(cfg) if "no option reads" in w] == [
        "prefetcher, distributed, world_size, rank; ignored, as timm's train.py ignores them"
    ]
