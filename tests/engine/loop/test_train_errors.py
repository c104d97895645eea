"""Bad input: one `error: ...` line on stderr, exit code 2, no traceback, nothing in the output dir lost."""

import os
import re
import subprocess
import sys

import pytest
import timm
import torch
from support.runs import messages

from convbias.base.run_layout import CONFIG_MARKER
from convbias.cli import train
from convbias.engine.checkpoint.points import save_weights

SMALL = [
    "--dataset",
    "digits",
    "--model",
    "convit_tiny",
    "--model-kwargs",
    "patch_size=8",
    "depth=2",
    "local_up_to_layer=1",
    "embed_dim=4",
    "--num-classes",
    "10",  # the digits' head (timm's default would be 1000 outputs, which a run warns of)
    "--workers",
    "0",
    "--epochs",
    "1",
    "--warmup-epochs",
    "0",
]


# What an earlier attempt that failed before its first checkpoint left (a folder holding anything that is not
# the engine's own is refused as such: tests/base/test_hostile_inputs.py).
KEPT, KEPT_TEXT = "config.yaml", f"{CONFIG_MARKER}\nmodel: convit_tiny\n# keep me\n"


@pytest.fixture
def output(tmp_path):
    """An output dir that already holds a file, which no failing run may touch."""
    out = tmp_path / "out"
    out.mkdir()
    (out / KEPT).write_text(KEPT_TEXT)
    return out


def run_cli(capsys, args):
    code = train.main(args)
    return code, messages(capsys.readouterr().err)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model", "convit_tinny"], r"unknown model 'convit_tinny' .*close choices: convit_tiny"),
        (["--dataset", "svhn"], r"unknown dataset 'svhn'; choices: digits, mnist, cifar10, cifar100, imagenet, folder"),
        (["--train-fraction", "0"], r"--train-fraction must be in \(0, 1\], got 0.0"),
        (["--train-fraction", "1.5"], r"--train-fraction must be in \(0, 1\], got 1.5"),
        (["--lr", "-0.1"], r"--lr must be positive, got -0.1"),
        (["--epochs", "-3"], r"--epochs must be a positive integer, got -3"),
        (["--batch-size", "0"], r"--batch-size must be a positive integer, got 0"),
        (
            ["--dataset", "folder", "--data-dir", "/nonexistent/images"],
            r"--data-dir /nonexistent/images is not a directory; expected layout for --dataset folder: DIR/train/<class>",
        ),
        (["--dataset", "imagenet"], r"--dataset imagenet needs --data-dir; expected layout: DIR/train/<class>"),
        (["--model-kwargs", "patch_sise=4"], r"cannot build convit_tiny .*patch_sise"),
        (["--resume", "EMPTY"], r"--resume .*: no checkpoint there"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_keeps_output(capsys, output, tmp_path, args, expected):
    args = [str(tmp_path) if a == "EMPTY" else a for a in args]
    code, err = run_cli(capsys, SMALL + ["--output", str(output)] + args)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(expected, err[0]), err[0]
    assert [p.name for p in output.iterdir()] == [KEPT]
    assert (output / KEPT).read_text() == KEPT_TEXT


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--checkpoint", "GARBAGE"], r"GARBAGE is not a readable safetensors file \(Error while deserializing header"),
        (["--eval-only", "GARBAGE"], r"GARBAGE is not a readable safetensors file"),
        (["--pretrained-file", "GARBAGE"], r"--pretrained-file: GARBAGE is not a readable safetensors file"),
        (
            ["--distill-teacher", "resnet18", "--distill-teacher-file", "GARBAGE"],
            r"GARBAGE is not a readable safetensors",
        ),
        (["--checkpoint", "TRUNCATED"], r"TRUNCATED is not a readable safetensors file"),
        (["--lr", "inf"], r"^error: --lr must be a finite number, got inf$"),
        (["--clip-grad", "nan"], r"^error: --clip-grad must be a finite number, got nan$"),
        (["--scale", "0.5", "inf"], r"^error: --scale must be a finite number, got inf$"),
        (
            ["--param-group-lr", "gating_param=inf"],
            r"--param-group-lr gating_param=\.\.\. needs a positive number, got 'inf'",
        ),
        (
            ["-c", "RECIPE:scale: 0.5"],
            r"^error: recipe RECIPE, line 1: scale expects a list of 2 float values, got 0.5$",
        ),
        (
            ["-c", "RECIPE:scale: [0.5]"],
            r"^error: recipe RECIPE, line 1: scale expects a list of 2 float values, got \[0.5\]$",
        ),
        (
            ["-c", "RECIPE:save_epochs: 1"],
            r"^error: recipe RECIPE, line 1: save_epochs expects a list of int values, got 1$",
        ),
        (["-c", "RECIPE:data_dir: 3"], r"^error: recipe RECIPE, line 1: data_dir expects a string, got 3$"),
        (["-c", "RECIPE:lr: .inf"], r"^error: recipe RECIPE, line 1: lr must be a finite number, got inf$"),
        (["-c", "RECIPE:epochs: 2\nlr: abc"], r"^error: recipe RECIPE, line 2: lr expects float, got 'abc'$"),
        (
            ["-c", "RECIPE:lr: 0.1\nepochs: 2\nlr: 0.2"],
            r"^error: recipe RECIPE is not valid YAML: the key 'lr' is given twice, on lines 1 and 3$",
        ),
        (["--which", "best"], r"--which best picks a checkpoint of a run directory; --checkpoint \(none\) is not one"),
    ],
)
def test_more_mistakes_are_one_line_exit_2_and_keep_output(capsys, output, tmp_path, args, expected):
    """Unreadable weight files in every option that loads weights, non-finite numbers, recipe values of the
    wrong type (a YAML recipe skips argparse's conversion: the recipe, its line and key named), a recipe key
    given twice (both lines named)."""
    garbage, truncated = tmp_path / "garbage.safetensors", tmp_path / "truncated.safetensors"
    garbage.write_bytes(bytes(range(256)) * 4)
    save_weights({"w": torch.zeros(64, 64)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    resolved = []
    for a in args:
        if a.startswith("RECIPE:"):
            (tmp_path / "recipe.yaml").write_text(a.removeprefix("RECIPE:") + "\n")
            a = str(tmp_path / "recipe.yaml")
        resolved.append(str(garbage) if a == "GARBAGE" else str(truncated) if a == "TRUNCATED" else a)
    code, err = run_cli(capsys, SMALL + ["--output", str(output)] + resolved)
    expected = expected.replace("GARBAGE", re.escape(str(garbage))).replace("TRUNCATED", re.escape(str(truncated)))
    expected = expected.replace("RECIPE", re.escape(str(tmp_path / "recipe.yaml")))
    damaged = {"GARBAGE", "TRUNCATED"} & set(args)  # a weights file that does not read: damaged input (65)
    assert code == (65 if damaged else 2) and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(expected, err[0]), err[0]
    assert [p.name for p in output.iterdir()] == [KEPT]


def test_output_that_cannot_be_a_run_directory_is_refused_before_set_up(capsys, tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("keep me")
    code, err = run_cli(capsys, SMALL + ["--output", str(a_file)])
    assert code == 2 and err == [f"error: --output {a_file} is a file; pass a directory (new or of this run)"]
    code, err = run_cli(capsys, SMALL + ["--output", str(a_file / "run")])
    assert code == 2 and err == [f"error: --output {a_file / 'run'}: {a_file} is a file, not a directory"]
    assert a_file.read_text() == "keep me" and [p.name for p in tmp_path.iterdir()] == ["results.txt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_in_a_read_only_directory_is_refused(capsys, tmp_path):
    tmp_path.chmod(0o555)
    try:
        code, err = run_cli(capsys, SMALL + ["--output", str(tmp_path / "run")])
    finally:
        tmp_path.chmod(0o755)
    assert code == 74 and err == [
        f"error: --output {tmp_path / 'run'}: {tmp_path} is not writable (read-only); choose another --output"
    ]


def write_folder(root, classes, broken=False):
    """A folder dataset of 8 random 16x16 PNGs per class (and one corrupt file in the first class)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(classes):
        folder = root / "train" / f"class_{label}"
        folder.mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    if broken:
        (root / "train" / "class_0" / "0broken.png").write_bytes(b"not a png")
    return root


FOLDER = [
    "--dataset",
    "folder",
    "--img-size",
    "16",
    "--no-aug",
    "--repeated-aug",
    "1",
    "--batch-size",
    "4",
    "--lr",
    "1e-3",
]


def test_a_one_class_dataset_is_refused(capsys, tmp_path, output):
    data = write_folder(tmp_path / "data", classes=1)
    code, err = run_cli(capsys, SMALL + FOLDER + ["--data-dir", str(data), "--output", str(output)])
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        f"error: --dataset folder at {data} has 1 class (class_0); classification needs at least 2"
    )
    assert [p.name for p in output.iterdir()] == [KEPT]


def test_unreadable_image_without_skipping_is_one_line_and_a_plain_rerun_starts_over(capsys, tmp_path):
    data, output = write_folder(tmp_path / "data", classes=2, broken=True), tmp_path / "run"
    # 15 training images in 3 batches of 5: every image is read in the first epoch
    args = (
        SMALL + FOLDER + ["--batch-size", "5", "--num-classes", "2", "--data-dir", str(data), "--output", str(output)]
    )
    code, err = run_cli(capsys, args + ["--no-skip-unreadable"])
    assert code == 65 and len(err) == 1, err  # damaged input
    assert re.search(r"^error: unreadable image .*0broken.png: .*--skip-unreadable skips and counts such files", err[0])
    assert not (output / "checkpoints").exists() and not (output / ".lock").exists()
    with pytest.warns(UserWarning, match="0broken.png"):
        assert train.main(args) == 0  # no checkpoint was written: the same command without the flag starts over
    assert "starting over" in capsys.readouterr().out
    assert (output / "results.json").is_file()


def test_ctrl_c_says_what_was_kept_and_exits_130(capsys, tmp_path):
    from convbias.engine import Extensions

    calls = []

    def interrupt_at_the_second_evaluation(model, images):  # called at init, after epoch 1, after epoch 2
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return {}

    output = tmp_path / "run"
    code = train.main(
        SMALL[:-4] + ["--epochs", "2", "--warmup-epochs", "0", "--no-aug", "--output", str(output)],
        Extensions(diagnostics={"interrupt": interrupt_at_the_second_evaluation}),
    )
    err = messages(capsys.readouterr().err)
    assert code == 130 and err == [
        f"interrupted: kept {output}/checkpoints/last (epoch 1); continue with --resume auto"
    ]
    assert not (output / ".lock").exists() and not (output / "results.json").exists()


def test_help_shows_the_defaults():
    from convbias.engine.config.command_line import build_parser

    text = " ".join(build_parser().format_help().split())
    for shown in (
        "--epochs EPOCHS (default: 300)",
        "--lr-base LR_BASE (default: 0.1)",  # timm's train.py's
        "--which {last,best} checkpoint of a run directory to evaluate or start from (default: last)",
        "start from pretrained weights (default: False)",
    ):
        assert shown in text, shown


def test_existing_run_is_not_overwritten_without_resume(capsys, output):
    (output / "summary.csv").write_text("epoch,train_loss\n1,0.5\n")
    (output / "results.json").write_text("{}\n")
    code, err = run_cli(capsys, SMALL + ["--output", str(output)])
    assert code == 2 and "already holds a run (results.json); pass --resume auto" in err[0]
    assert (output / "summary.csv").read_text() == "epoch,train_loss\n1,0.5\n"


def test_checkpoint_of_another_model_names_the_mismatched_keys(capsys, tmp_path, output):
    other = timm.create_model("resnet18", num_classes=10, in_chans=1)
    save_weights(other.state_dict(), tmp_path / "resnet18.safetensors")
    code, err = run_cli(capsys, SMALL + ["--eval-only", "--checkpoint", str(tmp_path / "resnet18.safetensors")])
    assert code == 2 and len(err) == 1
    assert "does not fit this model" in err[0] and "missing keys: " in err[0] and "unexpected keys: " in err[0]
    assert "layer1.0.bn1" in err[0] and "pos_embed" in err[0]  # keys of both models named

    wrong_width = timm.create_model(
        "convit_tiny", patch_size=8, depth=2, local_up_to_layer=1, embed_dim=8, img_size=32, in_chans=1, num_classes=10
    )
    torch.save(wrong_width.state_dict(), tmp_path / "wide.pth")
    code, err = run_cli(capsys, SMALL + ["--eval-only", "--checkpoint", str(tmp_path / "wide.pth")])
    assert code == 2 and "mismatched shapes: " in err[0] and "vs model" in err[0]


@pytest.mark.integration
@pytest.mark.slow
def test_real_cli_prints_no_traceback(tmp_path, console_script):
    result = subprocess.run(
        [
            console_script("convbias-train"),
            "--model",
            "convit_tiny",
            "--batch-size",
            "0",
            "--output",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
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
        train.run(
            [
                "--model",
                "convit_tiny",
                "--model-kwargs",
                "patch_size=8",
                "depth=2",
                "local_up_to_layer=1",
                "embed_dim=4",
                "--dataset",
                "folder",
                "--data-dir",
                str(tmp_path / "data"),
                "--img-size",
                "16",
                "--no-aug",
                "--repeated-aug",
                "1",
                "--batch-size",
                "4",
                "--workers",
                "0",
                "--epochs",
                "1",
                "--output",
                str(output),
            ]
        )
    record = json.loads((output / "log.jsonl").read_text().splitlines()[-1])
    assert record["unreadable_images"] == 1


@pytest.mark.integration
@pytest.mark.slow
def test_a_worker_process_hitting_an_unreadable_image_ends_the_run_with_one_line(tmp_path, console_script):
    """Workers ignore the scheduler's preemption signals but still obey the main process's shutdown:
    with workers, an error in one of them is one line and the process exits (no hang, no traceback)."""
    data = write_folder(tmp_path / "data", classes=2, broken=True)
    result = subprocess.run(
        [
            console_script("convbias-train"),
            *SMALL,
            *FOLDER,
            "--batch-size",
            "5",
            "--num-classes",
            "2",
            "--data-dir",
            str(data),
            "--workers",
            "2",
            "--no-skip-unreadable",
            "--output",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    progress = re.compile(r"epoch \d+/\d+: +\d+%\|")  # tqdm's bar (its rate reads it/s or s/it)
    lines = [
        line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip() and not progress.match(line)
    ]
    assert result.returncode == 65 and len(lines) == 1, result.stderr[-2000:]
    assert re.search(r"^error: unreadable image .*0broken.png", lines[0])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full (a device that is always full)")
def test_standard_output_on_a_full_disk_is_named_as_such(capsys, monkeypatch, tmp_path):
    """The start-up block written to a full standard output: standard output's failure, not the --output folder's
    disk (which has room), and nothing left for the interpreter to fail on at exit."""
    with open("/dev/full", "w", buffering=1) as full:
        monkeypatch.setattr(sys, "stdout", full)
        code, err = run_cli(capsys, SMALL + ["--output", str(tmp_path / "run")])
        monkeypatch.undo()
        full.write("left at exit\n")  # what the interpreter flushes at exit now goes nowhere, without an error
    assert code == 74 and err == [
        "error: writing to standard output failed (no space left on the device); no checkpoint was written yet "
        f"in {tmp_path / 'run'}; rerun the same command to start over"
    ], err
