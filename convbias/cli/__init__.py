"""Console scripts (see pyproject's [project.scripts]); each module's `main(argv) -> exit code`.

Every command reports what stops it the same way (``run_command``): one ``error: ...`` line (``interrupted:``
for Ctrl-C) and the engine's exit code of ``convbias.errors``: 2 bad input, 65 a damaged or foreign
checkpoint or run file, 74 an output that cannot be written (disk full, read-only), 130 Ctrl-C. Anything
else is a bug and keeps its traceback; with ``CONVBIAS_TRACEBACK=1`` every error shows its traceback after the line.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

from convbias.engine.config.command_line import OptionParser, key_value, yaml_scalar
from convbias.storage import storage_reason

__all__ = ["OptionParser", "key_value", "report", "run_command", "yaml_scalar"]


def report(error: BaseException) -> int:
    """Print ``error`` as one line on stderr and return its exit code; re-raise what is not a reported error."""
    from convbias.errors import exit_code, print_error, show_traceback, stop_prefix

    code = exit_code(error)
    if code is None:
        raise error
    message = str(error)
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
        where = Path(error.filename) if error.filename else None
        reason = storage_reason(error, where.parent if where else Path.cwd())
        message = f"writing {where} failed ({reason})" if where else f"a write failed ({reason})"
    print_error(message, stop_prefix(error))
    if show_traceback():
        traceback.print_exception(error)
    return code


def run_command(body: Callable[[], int | None]) -> int:
    """``body()``'s exit code (None is 0), or the one line and exit code of what stopped it (``report``)."""
    try:
        return body() or 0
    except (Exception, KeyboardInterrupt) as error:
        return report(error)
