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
engine.checkpointing.run_files'.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
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
from convbias.base.inputs import check_plain_file, first_line, quoted, read_file, read_json
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EMA_FILE,
    LAST_LINK,
    MANIFEST_FILE,
    RESULTS_FILE,
    SHARDED_DIR,
    SNAPSHOT_NAME,
    SNAPSHOT_SUFFIX,
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
from convbias.base.weights import load_weights, weights_metadata

from ..config.options import DEFAULT_WHICH, WHICH, Config
from ..data.datasets import DATASETS
from ..model.factory import create_run_model
from ..model.output_scale import OutputScale
from .run_files import (
    RUN_KEYS,
    read_run_config,
)

_HASH_CHUNK = 1 << 22  # sha256 is streamed in 4 MiB reads
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
RESULT_KEYS = ("model", "epochs", "final_top1", "best_top1", "best_epoch")  # what makes results.json readable
# How many times a command reading a run chooses a point again when the run's rotation removed the one it chose
ROTATION_RETRIES = 3
Read = TypeVar("Read")


def is_count(value: Any) -> bool:
    """An integer >= 0 (a JSON true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


def load_manifest(point: Path) -> dict[str, Any]:
    """The manifest of ``point``, every field checked: ``files`` a non-empty mapping of the point's relative
    file names to their ``bytes`` (an integer >= 0) and ``sha256`` (64 hex digits); ``epoch``, ``step`` and
    ``best_epoch`` integers >= 0 where present (``best_epoch`` may be null). DamagedCheckpointError naming the
    file and the key otherwise (a FIFO or device in its place is never opened)."""
    path = point / MANIFEST_FILE
    manifest = read_json(path, "manifest", DamagedCheckpointError)

    def damaged(key: str, problem: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"{path}: {key}: {problem}")

    if not isinstance(manifest, dict):
        raise damaged("(top level)", f"expected an object, got {type(manifest).__name__}")
    for key in ("epoch", "step", "best_epoch"):
        value = manifest.get(key)
        if value is None and (key == "best_epoch" or key not in manifest):
            continue
        if not is_count(value):
            raise damaged(key, f"expected an integer >= 0, got {quoted(value)}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise damaged("files", f"expected the point's files with their size and sha256, got {quoted(files)}")
    for name, entry in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or name == MANIFEST_FILE:
            raise damaged(f"files: {quoted(name)}", "not the name of a file inside the point")
        problem = entry_problem(entry)
        if problem:
            raise damaged(f"files: {name}: {problem[0]}", problem[1])
    return manifest


def entry_problem(entry: Any) -> tuple[str, str] | None:
    """(the key, what is wrong) of a file's entry in a manifest or the snapshot listing: ``bytes`` an integer
    >= 0, ``sha256`` 64 hex digits; None when it is one."""
    entry = entry if isinstance(entry, dict) else {}
    size, digest = entry.get("bytes"), entry.get("sha256")
    if not is_count(size):
        return "bytes", f"expected an integer >= 0, got {quoted(size)}"
    if not (isinstance(digest, str) and SHA256_HEX.fullmatch(digest)):
        return "sha256", f"expected 64 hex digits, got {quoted(digest)}"
    return None


def read_snapshots(root: Path) -> dict[str, dict[str, Any]]:
    """The listing of a run's ``--save-epochs`` snapshots, ``checkpoints/snapshots.json`` ({} when there is none):
    an object of snapshot file names (``epoch_N.safetensors``) to their entries (``entry_problem``), read as the
    file the engine wrote (a plain regular file: never through a link, never a FIFO). DamagedCheckpointError
    (exit 65) naming the file and the field otherwise: what it lists cannot be verified."""
    path = root / SNAPSHOTS_FILE
    if not os.path.lexists(path):
        return {}
    listing = read_json(path, "snapshot listing", DamagedCheckpointError, plain=True)
    if not isinstance(listing, dict):
        raise DamagedCheckpointError(f"{path}: (top level): expected an object, got {type(listing).__name__}")
    for name, entry in listing.items():
        stem = name.removesuffix(SNAPSHOT_SUFFIX)
        if stem == name or not SNAPSHOT_NAME.fullmatch(stem) or snapshot_file(snapshot_epoch(stem)) != name:
            raise DamagedCheckpointError(
                f"{path}: {quoted(name)}: not the name of a snapshot (epoch_N{SNAPSHOT_SUFFIX})"
            )
        problem = entry_problem(entry)
        if problem:
            raise DamagedCheckpointError(f"{path}: {name}: {problem[0]}: {problem[1]}")
    return listing


def read_manifest(point: Path) -> dict[str, Any] | None:
    """The manifest's ``files`` entry; None when the point has none or it is damaged."""
    try:
        return load_manifest(point)["files"]
    except DamagedCheckpointError:
        return None


def loaded_files(point: Path) -> list[str]:
    """The files of ``point`` that a resume loads (weights, EMA, training state, shards): each must be in the
    manifest, so a manifest that lists fewer cannot vouch for the point."""
    return [
        name
        for name in point_files(point)
        if name in (WEIGHTS_FILE, EMA_FILE, STATE_FILE) or name.startswith(f"{SHARDED_DIR}/")
    ]


def check_point(point: Path, names: Iterable[str] | None = None) -> str | None:
    """None when the files ``names`` (default: every file the manifest lists and every file a resume loads)
    of ``point`` match its manifest, else why not."""
    if not os.path.lexists(point / MANIFEST_FILE):
        return f"no {MANIFEST_FILE}: the save did not complete"
    try:
        listed = load_manifest(point)["files"]
    except DamagedCheckpointError as e:
        return f"{e}"
    for name in dict.fromkeys([*listed, *loaded_files(point)]) if names is None else names:
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
    if path.is_file() and os.path.lexists(path.parent / MANIFEST_FILE):
        problem = check_point(path.parent, [path.name])
        if problem:
            raise DamagedCheckpointError(f"{path} is damaged: {problem}; it was not loaded")


def file_entry(path: Path) -> dict[str, Any]:
    """What a manifest records of a file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def check_snapshots(root: Path) -> dict[str, dict[str, Any]]:
    """What a run writing ``--save-epochs`` snapshots into ``root`` (its checkpoints/) checks first: the listing
    (``read_snapshots``, returned) and every snapshot file there a plain regular file (never a link or FIFO:
    ``inputs.check_plain_file``); a DamagedCheckpointError (exit 65) naming the first that is not."""
    listing = read_snapshots(root)
    for path in sorted(root.glob(f"*{SNAPSHOT_SUFFIX}")) if root.is_dir() else ():
        if SNAPSHOT_NAME.fullmatch(path.name.removesuffix(SNAPSHOT_SUFFIX)):
            check_plain_file(path, "snapshot", DamagedCheckpointError)
    return listing


def verify_snapshot(path: Path) -> None:
    """DamagedCheckpointError unless a ``--save-epochs`` snapshot is a plain file matching its entry in
    ``snapshots.json`` (``read_snapshots``; one written before that file existed must at least read as
    safetensors)."""
    check_plain_file(path, "snapshot", DamagedCheckpointError)
    listed = read_snapshots(path.parent).get(path.name)
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

    def training_state(self, point: Path | None = None) -> dict[str, Any]:
        """The training state of ``point`` (default: the newest), verified, loaded with weights_only=True."""
        point = point or self.newest_point()
        self.verify(point, STATE_FILE)
        return load_training_state(point)

    def best_epoch(self) -> int | None:
        """The epoch of the best evaluation so far, as the newest point records it: in its manifest, else
        (a point written before manifests carried it) in its verified training state."""
        point = self.newest_point()
        manifest = load_manifest(point) if os.path.lexists(point / MANIFEST_FILE) else {}
        if "best_epoch" in manifest:
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

    # ---------------------------------------------------------------------------------------- model
    def model_spec(self, which: str = DEFAULT_WHICH) -> dict[str, Any]:
        """What rebuilding the run's model needs: model, model_kwargs (with --gp as global_pool), img_size,
        in_chans, num_classes, and the checkpoint (a verified RunCheckpoint). Classes and channels come from the
        checkpoint's metadata, else from config.yaml and the dataset's description."""
        return self._while_written(which, lambda: self._unless_removed(which, lambda: self._model_spec(which)))

    def _model_spec(self, which: str) -> dict[str, Any]:
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
        output-scale wrapper of an ``--output-scale`` run. A point the run removes meanwhile gives way to the
        next verified one."""
        return self._while_written(which, lambda: self._build_model(which, extensions))

    def load_weights(self, model: torch.nn.Module, which: str = DEFAULT_WHICH) -> RunCheckpoint:
        """Load the verified weights of ``which`` into ``model`` (built as ``model_spec`` says): the point
        chosen, or the next verified one when the run removed it meanwhile. Returns the checkpoint loaded."""
        return self._while_written(which, lambda: self._unless_removed(which, lambda: self._load(model, which)))

    def _load(self, model: torch.nn.Module, which: str) -> RunCheckpoint:
        checkpoint = self.checkpoint(which)
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

    def _build_model(self, which: str, extensions: Any) -> tuple[Any, RunCheckpoint]:
        return self._unless_removed(which, lambda: self._build_verified_model(which, extensions))

    def _build_verified_model(self, which: str, extensions: Any) -> tuple[Any, RunCheckpoint]:
        spec, cfg = self.model_spec(which), self.run_config()
        initialization = getattr(extensions, "initialization_kwargs", frozenset())  # the checkpoint replaces them
        model_kwargs = {k: v for k, v in (cfg.model_kwargs or {}).items() if k not in initialization}
        cfg = cfg.replace(img_size=spec["img_size"], pretrained=False, pretrained_file=None, model_kwargs=model_kwargs)
        known = getattr(extensions, "reparametrizations", {}) or {}
        model, _ = create_run_model(
            cfg, spec["num_classes"], spec["in_chans"], spec["reparametrized"], known, spec["checkpoint"].describe()
        )
        if cfg.output_scale is not None:
            model = OutputScale(model, cfg.output_scale)
        return model.eval(), self._load(model, which)

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
