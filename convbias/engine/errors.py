"""The ways a run stops on purpose, and the exit code of each (light to import: ``train.py --help`` loads no
torch). The codes above 2 follow sysexits.h, so a job script can tell them apart (docs/run-directory.md)."""

from __future__ import annotations

import errno
import os

EXIT_DIVERGED = 1  # NonFiniteLossError
EXIT_USAGE = 2  # ConfigError: a user mistake
EXIT_DAMAGED = 65  # DamagedCheckpointError (EX_DATAERR): a checkpoint file fails its checksum or is foreign
EXIT_STORAGE = 74  # StorageError (EX_IOERR): the output could not be written (full, read-only, removed)
EXIT_REQUEUE = getattr(os, "EX_TEMPFAIL", 75)  # engine.preemption.Preempted: a resume point, then requeue
EXIT_INTERRUPTED = 130  # Interrupted: Ctrl-C, as a shell reports SIGINT


class ConfigError(ValueError):
    """A user mistake in the options, the recipe files or the paths they name (exit code 2)."""


class NonFiniteLossError(RuntimeError):
    """Training diverged; the run stops before saving, so the last checkpoint is the last good one (exit 1)."""


class Interrupted(Exception):
    """Ctrl-C: the message says what was kept (exit code 130, as a shell reports SIGINT)."""


class UnreadableImageError(ConfigError):
    """An image file that PIL cannot decode, raised when unreadable images are not skipped (exit code 2).

    Raised in a DataLoader worker, it comes back with the worker's traceback as its message: only the
    original one-line message is kept."""

    def __init__(self, message: str):
        if "Traceback" in message:
            message = message.strip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


class DamagedCheckpointError(Exception):
    """A checkpoint that fails its manifest's checksums, or a file this engine did not write (exit code 65)."""


class StorageError(Exception):
    """Writing into the output failed: disk full, read-only, removed (exit code 74). The message says what
    failed, what is kept and how to resume."""


_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.ENOENT: "the output directory or a file in it was removed",
    errno.EACCES: "permission denied",
    errno.EIO: "an I/O error of the device",
}


def storage_reason(error: BaseException, directory: str | os.PathLike | None = None) -> str:
    """Why a write failed, in a few words: from the errno of an OSError, else (torch's and safetensors' own
    write errors carry none) from the state of ``directory``'s file system."""
    code = getattr(error, "errno", None)
    if code is None and directory is not None:
        try:
            stat = os.statvfs(directory)
            if stat.f_flag & os.ST_RDONLY:
                code = errno.EROFS
            elif stat.f_bavail * stat.f_frsize < 1 << 20:
                code = errno.ENOSPC
        except FileNotFoundError:
            code = errno.ENOENT
        except OSError:
            pass
    if code in _REASONS:
        return _REASONS[code]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
