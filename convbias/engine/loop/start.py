"""Where a run starts: ``start_run`` takes the accelerator, the output dir's lock, the weights ``--checkpoint``
names (engine.rundir.choice) and what the run resumes with every check of the options against it
(engine.checkpoint.resume), derives the run's values once (``config.derived.RunValues``) and fills what the
checks leave open into a frozen copy of the Config (``resolved_options``): nothing changes the options, nor the
``RunStart``, after that. A run that is already finished ends here. Also what a run that stops says it kept.
Every check here runs before the run writes anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from convbias.base.errors import ConfigError, DamagedInputError, DamagedRunRecordError
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    LAST_LINK,
    MANIFEST_FILE,
    RESULTS_FILE,
    point_position,
)
from convbias.base.weights import weights_metadata

from ..checkpoint.points import CheckpointDir
from ..checkpoint.resume import (
    Resume,
    ResumePoint,
    check_resume_options,
    check_resume_world_size,
    find_resume,
)
from ..config.derived import RunValues
from ..config.options import Config
from ..config.parsing import credit, option_source
from ..data.factory import input_format
from ..model.factory import check_model_name
from ..model.pretrained import check_pretrained_reachable
from ..optim import factory as optim
from ..rundir.choice import CheckpointChoice, resolve_checkpoint
from ..rundir.lock import ForeignLockError, RunLock, RunLockedError
from ..rundir.lock import describe as describe_holder
from ..rundir.manifest import verify_file
from ..rundir.reader import RunDir
from ..rundir.run_files import (
    read_run_config,
)
from ..rundir.timm_files import TimmCheckpoint
from .extensions import Extensions
from .node import set_threads
from .records import METRIC_NAMES, RunLog, results_record


def take_lock(accelerator: Accelerator, lock: RunLock | None, notes: list[str]) -> None:
    """The output dir's lock (engine.rundir.lock), taken by the main process before anything there is read or
    written; every process stops when another live run holds it. A stale lock taken over is noted."""
    message, foreign = None, False
    if lock is None:
        return
    if accelerator.is_main_process:
        try:
            lock.acquire()
        except RunLockedError as e:
            message, foreign = str(e), isinstance(e, ForeignLockError)
        if lock.stale:
            notes.append(f"took over the stale lock of {describe_holder(lock.stale)} (that process is gone)")
    if accelerator.num_processes > 1:
        message, foreign = broadcast_object_list([message, foreign])
    if message:
        raise (DamagedInputError if foreign else ConfigError)(message)


def finished_message(
    point: ResumePoint | None, output: Path, epochs: int, write: bool, options: dict[str, Any]
) -> str | None:
    """What --resume of a run that already trained all its epochs says instead of training again. Its
    results.json follows the point: missing, unreadable or older than the point (a run extended with a larger
    --epochs, killed before it rewrote the file), it is rewritten from the point's training state (by the main
    process, ``write``) and the message says so. The record is the one the run writes when it finishes
    (``records.results_record``), of the options it trained with: its config.yaml over this command's
    ``options``, the point's own over both; the same fields with the same meaning (``metric_of``: whose
    evaluations the training state holds, the EMA's or the model's, even when --model-ema is not repeated)."""
    if point is None or point.position[1] or point.position[0] < epochs:
        return None
    epoch, (final, best) = point.position[0], point.evaluations
    options = {**options, **_trained_with(output), **point.options}
    expected = results_record(options, epoch, final, best)
    try:
        results = RunDir(output).results()
    except DamagedRunRecordError:
        results, problem = {}, "unreadable"
    else:
        if results is None:
            results, problem = {}, "missing"
        else:
            problem = None if results == {**results, **expected} else f"stale (epoch {results.get('epochs')})"
    repaired = ""
    if problem:
        if write:
            RunLog(output, enabled=True).write_results({**results, **expected})
        repaired = f"{RESULTS_FILE} was {problem}; rewrote it from epoch {epoch}'s training state; "
    metric = options.get("eval_metric", "top1")  # what chose the best epoch
    return (
        f"{repaired}{output} is already finished (epoch {epoch}/{epochs}, final top-1 "
        f"{final.get('eval_top1', float('nan')):.2f}, best {METRIC_NAMES.get(metric, metric)} "
        f"{best.get(f'eval_{metric}', float('nan')):.{4 if metric == 'loss' else 2}f} at epoch {best.get('epoch')}); "
        f"nothing to do (a larger --epochs trains on)"
    )


def _trained_with(output: Path) -> dict[str, Any]:
    """The options of the run in ``output`` as its config.yaml records them ({} when it has none that reads)."""
    try:
        return read_run_config(output)
    except ConfigError:
        return {}


def kept(cfg: Config, output: Path) -> str:
    """What an interrupted run leaves behind, in one sentence."""
    if cfg.eval_only:
        return "nothing was written"
    checkpoints = CheckpointDir(output)
    try:  # the newest point its manifest completed (not re-hashed here); the output may be gone
        point = next((p for p in checkpoints.points() if (p / MANIFEST_FILE).is_file()), None)
    except OSError:
        point = None
    if point is None:
        return f"no checkpoint was written yet in {output}; rerun the same command to start over"
    name = LAST_LINK if point == checkpoints.points()[0] else point.name
    epoch, step = point_position(point)
    within = f" and {step} steps of epoch {epoch + 1}" if step else ""
    return f"kept {output / CHECKPOINTS_DIR / name} (epoch {epoch}{within}); continue with --resume auto"


@dataclass(frozen=True)
class RunStart:
    """Where a run starts, decided before anything is built or written."""

    cfg: Config  # the checked options, resolved (resolved_options) and frozen
    extensions: Extensions
    accelerator: Accelerator
    output: Path
    values: RunValues  # what the run derives from its options: epochs, global batch, lr
    checkpoint: CheckpointChoice  # --checkpoint's weights, their name in messages, the run they were chosen in
    checkpoint_metadata: dict[str, str]  # the metadata of --checkpoint's weights ({} when resuming or none)
    resume: Resume | None  # what the run continues (engine.checkpoint.resume); None for a fresh run
    head: tuple[int | None, str]  # the classifier's size asked of timm (None: the model's) and why
    threads: str  # where the intra-op threads came from (engine.loop.node.set_threads)
    notes: tuple[str, ...] = ()  # said when training starts (stale lock taken over, restart)
    finished: str | None = None  # --resume of a run that trained all its epochs: what to say instead

    @property
    def sharded(self) -> bool:
        return self.accelerator.is_fsdp2

    @property
    def point(self) -> ResumePoint | None:
        """This engine's resume point the run continues, if it continues one."""
        return self.resume if isinstance(self.resume, ResumePoint) else None

    @property
    def reparametrized(self) -> bool:
        """The weights the run starts from were written after a reparametrization (its resume point's, or
        --checkpoint's)."""
        if self.point is not None:
            return self.point.reparametrized
        return self.checkpoint_metadata.get("reparametrized") == "True"


def start_run(cfg: Config, extensions: Extensions | None, lock: RunLock | None) -> RunStart:
    """The accelerator, the checks that need no data, the lock and the resume point."""
    extensions = extensions or Extensions()
    threads = set_threads(cfg.workers)
    acc = Accelerator(  # the trainer accumulates gradients as timm's train.py does (engine.loop.trainer)
        mixed_precision=cfg.mixed_precision, log_with="wandb" if cfg.log_wandb and not cfg.eval_only else None
    )
    _check_fsdp(acc, cfg)
    check_model_name(cfg.model)
    if cfg.pretrained and not cfg.pretrained_file:
        check_pretrained_reachable(cfg.model)
    check_reparametrization(cfg, extensions)
    if cfg.distill_teacher:
        check_model_name(cfg.distill_teacher, "--distill-teacher")
    choice = resolve_checkpoint(cfg)
    for weights in (cfg.pretrained_file, cfg.distill_teacher_file):  # files of a resume point: checksummed
        if weights:
            verify_file(weights)
    values = RunValues.derive(cfg, acc.num_processes, optim.trained_epochs(cfg))
    output, notes = Path(cfg.output), []
    take_lock(acc, lock, notes)
    resume = find_resume(acc, cfg, output, values.epochs, notes)
    point = resume if isinstance(resume, ResumePoint) else None
    if point is not None:
        check_resume_options(cfg, output, point.path)
    metadata = weights_metadata(choice.weights) if choice.weights and point is None else {}
    cfg = resolved_options(cfg, choice.weights, metadata, extensions)
    finished = finished_message(point, output, values.epochs, acc.is_main_process, cfg.to_dict())
    if not finished:
        check_resume_world_size(point, acc.num_processes)
    head = requested_head(cfg, metadata, resume)
    return RunStart(
        cfg,
        extensions,
        acc,
        output,
        values,
        choice,
        metadata,
        resume,
        head,
        threads,
        tuple(notes),
        "; ".join([*notes, finished]) if finished else None,
    )


def resolved_options(cfg: Config, checkpoint: str | None, metadata: dict[str, str], extensions: Extensions) -> Config:
    """The run's options with what the checks leave open filled in, as a frozen copy: --checkpoint's weights file
    (a run directory names its checkpoints/<--which>), the image size (the data set's when not given: data and
    model agree), and from the metadata of --checkpoint's weights the reparametrization and output scale they
    were written with (a checkpoint written after --reparametrize-at-epoch needs the changed architecture;
    weights of an output-scaled run hold f_w0 too)."""
    shape = input_format(cfg)  # the model's input size as timm resolves it (validate.py's with --eval-only)
    changes: dict[str, Any] = {"img_size": cfg.img_size or shape.img_size}
    if checkpoint is not None:
        changes["checkpoint"] = checkpoint
    if metadata:
        changes["reparametrize"] = cfg.reparametrize or metadata.get("reparametrization") or None
        if metadata.get("output_scale"):
            changes["output_scale"] = cfg.output_scale or float(metadata["output_scale"])
    resolved = cfg.resolved(**changes)
    if cfg.img_size is None:
        credit(resolved, "img_size", shape.sources["img_size"])
    check_reparametrization(resolved, extensions)
    return resolved


def requested_head(cfg: Config, metadata: dict[str, str], resume: Resume | None) -> tuple[int | None, str]:
    """(the classifier's size to build, the rule that gave it): --num-classes as timm's train.py reads it (the
    command line or a recipe), else the head of the weights the run continues or evaluates (a resume point, a
    timm checkpoint's args, --checkpoint's metadata), else None: the model's default, as timm."""
    if cfg.num_classes is not None:
        source = option_source(cfg, "num_classes")
        return cfg.num_classes, "recipe" if source.startswith("recipe") else source
    recorded = resume.metadata if isinstance(resume, ResumePoint) else metadata
    if isinstance(resume, TimmCheckpoint) and resume.args.get("num_classes"):
        return int(resume.args["num_classes"]), "the resumed checkpoint's args"
    if recorded.get("num_classes"):
        return int(recorded["num_classes"]), "the weights' head"
    return None, "model default, as timm"


def _check_fsdp(acc: Accelerator, cfg: Config) -> None:
    """FSDP through fsdp_version 2 only, and without a mid-run change of architecture."""
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise ConfigError(
            "FSDP1 (fsdp_version 1) is not supported: its resume points cannot be continued; set "
            "fsdp_version: 2 in the accelerate config (or --fsdp_version 2), or train with DDP"
        )
    if acc.is_fsdp2 and cfg.clip_grad is not None and cfg.clip_mode != "norm" and not cfg.eval_only:
        raise ConfigError(
            f"--clip-mode {cfg.clip_mode} is not supported under FSDP (its gradients are sharded); use --clip-mode "
            f"norm, or train with DDP"
        )
    if acc.is_fsdp2 and cfg.reparametrize_at_epoch is not None and not cfg.eval_only:
        raise ConfigError(
            "--reparametrize-at-epoch changes the model's architecture mid-run, which FSDP's "
            "sharded parameters cannot follow; run it with DDP"
        )


def check_reparametrization(cfg: Config, extensions: Extensions) -> None:
    """--reparametrize names one of the composition root's reparametrizations (needed by
    --reparametrize-at-epoch, and to rebuild a model from a checkpoint written after one)."""
    name, known = cfg.reparametrize, extensions.reparametrizations
    if name is not None and name not in known:
        raise ConfigError(f"unknown --reparametrize '{name}'; choices: {', '.join(known) or 'none registered'}")
    if cfg.reparametrize_at_epoch is not None and name is None:
        raise ConfigError(
            f"--reparametrize-at-epoch needs --reparametrize NAME; choices: {', '.join(known) or 'none registered'}"
        )
