"""A launch says at start what it will do: output, processes and threads, device and precision, model size,
data, global batch with the effective lr and the rule that gave it, epochs and warm-up."""

import os
import re
import subprocess

import pytest
import timm
import torch
from test_train_errors import PROGRESS, messages

import convit  # noqa: F401  (registers the project's models)
from convbias.cli import train
from convbias.engine.loop.node import set_threads

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_startup_block_states_what_the_run_will_do(cli_argv, tmp_path, capsys):
    args = cli_argv(
        cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, batch_size=16, train_fraction=0.5, epochs=1, no_diagnostics=True
    )
    output = tmp_path / "run"
    assert train.main(args + ["--output", str(output)]) == 0
    out, err = capsys.readouterr()
    assert messages(err) == []
    model = timm.create_model(
        "convit_tiny", **cli_argv.TINY_CONVIT["model_kwargs"], img_size=8, in_chans=1, num_classes=10
    )
    params = sum(p.numel() for p in model.parameters()) / 1e6
    updates = 719 // 16  # half of the 1,438 training digits, in full batches of 16
    assert out.splitlines()[:13] == [
        f"output: {output} (a new run)",
        "processes: 1 (1 thread each) on cpu, fp32",  # the module's single_thread fixture
        f"model: convit_tiny, {params:.2f}M parameters",
        "data: digits, 719 train / 359 val images, 10 classes",
        "num_classes: 10 (command line)",  # PLAIN_DIGITS's --num-classes 10
        "batch: 16 global = 16 per process x 1 x 1 accumulation; lr 0.00625 (--lr-base 0.1 x 16 / --lr-base-size 256)",
        f"schedule: 1 epoch, 0 of warm-up, {updates} updates per epoch",
        # timm's train.py's defaults where the command line sets nothing, each value with its source
        "optimizer: SGD (--opt sgd [timm default]), momentum 0.9 [timm default], nesterov True [--opt sgd], "
        "weight decay 2e-05 [timm default]",
        "lr: 0.00625 from --lr-base 0.1 [timm default] per 256 [timm default] images, scaled linear [timm default]",
        "lr schedule: cosine [timm default] stepped per epoch [timm default], warm-up from 1e-05 [timm default], "
        "min lr 0 [timm default]",
        "augmentation: auto-augment none [timm default], random erasing 0 [timm default], mixup/cutmix off, "
        "repeated augmentation 1 [command line], drop-path the model's, color jitter 0 [timm default], smoothing 0 "
        "[timm default] (all off: --no-aug)",
        "EMA: off [timm default]",
        "input: 8 [command line] px, crop 1.0 [command line], interpolation bicubic [model convit_tiny's config] "
        "(train bicubic [as eval]), mean (0.3053,) [dataset digits], std (0.3759,) [dataset digits]",
    ]


def test_likely_unintended_settings_are_warned_before_training(cli_argv, tmp_path, capsys, monkeypatch):
    """The DeiT recipe on 8-px digits: its augmentation, an lr scaled to 7.8e-6 by a batch of 8, and more
    loader workers than the node's cores (one core here)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    args = cli_argv(
        cli_argv.DEIT_RECIPE,
        cli_argv.TINY_CONVIT,
        dataset="digits",
        batch_size=8,
        train_fraction=0.05,
        epochs=1,
        warmup_epochs=0,
        workers=2,
    )
    assert train.main(args + ["--output", str(tmp_path / "run"), "--no-diagnostics"]) == 0
    warnings = [line for line in messages(capsys.readouterr().err) if line.startswith("warning: ")]
    assert warnings == [
        "warning: the lr scaled to the global batch is 7.81e-06 (--lr-base 0.0005 x 8 / --lr-base-size 512), below "
        "1e-05: the run may barely learn; set --lr, or raise --lr-base or the batch",
        "warning: heavy augmentation (--aa rand-m9-mstd0.5-inc1, --mixup 0.8, --cutmix 1, --reprob 0.25, "
        "--repeated-aug 3) on 8-px images: recipes like DeiT's are made for 224 px and leave little of a small image; "
        "use a light recipe (configs/train/demo_digits.yaml) or --no-aug",
        "warning: --workers 2 x 1 process on this node start 2 loader processes for 1 core: they compete with "
        "training; lower --workers",
    ]


@pytest.mark.integration
@pytest.mark.slow
def test_output_that_is_not_a_terminal_gets_one_line_per_epoch_and_no_progress_bar(cli_argv, tmp_path, console_script):
    """A job log (stdout and stderr to files) holds the epoch lines, not hundreds of progress-bar redraws."""
    args = cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, lr=1e-3, train_fraction=0.1, epochs=2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [console_script("convbias-train"), *args, "--no-diagnostics", "--output", str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and not any(PROGRESS.match(line) for line in done.stderr.splitlines()), done.stderr
    epochs = [line for line in done.stdout.splitlines() if re.match(r"epoch \d/2  train_loss", line)]
    assert [line.split()[1] for line in epochs] == ["1/2", "2/2"]


def test_each_process_takes_its_share_of_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    try:
        set_threads()
        assert torch.get_num_threads() == 2  # 8 cores, 4 processes on the node
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        set_threads()
        assert torch.get_num_threads() == 3  # the user's choice stands
    finally:
        torch.set_num_threads(before)


def test_convbias_traceback_shows_the_error_behind_a_set_up_refusal(cli_argv, tmp_path, capsys, monkeypatch):
    args = cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, epochs=1, output=str(tmp_path / "run"))
    bad = [a if a != "local_up_to_layer=1" else "local_up_to_layer=7" for a in args]  # more GPSA blocks than blocks
    assert train.main(bad) == 2
    plain = messages(capsys.readouterr().err)
    assert len(plain) == 1 and plain[0].startswith("error: ")
    monkeypatch.setenv("CONVBIAS_TRACEBACK", "1")
    assert train.main(bad) == 2
    err = capsys.readouterr().err
    assert plain[0] in err and "Traceback (most recent call last)" in err and "The above exception" in err
