"""Building a model from a run's options through timm's registry (the only way the engine makes models).

The registry must already hold the model: the composition root imports the families first.
"""

from __future__ import annotations

import difflib
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import timm
import torch
from accelerate import Accelerator
from timm.layers import is_fast_norm, set_fast_norm

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.inputs import first_line, quoted
from convbias.base.weights import (
    check_finite,
    check_pretrained,
    check_weights_file,
    describe_pretrained_load,
    load_checked,
    load_weights,
    read_state_dict,
    timm_load_report,
)

from ..config.options import Config


def check_model_name(name: str, option: str = "--model") -> None:
    """ConfigError naming close registry entries when `name` is not a timm model."""
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.5)
        hint = f"; close choices: {', '.join(close)}" if close else "; see timm.list_models()"
        raise ConfigError(f"unknown model '{name}' for {option}{hint}")


@contextmanager
def fast_norm(enabled: bool) -> Iterator[None]:
    """timm's fast-norm switch while a model is built (its norm layers read it in their constructor), then
    back to what it was: the choice belongs to the run's model, not to every model the process builds later."""
    previous = is_fast_norm()
    set_fast_norm(enabled)
    try:
        yield
    finally:
        set_fast_norm(previous)


def mistyped_kwargs(model: str, model_kwargs: dict[str, Any]) -> list[str]:
    """The ``model_kwargs`` whose value is not of the type of the default that the model's classes give that
    argument (``embed_dim=abc: expected an int, as ConVit's default 48``), read from the signatures of the
    classes in the module that registers ``model``: why a constructor failed with a message about types."""
    if not timm.is_model(model):
        return []
    module = sys.modules.get(timm.models.model_entrypoint(model).__module__)
    defaults: dict[str, tuple[str, Any]] = {}
    for owner in vars(module).values() if module else ():
        if inspect.isclass(owner) and issubclass(owner, torch.nn.Module) and owner.__module__ == module.__name__:
            for name, parameter in inspect.signature(owner).parameters.items():
                if type(parameter.default) in (int, float, bool) and name not in defaults:
                    defaults[name] = (owner.__name__, parameter.default)
    found = []
    for name, value in model_kwargs.items():
        if name not in defaults:
            continue
        owner, default = defaults[name]
        numeric = type(default) is float and type(value) in (int, float)
        if type(value) is not type(default) and not numeric:
            found.append(
                f"{name}={quoted(value)}: expected {'an' if type(default) is int else 'a'} {type(default).__name__} "
                f"(as {owner}'s default {default!r}), got {'a' if type(value) is not int else 'an'} "
                f"{type(value).__name__}"
            )
    return found


# timm.create_model's argument that loads a weights file into the model it built (timm's load_checkpoint, as
# timm's train.py --initial-checkpoint); given in --model-kwargs, the engine loads it with the package's checks
CHECKPOINT_ARGUMENT = "checkpoint_path"
# timm.create_model's arguments whose "file" is the weights its pretrained loading reads (with --pretrained)
PRETRAINED_CFG_ARGUMENTS = ("pretrained_cfg_overlay", "pretrained_cfg")


def _pretrained_file(cfg: Config, model_kwargs: dict[str, Any]) -> tuple[str, str | None]:
    """(how it was named, the file) of the weights timm's pretrained loading reads: --pretrained-file, or the
    "file" of a pretrained config that --model-kwargs gives (read with --pretrained only); two files named is a
    ConfigError."""
    named = {"--pretrained-file": cfg.pretrained_file} if cfg.pretrained_file else {}
    for key in PRETRAINED_CFG_ARGUMENTS:
        value = model_kwargs.get(key)
        if cfg.pretrained and isinstance(value, dict) and value.get("file"):
            named[f"--model-kwargs {key}"] = str(value["file"])
    if len({str(Path(path).resolve()) for path in named.values()}) > 1:
        raise ConfigError(f"{' and '.join(f'{k} {v}' for k, v in named.items())} name two weights files; give one")
    return next(iter(named.items()), ("--pretrained-file", None))


def create_model(cfg: Config, num_classes: int | None, in_chans: int) -> torch.nn.Module:
    """timm.create_model with the run's model options (see create_model_and_report)."""
    return create_model_and_report(cfg, num_classes, in_chans)[0]


def create_model_and_report(cfg: Config, num_classes: int | None, in_chans: int) -> tuple[torch.nn.Module, str | None]:
    """timm.create_model with the run's model options (model, model_kwargs, img_size, drop, drop_path, drop_block,
    gp, fast_norm, pretrained, pretrained_file, head_init_scale), and with --pretrained what timm's loading did to
    the weights, in one line (weights.describe_pretrained_load). ``num_classes`` None: the model's own head size,
    as timm's train.py without --num-classes."""
    chosen = dict(drop_rate=cfg.drop or None, drop_block_rate=cfg.drop_block, global_pool=cfg.gp)
    chosen = {key: value for key, value in chosen.items() if value is not None}  # passed only to models taking them
    kwargs: dict[str, Any] = dict(
        **({} if num_classes is None else {"num_classes": num_classes}),
        **chosen,
        drop_path_rate=cfg.drop_path or None,
        in_chans=None if in_chans == 3 else in_chans,
        pretrained=bool(cfg.pretrained),
    )
    model_kwargs = dict(cfg.model_kwargs or {})
    checkpoint_path = model_kwargs.pop(CHECKPOINT_ARGUMENT, None)  # loaded below, with the package's checks
    pretrained_file = _pretrained_file(cfg, model_kwargs)
    for label, path in (pretrained_file, (f"--model-kwargs {CHECKPOINT_ARGUMENT}", checkpoint_path)):
        if path is not None:
            if not isinstance(path, str):
                raise ConfigError(f"{label} must be a weights file's path, got {quoted(path)}")
            try:
                check_weights_file(path)
            except ValueError as e:  # a damaged file stays one (exit 65)
                raise type(e)(f"{label}: {e}") from None
    kwargs.update(model_kwargs)
    if pretrained_file[1] is not None:
        overlay = model_kwargs.get("pretrained_cfg_overlay") or {}
        kwargs["pretrained_cfg_overlay"] = {**overlay, "file": str(Path(pretrained_file[1]).resolve())}
    kwargs.setdefault("img_size", cfg.img_size)
    try:
        with fast_norm(bool(cfg.fast_norm)), timm_load_report() as loaded:
            try:
                model = timm.create_model(cfg.model, **kwargs)
            except TypeError as e:  # CNNs take no img_size: they run at any resolution
                if "img_size" not in str(e) or "img_size" in model_kwargs:
                    raise
                kwargs.pop("img_size")
                model = timm.create_model(cfg.model, **kwargs)
    except DamagedInputError:  # a file the model's arguments name (an eFCN's cnn_checkpoint) is damaged: exit 65
        raise
    except (TypeError, ValueError, RuntimeError, FileNotFoundError, AssertionError) as e:  # how constructors refuse
        mistyped = mistyped_kwargs(cfg.model, model_kwargs)
        if mistyped:
            raise ConfigError(f"--model-kwargs {'; '.join(mistyped)}") from e
        given = {**chosen, **model_kwargs}
        raise ConfigError(
            f"cannot build {cfg.model} with {quoted(given or 'default arguments', 300)}: {first_line(e)}"
        ) from e  # the constructor's traceback, shown with CONVBIAS_TRACEBACK=1
    report = None
    path = pretrained_file[1]
    if path is not None:
        given = read_state_dict(path)
        partial = check_pretrained(model, path, given, loaded, cfg.allow_partial)
        if partial:
            warnings.warn(f"--allow-partial: {partial}", stacklevel=2)
        report = describe_pretrained_load(model, path, loaded, given)
    elif cfg.pretrained:
        source = model.pretrained_cfg.get("hf_hub_id") or model.pretrained_cfg.get("url") or "timm's weights"
        report = describe_pretrained_load(model, source, loaded, None)
    if path is None and model.pretrained_cfg.get("file"):  # a model argument had timm load a file (cnn_checkpoint)
        check_finite(dict(model.named_parameters()), f"{model.pretrained_cfg['file']} (as {cfg.model}'s weights)")
    if checkpoint_path is not None and not any(p.is_meta for p in model.parameters()):
        load_checked(
            model,
            read_state_dict(checkpoint_path, use_ema=True),  # as timm's create_model(checkpoint_path=) loads it
            f"--model-kwargs {CHECKPOINT_ARGUMENT}={checkpoint_path}",
        )
    if cfg.head_init_scale is not None:
        with torch.no_grad():
            for tensor in classifier_tensors(model, ("weight", "bias"), "--head-init-scale", cfg.model):
                tensor.mul_(cfg.head_init_scale)
    if cfg.head_init_bias is not None:
        with torch.no_grad():
            for bias in classifier_tensors(model, ("bias",), "--head-init-bias", cfg.model):
                bias.fill_(cfg.head_init_bias)
    if cfg.bn_eps is not None or cfg.bn_momentum is not None:
        set_batchnorm(model, cfg.bn_eps, cfg.bn_momentum, cfg.model)
    return model, report


def create_run_model(
    cfg: Config,
    num_classes: int | None,
    in_chans: int,
    reparametrized: bool,
    reparametrizations: Mapping[str, Callable[..., torch.nn.Module]],
    written_by: str = "the weights to load",
) -> tuple[torch.nn.Module, str | None]:
    """The model a run with the options ``cfg`` trains, or trained when its weights were written: timm's registry
    (``create_model_and_report``), then, for weights written after a reparametrization (``reparametrized``), the
    run's ``--reparametrize`` from ``reparametrizations`` (the composition root's). The one way a run's model is
    rebuilt: by the set-up (a resumed run, ``--checkpoint``) and by ``model.build.build_run_model`` (evaluation, studies).
    ``written_by`` names the weights in the messages."""
    model, report = create_model_and_report(cfg, num_classes, in_chans)
    if reparametrized:
        model = reparametrize(model, cfg, reparametrizations, written_by)
    return model, report


def reparametrize(
    model: torch.nn.Module,
    cfg: Config,
    reparametrizations: Mapping[str, Callable[..., torch.nn.Module]],
    written_by: str = "the weights to load",
) -> torch.nn.Module:
    """The model after the run's ``--reparametrize`` with ``--reparametrize-kwargs``: mid-run, or to rebuild the
    architecture of weights written after one."""
    if cfg.reparametrize is None:
        raise ConfigError(
            f"{written_by}: written after a reparametrization; pass the run's --reparametrize NAME and "
            "--reparametrize-kwargs to rebuild its architecture"
        )
    if cfg.reparametrize not in reparametrizations:
        raise ConfigError(
            f"{written_by}: written after the reparametrization {cfg.reparametrize!r}, which is not registered here "
            "(convbias.families.load_families())"
        )
    return reparametrizations[cfg.reparametrize](model, **(cfg.reparametrize_kwargs or {}))


def head_classes(model: torch.nn.Module) -> int:
    """The classifier's outputs (timm's ``num_classes`` attribute, which every timm model has), through the
    wrappers around it (DDP's ``module``, the output-scale wrapper's ``model``)."""
    if getattr(model, "num_classes", None) is not None:
        return int(model.num_classes)
    for wrapped in ("module", "model"):
        inner = getattr(model, wrapped, None)
        if isinstance(inner, torch.nn.Module):
            return head_classes(inner)
    raise AttributeError(f"{type(model).__name__} has no num_classes")


def check_head_fits(model: torch.nn.Module, data_classes: int, classes_source: str) -> int:
    """The head's size, after checking that the data set's labels 0..K-1 are among its outputs (timm's train.py
    would fail on the first out-of-range label); ``classes_source`` names where K came from."""
    head = head_classes(model)
    if data_classes > head:
        raise ConfigError(
            f"{classes_source} has {data_classes} classes and the model's head {head} outputs: pass "
            f"--num-classes {data_classes} (the head's size), or --first-classes {head} (keep the first {head} classes)"
        )
    return head


TRIVIAL_TOP5 = 5  # with this many classes or fewer, every model's top-5 holds every label: eval_top5 is 100


def head_fit_warning(head: int, head_source: str, data_classes: int, classes_source: str) -> str | None:
    """The warning of a head larger than the data set's class count (timm's 1000-way default on a 10-class set, a
    recipe's 10-way head on a 3-class folder), which trains without an error: the extra outputs are never a label
    but take part in the softmax and in top-5. None when the head fits."""
    if head <= data_classes:
        return None
    top5 = (
        f"; with {data_classes} classes eval_top5 says nothing (a {data_classes}-way model scores 100%): judge by top-1"
        if data_classes <= TRIVIAL_TOP5
        else ""
    )
    return (
        f"the model's head has {head} outputs ({head_source}) and {classes_source} has {data_classes} classes: "
        f"{head - data_classes} outputs are never a label but share the softmax; pass --num-classes "
        f"{data_classes}{top5}"
    )


def classifier_tensors(model: torch.nn.Module, keys: tuple[str, ...], option: str, name: str) -> list[torch.Tensor]:
    """The classifier's ``keys`` tensors (every head's, for a distilled model's pair), which --head-init-scale and
    --head-init-bias set after the model is created, as timm's train.py does (a small head starts fine-tuning
    near uniform predictions)."""
    if not hasattr(model, "get_classifier"):
        raise ConfigError(f"{option}: {type(model).__name__} ({name}) has no get_classifier(); run without it")
    heads = model.get_classifier()
    heads = heads if isinstance(heads, (tuple, list)) else (heads,)
    tensors = [getattr(head, key, None) for head in heads for key in keys]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ConfigError(f"{option}: the classifier of {name} ({heads[0]}) has no {' or '.join(keys)}")
    return tensors


def set_batchnorm(model: torch.nn.Module, eps: float | None, momentum: float | None, name: str) -> None:
    """--bn-eps / --bn-momentum on every BatchNorm layer. timm's train.py passes them to the model's constructor,
    which only its EfficientNet-style builders take; setting the layers works for any model, and a run's model
    rebuilt for evaluation gets the same eps."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not layers:
        option = "--bn-eps" if eps is not None else "--bn-momentum"
        raise ConfigError(f"{option}: {name} has no BatchNorm layers; run without it")
    for layer in layers:
        if eps is not None:
            layer.eps = eps
        if momentum is not None:
            layer.momentum = momentum


def set_grad_checkpointing(model: torch.nn.Module, name: str) -> None:
    """--grad-checkpointing: timm's own switch; the model must have one."""
    if not hasattr(model, "set_grad_checkpointing"):
        raise ConfigError(
            f"--grad-checkpointing: {type(model).__name__} ({name}) has no set_grad_checkpointing(); run without it"
        )
    model.set_grad_checkpointing(True)


def has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def sync_batchnorm(model: torch.nn.Module, name: str, acc: Accelerator) -> torch.nn.Module:
    """--sync-bn: torch's SyncBatchNorm in place of every BatchNorm when more than one process trains (as
    timm's train.py; one process has nothing to synchronize)."""
    if not has_batchnorm(model):
        raise ConfigError(f"--sync-bn: {name} has no BatchNorm layers; run without it")
    if acc.num_processes == 1:
        return model
    if acc.device.type == "cpu":
        raise ConfigError("--sync-bn needs GPUs (torch's SyncBatchNorm does not run on CPUs); use --dist-bn")
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def create_teacher(cfg: Config, num_classes: int, in_chans: int, device: torch.device) -> torch.nn.Module:
    """--distill-teacher with the weights of --distill-teacher-file, in eval mode on ``device``."""
    teacher = timm.create_model(
        cfg.distill_teacher, num_classes=num_classes, in_chans=None if in_chans == 3 else in_chans
    )
    load_weights(teacher, cfg.distill_teacher_file)
    return teacher.to(device).eval()
