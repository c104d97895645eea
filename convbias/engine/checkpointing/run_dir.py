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
``RunDir.status()`` says whether it still matches the newest point. Light to import (no torch until a
checkpoint is read): ``train.py --help`` reads this module.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from ...errors import ConfigError, DamagedCheckpointError, DamagedInputError
from ...inputs import first_line, json_record, read_yaml
from ..config.options import DEFAULT_WHICH, WHICH

# The file names of timm's training checkpoints (its CheckpointSaver's .pth.tar, timm's usual .pth weights): a
# file named so is read as one (convbias.timm_checkpoint) where a command takes a run directory
TIMM_SUFFIXES = (".pth.tar", ".pth")


def is_timm_checkpoint_name(path: str | Path) -> bool:
    """Whether ``path`` is a file named as timm's checkpoints are (its content is checked when it is read)."""
    return str(path).endswith(TIMM_SUFFIXES) and Path(path).is_file()


CONFIG_FILE = "config.yaml"
# The first line of every config.yaml train.py writes: what marks a folder as this engine's run.
CONFIG_MARKER = "# resolved config of this run; reload with -c"
SUMMARY_FILE = "summary.csv"
LOG_FILE = "log.jsonl"
LOCK_FILE = ".lock"  # as engine.checkpointing.lock.LOCK_FILE
MAX_FIRST_LINE = 1 << 20  # bytes of a file's first line read to recognize it (a log record is far shorter)
# What train.py writes at the top of its output (wandb: the tracker's folder with --log-wandb).
RUN_FILES = (CONFIG_FILE, SUMMARY_FILE, LOG_FILE, "results.json", LOCK_FILE, "checkpoints", "wandb")
RESULTS_FILE = "results.json"
WEIGHTS_FILE = "model.safetensors"  # as convbias.weights.WEIGHTS_FILE (not imported: it loads torch)
STATE_FILE = "training_state.pt"
MANIFEST_FILE = "manifest.json"
SNAPSHOTS_FILE = "snapshots.json"  # size and sha256 of every --save-epochs snapshot
POINT_NAME = re.compile(r"epoch_(\d{4,})(?:_step_(\d{7,}))?")
SNAPSHOT_NAME = re.compile(r"init|epoch_(\d+)")
RESULT_KEYS = ("model", "epochs", "final_top1", "best_top1", "best_epoch")  # what makes results.json readable
# What a run's config.yaml contributes to a command that reuses the run: the model and how its data is read.
# Not --input-size: the config holds it resolved into img_size and in_chans, so a command may change --img-size.
RUN_KEYS = (
    "model",
    "model_kwargs",
    "img_size",
    "in_chans",
    "mean",
    "std",
    "num_classes",
    "class_map",
    "input_key",
    "target_key",
    "bn_eps",
    "gp",
    "fast_norm",
    "dataset",
    "data_dir",
    "crop_pct",
    "interpolation",
    "reparametrize",
    "reparametrize_kwargs",
    "output_scale",
)


def point_name(epoch: int, step: int = 0) -> str:
    """The folder name of the resume point after ``epoch`` epochs and ``step`` steps of the next one."""
    return f"epoch_{epoch:04d}" + (f"_step_{step:07d}" if step else "")


def point_position(path: Path) -> tuple[int, int] | None:
    """(epoch, step) of a resume point folder by its name; None for any other name."""
    match = POINT_NAME.fullmatch(path.name)
    return (int(match[1]), int(match[2] or 0)) if match else None


def list_points(root: Path) -> list[Path]:
    """The resume-point folders of a ``checkpoints/`` folder by name, newest first (not yet verified)."""
    found = []
    for path in root.glob("epoch_*") if root.is_dir() else ():
        position = point_position(path)
        if position and path.is_dir() and not path.is_symlink():
            found.append((position, path))
    return [path for _, path in sorted(found, reverse=True)]


def held_entries(root: Path) -> list[str]:
    """What in a ``checkpoints/`` folder may hold weights: every entry but the links and a killed save's
    staging (hidden ``.NAME.tmp`` names, which only the engine writes)."""
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if not p.is_symlink() and not (p.name.startswith(".") and ".tmp" in p.name)
    )


def is_temporary(name: str) -> bool:
    """A hidden ``.NAME.tmp...`` file or folder: what a killed atomic write or save leaves (only the engine
    writes such names)."""
    return name.startswith(".") and ".tmp" in name


def written_by_engine(path: Path) -> bool:
    """``path`` (an entry of an output folder) is recognizably one that train.py wrote."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(MAX_FIRST_LINE)
    except OSError:
        return False
    if path.name == CONFIG_FILE:
        return first.rstrip(b"\n") == CONFIG_MARKER.encode()
    if path.name == SUMMARY_FILE:
        return first.startswith(b"epoch,") or first == b""
    if path.name == LOG_FILE:
        return first == b"" or isinstance(json_record(first), dict)
    return False


def foreign_entry(output: Path) -> str | None:
    """The first entry of an output folder that train.py did not recognizably write, with why (None: each
    is the engine's own, so the folder may be started over). A folder's checkpoints/, results.json and
    wandb/ count as the engine's only beside the config.yaml it marks."""
    if not output.is_dir():
        return None
    marked = written_by_engine(output / CONFIG_FILE)
    for entry in sorted(output.iterdir()):
        name = entry.name
        if name == LOCK_FILE or is_temporary(name):
            continue
        if entry.is_symlink():
            return f"{name} (a symbolic link to {os.readlink(entry)})"
        if name in (CONFIG_FILE, SUMMARY_FILE, LOG_FILE):
            if not written_by_engine(entry):
                return f"{name} (not as train.py writes it)"
        elif name not in RUN_FILES or not marked:
            return f"{name} (not a file train.py writes)" if name not in RUN_FILES else f"{name} (beside no run config)"
    return None


def foreign_links(output: Path) -> list[str]:
    """The files train.py writes in an output folder (top level and points) that are symbolic links: it
    writes nothing through a link it did not make (its own are checkpoints/last and best)."""
    found = [output / name for name in RUN_FILES if (output / name).is_symlink()]
    root = output / "checkpoints"
    if root.is_dir() and not root.is_symlink():
        found += [p for p in root.iterdir() if p.is_symlink() and point_position(p)]
    return [f"{p} -> {os.readlink(p)}" for p in found]


def run_owning(path: str | Path) -> Path | None:
    """The run directory whose own file ``path`` is (or would be): its config, logs, results, lock, or
    anything under its checkpoints/ (through links too); None for any other path."""
    path = Path(path).absolute()
    for candidate in (path, path.resolve()):
        if candidate.name in RUN_FILES and is_run_dir(candidate.parent):
            return candidate.parent
        for ancestor in candidate.parents:
            if ancestor.name == "checkpoints" and is_run_dir(ancestor.parent):
                return ancestor.parent
    return None


def check_not_run_file(path: str | Path, option: str = "--output") -> None:
    """ConfigError naming ``path`` when a command would write it over a file of a run (``run_owning``), or
    when it names a run directory where a command writes its own config.yaml and results."""
    run = run_owning(path)
    if run is not None:
        raise ConfigError(
            f"{option} {path} is a file of the run {run}; no command writes over a run's own files: choose another path"
        )


def is_run_dir(path: str | Path) -> bool:
    """A directory written by train.py: it holds config.yaml (and, once an epoch is done, checkpoints/)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_run_config(run: str | Path) -> dict[str, Any]:
    """The run's resolved options (its config.yaml); ConfigError naming the file when it cannot be read."""
    path = Path(run) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{run} is not a run directory: no {CONFIG_FILE} in it")
    try:
        data = read_yaml(path, "run config")
    except OSError as e:
        raise ConfigError(f"{path} is not a readable run config ({first_line(e)})") from None
    if not isinstance(data, dict) or "model" not in data:
        raise ConfigError(f"{path} is not a run config (expected a mapping of option: value with a model)")
    return data


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
        return f"{self.run / 'checkpoints' / self.which} ({where})" if self.epoch is not None else str(self.weights)


class RunDir:
    """A train.py output directory: its config, resume points, verified checkpoints, model and results."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"run directory not found: {path}")
        self.root = self.path / "checkpoints"
        self._verified: dict[str, RunCheckpoint] = {}

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -------------------------------------------------------------------------------------- config
    @cached_property
    def config(self) -> dict[str, Any]:
        return read_run_config(self.path)

    def run_config(self) -> Any:
        """The run's options as a typed ``engine.Config`` (an option config.yaml lacks takes its default)."""
        from ..config.options import Config

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
        from .points import check_point  # hashes: only once a file is to be read

        problem = check_point(point, [name])
        if problem:
            raise DamagedCheckpointError(f"{point / name} is damaged: {problem}; it was not loaded")
        return point / name

    def training_state(self, point: Path | None = None) -> dict[str, Any]:
        """The training state of ``point`` (default: the newest), verified, loaded with weights_only=True."""
        from .points import load_training_state

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
            point = self.newest_point() if which == "last" else self.best_point()
            epoch, step = point_position(point)
            return RunCheckpoint(self.path, which, self.verify(point, WEIGHTS_FILE), epoch, step)
        if not SNAPSHOT_NAME.fullmatch(which):
            raise ConfigError(f"checkpoint {which!r}: expected last, best, init or epoch_N")
        epoch = 0 if which == "init" else int(which[6:])
        weights = self.root / f"epoch_{epoch}.safetensors"
        if not weights.is_file():
            hint = " (train with --save-epochs 0)" if epoch == 0 else f" (train with --save-epochs {epoch})"
            raise ConfigError(f"{self.path} has no checkpoint {which!r}: {weights} not found{hint}")
        from .points import verify_snapshot

        verify_snapshot(weights)
        return RunCheckpoint(self.path, which, weights, epoch)

    # ---------------------------------------------------------------------------------------- model
    def model_spec(self, which: str = DEFAULT_WHICH) -> dict[str, Any]:
        """What rebuilding the run's model needs: model, model_kwargs (with --gp as global_pool), img_size,
        in_chans, num_classes, and the checkpoint (a verified RunCheckpoint). Classes and channels come from the
        checkpoint's metadata, else from config.yaml and the dataset's description."""
        from convbias.weights import weights_metadata  # torch and the data sets: only once a model is rebuilt

        from ..data.datasets import DATASETS

        options, checkpoint = self.options(), self.checkpoint(which)
        metadata = weights_metadata(checkpoint.weights)
        dataset = DATASETS.get(options.get("dataset", ""))
        num_classes = metadata.get("num_classes") or options.get("num_classes")
        in_chans = metadata.get("in_chans") or options.get("in_chans") or (dataset.in_chans if dataset else None)
        if num_classes is None or in_chans is None:
            lacking = " and ".join(
                name for name, value in (("num_classes", num_classes), ("in_chans", in_chans)) if value is None
            )
            raise ConfigError(
                f"{checkpoint.weights} records no {lacking} in its metadata and {self.path / CONFIG_FILE} names "
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
            "num_classes": int(num_classes),
            "checkpoint": checkpoint,
            "reparametrized": metadata.get("reparametrized") == "True",
        }

    def build_model(self, which: str = DEFAULT_WHICH, extensions: Any = None) -> tuple[Any, RunCheckpoint]:
        """The run's model as train.py built it, in eval mode with the verified weights of ``which``: timm's
        registry, the reparametrization the weights were written after (from ``extensions``), the
        output-scale wrapper of an ``--output-scale`` run."""
        from convbias.weights import load_weights

        from ..model.factory import create_model
        from ..model.output_scale import OutputScale

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
