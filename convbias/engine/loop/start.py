"""Where a run starts: ``start_run`` takes the accelerator, the output dir's lock, the weights ``--checkpoint``
names and what the run resumes (engine.checkpointing.resume), derives the run's values once
(``config.derived.RunValues``) and fills what the checks leave open into a frozen copy of the Config
(``resolved_options``): nothing changes the options after that. A run that is already finished ends here.
Also what a run that stops says it kept. Every check here runs before the run writes anything."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from convbias.base.errors import ConfigError, DamagedInputError, DamagedRunRecordError
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    EMA_FILE,
    LAST_LINK,
    MANIFEST_FILE,
    RESULTS_FILE,
    WEIGHTS_FILE,
    point_position,
)
from convbias.base.weights import weights_metadata

from ..checkpointing.lock import ForeignLockError, RunLock, RunLockedError
from ..checkpointing.lock import describe as describe_holder
from ..checkpointing.points import CheckpointDir
from ..checkpointing.resume import Resume, ResumePoint, find_resume
from ..checkpointing.run_dir import RunDir, verify_file
from ..checkpointing.run_files import (
    is_run_dir,
    is_timm_checkpoint_name,
    is_timm_output_dir,
    read_run_config,
    timm_output_file,
)
from ..checkpointing.timm_checkpoint import TimmCheckpoint, read_timm_checkpoint
from ..config.derived import RunValues
from ..config.options import DEFAULT_WHICH, Config, OptimizationOptions, ScheduleOptions
from ..config.parsing import credit, option_source
from ..data.factory import input_format
from ..model.factory import check_model_name
from ..model.pretrained import check_pretrained_reachable
from ..optim import factory as optim
from .extensions import Extensions
from .node import set_threads
from .records import METRIC_NAMES, RunLog, results_record


def _check_which_target(which: str | None, checkpoint: Path | None) -> None:
    if which is not None:
        raise ConfigError(
            f"--which {which} picks a checkpoint of a run directory; --checkpoint {checkpoint or '(none)'} is not one"
        )


@dataclass(frozen=True)
class CheckpointChoice:
    """The weights --checkpoint (or --eval-only) names, how messages name them, and the run directory they were
    chosen in: a run being written may remove the chosen point before it is loaded, and its RunDir then loads
    the next verified one (RunDir.load_weights)."""

    weights: str | None = None
    name: str | None = None
    run: RunDir | None = None
    which: str = DEFAULT_WHICH
    timm_ema: bool = False  # the state_dict_ema of timm's checkpoint ``weights`` (--use-ema)


def resolve_checkpoint(cfg: Config) -> CheckpointChoice:
    """--checkpoint's weights: a run directory's checkpoints/<--which>, timm's output folder's file by --which,
    else the file itself; with --use-ema, the EMA's weights of that point or timm checkpoint."""
    choice = _chosen_weights(cfg)
    return _ema_of(choice, cfg.checkpoint) if cfg.use_ema else choice


def _ema_of(choice: CheckpointChoice, given: str) -> CheckpointChoice:
    """The EMA's weights beside the chosen ones, as timm's validate.py --use-ema loads them: timm's checkpoint's
    state_dict_ema, a resume point's EMA file (verified against its manifest); a ConfigError where there is none."""
    if is_timm_checkpoint_name(choice.weights) and choice.run is None:
        read_timm_checkpoint(choice.weights).weights(use_ema=True)  # a ConfigError when the file has none
        return replace(choice, name=f"{choice.name} (state_dict_ema)", timm_ema=True)
    if choice.run is None:
        raise ConfigError(
            f"--use-ema takes the EMA of a run directory's checkpoint or of timm's checkpoint; {given} is a weights "
            "file: pass the EMA's own file"
        )
    ema = Path(choice.weights).parent / EMA_FILE
    if not ema.is_file():
        raise ConfigError(f"--use-ema: {choice.name} holds no EMA weights ({EMA_FILE}: its run had no --model-ema)")
    verify_file(ema)
    return CheckpointChoice(str(ema), f"{choice.name}, its EMA", None, choice.which)


def _chosen_weights(cfg: Config) -> CheckpointChoice:
    if cfg.checkpoint is None:
        _check_which_target(cfg.which, None)
        return CheckpointChoice()
    run = Path(cfg.checkpoint)
    if is_timm_output_dir(run):  # timm's last.pth.tar or model_best.pth.tar, by --which
        chosen = timm_output_file(run, cfg.which)
        return CheckpointChoice(str(chosen), str(chosen))
    if (run / CHECKPOINTS_DIR).is_dir() or is_run_dir(run):
        run_dir, which = RunDir(run), cfg.which or DEFAULT_WHICH
        chosen = run_dir.checkpoint(which)
        return CheckpointChoice(str(chosen.weights), chosen.describe(), run_dir, which)
    _check_which_target(cfg.which, run)
    verify_file(run)
    epoch = weights_metadata(run).get("epoch")
    return CheckpointChoice(cfg.checkpoint, f"{run}, epoch {epoch}" if epoch else str(run))


def take_lock(accelerator: Accelerator, lock: RunLock | None, notes: list[str]) -> None:
    """The output dir's lock (engine.checkpointing.lock), taken by the main process before anything there is read or
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
    state: dict[str, Any] | None, output: Path, epochs: int, write: bool, options: dict[str, Any]
) -> str | None:
    """What --resume of a run that already trained all its epochs says instead of training again. Its
    results.json follows the point: missing, unreadable or older than the point (a run extended with a larger
    --epochs, killed before it rewrote the file), it is rewritten from the training state (by the main
    process, ``write``) and the message says so. The record is the one the run writes when it finishes
    (``records.results_record``), of the options it trained with: its config.yaml over this command's
    ``options``, the point's own over both; the same fields with the same meaning (``metric_of``: whose
    evaluations the training state holds, the EMA's or the model's, even when --model-ema is not repeated)."""
    if not state or state.get("step") or state["epoch"] < epochs:
        return None
    final, best = state.get("final") or {}, state.get("best") or {}
    options = {**options, **_trained_with(output), **(state.get("options") or {"model": state["model"]})}
    expected = results_record(options, state["epoch"], final, best)
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
        repaired = f"{RESULTS_FILE} was {problem}; rewrote it from epoch {state['epoch']}'s training state; "
    metric = options.get("eval_metric", "top1")  # what chose the best epoch
    return (
        f"{repaired}{output} is already finished (epoch {state['epoch']}/{epochs}, final top-1 "
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


def check_exact_continuation(
    cfg: Config, state: dict[str, Any] | None, point: Path | None, keys: tuple[str, ...]
) -> str | None:
    """A mid-epoch resume point continues exactly only with the options that shaped its epoch (``keys``, which
    the resume point's parts declare: the batches, their order, the model): a change is refused, or with
    --accept-resume-changes returned as a sentence for the run log. An end-of-epoch point, or one written
    without its options, is not checked."""
    if not state or not state.get("step") or not isinstance(state.get("options"), dict):
        return None
    written = state["options"]
    changes = [
        f"--{key.replace('_', '-')} {_shown(written[key])} -> {_shown(getattr(cfg, key))}"
        for key in keys
        if key in written and _shown(written[key]) != _shown(getattr(cfg, key))
    ]
    if not changes:
        return None
    if not cfg.accept_resume_changes:
        raise ConfigError(
            f"--resume {point} is a mid-epoch resume point ({state['step']} steps into epoch {state['epoch'] + 1}) "
            f"and these options differ from the run that wrote it: {'; '.join(changes)}; the epoch would not "
            f"continue exactly: give the run's values, or pass --accept-resume-changes (recorded in log.jsonl)"
        )
    return "; ".join(changes)


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def check_resume_world_size(state: dict[str, Any] | None, point: Path | None, world: int) -> None:
    """A mid-epoch resume point continues exactly only on as many processes as wrote it (each rank's
    sampler offset, RNG streams and loss sum); an end-of-epoch one continues on any number."""
    if state and state.get("step") and len(state["rng"]) != world:
        raise ConfigError(
            f"--resume {point} is a mid-epoch resume point ({state['step']} steps into epoch "
            f"{state['epoch'] + 1}) written by {len(state['rng'])} processes, and this run has {world}: its "
            f"position in the epoch cannot be continued exactly; resume with {len(state['rng'])} processes, "
            f"or keep its weights only with --checkpoint {point / WEIGHTS_FILE} in a new --output"
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


@dataclass
class RunStart:
    """Where a run starts, decided before anything is built or written."""

    cfg: Config  # the checked options, resolved by the set-up (resolved_options) and frozen
    extensions: Extensions
    accelerator: Accelerator
    output: Path
    values: RunValues  # what the run derives from its options: epochs, global batch, lr
    checkpoint: CheckpointChoice  # --checkpoint's weights, their name in messages, the run they were chosen in
    checkpoint_metadata: dict[str, str]  # the metadata of --checkpoint's weights ({} when resuming or none)
    resume: Resume | None  # what the run continues (engine.checkpointing.resume); None for a fresh run
    notes: list[str] = field(default_factory=list)  # said when training starts (stale lock taken over, restart)
    finished: str | None = None  # --resume of a run that trained all its epochs: what to say instead
    threads: str = ""  # where the intra-op threads came from (engine.loop.node.set_threads)
    weights: str | None = None  # the starting weights and what loading them did (set when the model is built)
    head: tuple[int | None, str] = (None, "")  # the classifier's size asked of timm (None: the model's) and why

    @property
    def sharded(self) -> bool:
        return self.accelerator.is_fsdp2

    @property
    def point(self) -> ResumePoint | None:
        """This engine's resume point the run continues, if it continues one."""
        return self.resume if isinstance(self.resume, ResumePoint) else None


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
    start = RunStart(cfg, extensions, acc, output, values, choice, metadata, resume, notes)
    start.threads = threads
    start.head = requested_head(cfg, metadata, resume)
    state = point.state if point is not None else None
    finished = finished_message(state, output, values.epochs, acc.is_main_process, cfg.to_dict())
    if finished:
        start.finished = "; ".join([*notes, finished])
    else:
        check_resume_world_size(state, point and point.path, acc.num_processes)
    return start


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
