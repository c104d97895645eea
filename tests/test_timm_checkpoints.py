"""timm's train.py checkpoints (written by timm's own CheckpointSaver: state_dict, optimizer, state_dict_ema,
epoch, arch, args as an argparse.Namespace, version, metric) load as weights, safely."""

import argparse
import pickle

import pytest
import timm
import torch
from timm.utils import CheckpointSaver

from convbias.errors import ConfigError
from convbias.weights import load_weights, read_state_dict


@pytest.fixture
def folder_of_three(tmp_path):
    """DIR/<class>/<image>: 3 classes of 2 images."""
    from PIL import Image

    for label in range(3):
        (tmp_path / "data" / f"c{label}").mkdir(parents=True)
        for index in range(2):
            Image.new("RGB", (16, 16), (90 * label, 40 * index, 0)).save(
                tmp_path / "data" / f"c{label}" / f"{index}.png"
            )
    return tmp_path / "data"


def timm_checkpoint(tmp_path):
    """model_best.pth.tar and last.pth.tar as timm's train.py writes them, for a tiny resnet with an EMA."""
    model = timm.create_model("resnet10t", num_classes=3)
    ema = timm.create_model("resnet10t", num_classes=3)
    args = argparse.Namespace(model="resnet10t", lr=0.1, model_kwargs={}, scale=[0.08, 1.0], aa=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(tmp_path))
    saver.save_checkpoint(epoch=0, metric=12.5)
    return model, ema


def test_a_timm_checkpoint_loads_its_models_weights(tmp_path):
    model, _ = timm_checkpoint(tmp_path)
    for name in ("model_best.pth.tar", "last.pth.tar"):
        weights = read_state_dict(tmp_path / name)
        assert weights.keys() == model.state_dict().keys()
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    fresh = timm.create_model("resnet10t", num_classes=3)
    load_weights(fresh, tmp_path / "model_best.pth.tar")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


class Payload:
    """An object that runs code when unpickled."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('executed')",))


def test_a_torch_file_with_other_objects_is_refused_unexecuted(tmp_path):
    path = tmp_path / "evil.pth.tar"
    torch.save(
        {"state_dict": {"w": torch.zeros(1)}, "payload": Payload()}, path, pickle_protocol=pickle.DEFAULT_PROTOCOL
    )
    with pytest.raises(ConfigError, match="weights_only=True .* it was not unpickled"):
        read_state_dict(path)


def test_a_timm_checkpoint_starts_a_run_and_is_evaluated_but_not_resumed(tmp_path, folder_of_three):
    from convbias import engine
    from convbias.engine.config import parse_config
    from convbias.families import load_families

    timm_checkpoint(tmp_path)
    best = str(tmp_path / "model_best.pth.tar")
    base = ["--model", "resnet10t", "--data-dir", str(folder_of_three), "--workers", "0"]
    metrics = engine.run(["--eval-only", best, *base], load_families())
    assert 0 <= metrics["eval_top1"] <= 100
    assert parse_config([*base, "--initial-checkpoint", best, "--output", str(tmp_path / "run")]).checkpoint == best
    with pytest.raises(ConfigError, match=r"^--resume \S+last\.pth\.tar is a file .* --initial-checkpoint"):
        parse_config([*base, "--resume", str(tmp_path / "last.pth.tar"), "--output", str(tmp_path / "run")])
