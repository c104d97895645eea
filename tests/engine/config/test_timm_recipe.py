"""timm's args.yaml (written by timm's own parser, tests/data/timm_train_args.yaml) as a train.py recipe."""

from pathlib import Path

import pytest
import yaml
from support import DATA, REPO

from convbias.cli import train
from convbias.engine import RunDir, parse_config
from convbias.engine.config.derived import scaled_lr
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS

ARGS_YAML = DATA / "timm_train_args.yaml"
DEIT_RECIPE = REPO / "configs" / "recipes" / "deit.yaml"


def args_yaml(tmp_path: Path, **changes) -> Path:
    values = {**yaml.safe_load(ARGS_YAML.read_text()), **changes}
    path = tmp_path / "args.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_the_file_holds_every_key_timms_parser_writes():
    assert set(yaml.safe_load(ARGS_YAML.read_text())) == set(TIMM_TRAIN_DEFAULTS) and len(TIMM_TRAIN_DEFAULTS) == 172


def test_timms_defaults_become_its_recipe(tmp_path):
    cfg = parse_config(["-c", str(ARGS_YAML), "--output", str(tmp_path / "run")])
    # timm's values where both engines have the option (timm's defaults, not the DeiT recipe's)
    assert (cfg.model, cfg.batch_size, cfg.opt, cfg.weight_decay, cfg.seed) == ("resnet50", 128, "sgd", 2e-5, 42)
    assert (cfg.lr_base, cfg.lr_base_size, cfg.min_lr, cfg.warmup_lr) == (0.1, 256, 0.0, 1e-5)
    assert cfg.aa is None and cfg.reprob == 0 and cfg.mixup == 0 and cfg.cutmix == 0
    assert cfg.dataset == "folder" and cfg.data_dir is None  # timm's '': class folders at --data-dir
    # timm's "unset": the model's stochastic depth, no repeated augmentation, fp32, no compile
    assert (cfg.drop_path, cfg.repeated_aug, cfg.mixed_precision, cfg.compile) == (None, 1, "no", False)


def timms_lr(lr_base: float, lr_base_size: int, lr_base_scale: str, opt: str, global_batch: int) -> float:
    """timm's train.py: the lr from --lr-base when --lr is unset (its main(), as written there)."""
    batch_ratio = global_batch / lr_base_size
    if not lr_base_scale:
        lr_base_scale = "sqrt" if any(o in opt.lower() for o in ("ada", "lamb")) else "linear"
    if lr_base_scale == "sqrt":
        batch_ratio = batch_ratio**0.5
    return lr_base * batch_ratio


@pytest.mark.parametrize("opt", ["sgd", "adamw", "lamb"])
@pytest.mark.parametrize("scale", ["", "sqrt", "linear"])
def test_an_args_yaml_scales_the_lr_as_timm(tmp_path, opt, scale):
    """timm's lr_base_scale ('' picks sqrt for Adam-family and LAMB optimizers) from an args.yaml with lr unset:
    the lr timm's train.py computes, for a global batch of 1024 (the rule named as the startup line prints it);
    the command line without a recipe gets the same (timm's defaults); the DeiT recipe file keeps DeiT's linear rule."""
    cfg = parse_config(["-c", str(args_yaml(tmp_path, opt=opt, lr_base_scale=scale)), "--output", str(tmp_path)])
    assert cfg.lr is None and cfg.lr_base_scale == scale
    lr, rule = scaled_lr(cfg, 1024)
    assert lr == pytest.approx(timms_lr(0.1, 256, scale, opt, 1024), rel=1e-12)
    assert ("sqrt(" in rule) == (scale == "sqrt" or (scale == "" and opt != "sgd"))
    own = parse_config(["--model", "vanilla_cnn", "--opt", opt, "--output", str(tmp_path)])
    assert scaled_lr(own, 1024)[0] == pytest.approx(timms_lr(0.1, 256, "", opt, 1024), rel=1e-12)
    deit = parse_config(["-c", str(DEIT_RECIPE), "--model", "vanilla_cnn", "--opt", opt, "--output", str(tmp_path)])
    assert scaled_lr(deit, 1024)[0] == pytest.approx(5e-4 * 1024 / 512)


def test_an_args_yaml_keeps_timms_empty_choices(tmp_path):
    """'' is a value where it is one of an option's choices: --dist-bn '' (no BN statistics sync) and
    --lr-base-scale '' (timm's pick), not this engine's defaults (reduce, linear)."""
    cfg = parse_config(["-c", str(args_yaml(tmp_path, dist_bn="")), "--output", str(tmp_path / "run")])
    assert (cfg.dist_bn, cfg.lr_base_scale) == ("", "")


@pytest.mark.integration
def test_an_args_yaml_trains(tmp_path, cli_argv):
    """Every key of timm's args.yaml in the recipe; the command line picks a tiny model, data and length."""
    argv = ["-c", str(ARGS_YAML), *cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, train_fraction=0.1)]
    argv += ["--epochs", "1", "--batch-size", "16", "--output", str(tmp_path / "run")]
    assert train.main(argv) == 0
    results = RunDir(tmp_path / "run").results()
    assert results["epochs"] == 1 and RunDir(tmp_path / "run").run_config().opt == "sgd"


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(amp=True, amp_dtype="bfloat16"), dict(mixed_precision="bf16")),
        (dict(amp=True), dict(mixed_precision="fp16")),
        (dict(torchcompile="aot_eager"), dict(compile=True, compile_backend="aot_eager")),
        (dict(aug_repeats=3), dict(repeated_aug=3)),
        (dict(validation_batch_size=7), dict(eval_batch_size=7)),
        (dict(val_interval=2), dict(eval_interval=2)),
        (dict(experiment="exp1", output="out"), dict(output="out/exp1")),
        (dict(drop_path=0.2, aa="rand-m9-mstd0.5"), dict(drop_path=0.2, aa="rand-m9-mstd0.5")),
    ],
)
def test_timm_spellings_are_translated(tmp_path, changes, expected):
    cfg = parse_config(["-c", str(args_yaml(tmp_path, **changes))])
    assert {key: getattr(cfg, key) for key in expected} == expected


def test_active_timm_options_this_engine_does_not_apply_are_all_named_in_one_line(tmp_path, capsys):
    recipe = args_yaml(tmp_path, jsd_loss=True, torchscript=True, tta=2, naflex_loader=True)
    code = train.main(["-c", str(recipe), "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not (tmp_path / "run").exists()
    for named in (
        "jsd_loss: True (JSD loss",
        "torchscript: True (TorchScript",
        "tta: 2 (test-time augmentation",
        "naflex_loader: True",
    ):
        assert named in err[0], named


def test_a_key_of_neither_engine_is_unknown(tmp_path):
    recipe = args_yaml(tmp_path, warmup_epoch=3)
    with pytest.raises(ValueError, match=r"warmup_epoch: unknown option .*did you mean warmup_epochs"):
        parse_config(["-c", str(recipe)])
