"""Robustness evaluation (Sec. 8.3.3): clean accuracy, white-box attacks (FGSM, L-inf PGD), common
corruptions (generated on the fly or an ImageNet-C folder) and the ImageNet-A / ImageNet-R 200-class
subsets. Their table (Table G.1) and Fig. 8.3 are `report`'s.

Everything works on pixels in [0, 1]: `PixelModel` wraps a classifier with its normalization, so
attacks and corruptions act on the image a camera would give, and attack budgets read as in the
paper, on the 0-255 scale (eps = 1 means one grey level). A batch source is any iterable of
(pixels, labels) pairs, re-iterable when it is used more than once.

Attack definitions (x: clean pixels, y: true labels, L: cross-entropy, clamp to [0, 1] each time):

- FGSM: x + eps * sign(grad_x L(x, y)).
- PGD: `steps` iterations of x_t + step_size * sign(grad L(x_t, y)), projected on the L-inf ball
  of radius eps around x. With `random_start` (on by default, as in foolbox's LinfPGD, the toolkit
  the paper used) x_0 is uniform in the ball; otherwise x_0 = x. The paper: eps = 1, 5 steps of 0.5.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.data import resolve_model_data_config
from torch import nn

from convbias.base.errors import ConfigError
from convbias.base.inputs import read_file

from .corruptions import CATEGORY_OF, CORRUPTIONS, SEVERITIES, corrupt

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]

PAPER_ATTACK = dict(eps=1.0, pgd_steps=5, pgd_step_size=0.5)  # Sec. 8.3.3, 0-255 scale


class PixelModel(nn.Module):
    """A classifier that takes pixels in [0, 1]: normalizes with (mean, std) then calls `model`."""

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    @classmethod
    def from_data_config(cls, model: nn.Module) -> PixelModel:
        """Wrap a timm model with the mean/std of its pretrained cfg (timm's data config), for
        models evaluated as timm ships them. Checkpoints from train.py were trained with the
        dataset's mean/std (engine.data.factory.DataBundle.mean/std): pass those to the constructor."""
        config = resolve_model_data_config(model)
        return cls(model, config["mean"], config["std"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model((pixels - self.mean) / self.std)


class Denormalized:
    """Re-iterable view of a loader of normalized images (as the engine's eval loader yields
    them) that gives [0, 1] pixel batches: images * std + mean."""

    def __init__(self, loader: Iterable, mean: Sequence[float], std: Sequence[float]):
        self.loader = loader
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def __iter__(self):
        for images, labels in self.loader:
            yield (images.float() * self.std + self.mean).clamp(0, 1), labels


# ---------------------------------------------------------------------------------------------
# Attacks (budgets in [0, 1] pixel units here; the evaluation functions take the 0-255 scale)
# ---------------------------------------------------------------------------------------------


def _input_gradient(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        pixels = pixels.detach().requires_grad_(True)
        loss = F.cross_entropy(model(pixels), labels)
        return torch.autograd.grad(loss, pixels)[0]


def fgsm(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    """Fast gradient sign method (Goodfellow et al., 2015), eps in [0, 1] pixel units."""
    step = eps * _input_gradient(model, pixels, labels).sign()
    return (pixels + step).clamp(0, 1).detach()


def pgd(
    model: nn.Module,
    pixels: torch.Tensor,
    labels: torch.Tensor,
    eps: float,
    step_size: float,
    steps: int,
    random_start: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """L-inf projected gradient descent (Madry et al., 2018), eps and step_size in [0, 1] units."""
    low, high = (pixels - eps).clamp(min=0), (pixels + eps).clamp(max=1)
    adversarial = pixels.detach().clone()
    if random_start:
        noise = torch.rand(pixels.shape, generator=generator).to(pixels) * 2 - 1
        adversarial = (adversarial + eps * noise).clamp(0, 1)
    for _ in range(steps):
        adversarial = adversarial + step_size * _input_gradient(model, adversarial, labels).sign()
        adversarial = torch.maximum(torch.minimum(adversarial, high), low)
    return adversarial.detach()


# ---------------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------------


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def correct(logits: torch.Tensor, labels: torch.Tensor, class_index: Sequence[int] | None = None) -> torch.Tensor:
    """Boolean top-1 hits. With `class_index`, label i of the dataset is logit class_index[i] of the
    model and the prediction is the argmax over those columns only (ImageNet-A/R: 200 of 1000)."""
    if class_index is not None:
        logits = logits[:, torch.as_tensor(class_index, device=logits.device)]
    return logits.argmax(1) == labels.to(logits.device)


def accuracy(model: nn.Module, batches: Batches, class_index: Sequence[int] | None = None) -> float:
    """Top-1 accuracy in percent of a PixelModel on (pixels, labels) batches."""
    model.eval()
    device, hits, total = _model_device(model), 0, 0
    with torch.no_grad():
        for pixels, labels in batches:
            hits += int(correct(model(pixels.to(device)), labels, class_index).sum())
            total += len(labels)
    return 100.0 * hits / max(total, 1)


def adversarial_accuracy(
    model: nn.Module,
    batches: Batches,
    eps: float = PAPER_ATTACK["eps"],
    pgd_steps: int = PAPER_ATTACK["pgd_steps"],
    pgd_step_size: float = PAPER_ATTACK["pgd_step_size"],
    random_start: bool = True,
    attacks: Sequence[str] = ("fgsm", "pgd"),
    seed: int = 0,
) -> dict[str, float]:
    """Top-1 accuracy (percent) on white-box adversarial examples of every image.

    eps and pgd_step_size are on the 0-255 pixel scale (Sec. 8.3.3: eps 1, 5 steps of 0.5).
    Returns {'FGSM': ..., 'PGD': ...} for the requested attacks.
    """
    unknown = set(attacks) - {"fgsm", "pgd"}
    if unknown:
        raise ConfigError(f"unknown attacks {sorted(unknown)}; expected fgsm and/or pgd")
    if eps < 0 or pgd_step_size < 0 or pgd_steps < 0:
        raise ConfigError(f"eps, PGD step size and steps must be >= 0, got {eps}, {pgd_step_size}, {pgd_steps}")
    model.eval()
    device = _model_device(model)
    generator = torch.Generator().manual_seed(seed)
    run: dict[str, Callable] = {}
    if "fgsm" in attacks:
        run["FGSM"] = lambda x, y: fgsm(model, x, y, eps / 255)
    if "pgd" in attacks:
        run["PGD"] = lambda x, y: pgd(model, x, y, eps / 255, pgd_step_size / 255, pgd_steps, random_start, generator)
    hits, total = dict.fromkeys(run, 0), 0
    for pixels, labels in batches:
        pixels, labels = pixels.to(device), labels.to(device)
        for name, attack in run.items():
            with torch.no_grad():
                hits[name] += int(correct(model(attack(pixels, labels)), labels).sum())
        total += len(labels)
    return {name: 100.0 * count / max(total, 1) for name, count in hits.items()}


def corruption_accuracy(
    models: Mapping[str, nn.Module],
    batches: Batches,
    corruptions: Sequence[str] = tuple(CORRUPTIONS),
    severities: Sequence[int] = SEVERITIES,
    seed: int = 0,
) -> list[dict]:
    """Top-1 accuracy (percent) of each model on every corruption and severity of the batches.

    Every model sees the same corrupted images (each batch is corrupted once, with a generator
    seeded by (seed, batch, corruption, severity)), so comparisons are paired. Returns rows
    {model, source='generated', corruption, category, severity, top1}.
    """
    for name in corruptions:
        if name not in CORRUPTIONS:
            raise ConfigError(f"unknown corruption {name!r}; expected some of {', '.join(CORRUPTIONS)}")
    for severity in severities:
        if severity not in SEVERITIES:
            raise ConfigError(f"severity must be in {SEVERITIES}, got {severity}")
    for model in models.values():
        model.eval()
    hits: dict[tuple, int] = defaultdict(int)
    total = 0
    with torch.no_grad():
        for batch_index, (pixels, labels) in enumerate(batches):
            for c_index, name in enumerate(corruptions):
                for severity in severities:
                    stream = ((seed * 100_003 + batch_index) * 101 + c_index) * 11 + severity
                    generator = torch.Generator().manual_seed(stream)
                    corrupted = corrupt(pixels, name, severity, generator)
                    for label, model in models.items():
                        logits = model(corrupted.to(_model_device(model)))
                        hits[label, name, severity] += int(correct(logits, labels).sum())
            total += len(labels)
    return [
        dict(
            model=label,
            source="generated",
            corruption=name,
            category=CATEGORY_OF[name],
            severity=severity,
            top1=100.0 * hits[label, name, severity] / max(total, 1),
        )
        for label in models
        for name in corruptions
        for severity in severities
    ]


# ---------------------------------------------------------------------------------------------
# Benchmark folders and class mapping
# ---------------------------------------------------------------------------------------------


def read_class_list(path: str | os.PathLike) -> list[str]:
    """Class names in logit order: the sorted sub-folder names of a folder (an ImageNet train
    folder gives the 1000 wnids in timm/torchvision order), or the lines of a text file (first
    token of each non-empty line, e.g. a wnid list)."""
    path = Path(path).expanduser()
    if path.is_dir():
        classes = sorted(entry.name for entry in path.iterdir() if entry.is_dir())
    elif path.is_file():
        try:
            text = read_file(path, "class list").decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(f"class list {path} is not UTF-8 text (byte {error.start})") from None
        classes = [line.split()[0] for line in text.splitlines() if line.strip()]
    else:
        raise ConfigError(f"class list {path} is neither a folder of class folders nor a text file")
    if not classes:
        raise ConfigError(f"class list {path} names no classes")
    return classes


def folder_classes(folder: str | os.PathLike) -> list[str]:
    """Sorted class folder names of an ImageFolder-style directory (torchvision's label order)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a directory")
    classes = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
    if not classes:
        raise ConfigError(f"{folder} holds no class folders (expected {folder}/<class>/<image>)")
    return classes


def class_index(folder: str | os.PathLike, classes: Sequence[str], model_classes: Sequence[str]) -> list[int]:
    """Logit index of each class of a dataset folder: the folder's label i is model logit
    class_index[i]. Raises ConfigError naming the folder and the classes the model does not have."""
    position = {name: i for i, name in enumerate(model_classes)}
    unmatched = [name for name in classes if name not in position]
    if unmatched:
        shown = ", ".join(unmatched[:10]) + (f" (+{len(unmatched) - 10} more)" if len(unmatched) > 10 else "")
        raise ConfigError(
            f"{folder}: {len(unmatched)} of {len(classes)} class folders are not classes of the "
            f"model ({len(model_classes)} classes, e.g. {', '.join(model_classes[:3])}): {shown}"
        )
    return [position[name] for name in classes]


def imagenet_c_folders(
    root: str | os.PathLike, corruptions: Sequence[str], severities: Sequence[int]
) -> dict[tuple[str, int], Path]:
    """The ROOT/<corruption>/<severity> folders of an ImageNet-C copy (also accepted: the
    corruption folders inside their category folder, ROOT/noise/gaussian_noise/...); ConfigError
    naming the missing ones."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(
            f"ImageNet-C folder {root} is not a directory (expected {root}/<corruption>/<severity>/<class>/<image>)"
        )

    def corruption_dir(name: str) -> Path:
        nested = root / CATEGORY_OF.get(name, "") / name
        return nested if not (root / name).is_dir() and nested.is_dir() else root / name

    folders = {
        (name, severity): corruption_dir(name) / str(severity) for name in corruptions for severity in severities
    }
    missing = [str(path) for path in folders.values() if not path.is_dir()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ConfigError(
            f"ImageNet-C folder {root} lacks {shown}; expected {root}/<corruption>/<severity>/<class>/<image> "
            f"(choose others with --corruptions/--severities)"
        )
    return folders


def folder_corruption_accuracy(
    models: Mapping[str, nn.Module], datasets: Mapping[tuple[str, int], tuple[Batches, Sequence[int]]]
) -> list[dict]:
    """Rows like `corruption_accuracy` for stored corrupted images: `datasets` maps
    (corruption, severity) to (batches, class_index)."""
    rows = []
    for (name, severity), (batches, index) in datasets.items():
        hits, total = dict.fromkeys(models, 0), 0
        with torch.no_grad():
            for pixels, labels in batches:
                for label, model in models.items():
                    model.eval()
                    hits[label] += int(correct(model(pixels.to(_model_device(model))), labels, index).sum())
                total += len(labels)
        rows += [
            dict(
                model=label,
                source="imagenet-c",
                corruption=name,
                category=CATEGORY_OF.get(name, "other"),
                severity=severity,
                top1=100.0 * hits[label] / max(total, 1),
            )
            for label in models
        ]
    return rows
