"""Preemption: SIGTERM in the middle of an epoch, then `--resume auto`, gives the uninterrupted run.

The stopped run is `convbias-train` (the installed console script) in its own process group, with the DeiT
recipe's randomness on (RandAugment, mixup/cutmix, random erasing, repeated augmentation, drop path) and 2
data-loader workers; the signal goes to the whole group, as a scheduler sends it to every process of a job.
The run must finish its step, write a mid-epoch resume point and exit with the requeue status; the resumed
run must continue from that step and end with exactly the uninterrupted run's per-epoch metrics. The runs
that no signal reaches (the uninterrupted one, the resumes) are train.py's main in this process, on one
thread as the console script's: a new interpreter costs seconds of start-up and tests nothing here.
"""

import csv
import functools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from support import DATA

from convbias.base.errors import EXIT_REQUEUE as REQUEUE_EXIT_CODE
from convbias.engine.checkpoint.points import STATE_FILE, write_manifest
from convbias.engine.checkpoint.resume import load_training_state

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

FIELDS = ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr")
# a tiny ConViT on the digits with the recipe's augmentation, 2 loader workers and a resume point every 4 steps:
# 13 steps per epoch
RUN = dict(
    train_fraction=0.15,
    batch_size=16,
    workers=2,
    epochs=2,
    warmup_epochs=1,
    checkpoint_interval=4,
    diagnostics_images=4,
)


@pytest.fixture(scope="module")
def args(cli_argv) -> list[str]:
    return cli_argv(cli_argv.DEIT_RECIPE, cli_argv.TINY_CONVIT, RUN, dataset="digits")


def _train(script: str, args: list[str], output: Path, *extra: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [script, *args, "--output", str(output), *extra],
        env=env,
        cwd=output.parent,
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


@pytest.fixture
def train(console_script, args):
    """`train(output, *extra)`: convbias-train in a subprocess of its own process group."""
    return functools.partial(_train, console_script("convbias-train"), args)


def train_here(capsys, args: list[str], output: Path, *extra: str) -> tuple[int, str, str]:
    """train.py's main in this process: its exit code, stdout and stderr."""
    from convbias.cli import train as cli

    capsys.readouterr()
    code = cli.main([*args, "--output", str(output), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def summary(output: Path) -> list[tuple[str, ...]]:
    with open(output / "summary.csv", newline="") as f:
        return [tuple(row[k] for k in FIELDS) for row in csv.DictReader(f)]


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


@pytest.mark.parametrize("signal_name", ["SIGTERM"])
def test_signal_mid_epoch_then_resume_auto_gives_the_uninterrupted_run(tmp_path, capsys, args, train, signal_name):
    reference = tmp_path / "reference"
    code, _, err = train_here(capsys, args, reference)
    assert code == 0, err[-3000:]

    stopped = tmp_path / "stopped"
    process = train(stopped)
    interval_point = stopped / "checkpoints" / "epoch_0000_step_0000004" / STATE_FILE
    deadline = time.monotonic() + 240
    while not interval_point.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, getattr(signal, signal_name))  # every process: the run and its loader workers
    code, _, err = finish(process)
    assert code == REQUEUE_EXIT_CODE, err[-3000:]
    last = (stopped / "checkpoints" / "last").resolve()
    state = load_training_state(last)
    assert f"preempted: stopped by {signal_name} after step {state['step']} of epoch 1" in err
    assert str(last) in err
    assert state["epoch"] == 0 and 4 < state["step"] < 13, state["step"]  # 13 steps per epoch
    assert state["num_updates"] == state["step"] and len(state["loss_sums"]) == 1 and state["loss_sums"][0] > 0
    assert not (stopped / "results.json").exists() and summary(stopped) == []

    # on another number of processes the position inside the epoch cannot be continued: one line, exit 2
    other_world = tmp_path / "other_world"
    shutil.copytree(stopped, other_world, symlinks=True)
    point = (other_world / "checkpoints" / "last").resolve()
    changed = dict(state, rng=state["rng"] * 2)  # as if written by 2 processes
    torch.save(changed, point / STATE_FILE)
    write_manifest(point, state["epoch"], state["step"])  # an edit that keeps the point intact
    before = sorted((p, p.stat().st_mtime_ns) for p in other_world.rglob("*"))
    code, _, err = train_here(capsys, args, other_world, "--resume", "auto")
    assert code == 2 and err.count("\n") == 1, err[-3000:]
    assert "mid-epoch resume point" in err and "written by 2 processes, and this run has 1" in err
    assert f"--checkpoint {point / 'model.safetensors'}" in err
    assert sorted((p, p.stat().st_mtime_ns) for p in other_world.rglob("*")) == before

    code, out, err = train_here(capsys, args, stopped, "--resume", "auto")
    assert code == 0, err[-3000:]
    assert f"resumed from {last} after epoch 0 and {state['step']} steps of epoch 1" in out
    assert summary(stopped) == summary(reference)


@pytest.mark.parametrize(
    "option, expected",
    [
        (["--preempt-signals", "SIGFOO"], "--preempt-signals: unknown signal 'SIGFOO'"),
        (["--preempt-signals", "SIGKILL"], "--preempt-signals: SIGKILL cannot be used"),
        (["--checkpoint-interval", "-1"], "--checkpoint-interval must be >= 0"),
        (["--compile", "--compile-mode", "fast"], "unknown --compile-mode 'fast'"),
        (["--compile", "--compile-backend", "nope"], "unknown --compile-backend 'nope'"),
    ],
)
def test_bad_scale_out_options_are_one_line(tmp_path, capsys, args, option, expected):
    from convbias.cli import train as cli

    output = tmp_path / "run"
    assert cli.main(args + ["--output", str(output), *option]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not output.exists()


# resume points written by earlier engines (each folder's README.md says which): before the engine became
# packages, and before the checkpoint manager restored a resume in one call
OLD_POINTS = {name: DATA / f"resume_point_{name}" for name in ("flat_engine", "packaged_engine")}
# the run that wrote them: RUN without loader workers, on 30% of the digits (26 steps per epoch)
OLD_POINT_RUN = dict(RUN, workers=0, train_fraction=0.3)


@pytest.mark.parametrize("engine", sorted(OLD_POINTS))
def test_a_resume_point_written_by_an_earlier_engine_continues_exactly(tmp_path, capsys, cli_argv, engine):
    """A mid-epoch resume point written by an earlier engine (same on-disk layout) resumes to the run that was
    never stopped: every epoch's accuracies and lr to the last digit, its losses within 1e-6 relative (the run
    that was never stopped ran the code of that time: its GPSA and optimizer may sum in another order, which
    moves the last bits; an inexact resume moves the loss in the third digit)."""
    old_point = OLD_POINTS[engine]
    stopped = tmp_path / "stopped"
    shutil.copytree(old_point / "stopped", stopped, symlinks=True)
    args = cli_argv(cli_argv.DEIT_RECIPE, cli_argv.TINY_CONVIT, OLD_POINT_RUN, dataset="digits")
    code, out, err = train_here(capsys, args, stopped, "--resume", "auto")
    assert code == 0, err[-3000:]
    point = stopped / "checkpoints" / "epoch_0000_step_0000005"
    assert f"resumed from {point} after epoch 0 and 5 steps of epoch 1" in out
    resumed, reference = summary(stopped), summary(old_point / "reference")
    assert len(resumed) == len(reference) == 2
    for got, expected in zip(resumed, reference):
        for field, value, wanted in zip(FIELDS, got, expected):
            if field in ("train_loss", "eval_loss"):
                assert float(value) == pytest.approx(float(wanted), rel=1e-6), field
            else:
                assert value == wanted, field
