"""The run directory's one owner: every command that reads a train.py run reads it through ``RunDir``.

A run's resume points are the folders ``checkpoints/epoch_NNNN[_step_NNNNNNN]`` (found by their names and
checked against their manifests, never through the ``last``/``best`` links, which are conveniences
regenerated from the training state). Which point is which:

- ``last``: the newest point by name (the run's latest weights);
- ``best``: the point of the best evaluation, as the newest point's training state records it;
- ``init`` / ``epoch_N``: the ``--save-epochs`` snapshots ``checkpoints/epoch_N.safetensors``.

Every weights file is checked against its manifest before it is read; a damaged one is a
DamagedCheckpointError (exit 65) naming it, the same for train.py --eval-only, ensembles, robustness,
stability, diagnostics, export and the sweep. ``RunDir.results()`` reads results.json and
``RunDir.status()`` says whether it still matches the newest point. The names of the files are
engine.checkpointing.layout's; recognizing a run folder without reading its checkpoints is
engine.checkpointing.run_files'.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError, DamagedCheckpointError, DamagedInputError
from ...weights import load_weights, weights_metadata
from ..config.options import DEFAULT_WHICH, WHICH, Config
from ..data.datasets import DATASETS
from ..model.factory import create_model
from ..model.output_scale import OutputScale
from .layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LAST_LINK,
    MANIFEST_FILE,
    RESULTS_FILE,
    SNAPSHOT_NAME,
    SNAPSHOTS_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    held_entries,
    list_points,
    point_name,
    point_position,
    snapshot_epoch,
    snapshot_file,
)
from .run_files import (
    RUN_KEYS,
    read_run_config,
)

_HASH_CHUNK = 1 << 22  # sha256 is streamed in 4 MiB reads
RESULT_KEYS = ("model", "epochs", "final_top1", "best_top1", "best_epoch")  # what makes results.json readable


# ------------------------------------------------------------------------------- verifying what was written
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def point_files(point: Path) -> list[str]:
    """Every file under ``point`` but its manifest, as relative POSIX paths."""
    return sorted(p.relative_to(point).as_posix() for p in point.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def read_manifest(point: Path) -> dict[str, Any] | None:
    """The manifest's ``files`` entry; None when the point has none or it cannot be read."""
    try:
        files = json.loads((point / MANIFEST_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def check_point(point: Path, names: Iterable[str] | None = None) -> str | None:
    """None when the files ``names`` (default: all) of ``point`` match its manifest, else why not."""
    if not (point / MANIFEST_FILE).is_file():
        return f"no {MANIFEST_FILE}: the save did not complete"
    listed = read_manifest(point)
    if listed is None:
        return f"its {MANIFEST_FILE} is unreadable"
    for name in listed if names is None else names:
        entry, path = listed.get(name), point / name
        if entry is None:
            return f"{name} is not in its {MANIFEST_FILE}"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, its manifest says {entry.get('bytes')}"
        if file_sha256(path) != entry.get("sha256"):
            return f"{name} does not match its sha256 (damaged)"
    return None


def verify_file(path: str | Path) -> None:
    """DamagedCheckpointError when ``path`` lies in a resume point whose manifest it does not match
    (a file without a manifest beside it is loaded as it is)."""
    path = Path(path)
    if path.is_file() and (path.parent / MANIFEST_FILE).is_file():
        problem = check_point(path.parent, [path.name])
        if problem:
            raise DamagedCheckpointError(f"{path} is damaged: {problem}; it was not loaded")


def file_entry(path: Path) -> dict[str, Any]:
    """What a manifest records of a file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def verify_snapshot(path: Path) -> None:
    """DamagedCheckpointError unless a ``--save-epochs`` snapshot matches its entry in ``snapshots.json``
    (one written before that file existed must at least read as safetensors)."""
    try:
        listed = json.loads((path.parent / SNAPSHOTS_FILE).read_bytes()).get(path.name)
    except (OSError, ValueError, AttributeError):
        listed = None
    if listed is None:
        try:
            weights_metadata(path)
        except ValueError as e:
            raise DamagedCheckpointError(f"{e}; it was not loaded") from None
        return
    if path.stat().st_size != listed.get("bytes") or file_sha256(path) != listed.get("sha256"):
        raise DamagedCheckpointError(
            f"{path} is damaged: it does not match its entry in {SNAPSHOTS_FILE}; it was not loaded"
        )


def load_training_state(point: Path) -> dict[str, Any]:
    """The training state of a resume point, loaded with weights_only=True."""
    try:
        return torch.load(point / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception:  # torch's message invites unpickling the file with weights_only=False: not ours to give
        raise DamagedCheckpointError(
            f"{point / STATE_FILE} is not a training state this engine wrote (damaged or foreign); it was not loaded"
        ) from None


def check_which(which: str) -> str:
    if which not in WHICH:
        raise ConfigError(f"--which must be one of {', '.join(WHICH)}, got {which!r}")
    return which


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
        """``point/name`` once it matches the point's manifest; DamagedCheckpointError naming it otherwise."""
        problem = check_point(point, [name])
        if problem:
            raise DamagedCheckpointError(f"{point / name} is damaged: {problem}; it was not loaded")
        return point / name

    def training_state(self, point: Path | None = None) -> dict[str, Any]:
        """The training state of ``point`` (default: the newest), verified, loaded with weights_only=True."""
        point = point or self.newest_point()
        self.verify(point, STATE_FILE)
        return load_training_state(point)

    def best_epoch(self) -> int | None:
        """The epoch of the best evaluation so far, as the newest point records it: in its manifest, else
        (a point written before manifests carried it) in its verified training state."""
        point = self.newest_point()
        try:
            manifest = json.loads((point / MANIFEST_FILE).read_bytes())
        except (OSError, ValueError):
            manifest = {}
        if isinstance(manifest, dict) and "best_epoch" in manifest:
            return manifest["best_epoch"]
        return (self.training_state(point).get("best") or {}).get("epoch")

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
            self._verified[which] = self._find_checkpoint(which)
        return self._verified[which]

    def _find_checkpoint(self, which: str) -> RunCheckpoint:
        if which in WHICH:
            point = self.newest_point() if which == LAST_LINK else self.best_point()
            epoch, step = point_position(point)
            return RunCheckpoint(self.path, which, self.verify(point, WEIGHTS_FILE), epoch, step)
        if not SNAPSHOT_NAME.fullmatch(which):
            raise ConfigError(f"checkpoint {which!r}: expected last, best, init or epoch_N")
        epoch = snapshot_epoch(which)
        weights = self.root / snapshot_file(epoch)
        if not weights.is_file():
            hint = " (train with --save-epochs 0)" if epoch == 0 else f" (train with --save-epochs {epoch})"
            raise ConfigError(f"{self.path} has no checkpoint {which!r}: {weights} not found{hint}")
        verify_snapshot(weights)
        return RunCheckpoint(self.path, which, weights, epoch)

    # ---------------------------------------------------------------------------------------- model
    def model_spec(self, which: str = DEFAULT_WHICH) -> dict[str, Any]:
        """What rebuilding the run's model needs: model, model_kwargs (with --gp as global_pool), img_size,
        in_chans, num_classes, and the checkpoint (a verified RunCheckpoint). Classes and channels come from the
        checkpoint's metadata, else from config.yaml and the dataset's description."""
        options, checkpoint = self.options(), self.checkpoint(which)
        metadata = weights_metadata(checkpoint.weights)
        dataset = DATASETS.get(options.get("dataset", ""))
        num_classes = metadata.get("num_classes") or options.get("num_classes")  # None: the model's default
        in_chans = metadata.get("in_chans") or options.get("in_chans") or (dataset.in_chans if dataset else None)
        if in_chans is None:
            raise ConfigError(
                f"{checkpoint.weights} records no in_chans in its metadata and {self.path / CONFIG_FILE} names "
                f"none (nor does its dataset): pass the model options explicitly"
            )
        return {
            "model": options["model"],
            "model_kwargs": {
                **({"global_pool": options["gp"]} if options.get("gp") else {}),
                **(options.get("model_kwargs") or {}),
            },
            "img_size": options.get("img_size") or (dataset.default_img_size if dataset else None),
            "in_chans": int(in_chans),
            "num_classes": None if num_classes is None else int(num_classes),
            "checkpoint": checkpoint,
            "reparametrized": metadata.get("reparametrized") == "True",
        }

    def build_model(self, which: str = DEFAULT_WHICH, extensions: Any = None) -> tuple[Any, RunCheckpoint]:
        """The run's model as train.py built it, in eval mode with the verified weights of ``which``: timm's
        registry, the reparametrization the weights were written after (from ``extensions``), the
        output-scale wrapper of an ``--output-scale`` run."""
        spec = self.model_spec(which)
        cfg = self.run_config().replace(img_size=spec["img_size"], pretrained=False, pretrained_file=None)
        model = create_model(cfg, spec["num_classes"], spec["in_chans"])
        if spec["reparametrized"]:
            known = getattr(extensions, "reparametrizations", {}) or {}
            if cfg.reparametrize not in known:
                raise ConfigError(
                    f"{spec['checkpoint'].describe()} was written after the reparametrization "
                    f"{cfg.reparametrize!r}, which is not registered here (convbias.families.load_families())"
                )
            model = known[cfg.reparametrize](model, **(cfg.reparametrize_kwargs or {}))
        if cfg.output_scale is not None:
            model = OutputScale(model, cfg.output_scale)
        load_weights(model, spec["checkpoint"].weights)
        return model.eval(), spec["checkpoint"]

    # ---------------------------------------------------------------------------------- bookkeeping
    def results(self) -> dict[str, Any] | None:
        """results.json (None when the run has not written it); DamagedCheckpointError naming it when it
        cannot be read."""
        path = self.path / RESULTS_FILE
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise DamagedCheckpointError(
                f"{path} is not readable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"train.py --resume auto rewrites it from the newest checkpoint"
            ) from None
        if not isinstance(data, dict) or any(key not in data for key in RESULT_KEYS):
            raise DamagedCheckpointError(
                f"{path} is not a results file (expected an object with {', '.join(RESULT_KEYS)}); "
                f"train.py --resume auto rewrites it from the newest checkpoint"
            )
        return data

    def current_results(self) -> dict[str, Any] | None:
        """results.json when it describes the newest point (its epochs are that point's), else None: absent,
        damaged, or older than a point written after it (a run extended with a larger --epochs)."""
        try:
            results = self.results()
        except DamagedCheckpointError:
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
