"""A recipe written by timm's train.py (the ``args.yaml`` of its output folder) read as this engine's options.

``train.py -c args.yaml`` runs: a key this engine declares is taken as it is (after timm's spellings of
"unset", '' and None, become this engine's default); a key with another name here is translated
(``TIMM_TRANSLATIONS``); a timm option this engine does not implement is accepted only while it holds timm's
default, inactive value (``TIMM_TRAIN_DEFAULTS``, generated from timm's parser). Set to anything else, every
such key is refused in one line with the reason (``TIMM_REFUSALS``); none is ignored silently.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from convbias.timm_train_options import TIMM_TRAIN_DEFAULTS

from ..errors import ConfigError
from .options import (
    declaration,
    default_value,
    did_you_mean,
    flag_name,
    option_aliases,
    option_names,
    option_types,
)

NOT_YET = "not implemented by this engine yet"
NO_DOWNLOAD = "this engine reads data and weights from local files only"
# timm options that this engine's design decides otherwise: refused when set, with the reason
TIMM_NOT_APPLICABLE: dict[str, str] = {
    **dict.fromkeys(
        ("device", "device_modules", "local_rank"), "accelerate places processes and devices (launch options)"
    ),
    **dict.fromkeys(("no_ddp_bb", "synchronize_step"), "accelerate wraps the model in DDP"),
    **dict.fromkeys(("dataset_download", "dataset_trust_remote_code"), NO_DOWNLOAD),
    "model_ema_force_cpu": "the EMA lives on the training device",
    "start_epoch": "a resume point sets the epoch (--resume)",
    "drop_connect": "timm's train.py does not read it (its stochastic depth is --drop-path)",
    "no_resume_opt": "a resume point always restores the optimizer",
    "worker_seeding": "each image's augmentation is seeded from (seed, epoch, index)",
    "use_multi_epochs_loader": "the loaders are rebuilt per epoch by their samplers",
    "save_images": "a debugging aid of timm's loop",
}
# timm options this engine does not implement: refused when set, with the reason
TIMM_REFUSALS: dict[str, str] = {
    **dict.fromkeys(("torchscript", "fuser"), "TorchScript is not supported; --compile uses torch.compile"),
    "model_dtype": "use --mixed-precision",
    **dict.fromkeys(
        ("jsd_loss", "aug_splits", "split_bn", "resplit"), "JSD loss and AugMix splits are not implemented"
    ),
    **dict.fromkeys(
        (
            n
            for n in TIMM_TRAIN_DEFAULTS
            if n.startswith("naflex") or n.startswith("train_size") or n == "train_img_sizes"
        ),
        "NaFlex and multi-size training are not implemented",
    ),
    **dict.fromkeys(("train_batch_sizes", "variable_batch_loss_scale"), "multi-size training is not implemented"),
    **dict.fromkeys(
        (n for n in TIMM_TRAIN_DEFAULTS if n.startswith("kd_") or n in ("distill_loss_weight", "task_loss_weight")),
        "timm's knowledge distillation is not implemented; this engine has DeiT's hard distillation "
        "(--distill-teacher)",
    ),
    "recovery_interval": "use --checkpoint-interval (in optimizer updates)",
    **dict.fromkeys(
        ("epoch_repeats", "train_batches_per_epoch"), "an epoch is one pass over the (repeated-augmentation) sampler"
    ),
    "tta": "test-time augmentation is not implemented",
    "val_num_samples": "a stream's validation split is read whole (its size from the split's info)",
}


def _amp(values: dict[str, Any]) -> dict[str, Any]:
    if not values.get("amp"):
        return {}
    return {"mixed_precision": "bf16" if values.get("amp_dtype") == "bfloat16" else "fp16"}


def _compile(values: dict[str, Any]) -> dict[str, Any]:
    backend = values.get("torchcompile")
    if not backend:
        return {}
    mode = values.get("torchcompile_mode")
    return {"compile": True, "compile_backend": backend, **({"compile_mode": mode} if mode else {})}


def _experiment(values: dict[str, Any]) -> dict[str, Any]:
    """timm writes into <output or ./output/train>/<experiment>."""
    name = values.get("experiment")
    return {"output": str(Path(values.get("output") or "output/train") / name)} if name else {}


# timm keys read together -> the options they set (empty: timm's default, nothing to set), and in words
TRANSLATED_AS = {
    ("amp", "amp_dtype"): "as `--mixed-precision fp16` or `bf16`",
    ("torchcompile", "torchcompile_mode"): "as `--compile --compile-backend B --compile-mode M`",
    ("experiment", "output"): "as `--output OUTPUT/EXPERIMENT`",
    ("aug_repeats",): "as `--repeated-aug` (0: 1)",
    ("validation_batch_size",): "as `--eval-batch-size`",
    ("pretrained_path",): "as `--pretrained-file`",
    ("initial_checkpoint",): "as `--checkpoint`",
    ("val_interval",): "as `--eval-interval`",
    ("data",): "as `--data-dir`",
}
TIMM_TRANSLATIONS: dict[tuple[str, ...], Callable[[dict[str, Any]], dict[str, Any]]] = {
    ("amp", "amp_dtype"): _amp,
    ("torchcompile", "torchcompile_mode"): _compile,
    ("experiment", "output"): _experiment,
    ("aug_repeats",): lambda v: {"repeated_aug": max(1, int(v["aug_repeats"] or 0))},
    ("validation_batch_size",): lambda v: {"eval_batch_size": v["validation_batch_size"]},
    ("pretrained_path",): lambda v: {"pretrained_file": v["pretrained_path"] or None},
    ("initial_checkpoint",): lambda v: {"checkpoint": v["initial_checkpoint"] or None},
    ("val_interval",): lambda v: {"eval_interval": v["val_interval"]},
    ("data",): lambda v: {"data_dir": v["data"]} if v["data"] else {},
}


# timm's None where this engine's option needs a number: what timm then does
TIMM_NONE_MEANS = {"drop_path": 0.0}  # the model's default stochastic depth: none in timm's models


def _accepts_none(name: str) -> bool:
    return type(None) in getattr(option_types()[name], "__args__", ())


def is_timm_recipe(values: dict[str, Any]) -> bool:
    """A recipe holding keys that only timm's train.py writes (an args.yaml)."""
    return any(name in TIMM_TRAIN_DEFAULTS and name not in option_names() for name in values)


def _shared_option(name: str, value: Any) -> tuple[bool, Any]:
    """(whether to set it, the value) for a key both timm and this engine declare. timm's '' and None mean
    "unset": None where this engine's option takes None, else this engine's default (or TIMM_NONE_MEANS); ''
    is a value where it is one of the option's choices (--dist-bn '', --lr-base-scale '')."""
    if name == "dataset" and value == "":  # timm's folder of class folders at --data-dir (or data)
        return True, "folder"
    if value not in ("", None) or (value == "" and "" in (declaration(name).metadata["choices"] or ())):
        return True, value
    if _accepts_none(name):
        return True, None
    if name in TIMM_NONE_MEANS:
        return True, TIMM_NONE_MEANS[name]
    return False, None


def read_timm_keys(values: dict[str, Any], source: str) -> dict[str, Any]:
    """An args.yaml's keys as this engine's options; a ConfigError naming every active timm option that this
    engine does not apply, or a key that is neither this engine's nor timm's."""
    options: dict[str, Any] = {}
    for name, value in values.items():
        if name in option_names():
            take, value = _shared_option(name, value)
            if take:
                options[name] = value
    translated = {key for keys in TIMM_TRANSLATIONS for key in keys}
    for keys, translate in TIMM_TRANSLATIONS.items():
        if any(key in values for key in keys):
            options.update(translate({key: values.get(key) for key in keys}))
    refused, unknown = [], []
    for name, value in values.items():
        if name in option_names() or name in translated:
            continue
        if name not in TIMM_TRAIN_DEFAULTS:
            unknown.append(name)
        elif value != TIMM_TRAIN_DEFAULTS[name]:
            refused.append(f"{name}: {value!r} ({timm_option_status(name)[1]})")
    if unknown:
        raise ConfigError(f"unknown option '{unknown[0]}' in {source}{did_you_mean(unknown[0])}")
    if refused:
        raise ConfigError(f"{source} sets timm options this engine does not apply: {'; '.join(refused)}")
    return options


def _default_here(name: str) -> str:
    """' (default here: X)' where this engine's default differs from timm's (DeiT's recipe, or a choice of this
    engine that docs/ gives the reason for); '' where they agree (timm's '' and None both mean unset)."""

    def plain(value: Any) -> Any:
        return None if value in ("", None) else list(value) if isinstance(value, (list, tuple)) else value

    ours = default_value(name)
    return "" if plain(ours) == plain(TIMM_TRAIN_DEFAULTS[name]) else f" (default here: `{ours!r}`)"


def timm_option_status(name: str) -> tuple[str, str]:
    """(group, what this engine does with it) of a key of timm's args.yaml, for docs/timm-options.md and the
    refusals: 'implemented' (an option of the same name, or the options it translates to), 'not applicable'
    or 'refused', with the reason."""
    if name in option_names():
        return "implemented", f"`{flag_name(name)}`{_default_here(name)}"
    if name in option_aliases():
        return "implemented", f"`{flag_name(name)}` (alias of `{flag_name(option_aliases()[name])}`)"
    for keys, words in TRANSLATED_AS.items():
        if name in keys:
            return "implemented", words
    if name in TIMM_NOT_APPLICABLE:
        return "not applicable", TIMM_NOT_APPLICABLE[name]
    return "refused", TIMM_REFUSALS.get(name, NOT_YET)
