"""A recipe written by timm's train.py (the ``args.yaml`` of its output folder) read as this engine's options.

``train.py -c args.yaml`` runs: a key this engine declares is taken as it is (after timm's spellings of
"unset", '' and None, become this engine's default); a key with another name here is translated
(``TIMM_TRANSLATIONS``); a timm option this engine does not implement is accepted only while it holds timm's
default, inactive value (``TIMM_TRAIN_DEFAULTS``, generated from timm's parser). Set to anything else, every
such key is refused in one line with the reason (``TIMM_REFUSALS``); none is ignored silently. The few timm
options that change only where or how fast timm runs, never the values it trains with, are accepted at any
value (``TIMM_ANY_VALUE``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from convbias.base.errors import ConfigError
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS

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
# timm options that this engine's design decides otherwise: refused when set, with the reason
TIMM_NOT_APPLICABLE: dict[str, str] = {
    "start_epoch": "a resume point sets the epoch (--resume)",
    "no_resume_opt": "a resume point always restores the optimizer",
    "save_images": "a debugging aid of timm's loop",
}
# timm options whose value changes where or how fast timm's train.py runs, never the values it trains with:
# accepted at any value (an args.yaml written by a multi-GPU run, or a published recipe, sets them)
TIMM_ANY_VALUE: dict[str, str] = {
    **dict.fromkeys(
        ("device", "device_modules"), "accelerate places processes and devices (launch options: --cpu, GPUs)"
    ),
    "dataset_download": "this engine reads local files only; a data set that is not there is an error naming the path",
    "dataset_trust_remote_code": "this engine runs no code from a data set",
    "local_rank": "accelerate gives each process its rank",
    **dict.fromkeys(("no_ddp_bb", "synchronize_step"), "accelerate wraps the model in DDP"),
    "use_multi_epochs_loader": "the loaders keep their workers across epochs, as timm's MultiEpochsDataLoader",
    "worker_seeding": "each image's augmentation is seeded from (seed, epoch, index)",
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


# keys that older timm train.py versions wrote into args.yaml, with the values at which they change nothing here
# (their defaults there); others are refused with the reason
OBSOLETE_TIMM_KEYS: dict[str, tuple[Any, ...]] = {
    "apex_amp": (False,),  # mixed precision is --amp (native AMP) in timm today
    "native_amp": (False,),
    "amp_impl": ("native",),
    "aot_autograd": (False,),
    "bn_tf": (False,),
    "jsd": (False,),  # today's jsd_loss
    "mixup_elem": (False,),  # today's --mixup-mode elem
    "num_gpu": (1,),
    "use_wandb": (False,),  # today's log_wandb
    "wandb_project_name": (None,),
    "validation_batch_size_multiplier": (1,),
    "alpha_kd": (5.0, 5),
    "use_kd_only_loss": (False,),
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
    ("data", "data_dir"): "as `--data-dir` where that is unset (timm's positional `train.py DIR`)",
    ("model_ema_force_cpu",): "as `--no-model-ema-metric`: the model's evaluation is the epoch's metric, as timm "
    "skips the EMA's (the EMA itself lives on the training device)",
    ("drop_connect", "drop_path"): "as `--drop-path` where that is unset (timm's train.py passed it as the models' "
    "drop_connect_rate, their drop_path_rate, until it deprecated it)",
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
    ("data", "data_dir"): lambda v: {"data_dir": v["data"]} if v["data"] and not v.get("data_dir") else {},
    ("model_ema_force_cpu",): lambda v: {"model_ema_metric": False} if v["model_ema_force_cpu"] else {},
    ("drop_connect", "drop_path"): lambda v: (
        {"drop_path": v["drop_connect"]} if v["drop_connect"] is not None and v["drop_path"] is None else {}
    ),
}


def _accepts_none(name: str) -> bool:
    return type(None) in getattr(option_types()[name], "__args__", ())


def is_timm_args(values: dict[str, Any]) -> bool:
    """A recipe holding keys that only timm's train.py writes, or wrote in older versions (an args.yaml)."""
    timm_only = (*TIMM_TRAIN_DEFAULTS, *OBSOLETE_TIMM_KEYS)
    return any(name in timm_only and name not in option_names() for name in values)


def _shared_option(name: str, value: Any) -> tuple[bool, Any]:
    """(whether to set it, the value) for a key both timm and this engine declare. timm's '' and None mean
    "unset": None where this engine's option takes None, else this engine's default; ''
    is a value where it is one of the option's choices (--dist-bn '', --lr-base-scale '')."""
    if name == "dataset" and value == "":  # timm's folder of class folders at --data-dir (or data)
        return True, "folder"
    if value not in ("", None) or (value == "" and "" in (declaration(name).metadata["choices"] or ())):
        return True, value
    if _accepts_none(name):
        return True, None
    return False, None


def read_timm_keys(values: dict[str, Any], source: str) -> dict[str, Any]:
    """An args.yaml's keys as this engine's options; a ConfigError naming every active timm option that this
    engine does not apply, and every key that is neither this engine's nor timm's, each with its reason."""
    options, problems = translate_timm_keys(values, source)
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}")
    return options


def translate_timm_keys(values: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """(this engine's options, the problems: 'key: value (reason)' for each active timm option that this engine
    does not apply, 'key: unknown option' for each key neither this engine's nor timm's)."""
    values = {option_aliases().get(key, key): value for key, value in values.items()}
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
    problems = []
    for name, value in values.items():
        if name in option_names() or name in translated:
            continue
        if name in OBSOLETE_TIMM_KEYS:
            inert = OBSOLETE_TIMM_KEYS[name]
            if value not in inert:
                problems.append(
                    f"{name}: {value!r} (an option of older timm train.py versions; accepted at {inert[0]!r})"
                )
        elif name not in TIMM_TRAIN_DEFAULTS:
            problems.append(f"{name}: unknown option{did_you_mean(name)}")
        elif value != TIMM_TRAIN_DEFAULTS[name] and name not in TIMM_ANY_VALUE:
            problems.append(f"{name}: {value!r} ({timm_option_status(name)[1]})")
    return options, problems


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
    if name in TIMM_ANY_VALUE:
        return "not applicable", f"any value accepted: {TIMM_ANY_VALUE[name]}"
    if name in TIMM_NOT_APPLICABLE:
        return "not applicable", TIMM_NOT_APPLICABLE[name]
    return "refused", TIMM_REFUSALS.get(name, NOT_YET)
