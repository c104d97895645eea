"""Former spellings of the commands' options: still accepted, each named once on stderr with what replaces it.

A command adds them with ``action=Deprecated`` (stored like the option they stand for) and calls ``announce``
once parsing is done, so that an option given twice, or a run of several values, is still one ``note:`` line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

NOTES = "_deprecation_notes"  # where the parsed namespace keeps its notes until ``announce``


class Deprecated(argparse.Action):
    """Stores its value like a plain option and records ``note``, formatted with the value (``{}``), for
    ``announce``; with ``when``, only for the values it is true of (a former meaning of a kept option)."""

    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        note: str = "",
        when: Callable[[Any], bool] | None = None,
        **kwargs: Any,
    ):
        super().__init__(option_strings, dest, **kwargs)
        self.note, self.when = note, when

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string=None
    ) -> None:
        setattr(namespace, self.dest, values)
        if self.when is None or self.when(values):
            shown = " ".join(map(str, values)) if isinstance(values, list) else str(values)
            notes = namespace.__dict__.setdefault(NOTES, {})
            notes[option_string] = f"note: {option_string} is deprecated; {self.note.format(shown)}"


def announce(args: argparse.Namespace) -> None:
    """Print each deprecated spelling's note once and drop them from ``args`` (which then holds options only)."""
    for line in args.__dict__.pop(NOTES, {}).values():
        print(line, file=sys.stderr)
