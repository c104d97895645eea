"""What a run resumes: found and verified once, before anything is built or written, every option of the run
checked against it, and restored into the run's parts in one call.

``find_resume`` answers for the run: this engine's resume point (``ResumePoint``: its folder, checked against
its manifest, and its training state), timm's training checkpoint (``TimmCheckpoint``, read safely: a
``--resume FILE.pth.tar`` continued by a new run of this engine, engine.checkpoint.timm_resume), or None for a
fresh run. The set-up reads from the answer what the model must be (its head, whether it was reparametrized).
The options a resumed run keeps from its point (``check_resume_options``), the processes a mid-epoch point
needs (``check_resume_world_size``) and the options its epoch was shaped by (``check_exact_continuation``) are
checked here; ``load_point`` restores a point into the parts (``CheckpointManager.load``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from convbias.base.errors import ConfigError, DamagedCheckpointError, DamagedFileError, DamagedInputError
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EMA_FILE,
    LAST_LINK,
    LOG_FILE,
    MANIFEST_FILE,
    RESULTS_FILE,
    STATE_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
    point_name,
)
from convbias.base.weights import load_weights, weights_metadata

from ..config.options import Config, OptimizationOptions, ScheduleOptions
from ..rundir.manifest import check_point, check_snapshots
from ..rundir.run_files import foreign_entry, foreign_links, is_timm_checkpoint_name, read_run_config
from ..rundir.timm_files import TimmCheckpoint
from .parts import Stateful, restore
from .points import CheckpointDir
from .shards import load_sharded
from .timm_resume import read_timm_resume


@dataclass(frozen=True)
class ResumePoint:
    """A resume point of this engine: its folder, verified against its manifest, its training state and its
    weights' metadata (the head's size)."""

    path: Path
    state: dict[str, Any]
    metadata: dict[str, str]

    @property
    def reparametrized(self) -> bool:
        return bool(self.state["reparametrized"])

    @property
    def position(self) -> tuple[int, int]:
        """(epochs done, steps into the next one)."""
        return self.state["epoch"], self.state.get("step") or 0

    @property
    def evaluations(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the latest evaluation, the best one) the point records ({} where none)."""
        return self.state.get("final") or {}, self.state.get("best") or {}

    @property
    def options(self) -> dict[str, Any]:
        """The options of the run that wrote the point, as far as it recorded them."""
        return self.state.get("options") or {"model": self.state["model"]}

    def __str__(self) -> str:
        return str(self.path)


Resume = ResumePoint | TimmCheckpoint


def find_resume(accelerator: Accelerator, cfg: Config, output: Path, epochs: int, notes: list[str]) -> Resume | None:
    """What ``--resume`` (or a run directory that already holds a run) continues from, or None for a fresh run;
    ``notes`` gets what was done on the way (a damaged point set aside, a failed attempt started over)."""
    if cfg.eval_only:
        return None
    if is_timm_checkpoint_name(cfg.resume or ""):
        checkpoint = read_timm_resume(cfg, epochs)
        if accelerator.is_fsdp2:
            raise ConfigError(
                f"--resume {cfg.resume}: timm's optimizer state is whole, FSDP's is sharded; resume it with DDP, "
                f"or start from its weights with --initial-checkpoint {cfg.resume}"
            )
        _point_on_every_process(accelerator, cfg, output, notes)  # the folder's checks: timm's file starts it
        return checkpoint
    point = _point_on_every_process(accelerator, cfg, output, notes)
    if point is None:
        return None
    resume = ResumePoint(point, load_training_state(point), weights_metadata(point / WEIGHTS_FILE))
    _check_point(accelerator, cfg, output, resume, notes)
    return resume


def _check_point(accelerator: Accelerator, cfg: Config, output: Path, resume: ResumePoint, notes: list[str]) -> None:
    """The point belongs to this model and this kind of distribution; its links follow its training state."""
    state, point = resume.state, resume.path
    if state.get("model") != cfg.model:
        raise ConfigError(f"--resume {point} is a checkpoint of {state.get('model')}, not of --model {cfg.model}")
    if not state.get("sharded") and state["optimizer"] is None:
        raise ConfigError(
            f"{point} was written under FSDP1, whose sharded optimizer state was not saved; start a new run "
            f"from its weights with --checkpoint instead"
        )
    if accelerator.is_fsdp2 and not state.get("sharded"):
        raise ConfigError(
            f"{point} was written without FSDP: its optimizer state is not sharded; continue it without FSDP, "
            f"or start a new run from its weights with --checkpoint"
        )
    checkpoints = CheckpointDir(output)
    if point.parent == checkpoints.root.resolve() and accelerator.is_main_process:
        best = (state.get("best") or {}).get("epoch")  # a copy of the run may have dropped the links
        notes += checkpoints.relink(point.name, None if best is None else point_name(best))


def _point_in_output(cfg: Config, output: Path, notes: list[str]) -> Path | None:
    """The resume point, or None for a fresh run. A directory that holds anything that may be weights is
    never started over: a plain run refuses it, ``--resume auto`` continues from its newest intact point
    (a damaged newer one is renamed ``<name>.damaged`` and named in ``notes``) or stops naming what it found.

    ``--resume`` of timm's checkpoint file (``timm_checkpoint``) starts this engine's run in ``output`` as a plain
    run does. A directory without any resume point is started over only when every entry in it is train.py's own
    (``run_files.foreign_entry``: its marked config.yaml, summary.csv, log.jsonl): a run that failed before its
    first checkpoint. Anything else, and any link in the place of a file the run writes, is refused."""
    links = foreign_links(output)
    if links:
        raise DamagedInputError(
            f"--output {output}: {links[0]} is a symbolic link that train.py did not make; it writes and resumes "
            f"nothing through one (a resume point or log elsewhere would be replaced): replace it with a copy of "
            f"what it points at, or move it away; nothing was changed"
        )
    checkpoints = CheckpointDir(output, cfg.keep_checkpoints)
    if cfg.save_epochs:  # the snapshots it writes are listed beside those it wrote: the listing must read first
        check_snapshots(checkpoints.root)
    foreign = None if checkpoints.points() else foreign_entry(output)
    if foreign:
        raise DamagedInputError(
            f"--output {output} is not a run of train.py: it holds {foreign}; a folder is started over only when "
            f"it holds nothing but train.py's own files; nothing was changed: choose another --output"
        )
    resume = None if is_timm_checkpoint_name(cfg.resume or "") else cfg.resume  # timm's file starts a new run
    if resume and resume != "auto":
        return find_resume_point(resume, output)
    held = [f"{CHECKPOINTS_DIR}/{name}" for name in checkpoints.held()]
    if resume is None:
        earlier = held + ([RESULTS_FILE] if (output / RESULTS_FILE).exists() else [])
        if earlier:
            raise ConfigError(
                f"output dir {output} already holds a run ({_listing(earlier)}); "
                f"pass --resume auto to continue it, or choose another --output"
            )
    else:
        point, skipped = checkpoints.select()
        if point is not None or skipped:
            checkpoints.remove_staging()  # a killed save's staging folder: ours, and never a resume point
        for damaged, problem in skipped if point is not None else ():
            aside = checkpoints.set_aside(damaged)
            notes.append(f"skipped {damaged} ({problem}); kept it as {aside.name}; resuming from {point.name}")
        if point is not None:
            return point
        if held:
            found = "; ".join(f"{p.name}: {problem}" for p, problem in skipped) or "no resume point by its name"
            raise DamagedCheckpointError(
                f"--resume auto: {output}/checkpoints holds {_listing(held)} but no intact resume point ({found}); "
                f"nothing was changed. Continue from one folder with --resume {output / CHECKPOINTS_DIR}/NAME (checked "
                f"against its manifest), take its weights only with --checkpoint "
                f"{output / CHECKPOINTS_DIR}/NAME/{WEIGHTS_FILE} in another --output, or choose another --output"
            )
    leftovers = [name for name in (CONFIG_FILE, SUMMARY_FILE, LOG_FILE) if (output / name).exists()]
    if leftovers and not (output / RESULTS_FILE).exists():
        checkpoints.remove_staging()
        notes.append(
            f"starting over: {output} holds no checkpoint of an earlier attempt "
            f"(its {', '.join(leftovers)} are replaced)"
        )
    return None


def _listing(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _point_on_every_process(accelerator: Accelerator, cfg: Config, output: Path, notes: list[str]) -> Path | None:
    """``_point_in_output`` on the main process only (it hashes the point's files and may rename a damaged
    one), its answer and its refusal on every process."""
    if accelerator.num_processes == 1:
        return _point_in_output(cfg, output, notes)
    answer: list[Any] = [None, notes, None]
    if accelerator.is_main_process:
        try:
            answer[0] = _point_in_output(cfg, output, notes)
        except (ValueError, DamagedFileError) as e:  # ConfigError included
            answer[2] = e
    point, notes[:], error = broadcast_object_list(answer)
    if error is not None:
        raise error
    return point


def find_resume_point(resume: str, output: str | Path) -> Path | None:
    """The checkpoint directory ``--resume`` names, checked against its manifest; for 'auto' the newest
    intact point of the run dir (None when it has none).

    Raises ConfigError for an explicit path that holds no resume point, DamagedCheckpointError for one
    whose files do not match its manifest (a point without one, written before checksums, is taken as is).
    """
    if resume == "auto":
        return CheckpointDir(output).select()[0]
    path = Path(resume)
    for candidate in (path, path / LAST_LINK, path / CHECKPOINTS_DIR / LAST_LINK):
        if (candidate / STATE_FILE).is_file() and (candidate / WEIGHTS_FILE).is_file():
            problem = check_point(candidate) if os.path.lexists(candidate / MANIFEST_FILE) else None
            if problem:
                raise DamagedCheckpointError(f"--resume {resume}: {candidate} is damaged: {problem}")
            return candidate.resolve()
    raise ConfigError(
        f"--resume {resume}: no checkpoint there (expected a run dir with {CHECKPOINTS_DIR}/{LAST_LINK}/, "
        f"or a checkpoint dir holding {WEIGHTS_FILE} and {STATE_FILE})"
    )


def check_exact_continuation(cfg: Config, point: ResumePoint, keys: tuple[str, ...]) -> str | None:
    """A mid-epoch resume point continues exactly only with the options that shaped its epoch (``keys``, which
    the resume point's parts declare: the batches, their order, the model): a change is refused, or with
    --accept-resume-changes returned as a sentence for the run log. An end-of-epoch point, or one written
    without its options, is not checked."""
    epoch, step = point.position
    written = point.state.get("options")
    if not step or not isinstance(written, dict):
        return None
    changes = [
        f"--{key.replace('_', '-')} {_shown(written[key])} -> {_shown(getattr(cfg, key))}"
        for key in keys
        if key in written and _shown(written[key]) != _shown(getattr(cfg, key))
    ]
    if not changes:
        return None
    if not cfg.accept_resume_changes:
        raise ConfigError(
            f"--resume {point.path} is a mid-epoch resume point ({step} steps into epoch {epoch + 1}) "
            f"and these options differ from the run that wrote it: {'; '.join(changes)}; the epoch would not "
            f"continue exactly: give the run's values, or pass --accept-resume-changes (recorded in log.jsonl)"
        )
    return "; ".join(changes)


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def check_resume_world_size(point: ResumePoint | None, world: int) -> None:
    """A mid-epoch resume point continues exactly only on as many processes as wrote it (each rank's
    sampler offset, RNG streams and loss sum); an end-of-epoch one continues on any number."""
    if point is None or not point.position[1]:
        return
    epoch, step = point.position
    written = len(point.state["rng"])
    if written != world:
        raise ConfigError(
            f"--resume {point.path} is a mid-epoch resume point ({step} steps into epoch {epoch + 1}) written by "
            f"{written} processes, and this run has {world}: its position in the epoch cannot be continued exactly; "
            f"resume with {written} processes, or keep its weights only with --checkpoint {point.path / WEIGHTS_FILE} "
            f"in a new --output"
        )


# Options a resume point overrides: its optimizer state restores every param group's hyperparameters (torch's
# Optimizer.load_state_dict) and its scheduler state every attribute of timm's scheduler. The rest of
# OptimizationOptions and ScheduleOptions a resumed run honours from where it continues.
RESUME_HONOURED = frozenset(
    {"batch_size", "eval_batch_size", "grad_accum_steps", "seed", "clip_grad", "clip_mode", "epochs", "scale_epochs"}
)


def resume_kept_options() -> tuple[str, ...]:
    """The options whose values a resumed run takes from its resume point, whatever the command line says."""
    return tuple(
        spec.name
        for group in (OptimizationOptions, ScheduleOptions)
        for spec in fields(group)
        if spec.name not in RESUME_HONOURED
    )


def check_resume_options(cfg: Config, output: Path, point: Path) -> None:
    """ConfigError when a resume would record an option it does not apply: one of ``resume_kept_options``
    differs from the run's config.yaml (the resumed optimizer and schedule keep the run's value). Checked
    before config.yaml is rewritten; a run without a readable config.yaml is not checked."""
    try:
        written = read_run_config(output)
    except ConfigError:
        return
    given = cfg.to_dict()
    changes = [
        f"--{key.replace('_', '-')} {_shown(given[key])} (the run: {_shown(written[key])})"
        for key in resume_kept_options()
        if key in written and key in given and _shown(written[key]) != _shown(given[key])
    ]
    if changes:
        raise ConfigError(
            f"--resume {point}: {'; '.join(changes[:4])}{' and more' if len(changes) > 4 else ''}: a resumed run "
            f"keeps the optimizer and schedule of its resume point, so these would not apply; give the run's values, "
            f"or start a new run from its weights with --checkpoint {point / WEIGHTS_FILE} in another --output; "
            f"nothing was changed"
        )


def load_point(point: ResumePoint, parts: dict[str, Stateful], models: Any) -> str:
    """This engine's point restored: the weights (every rank's shards under FSDP, on any number of ranks), the
    EMA's (the model's when the point has none), then each part of its training state. Returns the sentence
    that says so."""
    acc = models.accelerator
    model = acc.unwrap_model(models.model)
    if acc.is_fsdp2:
        load_sharded(point.path, models.model, parts["optimizer"].optimization.optimizer.optimizer)
    else:
        load_weights(model, point.path / WEIGHTS_FILE)
    if models.ema is not None:
        if (point.path / EMA_FILE).is_file():
            load_weights(models.ema.module, point.path / EMA_FILE)
        elif not acc.is_fsdp2:
            models.ema.set(model)
    restore(parts, point.state)
    progress = parts["progress"]
    within = f" and {progress.step} steps of epoch {progress.epoch + 1}" if progress.step else ""
    return f"resumed from {point} after epoch {progress.epoch}{within}"


def load_training_state(point: Path) -> dict[str, Any]:
    """The training state of a resume point, loaded with weights_only=True."""
    try:
        return torch.load(point / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception:  # torch's message invites unpickling the file with weights_only=False: not ours to give
        raise DamagedCheckpointError(
            f"{point / STATE_FILE} is not a training state this engine wrote (damaged or foreign); it was not loaded"
        ) from None
