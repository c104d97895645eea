"""A recipe written by timm's train.py (the ``args.yaml`` of its output folder) read as this engine's options.

``train.py -c args.yaml`` runs: a key this engine declares is taken as it is (after timm's spellings of
"unset", '' and None, become this engine's default); a key with another name here is translated
(``TIMM_TRANSLATIONS``); a timm option this engine does not implement is accepted only while it holds timm's
default, inactive value (``TIMM_TRAIN_DEFAULTS``, generated from timm's parser). Set to anything else, every
such key is refused in one line with the reason (``TIMM_REFUSALS``); none is ignored silently. The few timm
options that change only where or how fast timm runs, never the values it trains with, are accepted at any
value (``TIMM_ANY_VALUE``). A key that is nobody's option, which timm's train.py sets on its arguments and never reads
(a fork's own keys, the runtime attributes its checkpoints save), is ignored here too, named in one warning; one
within a typo of an option's name is refused with that name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS

from .derived import effective_epochs
from .options import (
    declaration,
    default_value,
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


# attributes timm's train.py sets on its parsed arguments (main, init_distributed_device): the arguments its
# checkpoints save hold them, and so does an args.yaml written from those (convbias-export's)
TIMM_RUNTIME_ATTRIBUTES = ("prefetcher", "distributed", "world_size", "rank")
# how close (difflib's ratio) a key that is nobody's option must be to an option's name to be taken for its typo
TYPO_SIMILARITY = 0.85


def typo_of(name: str) -> list[str]:
    """The names of this engine's and timm's options that ``name`` is within a typo of (up to three)."""
    names = sorted({*option_names(), *option_aliases(), *TIMM_TRAIN_DEFAULTS})
    return difflib.get_close_matches(name, names, n=3, cutoff=TYPO_SIMILARITY)


def _nobodys(name: str) -> bool:
    """A key that is neither this engine's option (or alias) nor timm's, today's or an older version's."""
    known = (*TIMM_TRAIN_DEFAULTS, *OBSOLETE_TIMM_KEYS, *option_aliases())
    return name not in option_names() and name not in known and not any(name in keys for keys in TIMM_TRANSLATIONS)


def ignored_timm_keys(values: dict[str, Any]) -> list[str]:
    """The keys of a timm args file that timm's train.py would take and never read: nobody's option, and a runtime
    attribute of its arguments or no typo of an option's name. Ignored here as there, in one warning."""
    return [name for name in values if _nobodys(name) and (name in TIMM_RUNTIME_ATTRIBUTES or not typo_of(name))]


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


# this engine's data sets under timm's names for them: the folder at --data-dir, torchvision's CIFAR files there
TIMM_DATASET_NAMES = {"folder": "", "cifar10": "torch/cifar10", "cifar100": "torch/cifar100"}
EMBEDDED_DATASETS = ("digits", "mnist")  # data sets that ship with a package: timm's train.py has no reader for them
# this engine's options that an args.yaml holds under timm's keys (TIMM_TRANSLATIONS reads them back), or that it
# holds resolved (--scale-epochs: in epochs and warmup_epochs; --which: in initial_checkpoint); --config names the
# file itself
EXPRESSED_AS_TIMM_KEYS = (
    "pretrained_file",
    "model_ema_metric",
    "repeated_aug",
    "eval_batch_size",
    "scale_epochs",
    "mixed_precision",
    "compile",
    "compile_mode",
    "compile_backend",
    "checkpoint",
    "which",
    "eval_interval",
    "config",
)
# this engine's options that watch and keep the run (diagnostics, signals, resume points) and change nothing it trains
# or evaluates: an args.yaml need not express them
RUN_KEEPING = (
    "diagnostics",
    "diagnostics_images",
    "preempt_signals",
    "checkpoint_interval",
    "keep_checkpoints",
    "save_epochs",
    "accept_resume_changes",
)


def timm_args(
    cfg: Any, initial_checkpoint: str | None = None, resolved: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(the args.yaml timm's train.py would have written for the run of ``cfg``: every key of timm's parser, each
    value meaning what timm's train.py makes of it; what of the run timm cannot express). ``initial_checkpoint``:
    the weights --checkpoint resolved to (a run directory's point); ``resolved``: values of timm's keys that the
    run resolved where timm would resolve others (the input size and statistics of this engine's own data sets;
    ``resume``: a --resume of timm's own checkpoint, which timm's train.py continues too)."""
    values, options = dict(TIMM_TRAIN_DEFAULTS), cfg.to_dict()
    for name, default in TIMM_TRAIN_DEFAULTS.items():
        if name in options:  # timm's "unset" is '' where its default is ''
            values[name] = default if options[name] is None and default == "" else options[name]
    epochs, warmup_epochs = effective_epochs(cfg)
    output = Path(cfg.output)  # timm writes into OUTPUT/EXPERIMENT
    values.update(
        dataset=TIMM_DATASET_NAMES.get(cfg.dataset, cfg.dataset),
        epochs=epochs,
        warmup_epochs=warmup_epochs,
        amp=cfg.mixed_precision != "no",
        amp_dtype="bfloat16" if cfg.mixed_precision == "bf16" else "float16",
        torchcompile=cfg.compile_backend if cfg.compile else None,
        torchcompile_mode=cfg.compile_mode if cfg.compile and cfg.compile_mode != "default" else None,
        output=str(output.parent),
        experiment=output.name,
        aug_repeats=cfg.repeated_aug if cfg.repeated_aug > 1 else 0,
        validation_batch_size=cfg.eval_batch_size,
        pretrained_path=cfg.pretrained_file,
        initial_checkpoint=initial_checkpoint or cfg.checkpoint or "",
        val_interval=cfg.eval_interval,
        model_ema_force_cpu=bool(cfg.model_ema and not cfg.model_ema_metric),
        resume="",
    )
    values.update(resolved or {})
    left_out = [
        f"--no-{flag_name(name)[2:]}"
        if options[name] is False
        else f"{flag_name(name)} {_shown(options[name])}".strip()
        for name in option_names()
        if name not in (*TIMM_TRAIN_DEFAULTS, *EXPRESSED_AS_TIMM_KEYS, *RUN_KEEPING)
        and options[name] != default_value(name)
    ]
    if cfg.dataset in EMBEDDED_DATASETS:
        left_out.append(f"--dataset {cfg.dataset} (this engine's embedded data set)")
    if cfg.resume and not values["resume"]:
        left_out.append(f"--resume {cfg.resume} (this launch continued a resume point of this engine)")
    return values, left_out


def _shown(value: Any) -> str:
    """An option's value as a command line gives it."""
    if value is True:
        return ""
    if isinstance(value, dict):
        return " ".join(f"{key}={item}" for key, item in value.items())
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


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
    if name == "dataset" and value in TIMM_DATASET_NAMES.values():  # timm's folder (''), torchvision's CIFAR
        return True, next(ours for ours, timms in TIMM_DATASET_NAMES.items() if timms == value)
    if value not in ("", None) or (value == "" and "" in (declaration(name).metadata["choices"] or ())):
        return True, value
    if _accepts_none(name):
        return True, None
    return False, None


def translate_timm_keys(values: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """(this engine's options, the problems: 'key: value (reason)' for each active timm option that this engine
    does not apply, 'key: unknown option (did you mean ...?)' for each key within a typo of an option's name;
    ``ignored_timm_keys`` are left out)."""
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
    problems, ignored = [], ignored_timm_keys(values)
    for name, value in values.items():
        if name in option_names() or name in translated or name in ignored:
            continue
        if name in OBSOLETE_TIMM_KEYS:
            inert = OBSOLETE_TIMM_KEYS[name]
            if value not in inert:
                problems.append(
                    f"{name}: {value!r} (an option of older timm train.py versions; accepted at {inert[0]!r})"
                )
        elif name not in TIMM_TRAIN_DEFAULTS:
            problems.append(f"{name}: unknown option (did you mean {', '.join(typo_of(name))}?)")
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
