"""Where a run starts: the weights ``--checkpoint`` names, the output dir's lock, the resume point, and
what a run that stops says it kept. Every check here runs before the run writes anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from .checkpoint import WEIGHTS_FILE, CheckpointDir, find_resume_point, weights_metadata
from .config import Config
from .errors import ConfigError
from .lock import RunLock, RunLockedError
from .lock import describe as describe_holder
from .run_dir import DEFAULT_WHICH, choose_checkpoint, is_run_dir


def _check_which_target(which: str | None, checkpoint: Path | None) -> None:
    if which is not None:
        raise ConfigError(
            f"--which {which} picks a checkpoint of a run directory; --checkpoint {checkpoint or '(none)'} is not one"
        )


def resolve_checkpoint(cfg: Config) -> str | None:
    """--checkpoint (or --eval-only) naming a run directory becomes its checkpoints/<--which> weights
    (``cfg.checkpoint`` is rewritten); returns how to name the weights in messages (the link and its epoch)."""
    if cfg.checkpoint is None:
        _check_which_target(cfg.which, None)
        return None
    run = Path(cfg.checkpoint)
    if (run / "checkpoints").is_dir() or is_run_dir(run):
        chosen = choose_checkpoint(run, cfg.which or DEFAULT_WHICH)
        cfg.checkpoint = str(chosen.weights)
        return chosen.describe()
    _check_which_target(cfg.which, run)
    epoch = weights_metadata(run).get("epoch")
    return f"{run}, epoch {epoch}" if epoch else str(run)


def take_lock(accelerator: Accelerator, lock: RunLock | None, notes: list[str]) -> None:
    """The output dir's lock (engine.lock), taken by the main process before anything there is read or
    written; every process stops when another live run holds it. A stale lock taken over is noted."""
    message = None
    if lock is None:
        return
    if accelerator.is_main_process:
        try:
            lock.acquire()
        except RunLockedError as e:
            message = str(e)
        if lock.stale:
            notes.append(f"took over the stale lock of {describe_holder(lock.stale)} (that process is gone)")
    if accelerator.num_processes > 1:
        message = broadcast_object_list([message])[0]
    if message:
        raise ConfigError(message)


def check_output_dir(cfg: Config, output: Path, notes: list[str]) -> Path | None:
    """The resume point, or None for a fresh run; refuses to overwrite an earlier run's results.

    A directory without a resume point or results.json holds only the start of a run that failed
    before its first checkpoint (config.yaml, summary.csv...): the run starts over there."""
    if cfg.eval_only:
        return None
    point = find_resume_point(cfg.resume, output) if cfg.resume else None
    if point is None and output.is_dir():
        earlier = [
            name
            for name, there in (
                ("checkpoints/last", CheckpointDir(output).last is not None),
                ("results.json", (output / "results.json").exists()),
            )
            if there
        ]
        if earlier and cfg.resume is None:
            raise ConfigError(
                f"output dir {output} already holds a run ({', '.join(earlier)}); "
                f"pass --resume auto to continue it, or choose another --output"
            )
        leftovers = [name for name in ("config.yaml", "summary.csv", "log.jsonl") if (output / name).exists()]
        if leftovers and not earlier:
            notes.append(
                f"starting over: {output} holds no checkpoint of an earlier attempt "
                f"(its {', '.join(leftovers)} are replaced)"
            )
    return point


def finished_message(state: dict[str, Any] | None, output: Path, epochs: int) -> str | None:
    """What --resume of a run that already trained all its epochs says instead of training again."""
    if not state or state.get("step") or state["epoch"] < epochs or not (output / "results.json").is_file():
        return None
    final, best = state.get("final") or {}, state.get("best") or {}
    return (
        f"{output} is already finished (epoch {state['epoch']}/{epochs}, final top-1 "
        f"{final.get('eval_top1', float('nan')):.2f}, best top-1 {best.get('eval_top1', float('nan')):.2f} "
        f"at epoch {best.get('epoch')}); nothing to do (a larger --epochs trains on)"
    )


def kept(cfg: Config, output: Path) -> str:
    """What an interrupted run leaves behind, in one sentence."""
    if cfg.eval_only:
        return "nothing was written"
    last = CheckpointDir(output).last
    if last is None:
        return f"no checkpoint was written yet in {output}; rerun the same command to start over"
    epoch = weights_metadata(last / WEIGHTS_FILE).get("epoch", "?")
    return f"kept {output}/checkpoints/last (epoch {epoch}); continue with --resume auto"


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
