"""The engine under accelerate's FSDP2 (GPU only: accelerate enables FSDP only on GPU-like devices; the
sharded checkpoints themselves are tested on CPU in test_fsdp.py).

One process on one GPU through `accelerate launch --use_fsdp --fsdp_version 2` (torchrun), with EMA and
diagnostics on (both read FullCopy) and a resume point every 4 steps:

- SIGTERM to the training process mid-epoch: it writes a sharded resume point and stops; `--resume auto`
  under FSDP2 continues from that step and ends with the uninterrupted run's per-epoch metrics, EMA ones
  included. The same point also continues without FSDP (`python train.py`), as DCP reads the shards
  into ordinary tensors. `--eval-only` of the run under FSDP2 evaluates its weights unsharded.
- FSDP1 and `--reparametrize-at-epoch` are refused with one line before anything is written.

GPU kernels need not be bitwise deterministic run to run, so metrics are compared to 1e-4 (relative).
"""

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convbias.engine.checkpoint.points import STATE_FILE
from convbias.engine.checkpoint.resume import load_training_state

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate enables FSDP only on GPUs"),
    pytest.mark.integration,
    pytest.mark.slow,
]

RUN = dict(
    dataset="digits",
    train_fraction=0.3,
    batch_size=16,
    workers=2,
    epochs=2,
    warmup_epochs=1,
    checkpoint_interval=4,
    diagnostics_images=4,
    model_ema=True,
    model_ema_decay=0.9,
    lr=5e-3,
    save_epochs=0,
)
TIMINGS = ("epoch_seconds", "images_per_sec")  # the only entries of log.jsonl that may differ between runs


def _launch(
    train_script: str, args: list[str], output: Path, *extra: str, fsdp_version: int | None = 2
) -> subprocess.Popen:
    launcher = (
        []
        if fsdp_version is None
        else [
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--use_fsdp",
            "--fsdp_version",
            str(fsdp_version),
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, *launcher, train_script, *args, "--output", str(output), *extra],
        env=env,
        cwd=output.parent,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=600)
    return process.returncode, out, err


def metrics(output: Path) -> list[dict[str, float]]:
    """log.jsonl's per-epoch records (losses, top-1/5, lr, EMA metrics, diagnostics) without timings."""
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records if "epoch" in r]


def assert_same_metrics(run: Path, reference: Path) -> None:
    got, expected = metrics(run), metrics(reference)
    assert len(got) == len(expected) == 2 and all(r.keys() == e.keys() for r, e in zip(got, expected))
    assert {"ema_eval_top1", "ema_eval_loss"} <= expected[0].keys()
    for row, expected_row in zip(got, expected):
        for key, value in expected_row.items():
            assert math.isclose(row[key], value, rel_tol=1e-4, abs_tol=1e-6), (row["epoch"], key, row[key], value)
    final, reference_final = (load_file(r / "checkpoints" / "last" / "model.safetensors") for r in (run, reference))
    initial = load_file(reference / "checkpoints" / "epoch_0.safetensors")
    moved = max((reference_final[k] - initial[k]).abs().max().item() for k in initial)
    gap = max((final[k] - reference_final[k]).abs().max().item() for k in initial)
    assert moved > 1e-2 and gap < 1e-4 * moved, (gap, moved)


@pytest.fixture
def launch(console_script, cli_argv):
    """`launch(output, *extra, fsdp_version=2)`: the installed convbias-train under accelerate's FSDP (or alone)."""
    return functools.partial(_launch, console_script("convbias-train"), cli_argv(cli_argv.TINY_CONVIT, RUN))


def training_process(launcher: subprocess.Popen) -> int:
    """The pid of convbias-train under torchrun (SIGTERM goes to it, as srun sends it to every task)."""
    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children():  # the worker (its loader workers are its children)
            if any(arg.endswith("convbias-train") for arg in child.cmdline()):
                return child.pid
        time.sleep(0.1)
    raise AssertionError("convbias-train did not start under accelerate launch")


def test_sigterm_under_fsdp2_then_resume_gives_the_uninterrupted_run(tmp_path, launch):
    reference = tmp_path / "reference"
    code, _, err = finish(launch(reference))
    assert code == 0, err[-3000:]

    stopped = tmp_path / "stopped"
    process = launch(stopped)
    worker = training_process(process)
    interval_point = stopped / "checkpoints" / "epoch_0000_step_0000004" / STATE_FILE
    deadline = time.monotonic() + 300
    while not interval_point.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(worker, signal.SIGTERM)
    code, _, err = finish(process)
    assert "preempted: stopped by SIGTERM after step" in err, err[-3000:]
    last = (stopped / "checkpoints" / "last").resolve()
    state = load_training_state(last)
    assert state["sharded"] and state["optimizer"] is None and state["epoch"] == 0 and 4 <= state["step"] < 26
    assert sorted(p.name for p in (last / "sharded").iterdir()) == [".metadata", "__0_0.distcp"]
    assert (last / "ema.safetensors").is_file() and (last / "model.safetensors").is_file()

    without_fsdp = tmp_path / "without_fsdp"
    shutil.copytree(stopped, without_fsdp, symlinks=True)
    code, out, err = finish(launch(stopped, "--resume", "auto"))
    assert code == 0, err[-3000:]
    assert f"resumed from {last} after epoch 0 and {state['step']} steps of epoch 1" in out
    assert_same_metrics(stopped, reference)
    code, out, err = finish(
        launch(tmp_path / "unused", "--eval-only", str(stopped), "--which", "last")
    )  # no sharding needed there
    assert code == 0 and f"top1 {metrics(stopped)[-1]['eval_top1']:.2f}" in out, err[-3000:]

    code, out, err = finish(launch(without_fsdp, "--resume", "auto", fsdp_version=None))
    assert code == 0, err[-3000:]
    assert_same_metrics(without_fsdp, reference)


@pytest.mark.parametrize(
    "fsdp_version, extra, expected",
    [
        (1, [], "FSDP1 (fsdp_version 1) is not supported"),
        (
            2,
            ["--reparametrize", "tcnn", "--reparametrize-at-epoch", "1"],
            "--reparametrize-at-epoch changes the model's",
        ),
    ],
)
def test_unsupported_fsdp_set_ups_are_one_line(tmp_path, launch, fsdp_version, extra, expected):
    output = tmp_path / "run"
    code, _, err = finish(launch(output, *extra, fsdp_version=fsdp_version))
    assert code != 0 and f"error: {expected}" in err, err[-3000:]
    assert not output.exists()
