"""convbias-sweep run in the test process, and the tiny options the tests' sweeps share."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from convbias.studies.sweep import command as sweep_command
from convbias.studies.sweep import sweep

# A ConViT and a DeiT of equal width and depth, small enough for a 1-second run on 8x8 digits.
TINY_MODEL_KWARGS = {"patch_size": 2, "embed_dim": 4, "depth": 2, "num_heads": 4, "local_up_to_layer": 1}
TINY_SET = {
    "dataset": "digits",
    "img_size": 8,
    "epochs": 1,
    "warmup_epochs": 0,
    "batch_size": 64,
    "workers": 0,
    "no_aug": True,
    "repeated_aug": 1,
    "diagnostics": False,
    "model_kwargs": TINY_MODEL_KWARGS,
}


@dataclass
class Done:
    """A command's exit code and what it wrote on each stream."""

    returncode: int
    stdout: str
    stderr: str


class TrainHere:
    """What the sweep starts for a run, ``python -m convbias.cli.train ARGS`` with both streams to the run's log,
    run as train.py's main in this process; ``wait`` gives its exit code. A train.py subprocess costs seconds of
    start-up: tests of what the sweep does with a run's outcome use this, the kill test a real subprocess."""

    def __init__(self, command: list[str], stdout, stderr) -> None:
        from convbias.cli import train

        assert command[:3] == [sys.executable, "-m", sweep.TRAIN_MODULE] and stderr == subprocess.STDOUT, command
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
            self.returncode = train.main(command[3:])

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def sweep_cli(*args: str, train_here: bool = False) -> Done:
    """convbias-sweep in this process; its train.py runs are subprocesses, or with ``train_here`` train.py's main
    in this process (``TrainHere``)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if train_here:
            here = SimpleNamespace(Popen=TrainHere, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired)
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(sweep, "subprocess", here)
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        code = sweep_command.main(list(args))
    return Done(code, out.getvalue(), err.getvalue())
