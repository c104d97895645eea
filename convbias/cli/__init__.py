"""The generic console scripts (see pyproject's [project.scripts]); each module's `main(argv) -> exit code`.
Each study's own console script is its `command` module (convbias.studies), built on the same helpers: the
argparse pieces of ``convbias.base.command_line`` and the declared options of ``convbias.engine``.

Every command reports what stops it the same way (``run_command``, ``convbias.base.reporting``): one ``error: ...`` line (``interrupted:``
for Ctrl-C) and the engine's exit code of ``convbias.base.errors``: 2 bad input, 65 a damaged or foreign
checkpoint or run file, 74 an output that cannot be written (disk full, read-only), 130 Ctrl-C. Anything
else is a bug and keeps its traceback; with ``CONVBIAS_TRACEBACK=1`` every error shows its traceback after the line.
"""

from __future__ import annotations

from convbias.base.reporting import report, run_command

__all__ = ["report", "run_command"]
