"""Grid sweeps over ``train.py``: expand a grid, print or run one ``train.py`` per point, collect a CSV.

A sweep file (YAML) describes the grid::

    config: configs/train/convit/deit_recipe.yaml   # optional base recipe, passed to every run as -c
                                              # (a path as given, else relative to the repository)
    set:                                      # train.py options shared by every run (config keys)
      data_dir: /data/imagenet
    grid:                                     # the runs are the Cartesian product of these lists
      model: [convit_small, deit_small_patch16_224]
      train_fraction: [0.05, 0.1, 0.3, 0.5, 1.0]
      seed: [0]
      model_kwargs.locality_strength: [1.0]   # a model constructor argument (any option works too)
    scale_epochs: true                        # epochs x 1/f (train.py --scale-epochs); default true;
                                              # an eval_interval set here is scaled the same way, so
                                              # every run evaluates after the same numbers of images
    baseline: deit_small_patch16_224          # what the report compares against

Instead of ``grid.model``, ``variants`` names option sets that are crossed with the grid, for
ablations that change several options at once (Table 7.3)::

    variants:
      convit: {model: convit_small_plus}
      frozen_gate: {model: convit_small_plus, model_kwargs: {train_gating: false}}

Every run is a plain ``train.py`` invocation with its own output directory, named from its grid
point, under ``<sweep dir>/runs/``, read through ``convbias.engine.RunDir``: a run is complete when its
``results.json`` matches its newest resume point. Every command carries ``--resume auto``: run again after
an interruption, it continues from the run's newest intact checkpoint. The sweep never removes anything
from a run: one that train.py cannot resume (no intact resume point) is left as it is and reported with
the command that resumes it. The sweep directory records its grid in ``sweep.yaml``, and rerunning a
different grid into it is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import yaml

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.inputs import read_file, read_yaml
from convbias.base.run_layout import (
    RESULTS_FILE,
    SUMMARY_FILE,
    SWEEP_ENSEMBLES_TABLE,
    SWEEP_FOLDER,
    SWEEP_LOG_SUFFIX,
    SWEEP_LOGS_DIR,
    SWEEP_RECORD,
    SWEEP_RUNS_DIR,
    SWEEP_RUNS_TABLE,
)
from convbias.base.storage import check_output, open_append, output_folder, write_text, writing
from convbias.base.tables import write_csv  # noqa: F401  (sweep.write_csv writes runs.csv)
from convbias.engine import (
    Config,
    DamagedRunRecordError,
    RunDir,
    build_parser,
    check_model_name,
    create_model,
    input_format,
    parse_config,
    read_summary,
)
from convbias.evaluation.ensembles import evaluate_runs

from . import spec as sweep_spec
from .spec import MODEL_KWARG_PREFIX, Run, column_name, expand_grid

# Options the sweep itself decides for every run: a sweep file must not set them.
RESERVED_OPTIONS = ("output", "resume", "config", "scale_epochs", "eval_only", "checkpoint")
RECORD_NAME = SWEEP_RECORD
BAD_INPUT_EXIT = 2  # train.py's exit code for a user mistake (convbias.cli.train)
CSV_NAME = SWEEP_RUNS_TABLE
ENSEMBLES_CSV_NAME = SWEEP_ENSEMBLES_TABLE  # one row per group of runs that differ only by seed
LOG_TAIL_BYTES = 1 << 16  # the end of a run's console log read for its last line
TRAIN_MODULE = "convbias.cli.train"  # train.py's body, importable from an installed package
# results.json field -> CSV column. The CSV keeps names that cannot collide with a swept option.
RESULT_COLUMNS = {
    "final_top1": "top1",
    "final_top5": "top5",
    "best_top1": "best_top1",
    "best_top5": "best_top5",
    "best_epoch": "best_epoch",
    "epochs": "epochs_trained",
}
# Sum of summary.csv's epoch_seconds: the training time of a run, resumed parts included.
TIME_COLUMN = "train_seconds"


# ----------------------------------------------------------------------------- validation


def train_parser() -> argparse.ArgumentParser:
    """The argument parser of train.py (the engine's), used to check keys and render options."""
    return build_parser()


def _options_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions if action.option_strings}


def _check_option_keys(keys: Iterable[str], where: str, known: dict[str, argparse.Action]) -> None:
    for key in keys:
        if key.startswith(MODEL_KWARG_PREFIX):
            continue
        if key in RESERVED_OPTIONS:
            raise ConfigError(f"{where}: '{key}' is set by the sweep for every run; remove it")
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{where}: '{key}' is not a train.py option (config key){hint}")


def _check_model(run: Run, cfg: Config) -> None:
    """Build the run's model as train.py would, on the meta device (no memory, no init cost)."""
    cfg = cfg.replace(pretrained=False, pretrained_file=None)  # no weights are read here
    try:
        with torch.device("meta"):
            create_model(cfg, num_classes=cfg.num_classes, in_chans=input_format(cfg).in_chans)
    except ConfigError as error:
        raise ConfigError(f"run {run.name}: {error}") from None


def _check_fraction(run: Run) -> None:
    fraction = run.options.get("train_fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ConfigError(f"train_fraction must be a number in (0, 1], got {fraction!r} (run {run.name})")


def _check_model_name(run: Run) -> None:
    """The run's model, in timm's registry: the families' models are registered by the command first
    (``convbias.families.load_families()``)."""
    if run.options.get("model") is None:
        raise ConfigError(f"run {run.name}: no model (add grid.model, set.model or variants)")
    check_model_name(run.options["model"], option=f"run {run.name}")


def validate(spec: dict[str, Any], runs: list[Run], known: dict[str, argparse.Action]) -> None:
    """Refuse bad input before anything runs: unknown models, fractions, keys, model kwargs, and
    every run's full train.py options (checked by the engine's own parser and validation)."""
    if spec["config"] is not None:
        resolve_config(spec["config"])
    _check_option_keys(spec["set"], "set", known)
    _check_option_keys(spec["grid"], "grid", known)
    for name, options in spec["variants"].items():
        _check_option_keys(options, f"variants.{name}", known)
    if not runs:
        raise ConfigError("the grid is empty")
    checked = set()
    for run in runs:
        _check_model_name(run)
        _check_fraction(run)
        try:
            cfg = parse_config(train_args(run, Path("unused"), spec, known))
        except ConfigError as error:
            raise ConfigError(f"run {run.name}: {error}") from None
        key = (cfg.model, repr(sorted(cfg.model_kwargs.items())), cfg.img_size, cfg.dataset)
        if key not in checked:
            _check_model(run, cfg)
            checked.add(key)


# ----------------------------------------------------------------------------- grid record


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for key in list(old) + [k for k in new if k not in old]:
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in new:
                lines.append(f"{where}: {old[key]!r} -> (absent)")
            elif key not in old:
                lines.append(f"{where}: (absent) -> {new[key]!r}")
            else:
                lines.extend(_diff(old[key], new[key], where))
        return lines
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def read_record(sweep_dir: Path) -> dict[str, Any]:
    """The grid a sweep directory records (its ``sweep.yaml``, as ``record_grid`` wrote it): DamagedInputError
    (exit 65) naming it when it is no plain regular file, not YAML or not a sweep's mapping."""
    record = sweep_dir / RECORD_NAME
    old = read_yaml(record, "sweep record", DamagedInputError, plain=True)
    if not isinstance(old, dict):
        raise DamagedInputError(
            f"{record} is not a sweep record (expected a mapping); move it away or choose another --output"
        )
    try:
        return sweep_spec.normalize_spec(old, source=str(record))
    except ConfigError as error:
        raise DamagedInputError(f"sweep record {error}") from None


def record_grid(sweep_dir: Path, spec: dict[str, Any]) -> None:
    """Write ``sweep.yaml``, or check that the one already there holds the same grid; the folder is marked as
    the sweep's (``run_layout.SWEEP_FOLDER``) either way."""
    check_output(sweep_dir, owned=SWEEP_FOLDER)
    record = sweep_dir / RECORD_NAME
    if os.path.lexists(record):
        old = read_record(sweep_dir)
        # The baseline only changes the report, not the runs.
        differences = _diff(
            {k: v for k, v in old.items() if k != "baseline"}, {k: v for k, v in spec.items() if k != "baseline"}
        )
        if differences:
            raise ConfigError(
                f"{sweep_dir} holds a different sweep ({record}); differences "
                f"(recorded -> requested): {'; '.join(differences)}. "
                "Use another output directory, or rerun with the recorded grid."
            )
        output_folder(sweep_dir, owned=SWEEP_FOLDER)
        return
    output_folder(sweep_dir, owned=SWEEP_FOLDER)
    write_text(record, yaml.safe_dump(spec, sort_keys=False), owner=sweep_dir)


# ----------------------------------------------------------------------------- commands


def resolve_config(path: str) -> Path:
    """A base recipe path, relative to the current directory."""
    if not Path(path).is_file():
        raise ConfigError(f"base config not found: {path} (relative to {Path.cwd()})")
    return Path(path).resolve()


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def option_args(key: str, value: Any, known: dict[str, argparse.Action]) -> list[str]:
    """The train.py arguments that set config key ``key`` to ``value``."""
    action = known[key]
    if isinstance(action, argparse.BooleanOptionalAction):
        positive = next(s for s in action.option_strings if s.startswith("--"))  # as declared
        return [positive if value else f"--no-{positive[2:]}"]
    if action.nargs == 0:  # store_true / store_false
        return [_flag(action)] if bool(value) != bool(action.default) else []
    if value is None:
        return []
    if isinstance(value, dict):
        return [_flag(action)] + [f"{k}={v}" for k, v in value.items()] if value else []
    if isinstance(value, (list, tuple)):
        return [_flag(action)] + [str(v) for v in value]
    return [_flag(action), str(value)]


def train_args(run: Run, run_dir: Path, spec: dict[str, Any], known: dict[str, argparse.Action]) -> list[str]:
    """The train.py arguments of one run (without the interpreter or launcher).

    ``--resume auto`` makes the same command start a new run or continue an interrupted one, so a
    scheduler can relaunch a preempted job as it is.
    """
    options = dict(run.options)
    if spec["scale_epochs"] and options.get("eval_interval"):
        fraction = options.get("train_fraction", 1.0)
        options["eval_interval"] = max(1, round(options["eval_interval"] / fraction))
    args = ["-c", str(resolve_config(spec["config"]))] if spec["config"] else []
    args += ["--model", str(options.pop("model"))]
    for key, value in options.items():
        args += option_args(key, value, known)
    if spec["scale_epochs"]:
        args.append("--scale-epochs")
    return args + ["--output", str(run_dir), "--resume", "auto"]


def command(train_arguments: list[str], launcher: list[str] | None = None) -> list[str]:
    """``python -m convbias.cli.train ARGS`` (train.py's body), or ``LAUNCHER -m convbias.cli.train ARGS``
    (e.g. ``accelerate launch --num_processes 8``)."""
    prefix = list(launcher) if launcher else [sys.executable]
    return prefix + ["-m", TRAIN_MODULE] + train_arguments


# ----------------------------------------------------------------------------- run state


def run_state(run_dir: Path) -> str:
    """``RunDir.status()``: 'done', 'interrupted' (train.py --resume auto continues it) or 'new' (also a run
    directory that does not exist yet)."""
    return RunDir(run_dir).status() if run_dir.is_dir() else "new"


def final_results(run_dir: Path) -> dict[str, Any] | None:
    """The run's results.json while it matches its newest resume point (``RunDir.current_results``), else None."""
    return RunDir(run_dir).current_results() if run_dir.is_dir() else None


def incomplete_reason(run_dir: Path) -> str | None:
    """Why a run's results cannot be collected, when it has a results.json that is not the run's final one
    (unreadable, or older than a resume point written after it); None otherwise."""
    if not run_dir.is_dir():
        return None
    run = RunDir(run_dir)
    try:
        results = run.results()
    except DamagedRunRecordError as error:
        return str(error)
    if results is None or run.current_results() is not None:
        return None
    return (
        f"{run.path / RESULTS_FILE} is older than the run's newest resume point {run.points()[0].name} "
        f"(epoch {results['epochs']} of a run extended since); rerun the sweep to finish it"
    )


def train_seconds(run_dir: Path) -> float | None:
    """Total training time from summary.csv (every epoch once, interrupted runs included; damaged lines
    skipped); None without any epoch."""
    rows, _ = read_summary(run_dir / SUMMARY_FILE)
    seconds = []
    for row in rows:
        with contextlib.suppress(ValueError):
            seconds.append(float(row["epoch_seconds"]))
    return round(sum(seconds), 1) if seconds else None


def last_line(log_path: Path) -> str:
    """The last non-empty line of a run's console log (any bytes; its end only, read as the sweep's own file),
    for a one-line report."""
    data = read_file(log_path, "run log", DamagedInputError, LOG_TAIL_BYTES, plain=True, tail=True)
    lines = data.decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1].strip() if lines else "(empty log)"


def open_log(path: Path, header: str, sweep_dir: Path) -> TextIO:
    """``path`` opened to append a run's console output (``storage.open_append``: never through a link),
    ``header`` written first; a failed write is a StorageError naming the log (a failure to start the run is
    not one)."""
    log = open_append(path, owner=sweep_dir, what="run log")
    with writing(path):
        try:
            log.write(header)
            log.flush()
        except BaseException:
            log.close()
            raise
    return log


@dataclass
class Sweep:
    """A validated sweep bound to its output directory."""

    spec: dict[str, Any]
    sweep_dir: Path
    runs: list[Run]
    known: dict[str, argparse.Action]

    @classmethod
    def prepare(cls, spec: dict[str, Any], sweep_dir: str | Path) -> Sweep:
        """Expand and validate the grid and record it in ``sweep_dir``; nothing runs yet."""
        check_output(sweep_dir, owned=SWEEP_FOLDER)  # another command's folder, a link among its files: first
        runs = expand_grid(spec)
        known = _options_by_key(train_parser())
        validate(spec, runs, known)
        sweep_dir = Path(sweep_dir)
        record_grid(sweep_dir, spec)
        return cls(spec, sweep_dir, runs, known)

    def run_dir(self, run: Run) -> Path:
        return self.sweep_dir / SWEEP_RUNS_DIR / run.name

    def commands(self, launcher: list[str] | None = None) -> list[list[str]]:
        """The command of every run that is not complete."""
        out = []
        for run in self.runs:
            state = run_state(self.run_dir(run))
            if state != "done":
                out.append(command(train_args(run, self.run_dir(run), self.spec, self.known), launcher))
        return out

    def execute(self, launcher: list[str] | None = None, log=print) -> list[str]:
        """Run every incomplete run, one subprocess at a time; return the names of failed runs.

        A run that train.py refuses as bad input (exit code 2, e.g. an empty data dir) stops the
        sweep with that message; a run that fails otherwise (diverged, crashed, no intact resume point:
        exit 65) is left as it is, reported with the last line of its log and the command that resumes
        it, and the sweep goes on.

        Each run's console output goes to ``<sweep dir>/logs/<run>.log``. On KeyboardInterrupt
        (or SIGTERM turned into one by the CLI) the running child is terminated first, so a rerun
        finds it interrupted and resumes it from its last checkpoint.
        """
        failed = []
        log_dir = self.sweep_dir / SWEEP_LOGS_DIR
        check_output(self.sweep_dir, owned=SWEEP_FOLDER)  # a link among the logs stops it before any run starts
        with writing(log_dir):
            log_dir.mkdir(parents=True, exist_ok=True)
        for index, run in enumerate(self.runs, 1):
            run_dir = self.run_dir(run)
            state = run_state(run_dir)
            prefix = f"[{index}/{len(self.runs)}] {run.name}"
            if state == "done":
                log(f"{prefix}: complete, skipped")
                continue
            cmd = command(train_args(run, run_dir, self.spec, self.known), launcher)
            log(f"{prefix}: {'resuming' if state == 'interrupted' else 'starting'}")
            log_path = log_dir / f"{run.name}{SWEEP_LOG_SUFFIX}"
            start = time.time()
            with open_log(log_path, f"$ {shlex.join(cmd)}\n", self.sweep_dir) as log_file:
                child = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
                try:
                    returncode = child.wait()
                except BaseException:
                    child.terminate()
                    try:
                        child.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        child.kill()
                    raise
            seconds = time.time() - start
            if returncode == BAD_INPUT_EXIT:  # the same mistake would stop every other run too
                last = last_line(log_path).removeprefix("error: ")
                raise ConfigError(f"train.py refused run {run.name} ({log_path}): {last}")
            results = final_results(run_dir) if returncode == 0 else None
            if results is None:
                log(
                    f"{prefix}: FAILED (exit {returncode}, {seconds:.0f}s): {last_line(log_path)} -- "
                    f"left as it is in {run_dir}; resume it with: {shlex.join(cmd)} (log: {log_path})"
                )
                failed.append(run.name)
                continue
            top1 = results.get("final_top1")
            log(f"{prefix}: " + (f"top-1 {top1:.2f}" if top1 is not None else "no evaluation") + f" ({seconds:.0f}s)")
        return failed

    def collect(self) -> tuple[list[dict[str, Any]], list[str]]:
        """One CSV row per complete run (grid values + results.json) and the incomplete runs: each by its
        name, followed by why in parentheses when its results.json is there but not its final one."""
        rows, missing = [], []
        for run in self.runs:
            run_dir = self.run_dir(run)
            results = final_results(run_dir)
            if results is None:
                reason = incomplete_reason(run_dir)
                missing.append(f"{run.name} ({reason})" if reason else run.name)
                continue
            row = {"run": run.name}
            if "variant" in run.point:
                row["variant"] = run.point["variant"]
            row.update(model=results["model"], train_fraction=results.get("train_fraction"), seed=results.get("seed"))
            for axis, value in run.point.items():
                row.setdefault(column_name(axis), value)
            for field, column in RESULT_COLUMNS.items():
                if results.get(field) is not None:
                    row[column] = results[field]
            seconds = train_seconds(run_dir)
            if seconds is not None:
                row[TIME_COLUMN] = seconds
            rows.append(row)
        return rows, missing

    def collect_ensembles(self, rows: list[dict[str, Any]], extensions: Any = None) -> list[dict[str, Any]]:
        """For every group of complete runs that differ only by their seed (2 or more): the ensemble of
        their checkpoints on the validation set (``convbias.evaluation.ensembles.evaluate_runs``) as
        top-1 of the averaged logits, mean and std of the members' top-1, the members' fluctuation and the
        number of validation images."""
        skip = {"run", "seed", TIME_COLUMN, *RESULT_COLUMNS.values()}
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for row in rows:
            key = tuple((k, v) for k, v in row.items() if k not in skip)
            groups.setdefault(key, []).append(row)
        ensembles = []
        for key, members in groups.items():
            if len(members) < 2:
                continue
            result = evaluate_runs([self.sweep_dir / SWEEP_RUNS_DIR / m["run"] for m in members], extensions)
            ensembles.append(
                {
                    **dict(key),
                    "members": result.members,
                    "ensemble_top1": 100 - result.ensemble_error,
                    "member_top1": 100 - result.mean_member_error,
                    "member_top1_std": statistics.stdev(100 - error for error in result.member_errors),
                    "fluctuation": result.fluctuation,
                    "images": result.images,
                }
            )
        return ensembles
