"""`convbias-train` / `train.py`: train or evaluate any registered model (options: --help).

The entry point composes the pieces: the families register their models and contribute their
diagnostics and reparametrizations (`convbias.families`); the generic engine runs.
"""

from __future__ import annotations

import sys
from typing import Any

from convbias import engine


def run(argv: list[str]) -> dict[str, Any]:
    """train.py from Python: returns the content of results.json (raises ConfigError on bad input)."""
    from convbias.families import load_families  # not at the top: `--help` loads no model code (see main)

    return engine.run(argv, load_families())


def main(argv: list[str] | None = None) -> int:
    """train.py's exit code: 0, 2 for bad input (one `error:` line), 1 when training diverges."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        return engine.main(argv)  # the options alone: no torch, no registry
    from convbias.families import load_families  # not at the top: see run

    return engine.main(argv, load_families())


if __name__ == "__main__":
    raise SystemExit(main())
