"""Robustness of a trained model (Sec. 8.3.3, Table G.1, Fig. 8.3): clean top-1, FGSM and PGD
accuracy, common corruptions (generated on the fly, or an ImageNet-C folder), ImageNet-A/-R.

    convbias-robustness --model tcnn_resnet50 --checkpoint RUN/checkpoints/best.safetensors \\
        --dataset imagenet --data-dir /data/imagenet \\
        --imagenet-c /data/imagenet-c --imagenet-a /data/imagenet-a --imagenet-r /data/imagenet-r \\
        --compare-model resnet50 --compare-checkpoint CNN.safetensors --output robustness/

Writes OUTPUT/robustness.csv and .md (one row per model: clean, C, A, R, FGSM, PGD),
corruptions.csv (top-1 per corruption and severity), corruption_errors.csv (CE per category) and,
with --compare-model, improvement.png (Fig. 8.3: gain of --model over the compared model).
Bad input prints one `error: ...` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader

from convbias.engine import (
    DATASETS,
    DEFAULT_WHICH,
    WHICH,
    ConfigError,
    ImageFolderDataset,
    OptionParser,
    build_datasets,
    build_eval_loader,
    check_model_name,
    choose_checkpoint,
    create_model,
    is_run_dir,
    key_value,
    run_options,
)
from convbias.evaluation.corruptions import CORRUPTIONS, SEVERITIES
from convbias.evaluation.robustness import (
    PAPER_ATTACK,
    TABLE_COLUMNS,
    Denormalized,
    PixelModel,
    accuracy,
    adversarial_accuracy,
    class_index,
    corruption_accuracy,
    corruption_summary,
    folder_classes,
    folder_corruption_accuracy,
    imagenet_c_folders,
    markdown_table,
    read_class_list,
    write_report,
)
from convbias.families import load_families
from convbias.weights import load_weights

DATASET_CHOICES = ("digits", "cifar10", "cifar100", "imagenet", "folder")
IMAGENET_C_LAYOUT = "DIR/<corruption>/<severity>/<class>/<image>"
SUBSET_LAYOUT = "DIR/<wnid>/<image> (ImageNet-A/-R: 200 ImageNet class folders)"


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="weights: a train.py run folder (its config.yaml gives --model, "
        "--model-kwargs, --dataset, --data-dir, --num-classes, --img-size unless given), a checkpoint "
        "folder or a safetensors / state-dict file",
    )
    p.add_argument("--which", choices=WHICH, default=DEFAULT_WHICH, help="checkpoint of a run folder")
    p.add_argument("--model", help="timm model name (any registered name); default: the run folder's")
    p.add_argument(
        "--model-kwargs", nargs="*", type=key_value, default=[], metavar="K=V", help="extra timm.create_model arguments"
    )
    p.add_argument("--compare-model", help="baseline model for the comparison (e.g. the CNN of a T-CNN)")
    p.add_argument("--compare-checkpoint", help="weights of --compare-model (same forms as --checkpoint)")
    p.add_argument("--compare-model-kwargs", nargs="*", type=key_value, default=[], metavar="K=V")
    p.add_argument(
        "--dataset",
        choices=DATASET_CHOICES,
        help="clean evaluation set (as train.py); default: the run folder's, else digits",
    )
    p.add_argument("--data-dir", help="dataset folder (as train.py)")
    p.add_argument("--num-classes", type=int, help="first N classes only (as train.py)")
    p.add_argument("--img-size", type=int, help="evaluation resolution (None: the dataset's default)")
    p.add_argument("--eps", type=float, default=PAPER_ATTACK["eps"], help="attack budget, 0-255 pixel scale")
    p.add_argument("--pgd-steps", type=int, default=PAPER_ATTACK["pgd_steps"])
    p.add_argument("--pgd-step-size", type=float, default=PAPER_ATTACK["pgd_step_size"], help="0-255 pixel scale")
    p.add_argument(
        "--pgd-random-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start PGD at a uniform point of the eps-ball (foolbox default)",
    )
    p.add_argument("--attacks", nargs="+", default=["fgsm", "pgd"], choices=["fgsm", "pgd", "none"])
    p.add_argument(
        "--corruptions",
        nargs="+",
        default=["all"],
        metavar="NAME",
        help=f"'all', 'none' or some of: {', '.join(CORRUPTIONS)}",
    )
    p.add_argument("--severities", nargs="+", type=int, default=list(SEVERITIES))
    p.add_argument(
        "--imagenet-c", metavar="DIR", help=f"ImageNet-C copy, {IMAGENET_C_LAYOUT}; replaces the generated corruptions"
    )
    p.add_argument("--imagenet-a", metavar="DIR", help=SUBSET_LAYOUT)
    p.add_argument("--imagenet-r", metavar="DIR", help=SUBSET_LAYOUT)
    p.add_argument(
        "--imagenet-classes",
        metavar="PATH",
        help="the model's classes in logit order, for the -C/-A/-R folders: an ImageNet train "
        "folder (sorted wnid folders) or a wnid list file; default: the --dataset classes",
    )
    p.add_argument("--max-images", type=int, help="evaluate on a fixed random subset of N images per dataset")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="subset, corruption and PGD randomness")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--output", default="robustness", help="output folder")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check everything that needs no data or model."""
    args = build_parser().parse_args(argv)
    if args.eps < 0 or args.pgd_step_size <= 0 or args.pgd_steps < 1:
        raise ConfigError(
            f"--eps must be >= 0, --pgd-step-size > 0 and --pgd-steps >= 1 "
            f"(got {args.eps}, {args.pgd_step_size}, {args.pgd_steps})"
        )
    if args.max_images is not None and args.max_images < 1:
        raise ConfigError(f"--max-images must be >= 1, got {args.max_images}")
    if args.batch_size < 1 or args.workers < 0:
        raise ConfigError(f"--batch-size must be >= 1 and --workers >= 0 (got {args.batch_size}, {args.workers})")
    args.attacks = [] if "none" in args.attacks else list(dict.fromkeys(args.attacks))
    if args.corruptions == ["all"]:
        args.corruptions = list(CORRUPTIONS)
    elif args.corruptions == ["none"]:
        args.corruptions = []
    else:
        unknown = [name for name in args.corruptions if name not in CORRUPTIONS]
        if unknown:
            raise ConfigError(
                f"--corruptions: unknown {', '.join(unknown)}; expected 'all', 'none' or some of "
                f"{', '.join(CORRUPTIONS)}"
            )
    bad = [s for s in args.severities if s not in SEVERITIES]
    if bad:
        raise ConfigError(f"--severities must be in {list(SEVERITIES)}, got {bad}")
    if bool(args.compare_model) != bool(args.compare_checkpoint):
        raise ConfigError("--compare-model and --compare-checkpoint go together")
    for option, path in (("--checkpoint", args.checkpoint), ("--compare-checkpoint", args.compare_checkpoint)):
        if path and not Path(path).exists():
            raise ConfigError(f"{option} {path} does not exist")
    for option, path in (("--imagenet-a", args.imagenet_a), ("--imagenet-r", args.imagenet_r)):
        if path and not Path(path).is_dir():
            raise ConfigError(f"{option} {path} is not a directory; expected {SUBSET_LAYOUT}")
    if args.imagenet_c and not args.corruptions:
        raise ConfigError("--imagenet-c given with --corruptions none")
    args.model_kwargs, args.compare_model_kwargs = dict(args.model_kwargs), dict(args.compare_model_kwargs)
    _take_run_options(args)
    if args.model is None:
        raise ConfigError(f"--checkpoint {args.checkpoint} is not a run folder: pass --model NAME")
    args.dataset = args.dataset or "digits"
    load_families()
    for option, name in (("--model", args.model), ("--compare-model", args.compare_model)):
        if name:
            check_model_name(name, option)
    return args


RUN_OPTIONS = ("model", "dataset", "data_dir", "num_classes", "img_size")


def _take_run_options(args: argparse.Namespace) -> None:
    """--checkpoint / --compare-checkpoint naming train.py runs: their config.yaml fills the options not given,
    and --which picks their checkpoint (named on stderr with its epoch)."""
    for option, model_key in (("checkpoint", "model"), ("compare_checkpoint", "compare_model")):
        run = getattr(args, option)
        if not run or not is_run_dir(run):
            continue
        options = run_options(run)
        kwargs_key = f"{model_key}_kwargs"
        setattr(args, kwargs_key, {**(options.get("model_kwargs") or {}), **getattr(args, kwargs_key)})
        if getattr(args, model_key) is None:
            setattr(args, model_key, options.get("model"))
        if option == "checkpoint":
            for key in RUN_OPTIONS[1:]:
                if getattr(args, key) is None:
                    setattr(args, key, options.get(key))
            # the run's evaluation transform, so that clean accuracy is the run's own top-1
            args.eval_transform = {key: options[key] for key in ("crop_pct", "interpolation") if key in options}
        chosen = choose_checkpoint(run, args.which)
        setattr(args, option, str(chosen.weights))
        print(f"{getattr(args, model_key)}: {chosen.describe()}", file=sys.stderr)


def _stage(message: str) -> None:
    """Progress of a long evaluation, one line per stage on stderr."""
    print(message, file=sys.stderr, flush=True)


def _subset(dataset, max_images: int | None, seed: int):
    """A fixed random subset (folders are sorted by class, so the first N would be a few classes)."""
    if max_images is None or max_images >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:max_images]
    return dataset.subset(sorted(order.tolist()))


def _labels(args) -> tuple[str, str | None]:
    main, other = args.model, args.compare_model
    if other == main:
        main, other = f"{main} ({Path(args.checkpoint).stem})", f"{other} ({Path(args.compare_checkpoint).stem})"
    if other == main:
        main, other = f"{args.model} ({args.checkpoint})", f"{args.compare_model} ({args.compare_checkpoint})"
    return main, other


class Setup:
    """Everything checked before the evaluation starts: options, data, class maps, models."""

    def __init__(self, argv: list[str] | None):
        args = self.args = parse_args(argv)
        args.img_size = args.img_size or DATASETS[args.dataset].default_img_size
        self.bundle = bundle = build_datasets(
            dict(
                dataset=args.dataset,
                data_dir=args.data_dir,
                num_classes=args.num_classes,
                img_size=args.img_size,
                seed=args.seed,
                no_aug=True,
                **getattr(args, "eval_transform", {}),
            )
        )
        model_classes = read_class_list(args.imagenet_classes) if args.imagenet_classes else bundle.class_names
        if len(model_classes) != bundle.num_classes:
            raise ConfigError(
                f"--imagenet-classes {args.imagenet_classes} names {len(model_classes)} classes, "
                f"the model has {bundle.num_classes} (--dataset {args.dataset})"
            )
        self.subsets = {
            column: (Path(root), class_index(root, folder_classes(root), model_classes))
            for column, root in (("A", args.imagenet_a), ("R", args.imagenet_r))
            if root
        }
        self.c_folders = {}
        if args.imagenet_c:
            for key, folder in imagenet_c_folders(args.imagenet_c, args.corruptions, args.severities).items():
                self.c_folders[key] = (folder, class_index(folder, folder_classes(folder), model_classes))
        label, self.baseline = _labels(args)
        self.models = {label: self._model(args.model, args.checkpoint, args.model_kwargs)}
        self.checkpoints = {label: args.checkpoint}
        if args.compare_model:
            self.models[self.baseline] = self._model(
                args.compare_model, args.compare_checkpoint, args.compare_model_kwargs
            )
            self.checkpoints[self.baseline] = args.compare_checkpoint

    def _model(self, name: str, checkpoint: str, kwargs: dict) -> torch.nn.Module:
        cfg = dict(model=name, model_kwargs=kwargs, img_size=self.args.img_size)
        model = create_model(cfg, self.bundle.num_classes, self.bundle.in_chans)
        load_weights(model, checkpoint)
        return PixelModel(model, self.bundle.mean, self.bundle.std).to(self.args.device).eval()

    def folder(self, root: Path, layout: str, transform) -> DataLoader:
        dataset = _subset(ImageFolderDataset.scan(root, layout), self.args.max_images, self.args.seed)
        dataset.transform = transform
        return build_eval_loader(dataset, self.args.batch_size, self.args.workers)


def evaluate(setup: Setup) -> dict:
    """Run every evaluation, write the report; returns {'table', 'corruptions', 'files'}."""
    args, bundle, models = setup.args, setup.bundle, setup.models
    val = _subset(bundle.val, args.max_images, args.seed)
    clean = Denormalized(build_eval_loader(val, args.batch_size, args.workers), bundle.mean, bundle.std)
    table = []
    for name, model in models.items():
        _stage(
            f"{name}: clean accuracy"
            + (f" and {', '.join(args.attacks).upper()}" if args.attacks else "")
            + f" on {len(val)} images"
        )
        row = dict(
            model=name,
            checkpoint=setup.checkpoints[name],
            img_size=args.img_size,
            params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            clean=accuracy(model, clean),
        )
        if args.attacks:
            row.update(
                adversarial_accuracy(
                    model,
                    clean,
                    args.eps,
                    args.pgd_steps,
                    args.pgd_step_size,
                    args.pgd_random_start,
                    args.attacks,
                    args.seed,
                )
            )
        table.append(row)

    # a partial (not a lambda) pickles into DataLoader workers under any start method
    to_mode = partial(Image.Image.convert, mode="L" if bundle.in_chans == 1 else "RGB")
    corruption_rows = []
    if setup.c_folders:  # used at their stored resolution (224 for ImageNet-C), as in the paper
        stored = T.Compose([to_mode, T.ToTensor()])
        corruption_rows = folder_corruption_accuracy(
            models,
            {
                key: (setup.folder(folder, IMAGENET_C_LAYOUT, stored), index)
                for key, (folder, index) in setup.c_folders.items()
            },
        )
    elif args.corruptions:
        _stage(f"{len(args.corruptions)} corruptions x {len(args.severities)} severities on {len(val)} images")
        corruption_rows = corruption_accuracy(models, clean, args.corruptions, args.severities, args.seed)
    for column, (root, index) in setup.subsets.items():
        loader = setup.folder(root, SUBSET_LAYOUT, T.Compose([to_mode, bundle.val.transform]))
        pixels = Denormalized(loader, bundle.mean, bundle.std)
        for row in table:
            row[column] = accuracy(models[row["model"]], pixels, index)
    for row in table:
        if corruption_rows:
            row["C"] = corruption_summary(corruption_rows, row["model"])

    files = write_report(table, corruption_rows, args.output, baseline=setup.baseline)
    settings = dict(vars(args), c_source="imagenet-c" if setup.c_folders else "generated")
    (Path(args.output) / "robustness.json").write_text(
        json.dumps(dict(settings=settings, table=table, corruptions=corruption_rows), indent=1, default=str)
    )
    print(markdown_table(table, TABLE_COLUMNS), end="")
    print("wrote " + ", ".join(str(path) for path in files.values()))
    return dict(table=table, corruptions=corruption_rows, files=files)


def main(argv: list[str] | None = None) -> int:
    try:
        setup = Setup(argv)
    except (ValueError, FileNotFoundError) as error:  # options, engine ConfigError, data, class maps, weights
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    evaluate(setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
