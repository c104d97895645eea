"""Writing files so that a kill or a fault leaves the old version or the new one, never half of either.

Every command that writes results (train.py's bookkeeping, the sweep's CSVs, an export's folder) writes
through ``atomic_write`` (a file) or ``staged_directory`` (a folder): the new content goes under a hidden
temporary name, ``.<name>.tmp<pid>``, and is renamed into place only once complete. A write that fails
removes its temporary; one that is killed leaves it, and the next write of the same name removes it once
its process is gone (``remove_stale_temporaries``). Figures go through ``save_figure``, a log that grows
through ``open_append``, and output folders are made by ``output_folder`` (a study's or sweep's marked as
its owner's, ``run_layout.OwnedFolder``). Each of these refuses, before writing, a destination that is a file
another command reads (a run's, an exported model's, a study's or sweep's read-back files:
``check_destination``), unless the writer names that folder as its ``owner`` (train.py writing its own run, a
study its own folder). A whole-file write replaces the name it is given, so it never writes through a link
of either kind; an append would, so ``open_append`` refuses a file that is not plain.

A write that fails (disk full, read-only, removed) is a ``StorageError`` naming the file and why
(``write_failure``; ``storage_reason`` names the disk and the space it needs when it is full): every writer here
raises it, and a command writing by other means wraps the write in ``writing(path)``. An ``OSError`` that reaches
a command's reporter is no write the package made, so it is a bug and keeps its traceback. Light to import: no
torch.

The calls these writers make to the file system (and those of the resume points' writer, the run log, the run lock,
the export and the weights reader) go through one ``FileSystem``, ``file_system()``: ``with using(other):``
replaces it for the block, so that a test puts a full disk, a read-only one or a kill at a real call of the
package, wherever the code making it lives.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import ConfigError, DamagedInputError, StorageError
from .inputs import check_plain_file
from .run_layout import (
    OWNER_FILE,
    OwnedFolder,
    check_destination,
    check_output_folder,
    check_owned_files,
    marked_owner,
    owner_mark,
)

_REASONS = {
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.ENOENT: "the output directory or a file in it was removed",
    errno.EACCES: "permission denied",
    errno.EIO: "an I/O error of the device",
}
_MIN_FREE = 1 << 20  # below this a write without an errno (torch's, safetensors') is taken as a full disk


class FileSystem:
    """The file-system calls of the package's writers and of its weights reader: the OS's, and the writes of
    safetensors, torch and timm (imported by the call that needs them). A subclass overrides what it changes."""

    def write_text(self, path: Path, text: str) -> None:
        path.write_text(text, newline="")

    def append_text(self, path: Path, text: str) -> None:
        with open(path, "a", newline="") as f:
            f.write(text)

    def copy_file(self, source: Path, target: Path) -> None:
        shutil.copyfile(source, target)

    def replace(self, source: Path, target: Path) -> None:
        os.replace(source, target)

    def rename(self, source: Path, target: Path) -> None:
        os.rename(source, target)

    def mkdir(self, path: Path, parents: bool = False, exist_ok: bool = False) -> None:
        path.mkdir(parents=parents, exist_ok=exist_ok)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int:
        return os.open(path, flags, mode)

    def pwrite(self, descriptor: int, data: bytes, offset: int) -> int:
        return os.pwrite(descriptor, data, offset)

    def save_safetensors(self, tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata=metadata)

    def save_torch(self, obj: Any, path: Path) -> None:
        import torch

        torch.save(obj, path)

    def save_hf(self, model: Any, folder: Path, **kwargs: Any) -> None:
        """timm's ``save_for_hf`` of ``model`` into ``folder`` (its weights and config.json)."""
        from timm.models import save_for_hf

        save_for_hf(model, folder, **kwargs)

    def load_safetensors(self, path: Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(path))


_file_system = FileSystem()


def file_system() -> FileSystem:
    """The FileSystem the package's writes go through (``using`` replaces it)."""
    return _file_system


@contextlib.contextmanager
def using(replacement: FileSystem) -> Iterator[FileSystem]:
    """``with using(faulty):`` the package's file-system calls are ``faulty``'s until the block ends."""
    global _file_system
    previous, _file_system = _file_system, replacement
    try:
        yield replacement
    finally:
        _file_system = previous


def temporary_name(path: Path) -> Path:
    """Where ``path``'s new version is written before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporaries of ``path`` that killed writers left (their process is gone); returns them."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.tmp(\d+)")
    removed = []
    for candidate in path.parent.glob(f".{path.name}.tmp*") if path.parent.is_dir() else ():
        match = pattern.fullmatch(candidate.name)
        if not match or int(match[1]) == os.getpid() or _alive(int(match[1])):
            continue
        with contextlib.suppress(OSError):
            if candidate.is_dir() and not candidate.is_symlink():
                shutil.rmtree(candidate)
            else:
                candidate.unlink()
            removed.append(candidate)
    return removed


def write_failure(error: BaseException, path: str | os.PathLike, kept: str = "") -> StorageError:
    """The StorageError of a failed write of ``path``: the file, why (``storage_reason``) and, given, what is
    kept. Raise it ``from error``: the cause is what ``storage_reason`` reads when the error is reported again."""
    path = Path(path)
    return StorageError(f"writing {path} failed ({storage_reason(error, path.parent)})" + (f"; {kept}" if kept else ""))


@contextlib.contextmanager
def writing(path: str | os.PathLike, kept: str = "") -> Iterator[None]:
    """``with writing(path):`` an OSError of the block is the StorageError of a failed write of ``path``."""
    try:
        yield
    except OSError as error:
        raise write_failure(error, path, kept) from error


STANDARD_OUTPUT = "standard output"


class _GuardedStream:
    """A text stream whose failed writes are the StorageError of standard output, not an OSError that a
    command would take for its own output folder's (or report as a bug)."""

    def __init__(self, stream: Any):
        self._stream = stream

    def _failed(self, error: OSError) -> StorageError:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # what is left is dropped at exit, not
            devnull = os.open(os.devnull, os.O_WRONLY)  # written again (a second error at exit)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        return StorageError(f"writing to {STANDARD_OUTPUT} failed ({storage_reason(error)})")

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise self._failed(error) from error

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise self._failed(error) from error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_standard_output() -> Iterator[None]:
    """While the block runs, a failed write to ``sys.stdout`` (a full disk, a closed pipe) is a StorageError naming
    standard output; what the block printed is flushed before it ends, so a failure is reported by the command."""
    if isinstance(sys.stdout, _GuardedStream) or sys.stdout is None:
        yield
        return
    original = guard = sys.stdout
    sys.stdout = guard = _GuardedStream(original)
    try:
        yield
        guard.flush()
    except BaseException:
        with contextlib.suppress(StorageError):  # what stopped the block is the error to report
            guard.flush()
        raise
    finally:
        if sys.stdout is guard:
            sys.stdout = original


def atomic_write(
    path: str | os.PathLike, write: Callable[[Path], None], owner: str | os.PathLike | None = None
) -> None:
    """Call ``write(tmp_path)``, then rename tmp_path over ``path``: readers see the old or the new file.
    ``owner``: the run folder the writer owns (``check_destination``). A failed write is a StorageError naming
    ``path``; an earlier version of it stays as it was."""
    path = Path(path)
    check_destination(path, owner=owner)
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    try:
        with writing(path, kept="any earlier version of it is unchanged"):
            write(tmp)
            file_system().replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # on a read-only or removed output there is nothing to clean
            tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str, owner: str | os.PathLike | None = None) -> None:
    """``atomic_write`` of a text file (LF line endings as given)."""
    atomic_write(path, lambda tmp: file_system().write_text(tmp, text), owner)


def save_figure(fig: Any, path: str | os.PathLike, **savefig: Any) -> Path:
    """``atomic_write`` of a matplotlib figure, in the format of ``path``'s suffix; returns ``path``."""
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip("."), **savefig))
    return path


def check_output(
    path: str | os.PathLike, option: str = "--output", owned: OwnedFolder | None = None, writer: str | None = None
) -> Path:
    """What ``output_folder`` checks, without writing: the folder is no run's or exported model's
    (``run_layout.check_output_folder``); with ``owned``, no other command's marked folder; with ``writer`` (a
    command that writes into unmarked folders or others'), a marked folder only where it is a guest; and the files
    of its declaration (``owned``'s, else its mark's) are plain (``run_layout.check_owned_files``)."""
    path = Path(path)
    check_output_folder(path, option)
    marked = marked_owner(path)
    if owned is not None and marked is not None and marked.owner != owned.owner:
        raise ConfigError(
            f"{option} {path} is the output folder of {marked.owner} (its {OWNER_FILE}); {owned.owner} writes into a "
            f"folder of its own: choose another {option}"
        )
    if writer is not None and marked is not None and not marked.admits(writer):
        raise ConfigError(
            f"{option} {path} is the output folder of {marked.owner} (its {OWNER_FILE}), which {writer} does not "
            f"write into: choose another {option}"
        )
    if os.path.lexists(path / OWNER_FILE):  # the mark is a file the package wrote: plain, naming its owner
        check_plain_file(path / OWNER_FILE, f"{option} {path}: its file", DamagedInputError)
        if marked is None:
            raise DamagedInputError(
                f"{option} {path}: its {OWNER_FILE} names no command of this package; nothing was written: move it away"
            )
    declared = owned or marked
    if declared is not None:
        check_owned_files(path, declared, option)
    return path


def output_folder(
    path: str | os.PathLike, option: str = "--output", owned: OwnedFolder | None = None, writer: str | None = None
) -> Path:
    """Make a command's output folder (and its parents) once ``check_output`` passes; with ``owned``, mark it as
    that declaration's owner's (``OWNER_FILE``), so the guard keeps its read-back files from other commands.
    Returns it."""
    path = check_output(path, option, owned, writer)
    with writing(path):
        file_system().mkdir(path, parents=True, exist_ok=True)
    if owned is not None and marked_owner(path) is None:
        write_text(path / OWNER_FILE, owner_mark(owned), owner=path)
    return path


def open_append(path: str | os.PathLike, owner: str | os.PathLike | None = None, what: str = "file") -> IO[str]:
    """``path`` opened to append text (created when absent), once ``check_destination`` passes: never through a
    symbolic link (``O_NOFOLLOW``) and never a file with other names (a hard link) or no regular file, which
    are a DamagedInputError naming it as ``what`` (exit 65); a failed open is a StorageError. The caller closes
    it."""
    path = Path(path)
    check_destination(path, owner=owner)
    if os.path.lexists(path):
        check_plain_file(path, what, DamagedInputError)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with writing(path):
        try:
            descriptor = file_system().open(path, flags, 0o644)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENXIO):  # a link, or a FIFO without a reader, put there meanwhile
                check_plain_file(path, what, DamagedInputError)
            raise
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:  # swapped in between: named, never written
            os.close(descriptor)
            check_plain_file(path, what, DamagedInputError)
            raise DamagedInputError(f"{what} {path} changed while it was opened; nothing was written")
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "a", encoding="utf-8", newline="")


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike) -> Iterator[Path]:
    """``with staged_directory(out) as tmp:`` fill ``tmp``; it becomes ``out`` (absent or empty) on success
    and is removed on any failure, so ``out`` never holds half of what was written (a StorageError says so)."""
    path = Path(path)
    check_destination(path)
    tmp = temporary_name(path)
    kept = f"nothing was written to {path}"
    with writing(path, kept):
        file_system().mkdir(path.parent, parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        shutil.rmtree(tmp, ignore_errors=True)
        file_system().mkdir(tmp)
    try:
        yield tmp
        with writing(path, kept):
            if path.exists():
                path.rmdir()  # empty: a non-empty one is the caller's to refuse
            file_system().replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def disk_of(path: str | os.PathLike) -> Path:
    """The mount point of the file system that holds ``path`` (or would hold it)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int | None:
    try:
        stat = os.statvfs(disk_of(path))
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def size_text(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def storage_reason(error: BaseException, directory: str | os.PathLike | None = None, needed: int | None = None) -> str:
    """Why a write into ``directory`` failed, in a few words: from the errno of an OSError, else (torch's and
    safetensors' own write errors carry none) from the state of the directory's file system. A full disk is
    named with its free space and, when known, the ``needed`` bytes. A ``write_failure`` is read by its cause."""
    if isinstance(error, StorageError) and error.__cause__ is not None:
        error = error.__cause__
    code = getattr(error, "errno", None)
    if code is None and directory is not None:
        try:
            stat = os.statvfs(disk_of(directory))
            if stat.f_flag & os.ST_RDONLY:
                code = errno.EROFS
            elif stat.f_bavail * stat.f_frsize < max(needed or 0, _MIN_FREE):
                code = errno.ENOSPC
        except OSError:
            pass
    if code == errno.ENOSPC:
        if directory is None:
            return "no space left on the device"
        free = free_bytes(directory)
        room = f"{size_text(free)} free" if free is not None else "its free space unknown"
        need = f"; this write needs about {size_text(needed)}" if needed else ""
        return f"no space left on the device: the disk at {disk_of(directory)} has {room}{need}"
    if code in _REASONS:
        return _REASONS[code]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
