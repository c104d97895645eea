"""Every console script reports what stops it the same way: one line and the engine's exit code."""

import errno
import re

import pytest

from convbias.base.errors import (
    EXIT_DAMAGED,
    EXIT_INTERRUPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
    ConfigError,
    DamagedCheckpointError,
    StorageError,
)
from convbias.base.reporting import describe, report
from convbias.cli import run_command


def raising(error: BaseException):
    def body():
        raise error

    return body


@pytest.mark.parametrize(
    "error, code, line",
    [
        (ConfigError("--which must be one of last, best"), EXIT_USAGE, "error: --which must be one of last, best"),
        (ValueError("a\n  two-line   message"), EXIT_USAGE, "error: a two-line message"),
        (FileNotFoundError("run directory not found: x"), EXIT_USAGE, "error: run directory not found: x"),
        (
            DamagedCheckpointError("RUN/model.safetensors is damaged"),
            EXIT_DAMAGED,
            "error: RUN/model.safetensors is damaged",
        ),
        (StorageError("writing X failed (the file system is read-only)"), EXIT_STORAGE, None),
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "interrupted: stopped"),
    ],
)
def test_each_reported_error_is_one_line_and_its_exit_code(capsys, error, code, line):
    assert run_command(raising(error)) == code
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.strip() == (line or f"error: {error}")


def test_a_failed_write_names_the_file_and_the_disk(capsys, tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "figure.png"))
    assert run_command(raising(full)) == EXIT_STORAGE
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"error: writing {re.escape(str(tmp_path))}/figure.png failed \(no space left on the device: the disk at "
        r"\S+ has [\d.]+ \w+ free\)",
        err,
    ), err


def test_a_bug_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError):
        run_command(lambda: 1 / 0)
    assert run_command(lambda: None) == 0 and run_command(lambda: 3) == 3


def test_convbias_traceback_shows_what_is_behind_the_line(capsys, monkeypatch):
    """A ValueError from a model constructor reads like a user's mistake; CONVBIAS_TRACEBACK=1 shows where it arose."""
    monkeypatch.setenv("CONVBIAS_TRACEBACK", "1")
    assert run_command(raising(ValueError("bad kernel size"))) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "error: bad kernel size" and "Traceback (most recent call last)" in err
    assert "raise error" in err  # the frame that raised it


def test_the_line_and_code_of_an_error_and_only_rank_0_prints_it(capsys, monkeypatch):
    """``describe`` gives the line every command prints; in a launched run the other ranks print nothing (one
    line for the user, not one per process) and still get their code."""
    assert describe(DamagedCheckpointError("a\n  b")) == (EXIT_DAMAGED, "error: a b")
    with pytest.raises(ZeroDivisionError):
        describe(ZeroDivisionError())
    monkeypatch.setenv("RANK", "1")
    assert report(ConfigError("--lr must be > 0")) == EXIT_USAGE
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert report(ConfigError("--lr must be > 0")) == EXIT_USAGE
    assert capsys.readouterr().err == "error: --lr must be > 0\n"
