"""Reading timm's training checkpoints (convbias.engine.rundir.timm_files) against timm itself: files
written by timm's own CheckpointSaver (and in the layout older timm versions saved), read back as timm's
resume_checkpoint and clean_state_dict read them, timm's optimizer state paired with this engine's parameter
groups, and a pickle with a foreign global refused without running it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import timm
import torch
from timm.models import clean_state_dict, resume_checkpoint
from timm.optim import create_optimizer_v2
from timm.utils import CheckpointSaver

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.engine.checkpoint.timm_resume import aligned_optimizer_state
from convbias.engine.model.build import create_timm_model
from convbias.engine.rundir.timm_files import read_timm_checkpoint, timm_class_names

pytestmark = pytest.mark.usefixtures("single_thread")

MODEL, CLASSES = "test_resnet", 3  # timm's 0.37M-parameter ResNet


def stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One training step, so that the optimizer holds state (momentum buffers)."""
    torch.manual_seed(0)
    model(torch.randn(2, 3, 16, 16)).square().mean().backward()
    optimizer.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """timm's train.py after epoch 4 (0-based): its model, EMA, optimizer (timm's, with weight decay) and args,
    saved by timm's CheckpointSaver."""
    folder = tmp_path_factory.mktemp("timm_output")
    torch.manual_seed(0)
    model, ema = timm.create_model(MODEL, num_classes=CLASSES), timm.create_model(MODEL, num_classes=CLASSES)
    optimizer = create_optimizer_v2(model, opt="momentum", lr=0.1, momentum=0.9, weight_decay=0.05)
    stepped(model, optimizer)
    args = argparse.Namespace(model=MODEL, num_classes=CLASSES, input_size=None, in_chans=None, gp=None, lr=0.1)
    CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(folder)).save_checkpoint(4, 61.5)
    return dict(path=folder / "last.pth.tar", model=model.eval(), ema=ema.eval(), optimizer=optimizer, args=args)


def equal_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_what_timms_saver_wrote_is_read_back(saved):
    checkpoint = read_timm_checkpoint(saved["path"])
    assert equal_tensors(checkpoint.state_dict, saved["model"].state_dict())
    assert equal_tensors(checkpoint.ema_state_dict, saved["ema"].state_dict())
    assert (checkpoint.epoch, checkpoint.version, checkpoint.metric) == (4, 2, 61.5)
    assert checkpoint.args == vars(saved["args"])
    expected = saved["optimizer"].state_dict()
    assert checkpoint.optimizer["param_groups"] == expected["param_groups"]
    assert all(equal_tensors(checkpoint.optimizer["state"][i], expected["state"][i]) for i in expected["state"])


def resumed_by_timm(path: Path) -> int:
    model = timm.create_model(MODEL, num_classes=CLASSES)
    return resume_checkpoint(model, str(path), log_info=False)


def test_the_resume_epoch_is_timms(saved, tmp_path):
    """timm's files since version 2 save the epoch just trained, older ones the next: resume_checkpoint's answer."""
    assert read_timm_checkpoint(saved["path"]).resume_epoch == resumed_by_timm(saved["path"]) == 5
    older = tmp_path / "old.pth.tar"
    torch.save({"state_dict": saved["model"].state_dict(), "epoch": 3}, older)
    checkpoint = read_timm_checkpoint(older)
    assert (checkpoint.version, checkpoint.resume_epoch) == (1, resumed_by_timm(older)) == (1, 3)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module.", "module._orig_mod."])
def test_wrapper_prefixes_are_removed_as_timms_clean_state_dict_does(saved, tmp_path, prefix):
    """A run under DDP or torch.compile saves its wrapper's names; timm's own loading removes them."""
    wrapped = {prefix + key: value for key, value in saved["model"].state_dict().items()}
    torch.save({"state_dict": wrapped, "epoch": 0, "version": 2}, tmp_path / "last.pth.tar")
    assert equal_tensors(read_timm_checkpoint(tmp_path / "last.pth.tar").state_dict, clean_state_dict(wrapped))


def test_the_model_is_rebuilt_from_its_args_with_its_weights_or_its_emas(saved):
    checkpoint = read_timm_checkpoint(saved["path"])
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for use_ema, oracle in ((False, saved["model"]), (True, saved["ema"])):
            model = create_timm_model(checkpoint, use_ema=use_ema)
            assert not model.training
            torch.testing.assert_close(model(images), oracle(images), rtol=0, atol=0)


def test_timms_optimizer_state_is_paired_with_this_runs_groups(saved):
    """timm lists the group without weight decay first; an optimizer with the groups the other way round (this
    engine's order) gets each parameter's own momentum and its group's settings."""
    timms = saved["optimizer"]
    groups = [dict(group) for group in reversed(timms.param_groups)]
    ours = torch.optim.SGD([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups], lr=0.1)
    ours.load_state_dict(aligned_optimizer_state(timms.state_dict(), ours, "last.pth.tar", "--resume"))
    for group, timm_group in zip(ours.param_groups, groups):
        assert (group["weight_decay"], group["momentum"]) == (timm_group["weight_decay"], 0.9)
        for param in group["params"]:
            assert torch.equal(ours.state[param]["momentum_buffer"], timms.state[param]["momentum_buffer"])
    one_group = torch.optim.SGD(saved["model"].parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="--resume last.pth.tar: its optimizer state does not fit"):
        aligned_optimizer_state(timms.state_dict(), one_group, "last.pth.tar", "--resume")


class Payload:
    """An object whose unpickling runs code: it writes the file it names."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "executed"))


def test_a_pickle_with_a_foreign_global_is_refused_unexecuted(saved, tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "last.pth.tar"
    torch.save({"state_dict": saved["model"].state_dict(), "epoch": 0, "args": Payload(marker)}, path)
    with pytest.raises(DamagedInputError, match="it was not unpickled"):
        read_timm_checkpoint(path)
    assert not marker.exists()


def test_a_file_without_timms_keys_is_refused(saved, tmp_path):
    with pytest.raises(ConfigError, match="timm checkpoint not found"):
        read_timm_checkpoint(tmp_path / "missing.pth.tar")
    for content in ({"epoch": 1}, {"state_dict": saved["model"].state_dict()}, {"state_dict": {}, "epoch": True}):
        torch.save(content, tmp_path / "x.pth.tar")
        with pytest.raises(DamagedInputError, match="is not a timm training checkpoint"):
            read_timm_checkpoint(tmp_path / "x.pth.tar")


def test_class_names_come_from_a_class_map_of_as_many_names(saved, tmp_path):
    checkpoint = read_timm_checkpoint(saved["path"])
    assert timm_class_names(checkpoint, CLASSES) == (
        None,
        [f"{saved['path']} names no --class-map: labels are class indices"],
    )
    (tmp_path / "classes.txt").write_text("cat\ndog\nbird\n")
    checkpoint.args["class_map"] = str(tmp_path / "classes.txt")
    assert timm_class_names(checkpoint, CLASSES) == (["cat", "dog", "bird"], [])
    names, why = timm_class_names(checkpoint, 4)
    assert names is None and why == [f"its --class-map {tmp_path / 'classes.txt'} has 3 names, the model 4 classes"]
