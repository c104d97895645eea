"""What a folder holds, told without reading a checkpoint (convbias.engine.rundir.run_files), against the
folders that really write them: a run folder that a one-epoch train.py run wrote here, and an output folder that
timm's own CheckpointSaver (what timm's train.py saves with) wrote, beside folders of other files."""

from __future__ import annotations

import argparse
import os

import pytest
import timm
import torch
import yaml
from timm.utils import CheckpointSaver

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.cli import train
from convbias.engine.rundir.run_files import (
    foreign_entry,
    foreign_links,
    in_timm_output,
    is_run_dir,
    is_timm_checkpoint_name,
    is_timm_output_dir,
    read_run_config,
    timm_output_file,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("single_thread")]

MODEL_KWARGS = dict(patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8)  # cli_argv.TINY_CONVIT's


@pytest.fixture(scope="module")
def run(tmp_path_factory, cli_argv):
    """The folder of a one-epoch train.py run of the tiny ConViT on a tenth of the digits."""
    output = tmp_path_factory.mktemp("run") / "run"
    argv = cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, epochs=1, train_fraction=0.1, output=output)
    train.run(argv)
    return output


@pytest.fixture(scope="module")
def timm_output(tmp_path_factory):
    """The output folder of timm's train.py after one epoch: CheckpointSaver's last, best and epoch files."""
    folder = tmp_path_factory.mktemp("timm_output")
    model = timm.create_model("test_resnet", num_classes=3)
    args = argparse.Namespace(model="test_resnet", num_classes=3)
    saver = CheckpointSaver(model, torch.optim.SGD(model.parameters(), lr=0.1), args=args, checkpoint_dir=str(folder))
    saver.save_checkpoint(epoch=0, metric=50.0)
    return folder


def test_a_train_run_is_a_run_dir_and_timms_output_is_not(run, timm_output, tmp_path):
    assert is_run_dir(run) and not is_timm_output_dir(run)
    assert is_timm_output_dir(timm_output) and not is_run_dir(timm_output)
    (tmp_path / "notes.txt").write_text("a folder of other files")
    assert not is_run_dir(tmp_path) and not is_timm_output_dir(tmp_path)
    assert not is_run_dir(run / "config.yaml")  # a file is no folder
    (tmp_path / "config.yaml").symlink_to(tmp_path / "nowhere")  # named so, whatever it is: its reader checks it
    assert is_run_dir(tmp_path)


def test_timms_files_are_named_as_timms_checkpoints(run, timm_output):
    for name in ("last.pth.tar", "model_best.pth.tar", "checkpoint-0.pth.tar"):
        assert is_timm_checkpoint_name(timm_output / name), name
    assert not is_timm_checkpoint_name(timm_output / "checkpoint-1.pth.tar")  # not there
    assert not any(is_timm_checkpoint_name(path) for path in run.rglob("*"))  # the engine's own files


def test_timms_output_folder_reads_as_its_checkpoint_by_which(timm_output, run):
    assert timm_output_file(timm_output, None) == timm_output / "last.pth.tar"
    assert timm_output_file(timm_output, "best") == timm_output / "model_best.pth.tar"
    assert in_timm_output(timm_output, "best") == (str(timm_output / "model_best.pth.tar"), None)
    assert in_timm_output(run, "best") == (str(run), "best")  # any other path is itself, --which kept for it
    os.remove(timm_output / "model_best.pth.tar")
    try:
        with pytest.raises(ConfigError, match="has no model_best.pth.tar"):
            timm_output_file(timm_output, "best")
    finally:
        os.link(timm_output / "last.pth.tar", timm_output / "model_best.pth.tar")


def test_the_runs_config_holds_the_options_it_was_given(run):
    options = read_run_config(run)
    given = dict(model="convit_tiny", model_kwargs=MODEL_KWARGS, img_size=8, dataset="digits", num_classes=10)
    assert {key: options[key] for key in given} == given
    assert options["epochs"] == 1 and options["train_fraction"] == 0.1


def test_a_config_that_is_not_a_runs_is_refused_naming_the_key(run, tmp_path):
    with pytest.raises(ConfigError, match="no config.yaml"):
        read_run_config(tmp_path)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**config, "modle_kwargs": {}}))
    with pytest.raises(DamagedInputError, match="config.yaml: modle_kwargs: not an option of train.py"):
        read_run_config(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**config, "img_size": "eight"}))
    with pytest.raises(DamagedInputError, match="config.yaml: img_size"):
        read_run_config(tmp_path)


def test_a_runs_own_entries_are_not_foreign_and_any_other_is(run, tmp_path):
    assert foreign_entry(run) is None and foreign_links(run) == []
    assert foreign_entry(tmp_path / "missing") is None
    (tmp_path / "results.json").write_text("{}")
    assert foreign_entry(tmp_path) == "results.json (beside no run config)"  # the engine's name, but no run's
    (tmp_path / "config.yaml").write_text((run / "config.yaml").read_text())
    assert foreign_entry(tmp_path) is None
    (tmp_path / "notes.txt").write_text("mine")
    assert foreign_entry(tmp_path) == "notes.txt (not a file train.py writes)"
    os.remove(tmp_path / "notes.txt")
    (tmp_path / "summary.csv").write_text("a table of mine\n")
    assert foreign_entry(tmp_path) == "summary.csv (not as train.py writes it)"
    os.remove(tmp_path / "summary.csv")
    (tmp_path / "log.jsonl").symlink_to(run / "log.jsonl")
    assert foreign_entry(tmp_path) == f"log.jsonl (a symbolic link to {run / 'log.jsonl'})"
    assert foreign_links(tmp_path) == [f"{tmp_path / 'log.jsonl'} -> {run / 'log.jsonl'}"]
