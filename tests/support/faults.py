"""Faults at the package's file-system calls (``convbias.base.storage.FileSystem``): a full or read-only disk, a
kill, an output removed meanwhile, each at a real call of the package, wherever the code making it lives. The
fixtures of tests/conftest.py (``file_faults``, ``disk_full``, ``read_only``, ``killed_at``) install them for a
test; a fixture of a wider scope enters ``storage.using(FaultyFileSystem(...))`` itself."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convbias.base.storage import FileSystem

PARTIAL = b"half a file"  # what a failed binary write leaves


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def read_only_disk() -> OSError:
    return OSError(errno.EROFS, os.strerror(errno.EROFS))


@dataclass
class Fault:
    """At the ``at``-th call (and the ``times - 1`` after it) of the FileSystem method ``on`` whose file's name
    holds ``name`` (a move's or copy's target; any file when empty): ``meanwhile(path)`` runs first (another
    process at work), then, with ``partial``, part of the content is written, and ``error`` is raised (an OSError
    naming that file, as the OS's do); without an error the call then goes through."""

    on: str
    error: BaseException | None = None
    name: str = ""
    at: int = 1
    times: int = 1
    partial: bool = False
    meanwhile: Callable[[Path], None] | None = None
    seen: int = 0  # the calls that matched so far

    def __post_init__(self) -> None:
        if not callable(getattr(FileSystem, self.on, None)):
            raise ValueError(f"FileSystem has no call {self.on!r}")

    def due(self, on: str, path: Path | None) -> bool:
        if on != self.on or (self.name and (path is None or self.name not in path.name)):
            return False
        self.seen += 1
        return self.at <= self.seen < self.at + self.times


class FaultyFileSystem(FileSystem):
    """The real file system but for the faults ``add``ed (or given); ``clear()`` drops them all."""

    def __init__(self, *faults: Fault):
        self.faults = list(faults)

    def add(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        self.faults.clear()

    def _call(self, on: str, path: Path | None, real: Callable[[], Any], partial: Callable[[], None]) -> Any:
        for fault in self.faults:
            if not fault.due(on, None if path is None else Path(path)):
                continue
            if fault.meanwhile is not None:
                fault.meanwhile(Path(path))
            if fault.error is not None:
                if fault.partial:
                    partial()
                raise _naming(fault.error, path)
        return real()

    def _binary(self, path: Path) -> Callable[[], None]:
        """A partial binary write: a few bytes at ``path`` (in it, as ``partial``, when it is a folder)."""
        return lambda: (Path(path) / "partial" if Path(path).is_dir() else Path(path)).write_bytes(PARTIAL)

    def write_text(self, path, text):
        write = super().write_text
        return self._call("write_text", path, lambda: write(path, text), lambda: write(path, text[: len(text) // 2]))

    def append_text(self, path, text):
        append = super().append_text
        half = text[: len(text) // 2]
        return self._call("append_text", path, lambda: append(path, text), lambda: append(path, half))

    def copy_file(self, source, target):
        copy = super().copy_file
        half = lambda: Path(target).write_bytes(Path(source).read_bytes()[: Path(source).stat().st_size // 2])  # noqa: E731
        return self._call("copy_file", target, lambda: copy(source, target), half)

    def replace(self, source, target):
        replace = super().replace
        return self._call("replace", target, lambda: replace(source, target), _none)

    def rename(self, source, target):
        rename = super().rename
        return self._call("rename", target, lambda: rename(source, target), _none)

    def mkdir(self, path, parents=False, exist_ok=False):
        mkdir = super().mkdir
        return self._call("mkdir", path, lambda: mkdir(path, parents, exist_ok), _none)

    def unlink(self, path):
        unlink = super().unlink
        return self._call("unlink", path, lambda: unlink(path), _none)

    def open(self, path, flags, mode=0o777):
        open_ = super().open
        return self._call("open", path, lambda: open_(path, flags, mode), _none)

    def pwrite(self, descriptor, data, offset):
        pwrite = super().pwrite
        return self._call("pwrite", None, lambda: pwrite(descriptor, data, offset), _none)

    def save_safetensors(self, tensors, path, metadata=None):
        save = super().save_safetensors
        return self._call("save_safetensors", path, lambda: save(tensors, path, metadata), self._binary(path))

    def save_torch(self, obj, path):
        save = super().save_torch
        return self._call("save_torch", path, lambda: save(obj, path), self._binary(path))

    def save_hf(self, model, folder, **kwargs):
        save = super().save_hf
        return self._call("save_hf", folder, lambda: save(model, folder, **kwargs), self._binary(folder))

    def load_safetensors(self, path):
        load = super().load_safetensors
        return self._call("load_safetensors", path, lambda: load(path), _none)


def _naming(error: BaseException, path: Path | None) -> BaseException:
    """``error`` as the OS raises it: an OSError names the file of the call."""
    if isinstance(error, OSError) and error.filename is None and path is not None:
        return OSError(error.errno, error.strerror, str(path))
    return error


def _none() -> None:
    """No partial write: the call makes or moves a file whole, or fails."""
