"""Which point a run resumes from: found and verified once, before anything is built or written.

``find_resume`` answers for the run: this engine's resume point (``ResumePoint``: its folder, checked against
its manifest, and its training state), timm's training checkpoint (``TimmCheckpoint``, read safely: a
``--resume FILE.pth.tar`` continued by a new run of this engine), or None for a fresh run. The set-up reads
from the answer what the model must be (its head, whether it was reparametrized); ``CheckpointManager.load``
restores it into the run's parts in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from convbias.base.errors import ConfigError, DamagedCheckpointError, DamagedFileError, DamagedInputError
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LOG_FILE,
    RESULTS_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
    point_name,
)
from convbias.base.weights import weights_metadata

from ..config.options import Config
from .points import CheckpointDir, find_resume_point
from .run_dir import check_snapshots, load_training_state
from .run_files import foreign_entry, foreign_links, is_timm_checkpoint_name
from .timm_checkpoint import TimmCheckpoint, read_timm_checkpoint


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


def read_timm_resume(cfg: Config, epochs: int) -> TimmCheckpoint:
    """--resume of timm's training checkpoint: read safely, of --model (its args name the model it trained),
    with epochs left to train."""
    checkpoint = read_timm_checkpoint(cfg.resume)
    model = checkpoint.args.get("model")
    if model is not None and model != cfg.model:
        raise ConfigError(f"--resume {cfg.resume} is timm's checkpoint of {model}, not of --model {cfg.model}")
    if checkpoint.resume_epoch >= epochs:
        raise ConfigError(
            f"--resume {cfg.resume} is timm's checkpoint after {checkpoint.resume_epoch} epochs, and this run has "
            f"{epochs}: nothing is left to train; give a larger --epochs"
        )
    return checkpoint


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
