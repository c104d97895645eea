"""Every console script reports what stops it the same way: one line and the engine's exit code; what is not
one of the package's errors (a ValueError or an OSError included) is a bug, shown with its traceback."""

import errno
import re
import subprocess
import sys

import pytest

from convbias.base import storage
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
        (ConfigError("a\n  two-line   message"), EXIT_USAGE, "error: a two-line message"),
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


def test_a_failed_write_names_the_file_and_the_disk(capsys, tmp_path, disk_full, file_faults):
    """The package's writers turn a failed write into a StorageError naming the file; the earlier file stays."""
    (tmp_path / "table.md").write_text("earlier\n")
    disk_full("replace", "table.md")  # the temporary written, its rename into place fails
    assert run_command(lambda: storage.write_text(tmp_path / "table.md", "new\n")) == EXIT_STORAGE
    file_faults.clear()
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"error: writing {re.escape(str(tmp_path))}/table.md failed \(no space left on the device: the disk at "
        r"\S+ has [\d.]+ \w+ free\); any earlier version of it is unchanged",
        err,
    ), err
    assert [p.name for p in tmp_path.iterdir()] == ["table.md"] and (tmp_path / "table.md").read_text() == "earlier\n"


@pytest.mark.parametrize("writer", ["output_folder", "staged_directory", "writing"])
def test_every_writer_of_the_package_reports_a_failed_write_as_a_storage_error(tmp_path, read_only, writer):
    """Where a folder cannot be made (the disk is read-only), each writer names the path and why."""
    read_only("mkdir")
    out = tmp_path / "out"
    kept = f"; nothing was written to {re.escape(str(out))}" if writer == "staged_directory" else ""
    with pytest.raises(
        StorageError, match=rf"^writing {re.escape(str(out))} failed \(the file system is read-only\){kept}$"
    ):
        if writer == "output_folder":
            storage.output_folder(out)
        elif writer == "staged_directory":
            with storage.staged_directory(out):
                pass
        else:
            with storage.writing(out):
                storage.file_system().mkdir(out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "error",
    [
        ZeroDivisionError(),
        ValueError("boom"),
        FileNotFoundError(errno.ENOENT, "No such file", "x"),
        OSError(errno.EROFS, "Read-only file system", "x"),
    ],
)
def test_a_bug_keeps_its_traceback(capsys, error):
    """Only the package's own errors are one line: a ValueError, a file not found that no check named first, or
    an OSError that no writer of the package reported as a StorageError comes from code that is not the
    package's or from a bug in it."""
    with pytest.raises(type(error)):
        run_command(raising(error))
    assert capsys.readouterr().err == ""
    assert run_command(lambda: None) == 0 and run_command(lambda: 3) == 3


def test_convbias_traceback_shows_what_is_behind_the_line(capsys, monkeypatch):
    """A refusal raised from a library's error (a model constructor's ValueError) is one line; CONVBIAS_TRACEBACK=1
    also shows where it arose."""
    monkeypatch.setenv("CONVBIAS_TRACEBACK", "1")

    def build():
        try:
            raise ValueError("kernel_size must be odd")
        except ValueError as error:
            raise ConfigError("cannot build the model: kernel_size must be odd") from error

    assert run_command(build) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "error: cannot build the model: kernel_size must be odd"
    assert "Traceback (most recent call last)" in err and "ValueError: kernel_size must be odd" in err


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


# A console script as its entry point runs it (``raise SystemExit(main())``), with what the command calls first,
# argparse's parsing, made to raise; train.py's --help and convbias-sweep load no torch.
SCRIPT = """
import argparse
from convbias.base.errors import ConfigError
from {module} import main

def fail(*args, **kwargs):
    raise {error}

argparse.ArgumentParser.parse_known_args = fail
raise SystemExit(main({argv!r}))
"""
SCRIPTS = [("convbias.cli.train", ["--help"]), ("convbias.studies.sweep.command", ["report", "runs.csv"])]


def run_script(module: str, argv: list[str], error: str) -> subprocess.CompletedProcess:
    script = SCRIPT.format(module=module, argv=argv, error=error)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module, argv", SCRIPTS, ids=["train", "sweep"])
def test_a_value_error_from_code_not_the_packages_is_a_traceback_and_exit_1(module, argv):
    bug = run_script(module, argv, 'ValueError("boom")')
    assert bug.returncode == 1 and bug.stdout == ""
    assert bug.stderr.startswith("Traceback (most recent call last)") and bug.stderr.endswith("ValueError: boom\n")
    assert not any(line.startswith("error:") for line in bug.stderr.splitlines()), bug.stderr
    mistake = run_script(module, argv, 'ConfigError("--lr must be > 0")')
    assert (mistake.returncode, mistake.stderr) == (EXIT_USAGE, "error: --lr must be > 0\n")


@pytest.mark.parametrize("module, argv", SCRIPTS, ids=["train", "sweep"])
def test_a_value_error_ends_main_with_its_traceback_in_process(monkeypatch, capsys, module, argv):
    """``main(argv)`` raises what is not the package's, so the interpreter prints its traceback (exit 1); a
    ConfigError is one line and exit 2."""
    import argparse
    import importlib

    main = importlib.import_module(module).main
    error: BaseException = ValueError("boom")

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", fail)
    with pytest.raises(ValueError, match="^boom$"):
        main(argv)
    assert capsys.readouterr().err == ""
    error = ConfigError("--lr must be > 0")
    assert main(argv) == EXIT_USAGE
    assert capsys.readouterr().err == "error: --lr must be > 0\n"
