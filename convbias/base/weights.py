"""Weight files: read a state dict safely, check it fits a model, load it (shared by the engine and the families).

Loading never unpickles arbitrary objects: weights come from safetensors, and ``.pt`` files are read
with ``torch.load(weights_only=True)`` (tensors and plain containers only). Every failure is a
ValueError whose one-line message names the file and what is wrong with it: a file that does not read as
weights, or holds integers for float weights or non-finite values, is a DamagedInputError (exit 65).
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.inputs import check_regular_file, first_line
from convbias.base.run_layout import CHECKPOINTS_DIR, WEIGHTS_FILE, point_name
from convbias.base.storage import file_system

MAX_KEYS_SHOWN = 5


def resolve_weights_path(path: str | Path) -> Path:
    """A weights file, or a checkpoint dir (its model.safetensors). A train.py run directory is read through
    ``convbias.engine.RunDir``, which picks a verified point: here it is named as such."""
    path = Path(path)
    if path.is_dir():
        if (path / WEIGHTS_FILE).is_file():
            return path / WEIGHTS_FILE
        if (path / CHECKPOINTS_DIR).is_dir():
            example = path / CHECKPOINTS_DIR / point_name(0).replace("0", "N") / WEIGHTS_FILE
            raise ConfigError(
                f"{path} is a run directory: give one of its checkpoints ({example}), or the run itself where a "
                f"command takes a run (--checkpoint RUN, --eval-only RUN)"
            )
        raise ConfigError(f"no weights in {path} (expected {WEIGHTS_FILE} in it)")
    return check_regular_file(path, "weights file")  # never a FIFO or device: reading it would block or not end


# Types allowed in a torch file besides tensors and plain containers: timm's train.py saves its arguments (an
# argparse.Namespace of plain values) in every checkpoint (checkpoint-N.pth.tar, model_best.pth.tar, last.pth.tar)
SAFE_GLOBALS = [argparse.Namespace]


def load_torch_file(path: str | Path, what: str = "weights") -> Any:
    """A torch file's content with weights_only=True: tensors, plain containers and SAFE_GLOBALS only, nothing
    executed (torch's allow-list); no fallback to full unpickling. A file that does not read so is a
    DamagedInputError naming it as the `what` it should have been."""
    check_regular_file(path, what, DamagedInputError)  # torch.load of a FIFO or /dev/zero blocks or never ends
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torch's message invites unpickling the file with weights_only=False: not ours to give
        raise DamagedInputError(
            f"{path} cannot be read as {what} with weights_only=True (it is damaged, or holds Python objects "
            f"besides tensors and timm's saved arguments); it was not unpickled"
        ) from None


# The keys a checkpoint file keeps its weights under: the model's, and its EMA's (timm's load_state_dict order)
WEIGHTS_KEYS = ("model", "state_dict", "model_state_dict")
EMA_KEYS = ("state_dict_ema", "model_ema")


def read_state_dict(path: str | Path, use_ema: bool = False) -> dict[str, torch.Tensor]:
    """Weights from a file or a directory (see resolve_weights_path), without unpickling arbitrary objects.

    Reads ``.safetensors``, or a torch file (``.pt``/``.pth``/``.bin``, timm's ``.pth.tar``) with weights_only=True
    (load_torch_file), unwrapping ``{'model': ...}``/``{'state_dict': ...}`` and a DDP ``module.`` prefix. With
    ``use_ema``, a checkpoint's EMA (``state_dict_ema``, ``model_ema``) comes first where it holds one, as timm's
    ``load_state_dict(use_ema=True)`` takes it (``read_weights`` also says which key was read).
    """
    return read_weights(path, use_ema)[0]


def read_weights(path: str | Path, use_ema: bool = False) -> tuple[dict[str, torch.Tensor], str | None]:
    """``read_state_dict``'s weights and the checkpoint's key they were read from (None for a bare state dict)."""
    path = resolve_weights_path(path)
    if path.suffix == ".safetensors":
        try:
            return file_system().load_safetensors(path), None
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise DamagedInputError(f"{path} is not a readable safetensors file ({first_line(e)})") from None
    obj = load_torch_file(path)
    chosen = None
    for key in (EMA_KEYS if use_ema else ()) + WEIGHTS_KEYS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj, chosen = obj[key], key
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise DamagedInputError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}, chosen


def _shown(keys: list[str]) -> str:
    more = f" (+{len(keys) - MAX_KEYS_SHOWN} more)" if len(keys) > MAX_KEYS_SHOWN else ""
    return ", ".join(keys[:MAX_KEYS_SHOWN]) + more


def check_compatible(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError naming missing, unexpected and shape-mismatched keys."""
    check_keys(model.state_dict(), state_dict, source, type(model).__name__)


def check_keys(
    expected: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], source: str, model_name: str
) -> None:
    """check_compatible against the tensors `expected` (a model's state dict, or part of it)."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [
        f"{k} {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and state_dict[k].shape != v.shape
    ]
    problems = [
        f"{label}: {_shown(keys)}"
        for label, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("mismatched shapes", mismatched),
        )
        if keys
    ]
    if problems:
        raise ConfigError(f"{source} does not fit this model ({model_name}): " + "; ".join(problems))
    check_dtypes(expected, state_dict, source)


def check_dtypes(expected: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """DamagedInputError when a floating-point tensor of the model would be set from an integer or bool one
    (``load_state_dict`` casts it without a word)."""
    cast = [
        f"{k} ({str(state_dict[k].dtype).removeprefix('torch.')})"
        for k, v in expected.items()
        if k in state_dict and v.is_floating_point() and not state_dict[k].is_floating_point()
    ]
    if cast:
        raise DamagedInputError(
            f"{source} holds {len(cast)} non-float tensors for float weights of the model: {_shown(cast)}; "
            f"it was not loaded"
        )


def check_finite(state_dict: Mapping[str, torch.Tensor], source: str, names: Iterable[str] | None = None) -> None:
    """DamagedInputError naming the tensors (of ``names``, default all) that hold NaN or infinity: such
    weights evaluate to a NaN loss. Buffers may hold infinities on purpose (attention masks): give the
    parameters' names."""
    keys = state_dict.keys() if names is None else [k for k in names if k in state_dict]
    bad = [k for k in keys if state_dict[k].is_floating_point() and not torch.isfinite(state_dict[k]).all()]
    if bad:
        raise DamagedInputError(
            f"{source} holds non-finite values (NaN or infinity) in {len(bad)} tensors: {_shown(bad)}; "
            f"it was not loaded"
        )


def partial_load(
    missing: list[str], unexpected: list[str], source: str, allow_partial: bool, option: str = "--allow-partial"
) -> str | None:
    """What a non-strict load left out, as one line (counts and the first names); ConfigError naming them
    unless ``allow_partial``, else the line for the run's log (None when nothing was left out)."""
    parts = [
        f"{len(keys)} {label} ({_shown(keys)})"
        for label, keys in (("missing keys, left at their initialization", missing), ("unexpected keys", unexpected))
        if keys
    ]
    if not parts:
        return None
    line = f"{source} loaded partially: " + "; ".join(parts)
    if not allow_partial:
        raise ConfigError(f"{line}; pass {option} to train from it anyway, or give the weights of this model")
    return line


def load_weights(model: torch.nn.Module, path: str | Path, use_ema: bool = False) -> torch.nn.Module:
    """Load weights written by train.py (or any safetensors / torch state-dict file) into ``model`` (``use_ema``:
    as ``read_state_dict``'s).

    Raises ValueError naming the missing, unexpected or mismatched keys when the file belongs to
    another model. Returns the model.
    """
    return load_checked(model, read_state_dict(path, use_ema), str(path))


def load_checked(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> torch.nn.Module:
    """``state_dict`` (read from ``source``) into ``model``, strictly, after the checks of ``load_weights``."""
    check_compatible(model, state_dict, source)
    check_finite(state_dict, source, [name for name, _ in model.named_parameters()])
    model.load_state_dict(state_dict, strict=True)
    return model


@contextmanager
def rebuild_hint(weights: str | Path) -> Iterator[None]:
    """Weights that do not fit the model built: the message says how to rebuild the model they were written for."""
    try:
        yield
    except ValueError as e:
        if "does not fit" not in str(e):
            raise
        raise ConfigError(
            f"{e}; give the model options the weights were trained with (--model, --model-kwargs, "
            f"--img-size, --num-classes), or pass the run directory, whose config.yaml has them"
        ) from None


def weights_metadata(path: str | Path) -> dict[str, str]:
    """The metadata stored in a safetensors header (model name, epoch), {} for other files."""
    path = resolve_weights_path(path)
    if path.suffix != ".safetensors":
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise DamagedInputError(f"{path} is not a readable safetensors file ({first_line(e)})") from None


def check_weights_file(path: str | Path) -> None:
    """ValueError naming ``path`` unless it reads as weights (a safetensors header, or a torch state dict):
    for files handed to a library that would fail with a traceback (timm's pretrained_cfg file)."""
    path = resolve_weights_path(path)
    if path.suffix == ".safetensors":
        weights_metadata(path)
    else:
        read_state_dict(path)


# Where a family's pretrained filter says what it did to the weights (a T-CNN's: transformed a ResNet's weights, or
# took a T-CNN's as they are): timm_load_report collects its INFO lines for the start-up block.
WEIGHTS_LOGGER = "convbias.base.weights"

# What timm's builder logs after a non-strict pretrained load (timm.models._builder.load_pretrained): the
# keys it left out, and a first conv it could not adapt to the input channels (left at its initialization).
TIMM_LOAD_LOGGER = "timm.models._builder"
TIMM_LOAD_MESSAGES = {
    "missing": re.compile(r"Missing keys \((.*)\) discovered while loading pretrained weights"),
    "unexpected": re.compile(r"Unexpected keys \((.*)\) found while loading pretrained weights"),
    "unconverted": re.compile(r"Unable to convert pretrained (\S+) weights"),
}


@contextmanager
def timm_load_report() -> Iterator[dict[str, list[str]]]:
    """The keys timm's pretrained loading left out while the block runs: {"missing", "unexpected",
    "unconverted"}: lists of names, from the lines timm logs (captured here, not printed)."""
    found: dict[str, list[str]] = {key: [] for key in (*TIMM_LOAD_MESSAGES, "family")}

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if record.name == WEIGHTS_LOGGER:
                found["family"].append(message)
            for key, pattern in TIMM_LOAD_MESSAGES.items():
                match = pattern.match(message)
                if match:
                    found[key] += [name for name in match[1].split(", ") if name]

    handler = Catch(logging.INFO)
    loggers = [logging.getLogger(name) for name in (TIMM_LOAD_LOGGER, WEIGHTS_LOGGER)]
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(handler)
    try:
        yield found
    finally:
        for logger, (level, propagate) in zip(loggers, saved):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


def classifier_keys(model: torch.nn.Module) -> set[str]:
    """The tensors of the classifier that timm's pretrained loading resets for another number of classes."""
    classifiers = model.pretrained_cfg.get("classifier") or ()
    classifiers = (classifiers,) if isinstance(classifiers, str) else tuple(classifiers)
    return {f"{name}.{kind}" for name in classifiers for kind in ("weight", "bias")}


def describe_pretrained_load(
    model: torch.nn.Module, source: str, report: dict[str, list[str]], given: Mapping[str, torch.Tensor] | None
) -> str:
    """What timm's pretrained loading did, in one line: the tensors loaded of the model's, the classifier reset
    for another number of classes, the tensors adapted to the model (``given``: the file's weights; a stem
    for other input channels, a position embedding for another grid), and what the family's filter did."""
    expected = model.state_dict()
    left_out = set(report["missing"]) | {f"{name}.weight" for name in report["unconverted"]}
    parts = [f"{source}: {len(expected) - len(left_out & set(expected))} of {len(expected)} tensors loaded"]
    reset = sorted(left_out & classifier_keys(model))
    if reset:
        head = next((given[k] for k in reset if k.endswith(".weight") and given and k in given), None)
        was = f" (the file's has {head.shape[0]})" if head is not None else ""
        parts.append(f"reset: {', '.join(reset)} for {model.num_classes} classes{was}")
    adapted = [
        f"{key} {tuple(given[key].shape)} -> {tuple(tensor.shape)}"
        for key, tensor in expected.items()
        if given and key in given and key not in left_out and given[key].shape != tensor.shape
    ]
    if adapted:
        parts.append(f"adapted: {_shown(adapted)}")
    if report["unconverted"]:
        parts.append(f"left at initialization (not convertible): {', '.join(report['unconverted'])}")
    return "; ".join(parts + report["family"])


def check_pretrained(
    model: torch.nn.Module,
    path: str | Path,
    given: Mapping[str, torch.Tensor],
    report: dict[str, list[str]],
    allow_partial: bool,
) -> str | None:
    """After timm loaded ``path`` (``given``: its weights) into ``model`` (``report``: ``timm_load_report``'s):
    integer tensors for float weights and non-finite weights refused, keys left out refused unless
    ``allow_partial`` (then the line saying what was left out is returned). The classifier that timm resets for
    another number of classes is timm's own adaptation, not counted."""
    source = str(path)
    check_dtypes(model.state_dict(), given, source)
    reset = classifier_keys(model)
    missing = [k for k in report["missing"] if k not in reset]
    missing += [f"{name}.weight" for name in report["unconverted"] if f"{name}.weight" not in missing]
    left_out = set(report["missing"]) | {f"{name}.weight" for name in report["unconverted"]}
    loaded = [name for name, _ in model.named_parameters() if name not in left_out]
    check_finite(dict(model.named_parameters()), source, loaded)
    return partial_load(missing, report["unexpected"], source, allow_partial)
