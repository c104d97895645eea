"""What a run writes besides checkpoints: config.yaml and timm's args.yaml, summary.csv, log.jsonl, results.json,
and tracker calls.

``summary.csv`` has exactly the columns of ``SUMMARY_FIELDS``, one row per epoch (``epoch`` counts
completed epochs, from 1). ``log.jsonl`` holds the same fields plus diagnostics and counters.
When a run resumes from epoch E, rows after E (written before a kill, for an epoch that is now
redone) are dropped, and so is a line cut short by a kill or a full disk, so the files read as if the run
had never stopped. Only the main process writes.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import io
import json
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import yaml
from timm.models import is_model, model_entrypoint
from timm.optim import create_optimizer_v2, get_optimizer_info

from convbias.base.errors import DamagedInputError
from convbias.base.inputs import json_record, read_file
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    CONFIG_MARKER,
    LINKS,
    LOG_FILE,
    RESULTS_FILE,
    SUMMARY_FILE,
    TIMM_ARGS_FILE,
    TIMM_ARGS_MARKER,
)
from convbias.base.storage import file_system, write_text
from convbias.base.tables import csv_text

from ..config.derived import ema_is_the_metric, lr_scaling
from ..config.options import (
    Config,
    DataOptions,
    ModelOptions,
    OptimizationOptions,
    ScheduleOptions,
    default_value,
    flag_name,
)
from ..config.parsing import inert_options, key_source, option_source
from ..config.timm_args import timm_args
from ..data.factory import NATIVE_DATASETS, color_jitter_off_by_aa, input_format, train_interpolation
from ..model.factory import head_classes
from ..optim.factory import create_mixup, create_train_loss, optimizer_arguments
from ..rundir.run_files import is_timm_checkpoint_name


def write_config(cfg: Config, path: Path, derived: dict) -> None:
    """The resolved options as a reloadable recipe; derived values (lr, global batch...) as comments."""
    header = "".join(f"# {key}: {value}\n" for key, value in derived.items())
    body = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    write_text(path, CONFIG_MARKER + "\n" + header + body, owner=path.parent)


def write_timm_args(cfg: Config, path: Path, initial_checkpoint: str | None) -> None:
    """The args.yaml timm's train.py would have written for this run (timm's keys and meanings,
    engine.config.timm_args.timm_args, dumped as timm dumps its arguments), what timm cannot express in a comment at
    its top. ``initial_checkpoint``: the weights --checkpoint resolved to."""
    resolved: dict[str, Any] = {"resume": cfg.resume} if is_timm_checkpoint_name(cfg.resume or "") else {}
    if cfg.dataset in NATIVE_DATASETS:  # their size and statistics stand in for the model's, which timm would take
        shape = input_format(cfg)
        resolved.update(img_size=shape.img_size, mean=list(shape.mean), std=list(shape.std))
    values, left_out = timm_args(cfg, initial_checkpoint, resolved)
    if is_model(cfg.model) and not model_entrypoint(cfg.model).__module__.startswith("timm."):
        module = model_entrypoint(cfg.model).__module__
        left_out.append(f"--model {cfg.model} (registered by {module}: timm's train.py needs that module imported)")
    header = (
        f"# what timm's train.py cannot express ({CONFIG_FILE} has it): {'; '.join(left_out)}"
        if left_out
        else "# timm's train.py expresses every option of this run"
    )
    body = yaml.safe_dump(values, default_flow_style=False)  # as timm's train.py writes its args.yaml
    write_text(path, f"{TIMM_ARGS_MARKER}\n{header}\n{body}", owner=path.parent)


# Bytes of a log.jsonl or summary.csv read whole: a line per epoch and evaluation stays far below it
MAX_LOG_BYTES = 1 << 30
SUMMARY_FIELDS = ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr", "images_per_sec", "epoch_seconds")


def read_log(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a log.jsonl (JSON objects with an integer epoch) and how many lines were dropped
    as damaged: cut short by a kill, not UTF-8, not an object. A missing file has none."""
    if not os.path.lexists(path):
        return [], 0
    lines = read_file(path, "run log", DamagedInputError, MAX_LOG_BYTES).splitlines()
    records, dropped = [], 0
    for line in lines:
        record = json_record(line)  # None: damaged, whatever its depth
        if isinstance(record, dict) and isinstance(record.get("epoch"), int):
            records.append(record)
        elif line.strip():
            dropped += 1
    return records, dropped


def read_summary(path: Path) -> tuple[list[dict[str, str]], int]:
    """The rows of a summary.csv with an integer epoch and every column, and how many were dropped."""
    if not os.path.lexists(path):
        return [], 0
    text = read_file(path, "run summary", DamagedInputError, MAX_LOG_BYTES).decode("utf-8", errors="replace")
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    kept = [
        r
        for r in rows
        if r.get("epoch", "").isdigit() and None not in r.values() and "\ufffd" not in "".join(r.values())
    ]
    return kept, len(rows) - len(kept)


def results_record(options: dict[str, Any], epochs: int, final: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    """The content of results.json: the run's identity, its final and best evaluations, and whose they are
    (metric_of: the EMA's or the model's, as timm's train.py picks the epoch's metric)."""
    return {
        "model": options["model"],
        "dataset": options.get("dataset"),
        "train_fraction": options.get("train_fraction"),
        "seed": options.get("seed"),
        "epochs": epochs,
        "final_top1": final.get("eval_top1"),
        "final_top5": final.get("eval_top5"),
        "best_top1": best.get("eval_top1"),
        "best_top5": best.get("eval_top5"),
        "best_epoch": best.get("epoch"),
        "metric_of": "ema" if ema_is_the_metric(options) else "model",
    }


def _append_line(path: Path, line: str) -> None:
    """Append one whole line: a write that fails (disk full) is cut back, so no half line is left when the
    disk allows it (``start`` drops one that stays, when the run resumes)."""
    size = path.stat().st_size
    try:
        file_system().append_text(path, line)
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


class RunLog:
    def __init__(self, output: str | Path, enabled: bool, tracker=None):
        self.output = Path(output)
        self.enabled = enabled
        self.tracker = tracker  # an accelerate.Accelerator with trackers initialized, or None
        self.summary = self.output / SUMMARY_FILE
        self.jsonl = self.output / LOG_FILE

    def start(self, completed_epochs: int) -> list[str]:
        """Fresh files, or the existing ones cut back to ``completed_epochs`` rows when resuming; damaged
        lines are dropped. Returns a note for each file that was repaired."""
        if not self.enabled:
            return []
        rows, bad_rows = read_summary(self.summary) if completed_epochs else ([], 0)
        lines, bad_lines = read_log(self.jsonl) if completed_epochs else ([], 0)
        rows = [r for r in rows if int(r["epoch"]) <= completed_epochs]
        lines = [r for r in lines if r["epoch"] <= completed_epochs]
        write_text(self.summary, csv_text(rows, SUMMARY_FIELDS), owner=self.output)
        write_text(self.jsonl, "".join(json.dumps(r) + "\n" for r in lines), owner=self.output)
        return [
            f"dropped {count} damaged line{'s' if count > 1 else ''} of {path} (kept {kept} epochs)"
            for path, count, kept in ((self.summary, bad_rows, len(rows)), (self.jsonl, bad_lines, len(lines)))
            if count
        ]

    def log_epoch(self, record: dict[str, Any]) -> None:
        """Append one epoch: the summary fields to summary.csv, everything to log.jsonl and the trackers."""
        if self.tracker is not None:
            self.tracker.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["epoch"])
        if not self.enabled:
            return
        _append_line(self.summary, csv_text([record], SUMMARY_FIELDS, header=False))
        _append_line(self.jsonl, json.dumps(record) + "\n")

    def write_results(self, results: dict[str, Any]) -> None:
        """results.json, atomically: its presence marks the run as complete."""
        if self.enabled:
            write_text(self.output / RESULTS_FILE, json.dumps(results, indent=2) + "\n", owner=self.output)


def images_per_second(steps: int, batch_size: int, processes: int, seconds: float) -> float:
    """The training images of ``steps`` steps of every process over ``seconds`` (log.jsonl's images_per_sec)."""
    return steps * batch_size * processes / seconds if seconds > 0 else math.nan


def seconds_left(seconds: float, steps_done: int, steps_left: int) -> float:
    """The time ``steps_left`` steps take at the pace of the ``steps_done`` steps that took ``seconds``
    (evaluations and checkpoints included)."""
    return seconds / steps_done * steps_left if steps_done else math.nan


def pace(seconds: float, images_per_sec: float, left: float) -> str:
    """Time, images per second and time left, as the epoch and step lines show them."""
    remaining = "?" if math.isnan(left) else str(datetime.timedelta(seconds=round(left)))
    return f"{seconds:.1f} s  {images_per_sec:.0f} img/s  {remaining} left"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def startup_block(start: Any, data: Any, model: Any, weights: str | None) -> list[str]:
    """What this launch will do, before its first step: where, on what, with which batch, lr and length
    (``start``: the run's engine.loop.start.RunStart; ``data``: its engine.data.build.TrainingData; ``model``: the
    unwrapped model; ``weights``: what its starting weights are, engine.model.build.StartingModel's)."""
    cfg, acc, bundle = start.cfg, start.accelerator, data.bundle
    begin = f"resuming from {start.point}" if start.point is not None else "a new run"
    if start.resume is not None and start.point is None:
        begin = f"a new run, resuming timm's {start.resume.path}"
    params = sum(p.numel() for p in model.parameters())
    try:
        sizes = f"{len(bundle.train):,} train / {len(bundle.val):,} val images"
    except TypeError:  # a stream without a known length
        sizes = "streamed"
    values = start.values
    precision = "fp32" if acc.mixed_precision == "no" else f"{acc.mixed_precision} mixed precision"
    given = option_source(cfg, "mixed_precision") if acc.mixed_precision == cfg.mixed_precision else "accelerate's"
    scaled = ", x 1/--train-fraction (--scale-epochs)" if cfg.scale_epochs else ""
    return [
        f"output: {start.output} ({begin})",
        f"processes: {acc.num_processes} ({plural(torch.get_num_threads(), 'thread')} each [{start.threads}]) on "
        f"{acc.device.type}, {precision} [{given}]",
        f"model: {cfg.model}, {params / 1e6:.2f}M parameters; arguments {model_arguments(cfg)}",
        *([f"weights: {weights}"] if weights else []),
        f"data: {_value(cfg, 'dataset')}, {sizes}, {bundle.num_classes} classes",
        f"num_classes: {head_classes(model)} ({start.head[1]})",
        f"batch: {values.global_batch} global = {_value(cfg, 'batch_size')} per process x {acc.num_processes} x "
        f"{_value(cfg, 'grad_accum_steps')} accumulation; lr {values.lr:.3g} ({values.lr_rule})",
        f"schedule: {_epochs(cfg, values)}, {values.warmup_epochs} of warm-up [{option_source(cfg, 'warmup_epochs')}"
        f"{scaled}], {data.updates_per_epoch} updates per epoch",
        *settings_lines(cfg, values.lr),
    ]


def _epochs(cfg: Any, values: Any) -> str:
    """The epochs the run trains, with where they came from: --epochs, scaled by --scale-epochs, and those timm's
    scheduler adds (cooldown, further lr cycles, a warm-up prefix)."""
    if values.epochs == cfg.epochs:
        return f"{plural(values.epochs, 'epoch')} [{option_source(cfg, 'epochs')}]"
    parts = [f"--epochs {cfg.epochs} ({option_source(cfg, 'epochs')})"]
    if cfg.scale_epochs:
        parts.append(f"x 1/--train-fraction {cfg.train_fraction:g} (--scale-epochs): {values.schedule_epochs}")
    if values.epochs != values.schedule_epochs:
        parts.append(
            f"{values.epochs - values.schedule_epochs} more as timm's scheduler counts them (--cooldown-epochs, "
            "--lr-cycle-limit, --warmup-prefix)"
        )
    return f"{plural(values.epochs, 'epoch')} [{'; '.join(parts)}]"


def model_arguments(cfg: Any) -> str:
    """--model-kwargs in force (a recipe's merged with the command line's), each with where it came from."""
    kwargs = cfg.model_kwargs or {}
    if not kwargs:
        return "the model's defaults"
    return ", ".join(f"{key}={value} [{key_source(cfg, 'model_kwargs', key)}]" for key, value in kwargs.items())


def _value(cfg: Any, name: str, shown: Any = None) -> str:
    """'value [where it came from]' of one option."""
    value = getattr(cfg, name) if shown is None else shown
    text = f"{value:g}" if isinstance(value, float) else "none" if value is None else str(value)
    return f"{text} [{option_source(cfg, name)}]"


def optimizer_settings(cfg: Any, lr: float) -> tuple[str, str, dict[str, Any]]:
    """The class of the optimizer timm's create_optimizer_v2 builds from the run's options, the class whose
    hyper-parameters it uses (Lookahead's inner optimizer) and those (built on one stand-in tensor, so the
    optimizer's own defaults show: eps, betas, momentum)."""
    optimizer = create_optimizer_v2([torch.zeros(1, requires_grad=True)], **optimizer_arguments(cfg, lr))
    name = inner = type(optimizer).__name__
    if cfg.opt.lower().startswith("lookahead_"):  # timm's Lookahead wraps the optimizer it names, sharing its defaults
        opt_class = get_optimizer_info(cfg.opt.lower().split("_", 1)[1]).opt_class
        inner = getattr(opt_class, "__name__", str(opt_class).rsplit(".", 1)[-1])  # a class named by its path
    return name, inner, dict(optimizer.defaults)


def settings_lines(cfg: Any, lr: float) -> list[str]:
    """The start-up block's account of the recipe: optimizer, schedule, augmentation, EMA and input, each value
    with where it came from (command line, -c FILE, timm default, default, or the model's or dataset's config)."""
    name, inner, hyper = optimizer_settings(cfg, lr)
    own = [  # the optimizer's hyper-parameters that the options set: from the option, else the optimizer's own
        f"{key} {hyper[key]} [{option_source(cfg, option) if getattr(cfg, option) is not None else inner + ' default'}]"
        for key, option in (("eps", "opt_eps"), ("betas", "opt_betas"), ("momentum", "momentum"))
        if key in hyper
    ]
    if inner != name:
        name = f"{name} of {inner}"
    if "nesterov" in hyper:  # timm's sgd and momentum optimizers differ by it
        own.append(f"nesterov {hyper['nesterov']} [--opt {cfg.opt}]")
    if cfg.lr is not None:
        lr_rule = f"--lr [{option_source(cfg, 'lr')}]"
    else:
        lr_rule = (
            f"--lr-base {_value(cfg, 'lr_base')} per {_value(cfg, 'lr_base_size')} images, scaled "
            f"{_value(cfg, 'lr_base_scale', lr_scaling(cfg))}"
        )
    shape = input_format(cfg)
    stepping = "per update" if cfg.sched_on_updates else "per epoch"
    mixing = (
        f"off [{option_source(cfg, 'mixup')}]"
        if not (cfg.mixup or cfg.cutmix or cfg.cutmix_minmax)
        else (f"mixup {_value(cfg, 'mixup')}, cutmix {_value(cfg, 'cutmix')}, prob {_value(cfg, 'mixup_prob')}")
    )
    ema = f"off [{option_source(cfg, 'model_ema')}]"
    if cfg.model_ema:
        metric = "the EMA's evaluation, as timm" if ema_is_the_metric(cfg) else "the model's evaluation"
        ema = (
            f"decay {_value(cfg, 'model_ema_decay')}, warm-up {_value(cfg, 'model_ema_warmup')}; the epoch's metric "
            f"and best: {metric}"
        )
    trained = train_interpolation(cfg, shape.interpolation)
    train_interp = _value(cfg, "train_interpolation") if trained == cfg.train_interpolation else f"{trained} [as eval]"
    drop_path = _value(cfg, "drop_path") if cfg.drop_path is not None else "the model's"
    return [
        f"optimizer: {name} (--opt {_value(cfg, 'opt')}), {', '.join(own) + ', ' if own else ''}weight decay "
        f"{_value(cfg, 'weight_decay')}",
        f"lr: {lr:.3g} from {lr_rule}",
        f"lr schedule: {_value(cfg, 'sched')} stepped {stepping} [{option_source(cfg, 'sched_on_updates')}], "
        f"warm-up from {_value(cfg, 'warmup_lr')}, min lr {_value(cfg, 'min_lr')}",
        f"augmentation: auto-augment {_value(cfg, 'aa')}, random erasing {_value(cfg, 'reprob')}, mixup/cutmix "
        f"{mixing}, repeated augmentation {_value(cfg, 'repeated_aug')}, drop-path {drop_path}"
        + (f", color jitter {_value(cfg, 'color_jitter')}" if not color_jitter_off_by_aa(cfg) else "")
        + (" (all off: --no-aug)" if cfg.no_aug else ""),
        loss_line(cfg),
        f"EMA: {ema}",
        input_line(cfg, shape, f" (train {train_interp})"),
        *also_line(cfg),
    ]


def loss_line(cfg: Any) -> str:
    """The training loss timm's train.py chooses (engine.optim.factory.create_train_loss) and its options."""
    loss = type(create_train_loss(cfg, create_mixup(cfg, num_classes=2))).__name__  # the loss, whatever the classes
    mixing = bool(cfg.mixup or cfg.cutmix or cfg.cutmix_minmax is not None)
    smoothing = _value(cfg, "smoothing")
    if loss == "CrossEntropyLoss":
        chosen = f"no mixup/cutmix, smoothing {smoothing}"
        if cfg.bce_loss:
            chosen += f"; --bce-loss [{option_source(cfg, 'bce_loss')}] ignored without them, as timm's train.py"
    else:
        chosen = f"smoothing {smoothing}" + (" in mixup/cutmix's targets" if mixing else "")
    if loss == "BinaryCrossEntropy":
        chosen = (
            f"--bce-loss [{option_source(cfg, 'bce_loss')}], {chosen}, target threshold "
            f"{_value(cfg, 'bce_target_thresh')}, summed over classes {_value(cfg, 'bce_sum')}, positive weight "
            f"{_value(cfg, 'bce_pos_weight')}"
        )
    teacher = f"; with hard distillation from {_value(cfg, 'distill_teacher')}" if cfg.distill_teacher else ""
    return f"loss: {loss} ({chosen}){teacher}"


# The options the lines above show, and those that say where or how fast the run reads its data, not what it trains
SHOWN_ABOVE = frozenset(
    (
        *("model", "model_kwargs", "pretrained", "pretrained_file", "checkpoint", "dataset", "num_classes"),
        *("batch_size", "grad_accum_steps", "epochs", "warmup_epochs", "mixed_precision", "opt", "opt_eps"),
        *("opt_betas", "momentum", "weight_decay", "lr", "lr_base", "lr_base_size", "lr_base_scale", "sched"),
        *("sched_on_updates", "warmup_lr", "min_lr", "aa", "reprob", "mixup", "cutmix", "mixup_prob", "repeated_aug"),
        *("drop_path", "color_jitter", "no_aug", "smoothing", "bce_loss", "bce_target_thresh", "bce_sum"),
        *("bce_pos_weight", "distill_teacher", "model_ema", "model_ema_decay", "model_ema_metric", "model_ema_warmup"),
        "img_size",
        *("crop_pct", "interpolation", "train_interpolation", "mean", "std"),
    )
)
DATA_ACCESS = frozenset(
    ("data_dir", "train_split", "val_split", "workers", "pin_mem", "no_prefetcher", "input_key", "target_key")
)
TRAINING_GROUPS = (ModelOptions, DataOptions, OptimizationOptions, ScheduleOptions)
TRAINING_OTHERS = ("eval_metric", "eval_interval", "sync_bn", "dist_bn", "fast_norm", "distill_teacher_file")


def also_line(cfg: Any) -> list[str]:
    """Every other training option whose value is not its default (timm's where timm has the option), with where it
    came from; the values timm's train.py ignores (warned about at start) are left out."""
    names = [spec.name for group in TRAINING_GROUPS for spec in fields(group)] + list(TRAINING_OTHERS)
    inert = inert_options(cfg)
    shown = [
        _flag(cfg, name)
        for name in names
        if name not in SHOWN_ABOVE | DATA_ACCESS and name not in inert and getattr(cfg, name) != default_value(name)
    ]
    return [f"also: {', '.join(shown)}"] if shown else []


def _flag(cfg: Any, name: str) -> str:
    """'--flag VALUE [where it came from]' of one option, as a command line gives it."""
    value, flag = getattr(cfg, name), flag_name(name)
    if isinstance(value, bool):
        given = flag if value else f"--no-{flag[2:]}"
    elif isinstance(value, dict):
        given = f"{flag} {' '.join(f'{k}={v}' for k, v in value.items())}"
    elif isinstance(value, (list, tuple)):
        given = f"{flag} {' '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in value)}"
    else:
        given = f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
    return f"{given} [{option_source(cfg, name)}]"


def input_line(cfg: Any, shape: Any, after_interpolation: str = "") -> str:
    """The start-up block's input line: size, crop, interpolation, mean and std, each with where it came from."""
    size, crop, interp, mean, std = (
        f"{getattr(shape, key)} [{option_source(cfg, key) if shape.sources.get(key) == 'set' else shape.sources[key]}]"
        for key in ("img_size", "crop_pct", "interpolation", "mean", "std")
    )
    return f"input: {size} px, crop {crop}, interpolation {interp}{after_interpolation}, mean {mean}, std {std}"


def evaluation_block(start: Any, data: Any, checkpoint_name: str | None) -> list[str]:
    """What --eval-only will do, before it starts: which weights, on what, and the input, as timm's validate.py
    takes it (the model's test size and crop) or, with --use-train-size, as train.py does."""
    cfg = start.cfg
    try:
        images = f"{len(data.bundle.val):,} images"
    except TypeError:  # a stream without a known length
        images = "streamed"
    weights = "its EMA's weights (--use-ema)" if cfg.use_ema else "its model weights (--use-ema: the EMA's)"
    rule = (
        "train.py's size and crop (--use-train-size)"
        if cfg.use_train_size
        else "timm's validate.py: the model's test_input_size and test_crop_pct where its config has them "
        "(--use-train-size: train.py's)"
    )
    return [
        f"evaluating: {checkpoint_name}, {weights}, on {cfg.dataset} ({images})",
        f"{input_line(cfg, input_format(cfg))}; as {rule}",
    ]


METRIC_NAMES = {"top1": "top-1", "top5": "top-5", "loss": "loss"}  # --eval-metric as the end line names it


def summary_line(
    results: dict[str, Any], final_epoch: int | None, output: Path, metric: str = "top1", best: dict | None = None
) -> str:
    """The last line of a run: its final top-1, the epoch that --eval-metric (``metric``) ranks best with that
    metric's value (``best``: that epoch's evaluation), and where its files are."""

    def shown(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    best_value = (best or {}).get(f"eval_{metric}", results.get(f"best_{metric}"))
    files = (
        RESULTS_FILE,
        SUMMARY_FILE,
        LOG_FILE,
        CONFIG_FILE,
        TIMM_ARGS_FILE,
        *(f"{CHECKPOINTS_DIR}/{link}" for link in LINKS),
    )
    of = " of the EMA" if results.get("metric_of") == "ema" else ""
    return (
        f"done: final top-1{of} {shown(results['final_top1'])} (epoch {final_epoch}), best {METRIC_NAMES[metric]}{of} "
        f"{shown(best_value, 4 if metric == 'loss' else 2)} (epoch {results['best_epoch']}); in {output}: "
        f"{', '.join(files)}"
    )
