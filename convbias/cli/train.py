"""`convbias-train` / `train.py`: train or evaluate any registered model (options: --help).

The entry point composes the pieces: the families register their models and contribute their diagnostics and
reparametrizations (`convbias.families`); the generic engine runs (`engine.run`) and raises the package's
errors; this module reports them: one line (printed by rank 0) and the exit code of `convbias.base.errors.STOPS`
(2 bad input, 1 diverged, 65 damaged checkpoint, 74 output not writable, 75 preempted, 130 Ctrl-C). Any other
exception is a bug and keeps its traceback. Under `convbias-launch` each rank also leaves its code and line in the
launcher's folder (accelerate's launchers exit 1 whatever the code; torchrun may stop rank 0 before it prints).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

from convbias import engine
from convbias.base.errors import exit_code, print_error
from convbias.base.reporting import describe, report
from convbias.base.storage import guarded_standard_output
from convbias.cli.launch import LAUNCH_EXIT_DIR, LAUNCH_PROCESSES
from convbias.families import Families, load_families

# the variables accelerate reads the number of processes from (torchrun's, then MPI's)
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def run(argv: list[str], families: Families | None = None) -> dict[str, Any]:
    """train.py from Python: returns the content of results.json (raises ConfigError on bad input). ``families``:
    the loaded families (``load_families()``, called here when not given), registered before the options are
    checked so that an unknown --model is named with the rest."""
    return engine.run(argv, families or load_families())


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """train.py's exit code: 0, or the code of what stopped the run, reported in one line. ``families``: as
    ``run``'s (a test's own family plugged in: ``load_families((*FAMILIES, "toy_family"))``)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        for warning in launch_warnings():  # before the options' checks: said even when they refuse the command line
            print_error(warning, prefix="warning")
        with guarded_standard_output():  # a failed write to it is standard output's, not the run's output's
            if any(arg in ("-h", "--help") for arg in argv):
                engine.run(argv)  # the options alone: no torch, no registry
            else:
                run(argv, families)
    except (Exception, KeyboardInterrupt) as error:
        if exit_code(error) is None:  # no code in errors.STOPS: a bug, with its traceback
            raise
        code = report(error)
        leave_exit_code(code, describe(error)[1])
        return code
    leave_exit_code(0)
    return 0


def leave_exit_code(code: int, line: str = "") -> None:
    """Under convbias-launch: this rank's exit code and line, for the launcher to exit with."""
    folder = os.environ.get(LAUNCH_EXIT_DIR)
    if folder:
        with contextlib.suppress(OSError):  # the launcher then reports the process's own exit status
            (Path(folder) / f"rank{os.environ.get('RANK', '0')}").write_text(f"{code}\n{line}\n")


def launch_warnings() -> list[str]:
    """A launch that started fewer processes than --num_processes asked for: accelerate's launcher runs one
    process unless --multi_gpu is given (`--cpu --num_processes 2` included) and says nothing."""
    asked = processes_asked()
    # a value that is not a count is the engine's to refuse (engine.check_launch_environment)
    counts = (os.environ.get(name, "") for name in WORLD_SIZE_VARIABLES)
    started = next((int(count) for count in counts if count.isdigit()), 1)
    if asked is None or asked <= started:
        return []
    return [
        f"this launch started {started} of the {asked} processes that --num_processes asks for (accelerate launch "
        f"runs one unless --multi_gpu is given, --cpu included); on CPUs run `convbias-launch --cpu --num_processes "
        f"{asked} ...` or `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {asked} ...`"
    ]


def processes_asked() -> int | None:
    """The --num_processes of this launch, or None where it is not known: convbias-launch passes it on; under
    `accelerate launch` it is read, with accelerate's own parser, from the command line of the launcher (this
    process's parent; Linux's /proc)."""
    if os.environ.get(LAUNCH_PROCESSES):
        return int(os.environ[LAUNCH_PROCESSES])
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (OSError, UnicodeDecodeError):
        return None
    for index, arg in enumerate(parent):
        if os.path.basename(arg) == "accelerate" and parent[index + 1 : index + 2] == ["launch"]:
            options = parent[index + 2 :]
        elif arg.endswith(("accelerate-launch", "accelerate.commands.launch", "accelerate/commands/launch.py")):
            options = parent[index + 1 :]
        else:
            continue
        from accelerate.commands.launch import launch_command_parser  # only under accelerate's launcher

        with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):  # it parsed them before
            return launch_command_parser().parse_args(options).num_processes
        return None
    return None


if __name__ == "__main__":
    raise SystemExit(main())
