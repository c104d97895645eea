"""Label a user's own images with a trained model, as timm's inference.py does: top-k classes and probabilities.

    predictor = load_predictor("runs/convit_tiny-digits", load_families(), which="best")   # or an exported folder
    result = predict(predictor, find_images(["photos/", "*.png"]), topk=3)
    write_predictions(result, "preds.csv", topk=3)

The model is either a train.py run (read through ``RunDir``: verified weights, the run's eval transform from
the engine's ``build_transforms``, class names from its dataset), a ``convbias-export`` folder (loaded by timm
from ``local-dir:``, preprocessing from its pretrained_cfg, class names from its ``label_names``) or timm's
training checkpoint (``*.pth.tar``: the model and preprocessing its saved train.py arguments give, read safely
by the engine's ``read_timm_checkpoint``), so an image is preprocessed exactly as the run's
validation images were. Images that cannot be decoded are skipped and reported, never fatal. Every refusal is a ConfigError with one line (exit 2 in the commands).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import timm
import torch
from huggingface_hub.constants import PYTORCH_WEIGHTS_NAME, SAFETENSORS_SINGLE_FILE
from PIL import Image
from timm.data import create_transform, resolve_model_data_config
from torchvision.datasets.folder import IMG_EXTENSIONS

from convbias.base.errors import DamagedInputError
from convbias.base.inputs import check_regular_file, first_line, quoted, read_json
from convbias.base.run_layout import check_destination
from convbias.base.storage import write_text
from convbias.base.weights import load_checked, read_state_dict
from convbias.engine import (
    TIMM_SUFFIXES,
    ConfigError,
    DamagedCheckpointError,
    RunDir,
    build_datasets,
    build_run_model,
    build_transforms,
    create_timm_model,
    image_mode,
    in_timm_output,
    input_format,
    is_run_dir,
    is_timm_checkpoint_name,
    read_timm_checkpoint,
    run_model_spec,
    timm_class_names,
    timm_data_config,
)
from convbias.families import Families

OUTPUT_FORMATS = (".csv", ".json")
EXPORTED_CONFIG = "config.json"  # what save_for_hf writes beside the weights: marks an exported folder
EXPORTED_WEIGHTS = (SAFETENSORS_SINGLE_FILE, PYTORCH_WEIGHTS_NAME)  # the files timm's local-dir: loads, in its order
GLOB_CHARACTERS = frozenset("*?[")


# A channel mean of the training images below this (or above 1 - it) says they are mostly dark (light)
MOSTLY_DARK = 0.4


def describe_input(data_config: dict[str, Any]) -> str:
    """The input a model expects, in words, from its evaluation preprocessing (timm's data config: input_size,
    mean, std, crop_pct, interpolation): channels, size, the resize and crop, the normalization, and whether its
    training images were mostly dark or light (the digits' light strokes on a dark background)."""
    channels, height, width = data_config["input_size"]
    crop, interpolation = float(data_config.get("crop_pct") or 1.0), data_config.get("interpolation") or "bilinear"
    mean, std = tuple(data_config["mean"]), tuple(data_config["std"])
    kind = (
        "1-channel (grayscale)"
        if channels == 1
        else f"{channels}-channel (RGB)"
        if channels == 3
        else f"{channels}-channel"
    )
    resize = round(min(height, width) / crop)
    text = (
        f"{kind} images, shorter side resized to {resize} px ({interpolation}) and center-cropped to "
        f"{height}x{width}, then normalized with mean {_numbers(mean)} and std {_numbers(std)}"
    )
    level = sum(mean) / len(mean)
    if level < MOSTLY_DARK:
        text += (
            f"; its training images are mostly dark (mean pixel {level:.2f} of 1): light strokes on a dark "
            "background, as the digits datasets' (invert dark-on-light images first)"
        )
    elif level > 1 - MOSTLY_DARK:
        text += (
            f"; its training images are mostly light (mean pixel {level:.2f} of 1): invert light-on-dark images first"
        )
    return text


def _numbers(values: tuple[float, ...]) -> str:
    return ", ".join(f"{value:.4g}" for value in values) if len(values) > 1 else f"{values[0]:.4g}"


@dataclass
class Predictor:
    """A model in eval mode with the preprocessing and class names it was trained with."""

    model: torch.nn.Module
    transform: Callable[[Image.Image], torch.Tensor]
    num_classes: int
    image_mode: str  # the PIL mode images are converted to: "L" for one channel, else "RGB"
    source: str  # the checkpoint or folder, for the user
    label_names: list[str] | None = None  # None: classes are named by their index
    notes: list[str] = field(default_factory=list)  # what the user should know (why labels are indices)
    data_config: dict[str, Any] = field(default_factory=dict)  # the preprocessing: input_size, mean, std, crop...

    def label(self, index: int) -> str:
        return self.label_names[index] if self.label_names else str(index)

    def expects(self) -> str:
        """The input the model expects, in words (`describe_input`)."""
        return describe_input(self.data_config)

    def image(self, path: str | Path) -> torch.Tensor:
        """One image file as the model sees it at evaluation (ConfigError naming a file that does not decode)."""
        try:
            return self.transform(read_image(Path(path), self.image_mode))
        except (OSError, ValueError) as error:  # PIL's UnidentifiedImageError is an OSError
            raise ConfigError(f"{path}: cannot read the image ({first_line(error)})") from None


@dataclass
class Prediction:
    path: str
    top: list[tuple[int, float]]  # (class index, probability), most probable first


@dataclass
class Predictions:
    predictions: list[Prediction]
    skipped: list[tuple[str, str]]  # (path, why it could not be read)


def is_exported(path: str | Path) -> bool:
    """A ``convbias-export`` folder (timm's Hub layout). It also holds the run's config.yaml, so it is told
    apart from a run directory by its config.json."""
    return os.path.lexists(Path(path) / EXPORTED_CONFIG)  # whatever it is: read_exported_config checks it


def source_kind(source: str | Path, which: str | None = None, use_ema: bool = False) -> str:
    """ "exported", "run" or "timm" (timm's training checkpoint, read by
    ``convbias.engine.rundir.timm_files``): what ``source`` is, checked before anything is loaded
    (ConfigError otherwise)."""
    path = Path(source)
    if is_timm_checkpoint_name(path):
        if which is not None:
            raise ConfigError(
                f"--which is for run directories; {path} is timm's checkpoint (use --use-ema for its EMA)"
            )
        return "timm"
    if use_ema:
        raise ConfigError(f"--use-ema picks the EMA weights of timm's checkpoint file (*.pth.tar); {path} is not one")
    if is_exported(path):
        if which is not None:
            raise ConfigError(f"--which is for run directories; {path} is an exported folder (one checkpoint)")
        return "exported"
    if is_run_dir(path):
        return "run"
    if not path.exists():
        raise ConfigError(
            f"{path} not found: expected a train.py run directory, a convbias-export folder or timm's *.pth.tar"
        )
    raise ConfigError(
        f"{path} is neither a train.py run directory (no config.yaml), a convbias-export folder (no "
        f"{EXPORTED_CONFIG}) nor timm's checkpoint (*{', *'.join(TIMM_SUFFIXES)})"
    )


def load_predictor(
    source: str | Path, families: Families, which: str | None = None, use_ema: bool = False
) -> Predictor:
    """The model of a train.py run (``which``: last or best, default last), of an exported folder, or of timm's
    training checkpoint (``use_ema``: its EMA's weights), or of timm's output folder (its checkpoint by ``which``).
    ``families``: the loaded families (``convbias.families.load_families()``): their models are registered, and a
    run's reparametrization is theirs."""
    source, which = in_timm_output(source, which)
    kind = source_kind(source, which, use_ema)
    if kind == "exported":
        return load_exported(source)
    if kind == "timm":
        return load_timm(source, use_ema)
    return load_run(source, families, which or "last")


def load_timm(path: str | Path, use_ema: bool = False) -> Predictor:
    """timm's training checkpoint as timm's inference.py predicts with it: the model its args name, the
    preprocessing ``resolve_data_config`` gives for its args and model, the names of its --class-map. The
    families' models are registered (``convbias.families.load_families()``)."""
    checkpoint = read_timm_checkpoint(path)
    model = create_timm_model(checkpoint, use_ema)
    data_config = timm_data_config(checkpoint, model)
    transform = create_transform(**data_config, is_training=False)
    labels, notes = timm_class_names(checkpoint, model.num_classes)
    source = f"{path}" + (" (EMA)" if use_ema else "")
    in_chans = data_config["input_size"][0]
    return Predictor(model, transform, model.num_classes, image_mode(in_chans), source, labels, notes, data_config)


def load_run(path: str | Path, families: Families, which: str = "last") -> Predictor:
    """A run's checkpoint ``which`` as train.py evaluated it: its model (built with the loaded ``families``) and
    the engine's eval transform (its --mean/--std or its dataset's statistics, for the channels the model was built
    with)."""
    run = RunDir(path)
    config = run.run_config()
    spec = run_model_spec(run, which)  # refuses a missing checkpoint, verifies the weights against their manifest
    model, checkpoint = build_run_model(run, which, families)
    shape = input_format(config.replace(img_size=int(spec["img_size"]), in_chans=spec["in_chans"]))
    _, transform = build_transforms(shape.img_size, shape.in_chans, shape.mean, shape.std, config)
    num_classes = spec["num_classes"] or model.num_classes
    labels, notes = run_class_names(config, num_classes)
    data_config = dict(
        input_size=(shape.in_chans, shape.img_size, shape.img_size),
        mean=shape.mean,
        std=shape.std,
        crop_pct=shape.crop_pct,
        interpolation=shape.interpolation,
    )
    mode = image_mode(spec["in_chans"])
    return Predictor(model, transform, num_classes, mode, checkpoint.describe(), labels, notes, data_config)


def run_class_names(config: Any, num_classes: int) -> tuple[list[str] | None, list[str]]:
    """The class names of the run's dataset (``config``: its ``engine.Config``) when it can be read here,
    else None and why (labels are then the class indices): a folder dataset whose data dir has moved, a
    download that is not there."""
    try:
        names = [str(name) for name in build_datasets(config).class_names]
    except (ValueError, OSError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        return None, [f"the class names of --dataset {config.dataset} cannot be read ({reason}): labels are indices"]
    if len(names) != num_classes:
        return None, [f"the dataset has {len(names)} classes, the model {num_classes}: labels are class indices"]
    return names, []


def read_exported_config(path: Path) -> dict[str, Any]:
    """The config.json of an export folder, every field timm reads checked for its type: ``architecture`` a
    registered model, ``num_classes`` an integer >= 1, ``model_args`` and ``pretrained_cfg`` mappings,
    ``label_names`` one name per class. DamagedInputError naming the file and the key otherwise. The families'
    models are registered (``convbias.families.load_families()``)."""
    file = path / EXPORTED_CONFIG
    config = read_json(file, "exported model config", DamagedInputError)
    if not isinstance(config, dict):
        raise DamagedInputError(f"{file} is not timm's model config (expected an object, got {type(config).__name__})")
    architecture, num_classes = config.get("architecture"), config.get("num_classes")
    rules = (
        ("architecture", isinstance(architecture, str) and timm.is_model(architecture), "a registered timm model"),
        ("num_classes", num_classes is None or (type(num_classes) is int and num_classes >= 1), "an integer >= 1"),
        *((key, isinstance(config.get(key, {}), dict), "a mapping") for key in ("model_args", "pretrained_cfg")),
        (
            "label_names",
            config.get("label_names") is None
            or (
                isinstance(config["label_names"], list)
                and all(isinstance(name, str) for name in config["label_names"])
                and len(config["label_names"]) == (num_classes or len(config["label_names"]))
            ),
            "a list of one name per class",
        ),
    )
    for key, valid, expected in rules:
        if not valid:
            raise DamagedInputError(f"{file}: {key}: expected {expected}, got {quoted(config.get(key))}")
    return config


def load_exported(path: str | Path) -> Predictor:
    """A ``convbias-export`` folder: its config.json checked (``read_exported_config``), its model built by timm
    from ``local-dir:`` without weights, then its weights read safely and loaded strictly, each tensor checked
    for its shape, dtype and finiteness as ``--pretrained-file`` is; the preprocessing its pretrained_cfg records
    and its ``label_names``. DamagedInputError (exit 65) naming the file and what does not fit."""
    path = Path(path)
    config = read_exported_config(path)
    weights = [path / name for name in EXPORTED_WEIGHTS if os.path.lexists(path / name)]
    if not weights:
        raise DamagedCheckpointError(f"{path} holds no weights ({' or '.join(EXPORTED_WEIGHTS)})")
    check_regular_file(weights[0], "weights file", DamagedInputError)
    state_dict = read_state_dict(weights[0])  # read safely: timm's own error would advise unpickling the file
    try:
        model = timm.create_model(f"local-dir:{path}", pretrained=False)
    except (TypeError, ValueError, KeyError, AssertionError, RuntimeError) as error:  # how constructors refuse
        raise DamagedInputError(
            f"{path / EXPORTED_CONFIG}: model_args: {config['architecture']} is not built from them "
            f"({first_line(error)})"
        ) from None
    if config.get("num_classes") not in (None, model.num_classes):  # its model_args built another head
        raise DamagedInputError(
            f"{path / EXPORTED_CONFIG}: num_classes: {config['num_classes']}, and the model its model_args build "
            f"has {model.num_classes} outputs"
        )
    try:
        load_checked(model, state_dict, str(weights[0]))
    except DamagedInputError:
        raise
    except ConfigError as error:  # keys or shapes that do not fit: the folder's config and weights disagree
        raise DamagedInputError(f"{error} (the model its {EXPORTED_CONFIG} describes)") from None
    model.eval()
    data_config = resolve_model_data_config(model)
    transform = create_transform(**data_config, is_training=False)
    labels = model.pretrained_cfg.get("label_names")
    notes = [] if labels else [f"{path / EXPORTED_CONFIG} has no label_names: labels are class indices"]
    in_chans = data_config["input_size"][0]
    return Predictor(model, transform, model.num_classes, image_mode(in_chans), str(path), labels, notes, data_config)


def find_images(items: Sequence[str | Path]) -> list[Path]:
    """The images named by files, folders (searched recursively for image extensions) and glob patterns,
    in the order given, each once. A name that matches nothing, or no image at all, is a ConfigError."""
    found: dict[Path, None] = {}
    for item in items:
        path = Path(item)
        if path.is_dir():
            # a dangling link is kept: predict names it among the skipped images
            matches = [
                p
                for p in sorted(path.rglob("*"))
                if p.suffix.lower() in IMG_EXTENSIONS and (p.is_file() or (p.is_symlink() and not p.exists()))
            ]
            if not matches:
                raise ConfigError(f"no image in folder {path} (extensions: {', '.join(IMG_EXTENSIONS)})")
        elif GLOB_CHARACTERS & set(str(item)) and not os.path.lexists(path):
            matches = [Path(p) for p in sorted(glob.glob(str(item), recursive=True)) if Path(p).is_file()]
            if not matches:
                raise ConfigError(f"no file matches {item}")
        else:  # a file; missing, a folder, a FIFO, a socket or a device is named as what it is
            matches = [check_regular_file(path, "image")]
        found.update(dict.fromkeys(matches))
    if not found:
        raise ConfigError("no images given")
    return list(found)


def _batches(paths: Sequence[Path], size: int) -> Iterator[list[Path]]:
    iterator = iter(paths)
    while batch := list(islice(iterator, size)):
        yield batch


def read_image(path: Path, mode: str) -> Image.Image:
    """The decoded image in ``mode`` (PIL decodes lazily: converting reads the whole file)."""
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(f"a dangling symbolic link to {os.readlink(path)}")
    with Image.open(path) as image:
        return image.convert(mode)


@torch.inference_mode()
def predict(
    predictor: Predictor,
    paths: Sequence[Path],
    topk: int = 5,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    on_skip: Callable[[str, str], None] | None = None,
) -> Predictions:
    """The ``topk`` most probable classes (softmax over all of them) of every readable image, in batches.
    An image that cannot be decoded is skipped and passed to ``on_skip(path, reason)``."""
    check_topk(topk, predictor.num_classes)
    model = predictor.model.to(device)
    result = Predictions([], [])
    for batch in _batches(paths, batch_size):
        tensors, names = [], []
        for path in batch:
            try:
                tensors.append(predictor.transform(read_image(path, predictor.image_mode)))
            except Exception as error:  # PIL raises many kinds for a damaged file; the engine skips them alike
                reason = " ".join(str(error).split()) or type(error).__name__
                result.skipped.append((str(path), reason))
                if on_skip:
                    on_skip(str(path), reason)
                continue
            names.append(str(path))
        if not tensors:
            continue
        probabilities = model(torch.stack(tensors).to(device)).float().softmax(-1)
        values, indices = probabilities.topk(topk, dim=-1)
        for name, value, index in zip(names, values.tolist(), indices.tolist()):
            result.predictions.append(Prediction(name, list(zip(index, value))))
    return result


def check_topk(topk: int, num_classes: int) -> None:
    if not 1 <= topk <= num_classes:
        raise ConfigError(f"--topk {topk}: the model has {num_classes} classes (choose 1 to {num_classes})")


def output_format(output: str | Path | None) -> str:
    """The format of ``output`` by its suffix (csv without an output: standard output), checked with its
    folder before any image is read."""
    if output is None:
        return ".csv"
    output = Path(output)
    suffix = output.suffix.lower()
    if suffix not in OUTPUT_FORMATS:
        raise ConfigError(f"--output {output}: unknown suffix {suffix or '(none)'!r}; choose .csv or .json")
    if not output.parent.is_dir():
        raise ConfigError(f"--output {output}: folder {output.parent} not found")
    check_destination(output)
    return suffix


def to_csv(result: Predictions, predictor: Predictor, topk: int) -> str:
    """One row per image: path, then label, index and probability of each of the top-k classes."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(
        ["path"] + [f"{column}_{k}" for k in range(1, topk + 1) for column in ("label", "index", "probability")]
    )
    for prediction in result.predictions:
        cells = [cell for index, p in prediction.top for cell in (predictor.label(index), index, repr(p))]
        writer.writerow([prediction.path, *cells])
    return buffer.getvalue()


def to_json(result: Predictions, predictor: Predictor, topk: int) -> str:
    """The predictions with the model they came from and the images that were skipped."""
    record = {
        "model": predictor.source,
        "topk": topk,
        "labels": "names" if predictor.label_names else "class indices",
        "predictions": [
            {
                "path": prediction.path,
                "top": [
                    {"label": predictor.label(index), "index": index, "probability": p} for index, p in prediction.top
                ],
            }
            for prediction in result.predictions
        ],
        "skipped": [{"path": path, "reason": reason} for path, reason in result.skipped],
    }
    return json.dumps(record, indent=2) + "\n"


def format_predictions(result: Predictions, predictor: Predictor, topk: int, suffix: str) -> str:
    return (to_json if suffix == ".json" else to_csv)(result, predictor, topk)


def write_predictions(result: Predictions, predictor: Predictor, topk: int, output: str | Path) -> None:
    """Write the predictions to ``output`` (replaced atomically) in the format of its suffix."""
    write_text(output, format_predictions(result, predictor, topk, output_format(output)))
