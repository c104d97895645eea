"""The run directory's one owner: every command that reads a train.py run reads it through ``RunDir``.

A run's resume points are the folders ``checkpoints/epoch_NNNN[_step_NNNNNNN]`` (found by their names and
checked against their manifests, never through the ``last``/``best`` links, which are conveniences
regenerated from the training state). Which point is which:

- ``last``: the newest point by name (the run's latest weights);
- ``best``: the point of the best evaluation, as the newest point's training state records it;
- ``init`` / ``epoch_N``: the ``--save-epochs`` snapshots ``checkpoints/epoch_N.safetensors``.

A run that is still training rotates superseded points away while a command reads it: a point removed
between its choice and its load is chosen again (the next verified one), and a run that keeps removing
what is read is a RunBeingWrittenError (exit 75: run the command again), never a user's mistake.

Every weights file is checked against its manifest before it is read; a damaged one is a
DamagedCheckpointError (exit 65) naming it, the same for train.py --eval-only, ensembles, robustness,
stability, diagnostics, export and the sweep. ``RunDir.results()`` reads results.json and
``RunDir.status()`` says whether it still matches the newest point. The names of the files are
base.run_layout's; recognizing a run folder without reading its checkpoints is
engine.rundir.run_files'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import torch

from convbias.base.errors import (
    ConfigError,
    DamagedCheckpointError,
    DamagedInputError,
    DamagedRunRecordError,
    RunBeingWrittenError,
)
from convbias.base.inputs import first_line, quoted, read_file
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LAST_LINK,
    MANIFEST_FILE,
    RESULTS_FILE,
    SNAPSHOT_NAME,
    WEIGHTS_FILE,
    held_entries,
    list_points,
    point_name,
    point_position,
    snapshot_epoch,
    snapshot_file,
)
from convbias.base.weights import load_weights

from ..config.options import DEFAULT_WHICH, WHICH, Config
from .manifest import check_point, is_count, load_manifest, verify_snapshot
from .run_files import (
    RUN_KEYS,
    read_run_config,
)

RESULT_KEYS = ("model", "epochs", "final_top1", "best_top1", "best_epoch")  # what makes results.json readable
# How many times a command reading a run chooses a point again when the run's rotation removed the one it chose
ROTATION_RETRIES = 3
Read = TypeVar("Read")


def results_problem(results: dict[str, Any]) -> str | None:
    """What is wrong with a field of results.json (``records.results_record`` writes it), or None."""

    def percentage(value: Any) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100)

    rules = (
        ("model", lambda v: isinstance(v, str), "a model name"),
        ("epochs", is_count, "an integer >= 0"),
        ("best_epoch", lambda v: v is None or is_count(v), "an integer >= 0"),
        *(
            (key, percentage, "a percentage in [0, 100]")
            for key in ("final_top1", "final_top5", "best_top1", "best_top5")
        ),
    )
    for key, valid, expected in rules:
        if key in results and not valid(results[key]):
            return f"{key}: expected {expected}, got {quoted(results[key])}"
    return None


def check_which(which: str) -> str:
    if which not in WHICH:
        raise ConfigError(f"--which must be one of {', '.join(WHICH)}, got {which!r}")
    return which


class PointRemoved(RunBeingWrittenError):
    """The resume point a reader chose was removed (the run's rotation) before the reader was done with it."""

    def __init__(self, point: Path):
        self.point = point
        super().__init__(f"{point} was removed while it was read: its run is being written; run the command again")


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a run: its verified weights file, which was asked for, and its position."""

    run: Path
    which: str
    weights: Path
    epoch: int | None
    step: int = 0

    def describe(self) -> str:
        where = f"epoch {self.epoch}" + (f", step {self.step}" if self.step else "")
        return f"{self.run / CHECKPOINTS_DIR / self.which} ({where})" if self.epoch is not None else str(self.weights)


class RunDir:
    """A train.py output directory: its config, resume points, verified checkpoints, model and results."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"run directory not found: {path}")
        self.root = self.path / CHECKPOINTS_DIR
        self._verified: dict[str, RunCheckpoint] = {}

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -------------------------------------------------------------------------------------- config
    @cached_property
    def config(self) -> dict[str, Any]:
        return read_run_config(self.path)

    def run_config(self) -> Any:
        """The run's options as a typed ``engine.Config`` (an option config.yaml lacks takes its default)."""
        return Config.from_dict(self.config, source=str(self.path / CONFIG_FILE))

    def options(self) -> dict[str, Any]:
        """The ``RUN_KEYS`` of the run's config: what a command reusing the run takes as its defaults."""
        return {key: self.config[key] for key in RUN_KEYS if key in self.config}

    # ---------------------------------------------------------------------------------- resume points
    def points(self) -> list[Path]:
        """The resume-point folders by name, newest first (not yet checked against their manifests)."""
        return list_points(self.root)

    def held(self) -> list[str]:
        """What in ``checkpoints/`` may hold weights (``held_entries``)."""
        return held_entries(self.root)

    def newest_point(self) -> Path:
        """The newest resume point by name; ConfigError saying what the run holds when it has none."""
        points = self.points()
        links = sorted(
            (p for p in (self.root.iterdir() if self.root.is_dir() else ()) if p.is_symlink() and point_position(p)),
            key=point_position,
        )
        if links and (not points or point_position(links[-1]) > point_position(points[0])):
            raise DamagedInputError(
                f"{links[-1]} is a symbolic link (to {os.readlink(links[-1])}), not a resume point of this run: its "
                f"newest point is not here; replace the link with a copy of what it points at, or move it away"
            )
        if not points:
            held = ", ".join(self.held()) or "no checkpoint"
            raise ConfigError(
                f"{self.path} has no resume point (checkpoints/ holds {held}): did the run finish an epoch?"
            )
        return points[0]

    def verify(self, point: Path, name: str) -> Path:
        """``point/name`` once it matches the point's manifest; DamagedCheckpointError naming it otherwise
        (PointRemoved when the run removed the point meanwhile)."""
        try:
            problem = check_point(point, [name])
        except FileNotFoundError:
            problem = f"{name} was removed while it was read"
        if problem and not point.is_dir():
            raise PointRemoved(point)
        if problem:
            raise DamagedCheckpointError(f"{point / name} is damaged: {problem}; it was not loaded")
        return point / name

    def best_epoch(self) -> int | None:
        """The epoch of the best evaluation so far, as the newest point's manifest records it (None: none yet, or
        a point written before manifests did)."""
        point = self.newest_point()
        return (load_manifest(point) if os.path.lexists(point / MANIFEST_FILE) else {}).get("best_epoch")

    def best_point(self) -> Path:
        """The point of the best evaluation (``best_epoch``), whatever the ``best`` link says."""
        epoch = self.best_epoch()
        if epoch is None:
            raise ConfigError(f"{self.path} has no best checkpoint: no evaluation is recorded yet")
        point = self.root / point_name(int(epoch))
        if not point.is_dir():
            raise DamagedCheckpointError(
                f"{point} is missing: the run records it as its best point (epoch {epoch}); it was moved or deleted"
            )
        return point

    def checkpoint(self, which: str = DEFAULT_WHICH) -> RunCheckpoint:
        """The weights of ``which`` (last, best, init or epoch_N), checked against the manifest before use;
        each is hashed once per RunDir (an ensemble verifies every member before it builds any model)."""
        if which not in self._verified:
            self._verified[which] = self._while_written(which, lambda: self._find_checkpoint(which))
        return self._verified[which]

    def _while_written(self, which: str, read: Callable[[], Read]) -> Read:
        """``read()`` of the checkpoint ``which``, again from the point chosen anew when the run's rotation
        removed the one it chose (ROTATION_RETRIES times, then RunBeingWrittenError)."""
        for _ in range(ROTATION_RETRIES):
            try:
                return read()
            except PointRemoved as removed:
                self._verified.pop(which, None)
                point = removed.point
        raise RunBeingWrittenError(
            f"{self.path} is being written: its training removed the point {point.name} while it was read, "
            f"{ROTATION_RETRIES} times; run the command again (or once the run has finished)"
        )

    def _find_checkpoint(self, which: str) -> RunCheckpoint:
        if which in WHICH:
            point = self.newest_point() if which == LAST_LINK else self.best_point()
            epoch, step = point_position(point)
            return RunCheckpoint(self.path, which, self.verify(point, WEIGHTS_FILE), epoch, step)
        if not SNAPSHOT_NAME.fullmatch(which):
            raise ConfigError(f"checkpoint {which!r}: expected last, best, init or epoch_N")
        epoch = snapshot_epoch(which)
        weights = self.root / snapshot_file(epoch)
        if not os.path.lexists(weights):
            hint = " (train with --save-epochs 0)" if epoch == 0 else f" (train with --save-epochs {epoch})"
            raise ConfigError(f"{self.path} has no checkpoint {which!r}: {weights} not found{hint}")
        verify_snapshot(weights)
        return RunCheckpoint(self.path, which, weights, epoch)

    # -------------------------------------------------------------------------------------- weights
    def load_weights(self, model: torch.nn.Module, which: str = DEFAULT_WHICH) -> RunCheckpoint:
        """Load the verified weights of ``which`` into ``model`` (built as the run's model is): the point
        chosen, or the next verified one when the run removed it meanwhile. Returns the checkpoint loaded."""
        return self.reading(which, lambda checkpoint: self._loaded(model, checkpoint))

    def reading(self, which: str, read: Callable[[RunCheckpoint], Read]) -> Read:
        """``read(checkpoint)`` of the verified checkpoint ``which``; when it fails because the run's rotation
        removed that point meanwhile, again with the point chosen anew (``ROTATION_RETRIES`` times, then
        RunBeingWrittenError)."""
        return self._while_written(which, lambda: self._unless_removed(which, lambda: read(self.checkpoint(which))))

    @staticmethod
    def _loaded(model: torch.nn.Module, checkpoint: RunCheckpoint) -> RunCheckpoint:
        load_weights(model, checkpoint.weights)
        return checkpoint

    def _unless_removed(self, which: str, read: Callable[[], Read]) -> Read:
        """``read()`` of the checkpoint ``which`` verified earlier; PointRemoved when it failed because the run
        removed that point meanwhile (a file gone is not the user's mistake then)."""
        try:
            return read()
        except (ConfigError, DamagedCheckpointError, OSError):
            chosen = self._verified.get(which)
            if which in WHICH and chosen is not None and not chosen.weights.parent.is_dir():
                raise PointRemoved(chosen.weights.parent) from None
            raise

    # ---------------------------------------------------------------------------------- bookkeeping
    def results(self) -> dict[str, Any] | None:
        """results.json (None when the run has not written it), every field checked (``results_problem``);
        DamagedRunRecordError naming it, and the key, when it cannot be read."""
        path = self.path / RESULTS_FILE
        if not os.path.lexists(path):
            return None
        rewrite = "train.py --resume auto rewrites it from the newest checkpoint"
        try:
            data = json.loads(read_file(path, "results file", DamagedRunRecordError))
        except DamagedRunRecordError as e:
            raise DamagedRunRecordError(f"{e}; {rewrite}") from None
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise DamagedRunRecordError(
                f"{path} is not readable ({type(e).__name__}: {first_line(e)}); {rewrite}"
            ) from None
        if not isinstance(data, dict) or any(key not in data for key in RESULT_KEYS):
            raise DamagedRunRecordError(
                f"{path} is not a results file (expected an object with {', '.join(RESULT_KEYS)}); {rewrite}"
            )
        problem = results_problem(data)
        if problem:
            raise DamagedRunRecordError(f"{path}: {problem}; {rewrite}")
        return data

    def current_results(self) -> dict[str, Any] | None:
        """results.json when it describes the newest point (its epochs are that point's), else None: absent,
        damaged, or older than a point written after it (a run extended with a larger --epochs)."""
        try:
            results = self.results()
        except DamagedRunRecordError:
            return None
        points = self.points()
        if results is None or not points:
            return results
        return results if point_position(points[0]) == (results["epochs"], 0) else None

    def status(self) -> str:
        """'done' (results.json matches the newest point), 'interrupted' (something that may hold weights
        is there: train.py --resume auto continues it) or 'new' (nothing that holds weights)."""
        if self.current_results() is not None:
            return "done"
        return "interrupted" if self.held() else "new"
