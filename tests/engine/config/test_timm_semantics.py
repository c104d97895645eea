"""What a timm command line or args.yaml means here, as in timm's train.py and validate.py: the folder at
--data-dir, the model's data config, parsed values, spellings and keys of older timm versions."""

import pytest
import yaml
from PIL import Image
from timm.data import resolve_data_config
from timm.models import get_pretrained_cfg

from convbias.base.errors import ConfigError
from convbias.engine import parse_config
from convbias.engine.config.options import Config
from convbias.engine.data.factory import build_datasets, input_format

CLASSES, PER_CLASS = ("ant", "bee", "cat"), 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """DIR/<class>/<image>: 3 classes of 10 images, no split folders (timm's validate.py's --data-dir DIR/val)."""
    root = tmp_path_factory.mktemp("val")
    for label, name in enumerate(CLASSES):
        (root / name).mkdir()
        for index in range(PER_CLASS):
            Image.new("RGB", (12, 10), (80 * label, 10 * index, 50)).save(root / name / f"{index}.jpg")
    return root


def parse(tmp_path, *argv: str) -> Config:
    return parse_config([*argv, "--output", str(tmp_path / "run")])


def test_data_dir_alone_is_timms_folder_dataset(tmp_path, folder):
    for argv in (["--data-dir", str(folder)], ["--dataset", "", "--data-dir", str(folder)]):
        cfg = parse(tmp_path, *argv)
        assert cfg.dataset == "folder"
        assert build_datasets(cfg.replace(workers=0)).class_names == list(CLASSES)


def test_eval_only_scores_every_image_of_a_folder_without_splits(tmp_path, folder):
    trained = build_datasets(Config(dataset="folder", data_dir=str(folder)))
    evaluated = build_datasets(Config(dataset="folder", data_dir=str(folder), eval_only=True))
    assert len(trained.val) == 3 and len(evaluated.val) == len(CLASSES) * PER_CLASS  # a 10% hold-out vs all


def test_first_classes_keeps_the_folders_first_classes_or_a_class_maps(tmp_path, folder):
    assert build_datasets(Config(dataset="folder", data_dir=str(folder), first_classes=2)).class_names == ["ant", "bee"]
    (tmp_path / "two.txt").write_text("cat\nant\n")
    mapped = build_datasets(
        Config(dataset="folder", data_dir=str(folder), first_classes=2, class_map=str(tmp_path / "two.txt"))
    )
    assert mapped.class_names == ["cat", "ant"]


@pytest.mark.parametrize("model", ["resnet18", "efficientnet_b2", "vit_base_patch16_384"])
def test_the_models_pretrained_config_sets_the_data_config_as_timm_resolves_it(tmp_path, folder, model):
    cfg = parse(tmp_path, "--data-dir", str(folder), "--model", model)
    expected = resolve_data_config({}, pretrained_cfg=get_pretrained_cfg(model).to_dict())
    shape = input_format(cfg)
    assert (3, shape.img_size, shape.img_size) == expected["input_size"]
    assert (shape.crop_pct, shape.interpolation) == (expected["crop_pct"], expected["interpolation"])
    assert (shape.mean, shape.std) == (tuple(expected["mean"]), tuple(expected["std"]))
    given = input_format(parse(tmp_path, "--data-dir", str(folder), "--model", model, "--crop-pct", "0.5"))
    assert given.crop_pct == 0.5 and given.sources["crop_pct"] == "set"


def test_a_runs_image_size_is_the_models_as_timm_resolves_it_and_credited_to_it(tmp_path, folder):
    """Without --img-size a folder run trains at the model's input size (efficientnet_b2's 256, not 224), the size
    timm's resolve_data_config gives its train.py, and the start-up block names where it came from."""
    from convbias.engine.config.parsing import option_source
    from convbias.engine.loop.start import start_run

    cfg = parse(tmp_path, "--data-dir", str(folder), "--model", "efficientnet_b2", "--workers", "0")
    resolved = start_run(cfg, None, None).cfg
    expected = resolve_data_config({}, pretrained_cfg=get_pretrained_cfg("efficientnet_b2").to_dict())
    assert (3, resolved.img_size, resolved.img_size) == expected["input_size"] == (3, 256, 256)
    assert option_source(resolved, "img_size") == "model efficientnet_b2's config"


def test_values_parse_as_timm_parses_them(tmp_path, folder):
    cfg = parse(tmp_path, "--data-dir", str(folder), "--model-kwargs", "dims=(32,64)", "flag=True", "name=abc")
    assert cfg.model_kwargs == {"dims": (32, 64), "flag": True, "name": "abc"}  # ast.literal_eval, else a string
    recipe = tmp_path / "args.yaml"
    recipe.write_text(yaml.safe_dump({"model": "resnet18", "color_jitter": None, "aug_repeats": 0, "amp": False}))
    assert parse(tmp_path, "-c", str(recipe), "--data-dir", str(folder)).color_jitter is None  # timm's None: off


def test_timms_spellings_and_older_keys(tmp_path, folder):
    cfg = parse(tmp_path, "--data-dir", str(folder), "-b", "8", "-j", "0", "-vb", "4", "--dr", "0.5", "--amp",
                "--experiment", "x", "--sched-on", "--drop-connect", "0.2")  # fmt: skip
    assert (cfg.batch_size, cfg.workers, cfg.eval_batch_size, cfg.decay_rate) == (8, 0, 4, 0.5)
    assert cfg.mixed_precision == "fp16" and cfg.output.endswith(
        "run/x"
    )  # timm: OUTPUT/EXPERIMENT and cfg.sched_on_updates
    assert cfg.drop_path == 0.2  # as older timm passed drop_connect_rate
    recipe = tmp_path / "old.yaml"
    recipe.write_text(
        yaml.safe_dump({"model": "resnet18", "apex_amp": False, "native_amp": False, "amp_impl": "native"})
    )
    assert parse(tmp_path, "-c", str(recipe), "--data-dir", str(folder)).model == "resnet18"
    recipe.write_text(yaml.safe_dump({"model": "resnet18", "apex_amp": True, "batch_sise": 8, "aug_splits": 3}))
    with pytest.raises(ConfigError) as error:
        parse(tmp_path, "-c", str(recipe), "--jsd", "--frobnicate", "--data-dir", str(folder))
    message = str(error.value)  # every problem at once, each with its reason, on one line
    assert "\n" not in message
    for part in (
        "apex_amp: True (an option of older timm train.py versions; accepted at False)",
        "batch_sise: unknown option (did you mean batch_size",
        "aug_splits: 3 (JSD loss and AugMix splits are not implemented)",
        "--frobnicate: unknown option",
        "--jsd-loss: True (JSD loss and AugMix splits are not implemented)",  # --jsd: argparse's prefix, as timm
    ):
        assert part in message, part
    with pytest.raises(ConfigError, match="ambiguous option: --lr-cy"):
        parse(tmp_path, "--data-dir", str(folder), "--lr-cy", "2")
