"""The weights ``--checkpoint`` (or ``--eval-only``) names, resolved once: a run directory's checkpoint by
``--which``, timm's output folder's file, or the file itself, with ``--use-ema`` the EMA's weights beside them;
each verified against its manifest where it has one."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from convbias.base.errors import ConfigError
from convbias.base.run_layout import CHECKPOINTS_DIR, EMA_FILE
from convbias.base.weights import weights_metadata

from ..config.options import DEFAULT_WHICH, Config
from .manifest import verify_file
from .reader import RunDir
from .run_files import is_run_dir, is_timm_checkpoint_name, is_timm_output_dir, timm_output_file
from .timm_files import read_timm_checkpoint


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
