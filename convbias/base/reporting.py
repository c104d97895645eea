"""The one reporter of every command (the console scripts and the engine's ``main``): what stopped a command as
one line on stderr (``error: ...``, ``interrupted: ...`` for Ctrl-C) and its exit code from ``errors.STOPS``;
what is not one of the package's reported errors (a ValueError or an OSError included) is re-raised with its
traceback."""

from __future__ import annotations

import traceback
from collections.abc import Callable

from .errors import exit_code, one_line, print_line, show_traceback, stop_prefix
from .storage import guarded_standard_output


def describe(error: BaseException) -> tuple[int, str]:
    """(exit code, the one line) of an error that a command reports; re-raises what is not one (a bug)."""
    code = exit_code(error)
    if code is None:
        raise error
    return code, one_line(str(error), stop_prefix(error))


def report(error: BaseException) -> int:
    """Print ``error`` as one line on stderr (``describe``) and return its exit code; re-raise what is not a
    reported error."""
    code, line = describe(error)
    print_line(line)
    if show_traceback():
        traceback.print_exception(error)
    return code


def run_command(body: Callable[[], int | None]) -> int:
    """``body()``'s exit code (None is 0), or the one line and exit code of what stopped it (``report``); a
    failed write to standard output is a StorageError naming it (``storage.guarded_standard_output``)."""
    try:
        with guarded_standard_output():
            return body() or 0
    except (Exception, KeyboardInterrupt) as error:
        return report(error)
