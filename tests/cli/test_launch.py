"""Launching with the real launchers on CPU: `convbias-launch` ends with the engine's one line and exits with
its code (2, 75, 130, not accelerate's 1) and starts the processes `--cpu --num_processes 2` asks for;
plain `accelerate launch --cpu --num_processes 2` starts one, and the engine says so.

Every command runs in a process group of its own, as a terminal's job; a tiny ConViT on 5% of the digits.
"""

import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path
from unittest import mock

import psutil
import pytest
import torch.distributed as dist
from accelerate.commands.launch import launch_command_parser

from convbias.base.run_layout import CHECKPOINTS_DIR, MANIFEST_FILE
from convbias.cli import launch
from convbias.cli.launch import LAUNCH_PROCESSES
from convbias.cli.train import launch_warnings
from convbias.engine.checkpoint.points import STATE_FILE
from convbias.engine.checkpoint.resume import load_training_state
from convbias.engine.loop.preemption import INTERRUPT_NOTE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TIMEOUT_S = 240  # a collective that one rank never joins hangs: fail instead
TINY = dict(train_fraction=0.05, batch_size=4, no_diagnostics=True)
# torchrun's gloo processes: a free port each (--main_process_port 0), so parallel tests do not collide
TWO = ["--num_processes", "2", "--main_process_port", "0"]
needs_two_processes = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="accelerate's CPU processes need gloo"
)


@pytest.fixture(scope="module")
def train_args(cli_argv, repo) -> list[str]:
    """train.py and the options of a tiny run, without --epochs and --output."""
    return [str(repo / "train.py"), *cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, TINY)]


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, env=env, cwd=cwd, start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, out, err


def lines(err: str, prefix: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prefix)]


def stop_mid_epoch(process: subprocess.Popen, output: Path, send) -> tuple[int, str, str]:
    """`send()` once the run wrote its first resume point (after 2 steps: it is training), then finish."""
    last = output / "checkpoints" / "last"  # the newest point (the next one replaces the first)
    deadline = time.monotonic() + TIMEOUT_S
    while not last.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert last.exists(), finish(process)[2][-3000:]
    send()
    return finish(process)


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=needs_two_processes)])
def test_sigterm_to_the_launcher_writes_a_resume_point_and_exits_75(tmp_path, console_script, train_args, processes):
    output = tmp_path / "run"
    options = ["--cpu"] + (TWO if processes > 1 else [])
    command = [console_script("convbias-launch"), *options, *train_args, "--epochs", "5", "--checkpoint-interval", "2"]
    process = start(command + ["--output", str(output)], tmp_path)
    code, out, err = stop_mid_epoch(process, output, lambda: os.kill(process.pid, signal.SIGTERM))

    assert code == 75, err[-3000:]
    assert out.count(f"output: {output} (a new run)") == 1, out  # the start-up block, from rank 0 only
    assert f"processes: {processes} (1 thread each [OMP_NUM_THREADS=1]) on cpu, fp32" in out, out
    last = (output / "checkpoints" / "last").resolve()
    assert len(lines(err, "preempted:")) == 1 and str(last) in err, err[-3000:]
    assert "Traceback" not in err and not lines(err, "error:"), err[-3000:]
    assert (last / STATE_FILE).exists() and load_training_state(last)["step"] >= 1  # inside an epoch
    assert f"# num_processes: {processes}" in (output / "config.yaml").read_text()
    notes = lines(err, "note: --cpu --num_processes 2 runs as ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu")
    assert len(notes) == (processes > 1), err[-3000:]
    assert "values were not passed to `accelerate launch`" not in err, err[-3000:]  # they were: accelerate's defaults
    assert len(lines(err, "note: no accelerate config")) == 1, err[-3000:]


def test_ctrl_c_to_the_job_keeps_a_mid_epoch_point_in_one_line_and_exit_130(tmp_path, console_script, train_args):
    """Ctrl-C keeps what SIGTERM keeps: the run stops after its step with a resume point inside the epoch (the
    run writes none of its own there) and says so when the key is pressed, then in its one line."""
    output = tmp_path / "run"
    command = [console_script("convbias-launch"), "--cpu", *train_args, "--epochs", "50"]
    process = start(command + ["--output", str(output)], tmp_path)
    code, _, err = stop_mid_epoch(process, output, lambda: os.killpg(process.pid, signal.SIGINT))

    assert code == 130, err[-3000:]
    last = (output / "checkpoints" / "last").resolve()
    state = load_training_state(last)
    assert state["step"] >= 1, last  # inside an epoch: written on Ctrl-C
    (line,) = lines(err, "interrupted:")
    assert line == (
        f"interrupted: Ctrl-C after step {state['step']} of epoch {state['epoch'] + 1}; resume point {last} "
        "(continue with --resume auto)"
    )
    assert INTERRUPT_NOTE in err.splitlines(), err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


@needs_two_processes
def test_a_user_error_in_every_rank_is_one_line_and_exit_2(tmp_path, console_script, train_args):
    """Every rank refuses the command line; torchrun stops the rest when the first fails: one line, exit 2.
    (The simple launcher's one process passes its code on as the signal tests show, through the same exit
    folder; the refusals themselves are tests/engine/loop/test_train_errors.py's.)"""
    args = [arg if arg != "convit_tiny" else "convit_tny" for arg in train_args]
    command = [console_script("convbias-launch"), "--cpu", *TWO, *args, "--epochs", "1"]
    code, _, err = finish(start(command + ["--output", str(tmp_path / "run")], tmp_path))

    assert code == 2, err[-3000:]
    assert len(lines(err, "error:")) == 1 and "unknown model 'convit_tny'" in lines(err, "error:")[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_accelerate_cpu_launch_warns_that_it_started_one_process(tmp_path, console_script, train_args):
    """accelerate's own launcher puts no process count in the environment: the engine reads it from the
    launcher's command line. (The run then stops on a misspelt model, to be quick.)"""
    args = [arg if arg != "convit_tiny" else "convit_tny" for arg in train_args]
    command = [console_script("accelerate"), "launch", "--cpu", "--num_processes", "2", *args]
    code, _, err = finish(start(command + ["--output", str(tmp_path / "run")], tmp_path))

    assert code != 0
    warning = lines(err, "warning: this launch started 1 of the 2 processes that --num_processes asks for")
    assert len(warning) == 1 and "`convbias-launch --cpu --num_processes 2 ...`" in warning[0], err[-3000:]


def test_the_launch_warning_needs_fewer_processes_than_asked(monkeypatch):
    monkeypatch.setenv(LAUNCH_PROCESSES, "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert len(launch_warnings()) == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch_warnings() == []


def test_the_launcher_exits_with_the_lowest_rank_code_and_its_line(tmp_path, capsys):
    """torchrun stops the other ranks when one fails, maybe before rank 0 printed its line: the launcher
    prints the line of the lowest rank that left one; a process that left none is one line with its status."""
    (tmp_path / "rank1").write_text("2\nerror: unknown model\n")
    (tmp_path / "rank2").write_text("2\nerror: unknown model\n")
    assert launch.exit_code(tmp_path, {0: -15, 1: 2, 2: 2}) == 2
    assert capsys.readouterr().err == "error: unknown model\n"

    (tmp_path / "rank0").write_text("75\npreempted: stopped by SIGTERM\n")
    assert launch.exit_code(tmp_path, {}) == 75
    assert capsys.readouterr().err == ""  # rank 0 printed it

    assert launch.exit_code(tmp_path / "none", {0: -9}) == 137
    assert capsys.readouterr().err.startswith("error: training process 0 stopped on SIGKILL")
    assert launch.exit_code(tmp_path / "none", {}) == 0


def test_a_rank_that_stops_first_is_named_with_its_signal_what_was_kept_and_resume_auto(tmp_path, capsys, train_args):
    """torchrun lists the rank that stopped first (rank 1, killed: out of memory, say) before those it stopped
    after it (rank 0, on its SIGTERM): the launcher's line names the first, and what the run kept, found with the
    run's own options."""
    run = tmp_path / "run"
    point = run / CHECKPOINTS_DIR / "epoch_0001_step_0000004"  # a mid-epoch resume point
    point.mkdir(parents=True)
    (point / MANIFEST_FILE).write_text("{}")
    args = launch_command_parser().parse_args(["--cpu", *TWO, *train_args, "--epochs", "5", "--output", str(run)])
    assert launch.exit_code(tmp_path / "none", {1: -9, 0: -15}, partial(launch.kept_line, args)) == 137
    assert capsys.readouterr().err == (
        "error: training process 1 stopped on SIGKILL first (the other processes were stopped after it) without "
        f"reporting an exit code; kept {run / CHECKPOINTS_DIR / 'last'} (epoch 1 and 4 steps of epoch 2); continue "
        "with --resume auto\n"
    )
    other = launch_command_parser().parse_args(["--cpu", "my_script.py", "--output", str(run)])  # not train.py
    assert launch.exit_code(tmp_path / "none", {0: -9}, partial(launch.kept_line, other)) == 137
    assert capsys.readouterr().err.endswith("without reporting an exit code; see the output above\n")


def test_the_launcher_passes_accelerate_the_values_it_would_default_or_names_the_config(tmp_path, monkeypatch):
    """Without an accelerate config, convbias-launch passes accelerate what accelerate itself would default (its
    own validation, the oracle, then has nothing to warn about); with one, it says accelerate reads it."""
    from accelerate.commands import launch as accelerate_launch

    config = tmp_path / "default_config.yaml"  # where `accelerate config` would write (not written)
    monkeypatch.setattr("accelerate.commands.config.default_config_file", str(config))
    monkeypatch.setattr(accelerate_launch, "default_config_file", str(config))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    parse = launch_command_parser().parse_args
    ours, theirs = parse(["--cpu", "train.py"]), parse(["--cpu", "--num_processes", "1", "train.py"])
    note = launch.accelerate_values(ours)
    threads = psutil.cpu_count(logical=False)
    assert note == (
        f"note: no accelerate config (`accelerate config` writes {config}): convbias-launch passes accelerate's "
        f"defaults --num_machines 1 --mixed_precision no --dynamo_backend no --num_processes 1 "
        f"--num_cpu_threads_per_process {threads}"
    )
    with mock.patch.object(accelerate_launch.logger, "warning") as warned:
        accelerate_launch._validate_launch_command(ours)
        assert warned.call_count == 0  # accelerate has nothing left to default
        accelerate_launch._validate_launch_command(theirs)
    if threads > 1:  # accelerate warns of the threads it chose on a machine of several cores
        assert "The following values were not passed to `accelerate launch`" in warned.call_args[0][0]
    for name in ("num_processes", "num_machines", "mixed_precision", "dynamo_backend", "num_cpu_threads_per_process"):
        assert getattr(ours, name) == getattr(theirs, name), name

    config.write_text("compute_environment: LOCAL_MACHINE\n")
    multi = parse(["--num_processes", "2", "train.py"])
    assert (
        launch.accelerate_values(multi)
        == f"note: accelerate launch takes its values from the accelerate config {config}"
    )
    assert multi.num_machines is None  # accelerate reads it from the config
