"""Bad input: one `error: ...` line on stderr, exit code 2, no traceback, nothing in the output dir lost."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

from convbias.cli import train
from convbias.engine.checkpoint import save_weights

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model", "convit_tiny", "--model-kwargs", "patch_size=8", "depth=2", "local_up_to_layer=1",
         "embed_dim=16", "--workers", "0", "--epochs", "1"]


@pytest.fixture
def output(tmp_path):
    """An output dir that already holds files, which no failing run may touch."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    return out


def run_cli(capsys, args):
    code = train.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("args, expected", [
    (["--model", "convit_tinny"], r"unknown model 'convit_tinny' .*close choices: convit_tiny"),
    (["--dataset", "mnist"], r"unknown dataset 'mnist'; choices: digits, cifar10, cifar100, imagenet, folder"),
    (["--train-fraction", "0"], r"--train-fraction must be in \(0, 1\], got 0.0"),
    (["--train-fraction", "1.5"], r"--train-fraction must be in \(0, 1\], got 1.5"),
    (["--lr", "-0.1"], r"--lr must be positive, got -0.1"),
    (["--epochs", "-3"], r"--epochs must be a positive integer, got -3"),
    (["--batch-size", "0"], r"--batch-size must be a positive integer, got 0"),
    (["--dataset", "folder", "--data-dir", "/nonexistent/images"], 
     r"--data-dir /nonexistent/images is not a directory; expected layout for --dataset folder: DIR/train/<class>"),
    (["--dataset", "imagenet"], r"--dataset imagenet needs --data-dir; expected layout: DIR/train/<class>"),
    (["--model-kwargs", "patch_sise=4"], r"cannot build convit_tiny .*patch_sise"),
    (["--resume", "EMPTY"], r"--resume .*: no checkpoint there"),
])
def test_bad_input_is_one_line_exit_2_and_keeps_output(capsys, output, tmp_path, args, expected):
    args = [str(tmp_path) if a == "EMPTY" else a for a in args]
    code, err = run_cli(capsys, SMALL + ["--output", str(output)] + args)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(expected, err[0]), err[0]
    assert [p.name for p in output.iterdir()] == ["notes.txt"]
    assert (output / "notes.txt").read_text() == "keep me"


def test_existing_run_is_not_overwritten_without_resume(capsys, output):
    (output / "summary.csv").write_text("epoch,train_loss\n1,0.5\n")
    code, err = run_cli(capsys, SMALL + ["--output", str(output)])
    assert code == 2 and "already holds a run (summary.csv); pass --resume auto" in err[0]
    assert (output / "summary.csv").read_text() == "epoch,train_loss\n1,0.5\n"


def test_checkpoint_of_another_model_names_the_mismatched_keys(capsys, tmp_path, output):
    other = timm.create_model("resnet18", num_classes=10, in_chans=1)
    save_weights(other.state_dict(), tmp_path / "resnet18.safetensors")
    code, err = run_cli(capsys, SMALL + ["--eval-only", "--checkpoint", str(tmp_path / "resnet18.safetensors")])
    assert code == 2 and len(err) == 1
    assert "does not fit this model" in err[0] and "missing keys: " in err[0] and "unexpected keys: " in err[0]
    assert "layer1.0.bn1" in err[0] and "pos_embed" in err[0]  # keys of both models named

    wrong_width = timm.create_model("convit_tiny", patch_size=8, depth=2, local_up_to_layer=1, embed_dim=32,
                                    img_size=32, in_chans=1, num_classes=10)
    torch.save(wrong_width.state_dict(), tmp_path / "wide.pth")
    code, err = run_cli(capsys, SMALL + ["--eval-only", "--checkpoint", str(tmp_path / "wide.pth")])
    assert code == 2 and "mismatched shapes: " in err[0] and "vs model" in err[0]


def test_real_cli_prints_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--model", "convit_tiny", "--batch-size", "0",
                             "--output", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --batch-size must be a positive integer, got 0"
    assert not (tmp_path / "out").exists()


def test_unreadable_image_is_skipped_and_counted_in_the_log(tmp_path):
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(2):
        folder = tmp_path / "data" / "train" / f"class_{label}"
        folder.mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (tmp_path / "data" / "train" / "class_0" / "broken.png").write_bytes(b"not a png")
    output = tmp_path / "run"
    with pytest.warns(UserWarning, match="broken.png"):
        train.run(["--model", "convit_tiny", "--model-kwargs", "patch_size=8", "depth=2", "local_up_to_layer=1",
                    "embed_dim=16", "--dataset", "folder", "--data-dir", str(tmp_path / "data"), "--img-size", "16",
                    "--no-aug", "--repeated-aug", "1", "--batch-size", "4", "--workers", "0", "--epochs", "1",
                    "--output", str(output)])
    record = json.loads((output / "log.jsonl").read_text().splitlines()[-1])
    assert record["unreadable_images"] == 1
