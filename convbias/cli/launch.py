"""`convbias-launch`: `accelerate launch` that ends with the engine's one line and exits with its code.

    convbias-launch [accelerate launch options] train.py ARGS...     (or: -m convbias.cli.train ARGS...)
    convbias-launch --cpu --num_processes 2 train.py -c RECIPE --output OUT

Why: `accelerate launch` exits 1 whatever the engine's exit code (2 bad input, 65 damaged checkpoint, 74
output not writable, 75 preempted, 130 Ctrl-C: docs/run-directory.md), so a job script cannot requeue on 75;
it ends a failed run with a traceback of its own (CalledProcessError, torchrun's ChildFailedError report, a
KeyboardInterrupt after the engine's `interrupted:` line); and its `--cpu` starts one process whatever
--num_processes says.

How, in the simplest way that keeps accelerate's meaning of every option: accelerate's launcher
(`launch_command`, what `accelerate launch` runs) runs in this process, and the training processes write
straight to the terminal (nothing is filtered: running `accelerate launch` as a subprocess and filtering its
stderr would also filter the ranks', which share it, and a rank's own traceback must stay). Around it:

- `--cpu --num_processes N` (N > 1) runs as accelerate's multi-CPU form, `--multi_gpu` with
  ACCELERATE_USE_CPU=1 (torchrun, gloo), said in one line.
- Without an accelerate config, the values accelerate would default with a warning of several lines are passed
  to it, with their defaults, and named in one note; with a config, the note names the file accelerate reads.
- The engine is told the process count asked for (`LAUNCH_PROCESSES`: train.py warns when it got fewer)
  and a folder where every rank leaves its exit code and its one line (`LAUNCH_EXIT_DIR`). The
  launcher exits with the lowest rank's non-zero code and prints that rank's line when rank 0 did not
  (torchrun stops the other ranks as soon as one fails, which can be before rank 0 printed). A process that
  left no code (a bug, its traceback above; a kill) gets one line naming it and its status: the rank that stopped
  first (torchrun lists it before those it stopped after it), with what the run kept and `--resume auto`.
- The launcher's exceptions are caught (so accelerate's --quiet is not needed: it would hide the exit
  status of the simple launcher's process) and torchrun's log lines (closing signals, failure report) left
  out: the engine's line says what happened.
- Signals. One process runs under accelerate's simple launcher, in this process group: Ctrl-C in the
  terminal reaches it directly, so this process lets SIGINT pass (no second interrupt in the run, no
  traceback here; a SIGINT sent to this process alone is not passed on) and forwards SIGTERM, SIGHUP and SIGUSR1 (the engine's preemption signals). Several
  processes run under torchrun, each in a session of its own: torchrun forwards SIGINT, SIGTERM, SIGHUP and
  (asked here) SIGUSR1, and kills what has not exited 30 s later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT). A signal
  before any training process exists ends the launcher with the engine's line and code (130, 75).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from convbias.base.command_line import Typed
from convbias.base.errors import EXIT_INTERRUPTED, EXIT_REQUEUE, ConfigError, StorageError, print_error
from convbias.base.storage import writing
from convbias.cli import run_command
from convbias.engine import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Check

USAGE = "convbias-launch [accelerate launch options] train.py ARGS..."
# What the launcher tells train.py (convbias.cli.train): the process count it was asked for (accelerate's launcher
# puts none in the environment), and the folder where each rank leaves its exit code and its one line (rank<RANK>)
LAUNCH_PROCESSES = "CONVBIAS_LAUNCH_PROCESSES"
LAUNCH_EXIT_DIR = "CONVBIAS_LAUNCH_EXIT_DIR"
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)  # the engine's default --preempt-signals
# torchrun's signals to forward (its --signals_to_handle, read from PET_*), with SLURM's warning signal added
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
ANY_RANK = -1


class _Stopped(Exception):
    """A signal before any training process existed: the launcher's own line and code."""

    def __init__(self, signum: int):
        self.code = EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_REQUEUE
        super().__init__(
            "interrupted: before the training processes started; nothing was written"
            if signum == signal.SIGINT
            else f"preempted: stopped by {signal.Signals(signum).name} before the training processes started; "
            f"nothing was written (exit code {EXIT_REQUEUE} asks the scheduler to requeue)"
        )


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: _launch(sys.argv[1:] if argv is None else argv))


def _launch(argv: list[str]) -> int:
    for signum in (signal.SIGINT, *PREEMPTION_SIGNALS):
        signal.signal(signum, _on_signal)
    try:
        from accelerate.commands.launch import launch_command

        parser = build_parser()
        first = parser.parse_args(argv)
        args = parser.parse_args(_multi_cpu(argv, first))
        print(accelerate_values(args), file=sys.stderr)
        if args.num_processes:
            os.environ[LAUNCH_PROCESSES] = str(args.num_processes)
        os.environ.setdefault("PET_SIGNALS_TO_HANDLE", TORCHRUN_SIGNALS)
        _quiet_torchrun()
        with writing(tempfile.gettempdir()):  # where the ranks leave their exit codes
            exits = tempfile.TemporaryDirectory(prefix="convbias-launch-")
        with exits as folder:
            os.environ[LAUNCH_EXIT_DIR] = folder
            return exit_code(Path(folder), _run(launch_command, args), partial(kept_line, args))
    except _Stopped as stopped:
        print(stopped, file=sys.stderr)
        return stopped.code


# The ranges of accelerate's number options that this launcher relies on; its other numbers are finite
LAUNCH_RANGES = {
    "num_processes": AT_LEAST_ONE,
    "num_machines": AT_LEAST_ONE,
    "num_cpu_threads_per_process": AT_LEAST_ONE,
    "machine_rank": NON_NEGATIVE,
    "main_process_port": Check(lambda v: 0 <= v < 2**16, "a port number in [0, 65535] (0: a free one)"),
    "max_restarts": NON_NEGATIVE,
    "monitor_interval": POSITIVE,
    "gradient_accumulation_steps": AT_LEAST_ONE,
    "gradient_clipping": POSITIVE,
}


def build_parser() -> argparse.ArgumentParser:
    """accelerate launch's parser, its errors one line, its number options declared with their checks (Typed)."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog, parser.usage = "convbias-launch", USAGE
    parser.description = f"accelerate launch, ending with the engine's one line and exit code. {parser.description}"
    parser.error = _usage_error  # one line, not argparse's usage block
    for action in parser._actions:
        if action.type in (int, float):
            action.type = Typed(action.type, LAUNCH_RANGES.get(action.dest))
    return parser


def _usage_error(message: str) -> NoReturn:
    raise ConfigError(f"{message}; usage: {USAGE} (--help lists accelerate's options)")


def _multi_cpu(argv: list[str], args: Any) -> list[str]:
    """`--cpu --num_processes N` as accelerate's form that starts N CPU processes (its --cpu starts one)."""
    if not (args.cpu and (args.num_processes or 1) > 1) or any((args.multi_gpu, args.use_fsdp, args.use_deepspeed)):
        return argv  # one process, or options that accelerate refuses with --cpu: it says so itself
    script = len(argv) - len(args.training_script_args) - 1  # the options end at the training script
    options = [arg for arg in argv[:script] if arg != "--cpu"]
    os.environ["ACCELERATE_USE_CPU"] = "1"
    print(
        f"note: --cpu --num_processes {args.num_processes} runs as ACCELERATE_USE_CPU=1 accelerate launch "
        f"--multi_gpu {' '.join(options)} (accelerate's --cpu alone starts one process)",
        file=sys.stderr,
    )
    return options + ["--multi_gpu"] + argv[script:]


def accelerate_values(args: Any) -> str:
    """The note that says where accelerate's values come from: the user's accelerate config (accelerate reads it
    when --config_file names one, or without --cpu when `accelerate config` wrote its default file), or else the
    values accelerate would default with a warning, passed to it here (set in ``args``): one process with
    --cpu, else the machine's CUDA devices; one machine; no mixed precision, no dynamo; with --cpu and no
    OMP_NUM_THREADS, the physical cores shared by the processes (accelerate's default)."""
    from accelerate.commands.config import default_config_file

    if args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu):
        return f"note: accelerate launch takes its values from the accelerate config {args.config_file or default_config_file}"
    defaults: dict[str, Any] = dict(num_machines=1, mixed_precision="no", dynamo_backend="no")
    if args.cpu or torch_cuda_devices():
        defaults["num_processes"] = 1 if args.cpu else torch_cuda_devices()
    if args.cpu and "OMP_NUM_THREADS" not in os.environ:
        import psutil  # a dependency of accelerate

        processes = max((args.num_processes or defaults["num_processes"]) // (args.num_machines or 1), 1)
        defaults["num_cpu_threads_per_process"] = max(1, (psutil.cpu_count(logical=False) or 1) // processes)
    passed = {name: value for name, value in defaults.items() if getattr(args, name, None) is None}
    for name, value in passed.items():
        setattr(args, name, value)
    if not passed:
        return "note: accelerate launch takes every value from this command line (no accelerate config)"
    shown = " ".join(f"--{name} {value}" for name, value in passed.items())
    return (
        f"note: no accelerate config (`accelerate config` writes {default_config_file}): convbias-launch passes "
        f"accelerate's defaults {shown}"
    )


def torch_cuda_devices() -> int:
    import torch  # accelerate's launcher imports it too

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _quiet_torchrun() -> None:
    """torchrun's agent logs the signals it forwards and a report of each failed rank: the engine's line says it."""
    quiet = logging.getLogger("torch.distributed.elastic")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False


def _run(launch_command: Any, args: Any) -> dict[int, int]:
    """Runs accelerate's launcher; returns the exit status of each rank it reports as failed (minus the
    signal's number for a signal; ANY_RANK: torchrun was stopped by one)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch_command(args)
    except subprocess.CalledProcessError as e:  # the simple launcher: its one process failed
        return {0: e.returncode}
    except ChildFailedError as e:  # torchrun: the ranks that failed
        return {rank: failure.exitcode for rank, failure in e.failures.items()}
    except SignalException as e:  # torchrun forwarded a signal and waited for the ranks to leave their codes
        return {ANY_RANK: -e.sigval}
    except SystemExit as e:  # the simple launcher under the user's --quiet: the code is in the exit folder
        return {0: 1} if e.code else {}
    except ConnectionError as e:  # torchrun's port is taken on a machine of several (a user's choice to change)
        raise ConfigError(str(e)) from None
    finally:  # the processes are gone: a late signal has nothing left to stop
        for signum in (signal.SIGINT, *PREEMPTION_SIGNALS):
            signal.signal(signum, signal.SIG_IGN)
    return {}


def exit_code(folder: Path, failed: dict[int, int], kept: Callable[[], str] | None = None) -> int:
    """The lowest rank's non-zero code left by the engine (with its line when rank 0 did not print it), else
    the status of the process that stopped first without leaving one (``failed`` in the order the launcher saw
    the processes stop; torchrun stops the others after it), in one line with what the run kept (``kept``)."""
    left = {}
    for path in folder.glob("rank*"):
        code, _, line = path.read_text().partition("\n")
        with contextlib.suppress(ValueError):  # a file cut short by a kill: that rank left nothing
            left[int(path.name.removeprefix("rank"))] = (int(code), line.strip())
    reported = sorted((rank, code, line) for rank, (code, line) in left.items() if code)
    if reported:
        rank, code, line = reported[0]
        if rank != 0:  # rank 0 prints its own line
            print(line, file=sys.stderr)
        return code
    unreported = [(rank, status) for rank, status in failed.items() if rank not in left]
    if not unreported or (unreported[0][0] == ANY_RANK and left):
        return 0
    rank, status = unreported[0]
    how = f"stopped on {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
    if rank == ANY_RANK:
        stopped = f"the training processes {how}"
    elif len(failed) > 1:
        stopped = f"training process {rank} {how} first (the other processes were stopped after it)"
    else:
        stopped = f"training process {rank} {how}"
    where = "" if status < 0 else " (its output is above)"
    print_error(
        f"{stopped} without reporting an exit code{where}; {(kept() if kept else '') or 'see the output above'}"
    )
    return 128 - status if status < 0 else status


def kept_line(args: Any) -> str:
    """What a run of this package's train.py left to continue from, in the engine's words (``kept``); '' for
    another script, or options that the engine refuses (each rank said why)."""
    script = Path(args.training_script).name if not args.module else args.training_script
    if script not in ("train.py", "convbias.cli.train"):
        return ""
    from convbias import engine

    try:
        cfg = engine.parse_config(list(args.training_script_args))
    except (ConfigError, StorageError):
        return ""
    return engine.kept(cfg, Path(cfg.output))


def _on_signal(signum: int, frame: Any) -> None:
    """Before a training process exists a signal ends the launcher; then SIGINT is left to the terminal (it
    reaches the whole foreground job) and the preemption signals are forwarded to the simple launcher's process.
    torchrun replaces this handler with its own while its ranks run."""
    import psutil  # a dependency of accelerate

    children = psutil.Process().children()
    if not children:
        raise _Stopped(signum)
    if signum != signal.SIGINT:
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):  # it has just exited
                child.send_signal(signum)


if __name__ == "__main__":
    raise SystemExit(main())
