"""Robustness of trained models (Sec. 8.3.3, Table G.1, Fig. 8.3), end to end: the clean evaluation set, the
class maps of ImageNet-C/-A/-R folders and the models with their weights (`RobustnessStudy`, which raises on
bad input before anything is measured), then clean top-1, FGSM and PGD accuracy, common corruptions
(generated on the fly, or an ImageNet-C folder) and ImageNet-A/-R accuracy, written as a report (`evaluate`).
The measurements themselves are in `measure`, the tables in `report`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader

from convbias.base.storage import write_text
from convbias.base.weights import load_weights
from convbias.engine import (
    DATASETS,
    DEFAULT_WHICH,
    Config,
    ConfigError,
    ImageFolderDataset,
    RunDir,
    build_datasets,
    build_eval_loader,
    create_model,
)

from .corruptions import CORRUPTIONS, SEVERITIES
from .measure import (
    PAPER_ATTACK,
    Denormalized,
    PixelModel,
    accuracy,
    adversarial_accuracy,
    class_index,
    corruption_accuracy,
    folder_classes,
    folder_corruption_accuracy,
    imagenet_c_folders,
    read_class_list,
)
from .report import attack_settings, corruption_summary, write_report

IMAGENET_C_LAYOUT = "DIR/<corruption>/<severity>/<class>/<image>"
SUBSET_LAYOUT = "DIR/<wnid>/<image> (ImageNet-A/-R: 200 ImageNet class folders)"


@dataclass
class RobustnessOptions:
    """What to evaluate: models and weights, the clean set (as train.py), attacks, corruptions and folders.
    Attack budgets are on the 0-255 pixel scale; `eval_transform` holds a run's data options (crop_pct,
    interpolation, channels, mean/std, class map);
    a `*_label` names the weights in the table (a run's checkpoint with its epoch; default: the path); a
    `*_run` names the run they were chosen from (its verified point, or the next one if its training removes it)."""

    model: str
    checkpoint: str
    checkpoint_label: str | None = None
    checkpoint_run: str | None = None
    which: str = DEFAULT_WHICH  # the checkpoint of the runs (last, best, epoch_N)
    model_kwargs: dict = field(default_factory=dict)
    compare_model: str | None = None
    compare_checkpoint: str | None = None
    compare_checkpoint_label: str | None = None
    compare_checkpoint_run: str | None = None
    compare_model_kwargs: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)  # a run's model options besides its kwargs (--bn-eps, --gp)
    compare_model_options: dict = field(default_factory=dict)
    dataset: str = "digits"
    data_dir: str | None = None
    first_classes: int | None = None
    img_size: int | None = None  # None: the dataset's default
    eval_transform: dict = field(default_factory=dict)
    eps: float = PAPER_ATTACK["eps"]
    pgd_steps: int = PAPER_ATTACK["pgd_steps"]
    pgd_step_size: float = PAPER_ATTACK["pgd_step_size"]
    pgd_random_start: bool = True
    attacks: list[str] = field(default_factory=lambda: ["fgsm", "pgd"])
    corruptions: list[str] = field(default_factory=lambda: list(CORRUPTIONS))
    severities: list[int] = field(default_factory=lambda: list(SEVERITIES))
    imagenet_c: str | None = None
    imagenet_a: str | None = None
    imagenet_r: str | None = None
    imagenet_classes: str | None = None  # the model's classes in logit order (default: the dataset's)
    max_images: int | None = None  # a fixed random subset of N images per dataset
    batch_size: int = 64
    workers: int = 2
    seed: int = 0
    device: str = "cpu"
    output: str = "robustness"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _subset(dataset, max_images: int | None, seed: int):
    """A fixed random subset (folders are sorted by class, so the first N would be a few classes)."""
    if max_images is None or max_images >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:max_images]
    return dataset.subset(sorted(order.tolist()))


def _labels(options: RobustnessOptions) -> tuple[str, str | None]:
    """Table names of the two models, told apart by checkpoint when they are the same model."""
    main, other = options.model, options.compare_model
    if other == main:
        main, other = f"{main} ({Path(options.checkpoint).stem})", f"{other} ({Path(options.compare_checkpoint).stem})"
    if other == main:
        main = f"{options.model} ({options.checkpoint})"
        other = f"{options.compare_model} ({options.compare_checkpoint})"
    return main, other


class RobustnessStudy:
    """Everything checked before the evaluation starts: data, class maps, models."""

    def __init__(self, options: RobustnessOptions):
        self.options = options
        self.img_size = options.img_size or DATASETS[options.dataset].default_img_size
        self.bundle = bundle = build_datasets(
            Config(
                model=options.model,
                dataset=options.dataset,
                data_dir=options.data_dir,
                first_classes=options.first_classes,
                img_size=self.img_size,
                seed=options.seed,
                no_aug=True,
                **options.eval_transform,
            )
        )
        model_classes = read_class_list(options.imagenet_classes) if options.imagenet_classes else bundle.class_names
        if len(model_classes) != bundle.num_classes:
            raise ConfigError(
                f"--imagenet-classes {options.imagenet_classes} names {len(model_classes)} classes, "
                f"the model has {bundle.num_classes} (--dataset {options.dataset})"
            )
        self.subsets = {
            column: (Path(root), class_index(root, folder_classes(root), model_classes))
            for column, root in (("A", options.imagenet_a), ("R", options.imagenet_r))
            if root
        }
        self.c_folders = {}
        if options.imagenet_c:
            for key, folder in imagenet_c_folders(options.imagenet_c, options.corruptions, options.severities).items():
                self.c_folders[key] = (folder, class_index(folder, folder_classes(folder), model_classes))
        label, self.baseline = _labels(options)
        sides = [(label, "")] + ([(self.baseline, "compare_")] if options.compare_model else [])
        self.models, self.checkpoints = {}, {}
        for name, side in sides:
            self.models[name], self.checkpoints[name] = self._model(
                *(
                    getattr(options, side + key)
                    for key in ("model", "checkpoint", "checkpoint_label", "checkpoint_run")
                ),
                getattr(options, side + "model_kwargs"),
                getattr(options, side + "model_options"),
            )

    def _model(
        self, name: str, checkpoint: str, label: str | None, run: str | None, kwargs: dict, model_options: dict
    ) -> tuple[torch.nn.Module, str]:
        """The model in pixels, with its weights and how the table names them: a run's verified point (the next
        one when its training removes the chosen one meanwhile), else the weights file."""
        # no stochastic depth at evaluation (and a model without residual branches takes none)
        cfg = Config(model=name, model_kwargs=kwargs, img_size=self.img_size, drop_path=0.0, **model_options)
        model = create_model(cfg, cfg.num_classes or self.bundle.num_classes, self.bundle.in_chans)
        if run is None:
            load_weights(model, checkpoint)
        else:
            label = RunDir(run).load_weights(model, self.options.which).describe()
        pixels = PixelModel(model, self.bundle.mean, self.bundle.std).to(self.options.device).eval()
        return pixels, label or checkpoint

    def folder(self, root: Path, layout: str, transform) -> DataLoader:
        dataset = _subset(ImageFolderDataset.scan(root, layout), self.options.max_images, self.options.seed)
        dataset.transform = transform
        return build_eval_loader(dataset, self.options.batch_size, self.options.workers)


def evaluate(
    study: RobustnessStudy,
    settings: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] = _stderr,
) -> dict:
    """Run every evaluation and write the report to options.output: robustness.csv/.md, corruptions.csv,
    corruption_errors.csv, improvement.png (with a compared model) and robustness.json, whose settings are
    `settings` (default: the options) with the image size used. Returns {'table', 'corruptions', 'files'}."""
    options, bundle, models = study.options, study.bundle, study.models
    val = _subset(bundle.val, options.max_images, options.seed)
    clean = Denormalized(build_eval_loader(val, options.batch_size, options.workers), bundle.mean, bundle.std)
    table = []
    for name, model in models.items():
        progress(
            f"{name}: clean accuracy"
            + (f" and {', '.join(options.attacks).upper()}" if options.attacks else "")
            + f" on {len(val)} images"
        )
        row = dict(
            model=name,
            checkpoint=study.checkpoints[name],
            img_size=study.img_size,
            params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            clean=accuracy(model, clean),
        )
        if options.attacks:
            row.update(
                attack_settings(
                    options.eps, options.attacks, options.pgd_steps, options.pgd_step_size, options.pgd_random_start
                )
            )
            row.update(
                adversarial_accuracy(
                    model,
                    clean,
                    options.eps,
                    options.pgd_steps,
                    options.pgd_step_size,
                    options.pgd_random_start,
                    options.attacks,
                    options.seed,
                )
            )
        table.append(row)

    # a partial (not a lambda) pickles into DataLoader workers under any start method
    to_mode = partial(Image.Image.convert, mode="L" if bundle.in_chans == 1 else "RGB")
    corruption_rows = []
    if study.c_folders:  # used at their stored resolution (224 for ImageNet-C), as in the paper
        stored = T.Compose([to_mode, T.ToTensor()])
        corruption_rows = folder_corruption_accuracy(
            models,
            {
                key: (study.folder(folder, IMAGENET_C_LAYOUT, stored), index)
                for key, (folder, index) in study.c_folders.items()
            },
        )
    elif options.corruptions:
        progress(f"{len(options.corruptions)} corruptions x {len(options.severities)} severities on {len(val)} images")
        corruption_rows = corruption_accuracy(models, clean, options.corruptions, options.severities, options.seed)
    for column, (root, index) in study.subsets.items():
        loader = study.folder(root, SUBSET_LAYOUT, T.Compose([to_mode, bundle.val.transform]))
        pixels = Denormalized(loader, bundle.mean, bundle.std)
        for row in table:
            row[column] = accuracy(models[row["model"]], pixels, index)
    for row in table:
        if corruption_rows:
            row["C"] = corruption_summary(corruption_rows, row["model"])

    files = write_report(table, corruption_rows, options.output, baseline=study.baseline)
    settings = dict(
        asdict(options) if settings is None else settings,
        img_size=study.img_size,
        c_source="imagenet-c" if study.c_folders else "generated",
    )
    write_text(
        Path(options.output) / "robustness.json",
        json.dumps(dict(settings=settings, table=table, corruptions=corruption_rows), indent=1, default=str),
    )
    return dict(table=table, corruptions=corruption_rows, files=files)
