"""`accelerate launch convbias-train` on an ImageFolder, and resume after SIGKILL giving the same metrics.

The killed run is `accelerate launch --cpu --num_processes 1 convbias-train ...` (the installed console
scripts) in a subprocess, with the DeiT recipe defaults (RandAugment, mixup/cutmix, random erasing, repeated
augmentation, drop path, 4 data workers): the resumed run only matches if every RNG stream and the schedule
are restored from what the killed process left on disk. The uninterrupted run and the resume are the same
train.py command in this process, on one thread and with the settings the launch gives its process (a launch
costs two interpreters' start-up).
"""

import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support import REPO

from convbias.cli import train

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

DETERMINISTIC_FIELDS = ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr")
# what `accelerate launch --cpu --mixed_precision no --dynamo_backend no` sets in its process's environment
LAUNCH_ENVIRONMENT = {
    "ACCELERATE_USE_CPU": "True",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_DYNAMO_BACKEND": "NO",
}


def write_image_folder(root: Path, per_class: dict[str, int], size: int = 16) -> None:
    """Two classes of RGB PNGs a model can tell apart (bright left half vs bright right half)."""
    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for label in range(2):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True)
            for i in range(count):
                image = rng.integers(0, 90, (size, size, 3), dtype=np.uint8)
                image[:, label * size // 2 : (label + 1) * size // 2] += 150
                Image.fromarray(image).save(folder / f"{i}.png")


def launch_command(console_script, *train_arguments: str) -> list[str]:
    return [
        console_script("accelerate"),
        "launch",
        "--cpu",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        console_script("convbias-train"),
        *train_arguments,
    ]


def train_arguments(data_dir: Path, output: Path, *extra: str) -> list[str]:
    return [
        "-c",
        str(REPO / "configs" / "recipes" / "deit.yaml"),  # the DeiT recipe, batch 64
        "--model",
        "convit_tiny",
        "--dataset",
        "folder",
        "--data-dir",
        str(data_dir),
        "--img-size",
        "16",
        "--model-kwargs",  # a 2-block ConViT of width 48 on 16 tokens: the launch, not the model, is under test
        "patch_size=4",
        "depth=2",
        "local_up_to_layer=1",
        "embed_dim=48",
        "--epochs",
        "2",
        "--output",
        str(output),
        *extra,
    ]


def train_as_launched(folder: Path, arguments: list[str]) -> int:
    """train.py's exit code, run in this process with the environment `launch_command` gives its process."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in LAUNCH_ENVIRONMENT.items():
            patch.setenv(name, value)
        patch.chdir(folder)
        return train.main(arguments)


def summary(output: Path) -> list[tuple[str, ...]]:
    with open(output / "summary.csv", newline="") as f:
        return [tuple(row[k] for k in DETERMINISTIC_FIELDS) for row in csv.DictReader(f)]


def test_launched_run_and_resume_after_kill(tmp_path, console_script, capsys):
    data = tmp_path / "data"
    write_image_folder(data, {"train": 32, "val": 4})  # 64 training images: one batch of the default 64
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    uninterrupted = tmp_path / "uninterrupted"
    assert train_as_launched(tmp_path, train_arguments(data, uninterrupted)) == 0
    assert (uninterrupted / "results.json").is_file()
    reference = summary(uninterrupted)
    assert [row[0] for row in reference] == ["1", "2"]

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        launch_command(console_script, *train_arguments(data, killed)),
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first_checkpoint = killed / "checkpoints" / "last" / "training_state.pt"
    deadline = time.monotonic() + 300
    while not first_checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=120)
    assert first_checkpoint.exists(), "the run ended before writing its first checkpoint"
    assert not (killed / "results.json").exists(), "the run finished before it could be killed"

    capsys.readouterr()
    assert train_as_launched(tmp_path, train_arguments(data, killed, "--resume", "auto")) == 0
    assert "resumed from" in capsys.readouterr().out
    assert summary(killed) == reference
    logged = [json.loads(line) for line in (killed / "log.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in logged] == [1, 2]
    assert json.loads((killed / "results.json").read_text())["final_top1"] == float(reference[-1][3])
