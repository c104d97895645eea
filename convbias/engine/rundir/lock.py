"""The run-directory lock: one run at a time writes into an output directory.

A run holds ``<output>/.lock`` for its whole life: the file names the holder (pid, host, start time)
and the holder keeps an exclusive ``fcntl.flock`` on it. The kernel drops that flock when the process
dies, however it dies (kill -9 included), so a lock file left behind by a dead run is recognised
as stale and taken over without anyone deleting it by hand; a live holder makes the second run stop
with one line naming its pid and host. (flock is per host: on a network file system shared by
several machines, a lock file written by another host is trusted while it exists: a run that ends,
fails or is interrupted removes it; only a killed one leaves it behind.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.inputs import special_file
from convbias.base.run_layout import LOCK_FILE
from convbias.base.storage import file_system


class RunLockedError(ConfigError):
    """Another live process holds the lock of this run directory."""


class ForeignLockError(DamagedInputError, RunLockedError):
    """The lock file's place holds a symbolic link, a hard link or no regular file (exit 65): the lock is never
    written through it, nor read from a FIFO."""


MAX_HOLDER_BYTES = 4096  # what a lock file's record of its holder can hold: a few dozen bytes are written


def _holder(fd: int) -> dict[str, Any]:
    """What the open lock file says about its holder ({} when it is empty or unreadable); read through its
    descriptor, bounded: the file checked at the open is the file read."""
    try:
        holder = json.loads(os.pread(fd, MAX_HOLDER_BYTES, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """``with RunLock(output): ...`` or ``acquire()`` / ``release()``.

    ``acquire`` creates the directory when needed (and ``release`` removes it again when the run wrote
    nothing else into it), so a run refused after locking leaves no trace. ``stale`` tells, after
    ``acquire``, the holder of a stale lock that was taken over (None when there was none).
    """

    def __init__(self, output: str | Path):
        self.output = Path(output)
        self.path = self.output / LOCK_FILE
        self.stale: dict[str, Any] | None = None
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> RunLock:
        """Take the lock or raise RunLockedError naming the live holder's pid and host."""
        if self._fd is not None:
            return self
        if not self.output.is_dir():
            self.output.mkdir(parents=True)
            self._created_dir = True
        while True:
            try:  # never through a link: a lock file that is one would overwrite what it points at
                fd = file_system().open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644
                )
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                self._cleanup_dir()
                raise ForeignLockError(
                    f"--output {self.output}: {self.path} is a symbolic link (to {os.readlink(self.path)}), not a "
                    f"lock file of train.py; nothing was written through it: remove the link or choose another --output"
                ) from None
            self._check_plain(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                self._cleanup_dir()
                raise RunLockedError(self._refusal(holder)) from None
            try:  # the file may have been released (unlinked) between our open and our flock: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _holder(fd)
        if previous.get("pid") and previous.get("host") not in (None, socket.gethostname()):
            os.close(fd)  # flock says nothing about another host's process: trust the file
            self._cleanup_dir()
            raise RunLockedError(self._refusal(previous) + f" (if that run is dead, delete {self.path})")
        self.stale = previous if previous.get("pid") else None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            os.ftruncate(fd, 0)
            file_system().pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError:  # a full or read-only disk: leave no empty lock file behind
            with contextlib.suppress(OSError):
                file_system().unlink(self.path)
            os.close(fd)
            self._cleanup_dir()
            raise
        self._fd = fd
        return self

    def _check_plain(self, fd: int) -> None:
        """ForeignLockError (fd closed) when the opened lock file is no regular file (a FIFO would block its
        reads) or has other names (a hard link: truncating it to record the holder would empty them too)."""
        status = os.fstat(fd)
        kind = special_file(status.st_mode) or ("a folder" if stat.S_ISDIR(status.st_mode) else None)
        if kind is None and status.st_nlink > 1:
            kind = f"a hard link ({status.st_nlink} names for one file)"
        if kind is None:
            return
        os.close(fd)
        self._cleanup_dir()
        raise ForeignLockError(
            f"--output {self.output}: {self.path} is {kind}, not a lock file of train.py; nothing was read from or "
            f"written through it: remove it or choose another --output"
        )

    def _refusal(self, holder: dict[str, Any]) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        since = f", since {holder['started']}" if holder.get("started") else ""
        return f"--output {self.output} is in use by another run ({who}{since}); wait for it or choose another --output"

    def release(self) -> None:
        """Drop the lock (and the directory, when acquire made it and nothing else was written)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # removed or read-only output: the file stays, recognizably stale
            file_system().unlink(self.path)
        os.close(self._fd)  # closing drops the flock
        self._fd = None
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._created_dir:
            try:
                self.output.rmdir()  # only when empty
                self._created_dir = False
            except OSError:
                pass

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def describe(holder: dict[str, Any]) -> str:
    """'pid 123 on host h' for messages about a stale lock that was taken over."""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
