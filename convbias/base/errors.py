"""The ways a run stops on purpose, and the exit code of each (light to import: ``train.py --help`` loads no
torch). The codes above 2 follow sysexits.h, so a job script can tell them apart (docs/run-directory.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXIT_DIVERGED = 1  # NonFiniteLossError
EXIT_USAGE = 2  # ConfigError: a user mistake
EXIT_DAMAGED = 65  # DamagedFileError (EX_DATAERR): a file fails its checksum, does not read, or is foreign
EXIT_STORAGE = 74  # StorageError (EX_IOERR): the output could not be written (full, read-only, removed)
EXIT_REQUEUE = getattr(os, "EX_TEMPFAIL", 75)  # Preempted: a resume point, then requeue
EXIT_INTERRUPTED = 130  # Interrupted: Ctrl-C, as a shell reports SIGINT
# Set to 1, every command shows the traceback of what stopped it after its one line: to see the library error
# behind a refusal (a model constructor's ValueError behind its ConfigError).
TRACEBACK_VARIABLE = "CONVBIAS_TRACEBACK"


def show_traceback() -> bool:
    return os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")


class ConfigError(ValueError):
    """A user mistake in the options, the recipe files or the paths they name (exit code 2)."""


class NonFiniteLossError(RuntimeError):
    """Training diverged; the run stops before saving, so the last checkpoint is the last good one (exit 1)."""


class Interrupted(Exception):
    """Ctrl-C: the message says what was kept (exit code 130, as a shell reports SIGINT)."""


class DamagedFileError(Exception):
    """A file that is damaged or is not what it claims to be (exit code 65); the subclasses say whose."""


class DamagedCheckpointError(DamagedFileError):
    """A checkpoint that fails its manifest's checksums or that this engine did not write (exit code 65)."""


class DamagedRunRecordError(DamagedFileError):
    """A run's record of its results (results.json) that cannot be read; ``--resume auto`` rewrites it from the
    newest checkpoint (exit code 65)."""


class DamagedInputError(DamagedFileError, ConfigError):
    """A file the user named that is damaged or foreign: weights that do not read or do not fit their use
    (non-finite, integer into float), an image that does not decode, a folder that is not a run (exit code
    65). A ConfigError too, so the set-up checks that catch a user's mistake catch it."""


class UnreadableImageError(DamagedInputError):
    """An image file that PIL cannot decode, raised when unreadable images are not skipped (exit code 65).

    Raised in a DataLoader worker, it comes back with the worker's traceback as its message: only the
    original one-line message is kept."""

    def __init__(self, message: str):
        if "Traceback" in message:
            message = message.strip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


class RunBeingWrittenError(Exception):
    """A run still training removed, again and again, the resume point a command was reading (its rotation
    of superseded points): nothing is wrong with the run or the command; run it again (exit code 75)."""


class StorageError(Exception):
    """Writing into the output failed: disk full, read-only, removed (exit code 74). The message says what
    failed, what is kept and how to resume."""


class Preempted(Exception):
    """The run stopped on a preemption signal after writing ``point`` (exit code 75: the scheduler requeues)."""

    def __init__(self, signal_name: str, point: Path | None, epoch: int, step: int):
        self.signal_name, self.point, self.epoch, self.step = signal_name, point, epoch, step
        super().__init__(
            f"stopped by {signal_name} after step {step} of epoch {epoch + 1}; resume point {point} "
            f"(continue with --resume auto; exit code {EXIT_REQUEUE} asks the scheduler to requeue)"
        )


# Every command's one table: each way it stops, its exit code and the first word of its one line, in the
# order they are matched. Only the package's own errors and Ctrl-C are one line (a damaged input is a
# ConfigError too). Anything not in the table is a bug, shown with its traceback (exit 1): a ValueError, and an
# OSError, since every write the package makes reports its failure as a StorageError naming the file
# (base.storage) and every command names a missing input in a ConfigError before reading it.
STOPS: tuple[tuple[tuple[type[BaseException], ...], int, str], ...] = (
    ((Preempted,), EXIT_REQUEUE, "preempted"),
    ((RunBeingWrittenError,), EXIT_REQUEUE, "error"),
    ((DamagedFileError,), EXIT_DAMAGED, "error"),
    ((ConfigError,), EXIT_USAGE, "error"),
    ((StorageError,), EXIT_STORAGE, "error"),
    ((NonFiniteLossError,), EXIT_DIVERGED, "error"),
    ((Interrupted, KeyboardInterrupt), EXIT_INTERRUPTED, "interrupted"),
)


def exit_code(error: BaseException) -> int | None:
    """The exit code of an error that a command reports as one line (None: a bug, shown with its traceback)."""
    return next((code for kinds, code, _ in STOPS if isinstance(error, kinds)), None)


def stop_prefix(error: BaseException) -> str:
    """The first word of the one line that reports ``error``: error, interrupted or preempted."""
    return next((prefix for kinds, _, prefix in STOPS if isinstance(error, kinds)), "error")


def one_line(message: str, prefix: str = "error") -> str:
    """``prefix: message`` on one line (``prefix``: error, warning, interrupted or preempted)."""
    return f"{prefix}: " + (" ".join(message.split()) or "stopped")


def print_line(line: str) -> None:
    """A command's line on stderr, on a line of its own (an open progress bar is closed first), by rank 0 only
    in a launched run: one line for the user, not one per process."""
    tqdm = sys.modules.get("tqdm")  # a run stopped mid-epoch leaves its progress bar open
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", [])):
        bar.close()
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def print_error(message: str, prefix: str = "error") -> str:
    """The one way a command prints what stopped it (or warns): ``one_line`` through ``print_line``; returns
    the line."""
    line = one_line(message, prefix)
    print_line(line)
    return line
