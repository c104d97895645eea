"""train.py run in-process on a tiny ConViT, its stderr as messages, and run folders with resume points."""

import os
import re
from pathlib import Path

import torch

from convbias.base.run_layout import CONFIG_MARKER
from convbias.cli import train
from convbias.engine.checkpoint.points import CheckpointDir

PROGRESS = re.compile(r"^\s*epoch \d+/\d+:")  # a tqdm progress bar's line


def messages(stderr):
    """stderr's lines without the progress bars (tqdm redraws them on stderr)."""
    return [line for line in stderr.strip().splitlines() if line.strip() and not PROGRESS.match(line)]


def one_line(err: list[str], pattern: str) -> None:
    """``err`` is one line matching ``pattern``, with no traceback and no advice to unpickle."""
    assert len(err) == 1 and re.search(pattern, err[0]), err
    assert "Traceback" not in err[0] and "weights_only=False" not in err[0]


# A 1-block ConViT of width 8 on 8x8 digits: built in milliseconds.
TINY_TRAIN_ARGS = [
    "--model", "convit_tiny", "--model-kwargs", "patch_size=2", "depth=2", "local_up_to_layer=1", "embed_dim=8",
    "--img-size", "8", "--dataset", "digits", "--epochs", "1", "--warmup-epochs", "0", "--workers", "0", "--no-aug",
]  # fmt: skip


def run_train(capsys, *args: str) -> tuple[int, list[str]]:
    """train.py's main on ``TINY_TRAIN_ARGS`` and ``args``: its exit code and stderr's messages."""
    code = train.main([*TINY_TRAIN_ARGS, *args])
    return code, messages(capsys.readouterr().err)


def tree(root) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target (what a refusal must leave as it was)."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return found


def save_point(points: CheckpointDir, epoch: int, step: int = 0, is_best: bool = False) -> Path:
    """A resume point of a 3-to-2 linear model, saved through ``points`` as the engine saves one."""
    model = torch.nn.Linear(3, 2)
    points.stage(epoch, step)
    best = {"epoch": 1}  # the training state records the best point (epoch 1 in these tests)
    return points.save(epoch, model.state_dict(), {"model": "m", "epoch": epoch, "best": best}, None, {}, is_best, step)


def a_run(root, points: int = 1):
    """A run folder as train.py leaves it: its marked config.yaml and ``points`` resume points."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(f"{CONFIG_MARKER}\nmodel: convit_tiny\nlr: 0.001\n")
    checkpoints = CheckpointDir(root)
    for epoch in range(1, points + 1):
        save_point(checkpoints, epoch, is_best=epoch == 1)
    return root


class Pickled:
    """An object that a weights_only load refuses."""
