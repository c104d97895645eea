"""A run directory as a model anyone can load: timm's Hub folder, a model card, deployment exports, upload.

`export_run(RUN, OUT)` writes what `timm.save_for_hf` writes (`model.safetensors`, `config.json` with the
model's reconstruction arguments in `model_args` and the run's preprocessing in `pretrained_cfg`), a
`README.md` model card in the Hub's format (YAML front matter, then architecture, recipe, results, usage),
and the run's own `config.yaml` and `results.json` beside them. The folder loads with
`timm.create_model('local-dir:OUT', pretrained=True)` once the family is imported (`import transformed_cnn`);
pushed to the Hub, with `'hf-hub:USER/REPO'`. The deployment exports (`model.onnx`, `model.pt2`) are
`convbias.sharing.deploy`'s. What a family adds (its Hub tag, the model a reparametrized run is exported as)
comes from its record, in the loaded families (`convbias.families.Families`) the command passes in: this module
names no family and registers none.

A run reparametrized during training (`--reparametrize tcnn`) is exported as the registered model its family
names for it (the `tcnn_<resnet>` entry its weights belong to), with the reparametrization's options as that
model's arguments (the transform options). An `--output-scale` run is refused: its model is a wrapper
(alpha (f - f_0)) that timm's registry does not build; so is a run with `--bn-eps`, set on the BatchNorm layers
after construction where config.json cannot record it.

The run is read through ``RunDir``: its weights are checked against their manifest before use (a damaged
file is a DamagedCheckpointError naming it, exit 65). Every refusal is a ConfigError with one line, raised
before anything is written. The folder is written under a hidden temporary name (``staged_directory``) and
renamed into place, so an interrupted export leaves no half folder (a killed one's is removed by the next
export to the same path); a write that fails (disk full, read-only) is one StorageError line naming the file
(exit 74), with nothing left at --output.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from importlib import metadata
from itertools import takewhile
from pathlib import Path
from typing import Any

import timm
import torch
import yaml
from huggingface_hub import HfApi
from huggingface_hub.constants import SAFETENSORS_SINGLE_FILE
from huggingface_hub.errors import OfflineModeIsEnabled
from timm.models import model_entrypoint

from convbias.base.errors import DamagedInputError
from convbias.base.inputs import read_file
from convbias.base.run_layout import CONFIG_FILE, LOG_FILE, RESULTS_FILE, TIMM_ARGS_FILE
from convbias.base.storage import file_system, staged_directory, storage_reason
from convbias.base.tables import markdown_table
from convbias.engine import (
    WRITE_ERRORS,
    Config,
    ConfigError,
    RunCheckpoint,
    RunDir,
    StorageError,
    build_datasets,
    check_model_name,
    check_which,
    create_model,
    create_timm_model,
    input_format,
    read_log,
    read_timm_checkpoint,
    run_model_spec,
    timm_class_names,
    timm_data_config,
)
from convbias.families import Families
from convbias.sharing.deploy import (
    DEPLOY_FORMATS,
    PACKAGE,
    check_onnx_installed,
    deploy_input,
    export_onnx,
    export_program,
)
from convbias.sharing.prediction import describe_input

DEFAULT_LICENSE = "apache-2.0"
# The recipe fields a model card lists (the whole config.yaml is in the folder too).
RECIPE_KEYS = (
    "model",
    "model_kwargs",
    "pretrained",
    "dataset",
    "train_fraction",
    "img_size",
    "epochs",
    "batch_size",
    "opt",
    "lr",
    "weight_decay",
    "sched",
    "warmup_epochs",
    "drop_path",
    "smoothing",
    "mixup",
    "cutmix",
    "aa",
    "reprob",
    "param_group_lr",
    "reparametrize",
    "reparametrize_at_epoch",
    "reparametrize_kwargs",
    "model_ema",
    "seed",
)
RUN_FILES = (CONFIG_FILE, RESULTS_FILE)  # the run's own files, beside the card
# Options naming a file or folder of the machine that trained the run (train.py's, and timm's args.yaml keys):
# an exported folder leaves them out, as the model kwargs that only say where initial weights came from
MACHINE_PATH_OPTIONS = ("output", "data_dir", "data", "resume", "checkpoint", "eval_only", "pretrained_file",
                        "pretrained_path", "initial_checkpoint", "class_map", "distill_teacher_file", "config")  # fmt: skip
KWARG_OPTIONS = ("model_kwargs", "reparametrize_kwargs")
# The work a card cites: the thesis (its chapter per family) and the ConViT paper
CITATIONS = (
    "S. d'Ascoli, *Overparametrization, Architectures and Dynamics of Deep Neural Networks: from Theory to "
    "Practice*, PhD thesis, Université PSL, 2022; Part II, *From Architectural Constraints to Inductive Biases* "
    "(chapter 6: eFCNs, chapter 7: ConViT, chapter 8: Transformed CNNs).",
    "S. d'Ascoli, H. Touvron, M. L. Leavitt, A. S. Morcos, G. Biroli, L. Sagun, *ConViT: Improving Vision "
    "Transformers with Soft Convolutional Inductive Biases*, ICML 2021.",
)
# pretrained_cfg fields that describe timm's published weights of the architecture, not a run's
SOURCE_FIELDS = (
    "tag",
    "url",
    "hf_hub_id",
    "file",
    "source",
    "license",
    "origin_url",
    "paper_ids",
    "paper_name",
    "notes",
)


def _family(model_name: str) -> str:
    """The package that registered the model (timm for timm's own): what a model card imports."""
    return model_entrypoint(model_name).__module__.split(".")[0]


def run_model(
    run: str | Path | RunDir, families: Families, which: str = "last"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The run's model (eval mode, the checkpoint's verified weights) built through timm's registry (the
    ``families`` loaded: their models registered, the model a reparametrized run is exported as named), and
    what was used to build it: name, kwargs, checkpoint, config, data options. ConfigError (one line) for
    what cannot be exported, DamagedCheckpointError naming a weights file that fails its manifest."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    config = run.config
    if config.get("output_scale") is not None:
        raise ConfigError(
            f"{run.path} was trained with --output-scale {config['output_scale']}: its model is a wrapper "
            "(alpha (f - f_0)) that timm's registry cannot rebuild; export a run without it"
        )
    if config.get("bn_eps") is not None:  # --bn-momentum acts in training only: the exported model is the same
        raise ConfigError(
            f"{run.path} was trained with --bn-eps {config['bn_eps']}, set on its BatchNorm layers after "
            "construction: timm's config.json cannot record it, so the exported model would normalize with another "
            "eps; export a run without it"
        )
    spec = run_model_spec(run, which)  # refuses a run without that checkpoint; verifies its weights
    initialization = families.initialization_kwargs  # the checkpoint's weights replace them (a file that may be gone)
    name = spec["model"]
    model_kwargs = {key: value for key, value in spec["model_kwargs"].items() if key not in initialization}
    try:
        check_model_name(name, option=f"{run.path / CONFIG_FILE} model")
    except ConfigError as error:
        raise ConfigError(f"{error} (is its family imported? convbias.families.load_families())") from None
    if spec["reparametrized"]:
        exported = families.export_name(config.get("reparametrize"), name)
        if exported is None or not timm.is_model(exported):
            raise ConfigError(
                f"{spec['checkpoint'].describe()} holds {name} reparametrized with "
                f"{config.get('reparametrize')!r}, which no registered model builds"
            )
        name, model_kwargs = exported, {**model_kwargs, **(config.get("reparametrize_kwargs") or {})}
    build = Config.from_dict(config).replace(
        model=name,
        model_kwargs=model_kwargs,
        pretrained=False,  # the checkpoint holds every weight; a pretrained file may be gone
        pretrained_file=None,
    )
    model = create_model(build, spec["num_classes"], spec["in_chans"])
    checkpoint = run.load_weights(model, which)  # the next verified point, if the run removed this one meanwhile
    return model.eval(), {
        **spec,
        "checkpoint": checkpoint,
        "model": name,
        "model_kwargs": model_kwargs,
        "config": config,
    }


def data_config(config: dict[str, Any], in_chans: int, img_size: int | None) -> dict[str, Any]:
    """The run's evaluation preprocessing, as timm's pretrained_cfg holds it (its --mean/--std, else its
    dataset's statistics for its channels)."""
    shape = input_format(Config.from_dict(config).replace(in_chans=in_chans, img_size=img_size))
    return dict(
        input_size=(shape.in_chans, shape.img_size, shape.img_size),
        mean=shape.mean,
        std=shape.std,
        crop_pct=config.get("crop_pct"),
        interpolation=config.get("interpolation"),
    )


def _class_names(config: dict[str, Any]) -> list[str] | None:
    """The dataset's class names when it can be read here (None otherwise: the card says so)."""
    try:
        return [str(name) for name in build_datasets(Config.from_dict(config)).class_names]
    except (ValueError, OSError):
        return None


def _top(record: dict[str, Any], prefix: str) -> dict[str, float]:
    values = {"top1": record.get(f"{prefix}_top1"), "top5": record.get(f"{prefix}_top5")}
    return {key: float(value) for key, value in values.items() if value is not None}


def run_metrics(run: RunDir, checkpoint: RunCheckpoint) -> dict[str, float]:
    """top-1/top-5 of the exported checkpoint. results.json holds them when it describes that point: its
    best_* for the best point, its final_* only while it matches the newest point (a run extended after it
    was written has newer weights); otherwise the evaluation logged at the checkpoint's epoch (none for a
    mid-epoch point). DamagedCheckpointError naming results.json when it cannot be read."""
    results = run.results()
    if results is not None and checkpoint.which == "best" and results.get("best_epoch") == checkpoint.epoch:
        return _top(results, "best")
    if checkpoint.which == "last" and run.current_results() is not None:
        return _top(results, "final")
    if checkpoint.step:
        return {}
    records, _dropped = read_log(run.path / LOG_FILE)
    for record in reversed(records):
        if record["epoch"] == checkpoint.epoch and record.get("eval_top1") is not None:
            return _top(record, "eval")
    return {}


def portable_options(options: dict[str, Any], initialization: frozenset[str]) -> tuple[dict[str, Any], list[str]]:
    """A run's options (its config.yaml, or timm's args.yaml) as an exported folder holds them: the options naming
    a file or folder of the machine that trained it emptied (`MACHINE_PATH_OPTIONS`), the model kwargs that only
    say where initial weights came from dropped (``initialization``: the families' `initialization_kwargs`); and
    what was left out."""
    kept, left_out = dict(options), []
    for name in MACHINE_PATH_OPTIONS:
        if isinstance(kept.get(name), str) and kept[name] not in ("", "auto"):
            kept[name] = None
            left_out.append(name)
    for name in KWARG_OPTIONS:
        kwargs = kept.get(name)
        if isinstance(kwargs, dict) and initialization & set(kwargs):
            kept[name] = {key: value for key, value in kwargs.items() if key not in initialization}
            left_out += [f"{name}.{key}" for key in sorted(initialization & set(kwargs))]
    return kept, left_out


def portable_run_config(run: RunDir, initialization: frozenset[str]) -> tuple[str, list[str]]:
    """The run's config.yaml as an exported folder holds it (`portable_options`): its comment lines (the derived
    values), then the options; and what was left out."""
    text = read_file(run.path / CONFIG_FILE, "run config", DamagedInputError).decode("utf-8", "replace")
    comments = "".join(line + "\n" for line in takewhile(lambda line: line.startswith("#"), text.splitlines()))
    options, left_out = portable_options(run.config, initialization)
    return comments + yaml.safe_dump(options, sort_keys=False), left_out


def _provenance() -> dict[str, str]:
    """Package version and the commit of its source tree (when it is a git checkout)."""
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    source = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown (not a git checkout)"
    return {"version": version, "commit": commit, "timm": timm.__version__, "torch": torch.__version__}


def _card_top(front: dict[str, Any], name: str) -> list[str]:
    """A model card's first lines: its YAML front matter (the Hub reads it) and its title."""
    return ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", f"# Model card for {name}"]


def _front_matter(name: str, tag: str, dataset: str, metrics: dict[str, float], license: str) -> dict[str, Any]:
    """The card's YAML header: what the Hub indexes (library, license, tags, dataset) and the run's top-k as a
    model-index, so the Hub shows the accuracy beside the model."""
    front = {
        "library_name": "timm",
        "license": license,
        "tags": ["image-classification", "timm", tag],
        "datasets": [dataset],
        "metrics": ["accuracy"],
        "pipeline_tag": "image-classification",
    }
    if metrics:
        front["model-index"] = [
            {
                "name": name,
                "results": [
                    {
                        "task": {"type": "image-classification", "name": "Image Classification"},
                        "dataset": {"name": dataset, "type": dataset, "split": "validation"},
                        "metrics": [
                            {"type": "accuracy", "name": f"top-{k[3:]}", "value": round(v, 4)}
                            for k, v in metrics.items()
                        ],
                    }
                ],
            }
        ]
    return front


def _results_table(checkpoint: RunCheckpoint, dataset: str, metrics: dict[str, float]) -> str:
    """The card's results: the exported checkpoint's top-1 and top-5, or "not recorded" for what the run lacks."""
    return markdown_table(
        ["checkpoint", "epoch", "dataset (validation)", "top-1 (%)", "top-5 (%)"],
        [
            [
                checkpoint.which,
                checkpoint.epoch if checkpoint.epoch is not None else "?",
                dataset,
                f"{metrics['top1']:.2f}" if "top1" in metrics else "not recorded",
                f"{metrics['top5']:.2f}" if "top5" in metrics else "not recorded",
            ]
        ],
    )


def model_card(
    model: torch.nn.Module,
    info: dict[str, Any],
    metrics: dict[str, float],
    exported: dict[str, Any],
    families: Families,
    license: str = DEFAULT_LICENSE,
    repo_id: str | None = None,
) -> str:
    """README.md in the Hub's format: YAML front matter (library, license, tags, datasets, metrics as a
    model-index with the run's top-1), then the architecture, the recipe, the results and how to load it; the tag
    and the kwargs left out are the ``families``'."""
    config, name, checkpoint = info["config"], info["model"], info["checkpoint"]
    family = _family(name)
    dataset = str(config["dataset"])
    front = _front_matter(name, families.hub_tag(family), dataset, metrics, license)
    args = exported["model_args"]
    params = sum(p.numel() for p in model.parameters())
    cfg = exported["pretrained_cfg"]
    options = portable_options(config, families.initialization_kwargs)[0]  # without the machine's paths, as config.yaml
    recipe = [(key, json.dumps(options[key])) for key in RECIPE_KEYS if options.get(key) not in (None, {})]
    results = _results_table(checkpoint, dataset, metrics)
    provenance = exported["provenance"]
    left_out = exported.get("left_out") or []
    rerun = "`train.py -c config.yaml` reruns it" + (
        f"; left out, as paths of the machine that trained it: {', '.join(left_out)} (give them again)"
        if left_out
        else ""
    )
    lines = [
        *_card_top(front, name),
        "",
        f"`{name}` ({family}) trained by `{PACKAGE}` `train.py` on `{dataset}`; exported from the run's "
        f"`checkpoints/{checkpoint.which}`.",
        "",
        "## Model details",
        f"- **Architecture:** `{name}`, {params / 1e6:.3f}M parameters",
        f"- **Constructor arguments (`model_args`):** `{json.dumps(args, sort_keys=True)}`",
        f"- **Input:** {describe_input(cfg)}",
        f"- **Classes:** {cfg['num_classes']}"
        + (f" ({', '.join(map(str, exported['label_names']))})" if exported.get("label_names") else ""),
        f"- **Dataset:** {dataset}",
        "",
        *_intended_use(f"the {cfg['num_classes']} classes of `{dataset}`", "below, on its validation images", cfg),
        "## Training recipe",
        markdown_table(["option", "value"], recipe).rstrip(),
        "",
        f"The complete resolved options are in `config.yaml` beside this card ({rerun}).",
        "",
        "## Results",
        results.rstrip(),
        "",
        *_usage_and_software(family, name, repo_id, exported["folder"], provenance),
    ]
    return "\n".join(lines)


def _intended_use(classes: str, measured: str, cfg: dict[str, Any]) -> list[str]:
    """The card's intended use and limits: what the model was trained for, the inputs it labels, what was measured."""
    size = cfg["input_size"]
    return [
        "## Intended use and limits",
        "- **Intended use:** research on convolutional inductive biases (the work cited below): reproducing, "
        "comparing or extending its experiments, such as the locality diagnostics of `convbias-diagnostics`.",
        f"- **Inputs:** {size[0]} x {size[1]} x {size[2]} images of {classes}, preprocessed as `config.json`'s "
        "`pretrained_cfg` says (timm's `resolve_model_data_config`, below). An image of another kind or class gets "
        "one of these labels anyway, without meaning.",
        f"- **Measured:** the accuracy {measured}, and nothing else: its calibration, robustness and behaviour on "
        "other data were not evaluated. It is not meant for decisions about people or anything safety-related.",
        "",
    ]


def _timm_builds_its_own(name: str) -> bool:
    """Whether timm alone (without the family's package) has its own model of this name (timm's ConViTs)."""
    entry = getattr(timm.models, name, None)
    return callable(entry) and getattr(entry, "__module__", "").startswith("timm.")


def _usage_and_software(
    family: str, name: str, repo_id: str | None, folder: str, provenance: dict[str, str]
) -> list[str]:
    """A model card's last sections: how to get the package that registers a family's model, how to load the model
    through timm (from the Hub with `repo_id`, else from the folder), the work to cite, and the software that
    exported it. `family`: the package that registered the model ('timm' for timm's own)."""
    ours = family != "timm"
    source = f"hf-hub:{repo_id}" if repo_id else f"local-dir:{folder}"
    where = "" if repo_id else "  # this folder, from the folder that holds it"
    lines = []
    if ours:
        lines += [
            "## Getting the package",
            f"`import {family}` registers `{name}` in timm; it comes with the `{PACKAGE}` package "
            f"({provenance['version']}), which is not part of timm. Install it from its source tree at the commit "
            "below (in a checkout of it: `pip install .`; Python >= 3.10, it brings torch and timm >= 1.0.31).",
            *(
                [f"timm alone (without `import {family}`) builds its own `{name}` from this folder too."]
                if _timm_builds_its_own(name)
                else []
            ),
            "",
        ]
    lines += [
        "## How to load it",
        "```python",
        "import timm",
        *([f"import {family}  # registers {name} in timm"] if ours else []),
        "",
        f"model = timm.create_model('{source}', pretrained=True).eval(){where}",
        "data_config = timm.data.resolve_model_data_config(model)",
        "transform = timm.data.create_transform(**data_config, is_training=False)",
        "```",
        "",
    ]
    if not repo_id:
        lines += [
            "Uploaded to the Hugging Face Hub (`convbias-export RUN --output DIR --push-to` a repository id, or "
            "`huggingface-cli upload`), it loads with `hf-hub:` and that id in place of `local-dir:`.",
            "",
        ]
    if ours:
        lines += ["## Citation", *(f"- {citation}" for citation in CITATIONS), ""]
    return [
        *lines,
        "## Software",
        f"- {PACKAGE} {provenance['version']}, commit {provenance['commit']}",
        f"- timm {provenance['timm']}, torch {provenance['torch']}",
        "",
    ]


def _check_output(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"--output {output} already exists and is not empty: choose a new folder")
    for parent in output.parents:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"--output {output}: {parent} is a file, not a folder")


@contextlib.contextmanager
def _writing(output: Path, name: str) -> Iterator[None]:
    """Report a failed write of ``name`` (disk full, read-only, removed) as one StorageError line naming it
    and why; the staging folder is removed, so nothing is left at ``output``."""
    try:
        yield
    except StorageError:
        raise  # it names its file already: an inner block's, or staged_directory's
    except WRITE_ERRORS as error:
        raise StorageError(
            f"writing {output / name} failed ({storage_reason(error, output.parent)}); "
            f"nothing was written to --output {output}"
        ) from None


def _usual_modes(folder: Path) -> None:
    """safetensors writes its files private (0600): give the folder and its files the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.iterdir()]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_run(
    run: str | Path,
    output: str | Path,
    families: Families,
    which: str = "last",
    deploy: tuple[str, ...] = (),
    img_size: int | None = None,
    license: str = DEFAULT_LICENSE,
    repo_id: str | None = None,
) -> dict[str, Any]:
    """Write the Hub folder of `run`'s checkpoint `which` to `output` (a new folder); `deploy` adds
    `model.onnx` and/or `model.pt2` checked against the PyTorch model; `families`: the loaded families
    (`convbias.families.load_families()`). Returns what was written."""
    output = Path(output)
    check_which(which)
    unknown = [f for f in deploy if f not in DEPLOY_FORMATS]
    if unknown:
        raise ConfigError(f"unknown deployment format {unknown[0]!r}; choices: {', '.join(DEPLOY_FORMATS)}")
    run = RunDir(run)
    _check_output(output)
    if "onnx" in deploy:
        check_onnx_installed()
    model, info = run_model(run, families, which)
    preprocessing = data_config(info["config"], info["in_chans"], info["img_size"])
    example = deploy_input(model, preprocessing, img_size) if deploy else None
    labels = _class_names(info["config"])
    model_config = {"label_names": labels} if labels and len(labels) == info["num_classes"] else {}
    metrics = run_metrics(run, info["checkpoint"])

    def card(exported: dict[str, Any]) -> str:
        return model_card(model, info, metrics, exported, families, license, repo_id)

    files: dict[str, Path | str] = {name: run.path / name for name in RUN_FILES if (run.path / name).is_file()}
    files[CONFIG_FILE], left_out = portable_run_config(run, families.initialization_kwargs)
    checks = write_export(output, model, model_config, preprocessing, card, files, deploy, example, license, left_out)
    return {
        "output": output,
        "model": info["model"],
        "checkpoint": info["checkpoint"].describe(),
        "metrics": metrics,
        "checks": checks,
    }


def write_export(
    output: Path,
    model: torch.nn.Module,
    model_config: dict[str, Any],
    preprocessing: dict[str, Any],
    card: Any,
    files: dict[str, Path | str],
    deploy: tuple[str, ...],
    example: torch.Tensor | None,
    license: str,
    left_out: list[str] | None = None,
) -> dict[str, float]:
    """Write the export folder (staged, renamed into place): timm's save_for_hf files, the card (``card``: the
    README.md text from what was exported), ``files`` (a Path: copied; a str: the text written), and the ``deploy`` formats checked
    against the model (their relative errors are returned); ``left_out``: the options the files leave out (the
    machine's paths), for the card."""
    # the weights are the run's: drop what the registered cfg says about timm's pretrained weights
    model.pretrained_cfg = {k: v for k, v in model.pretrained_cfg.items() if k not in SOURCE_FIELDS}
    model.pretrained_cfg["license"] = license
    checks = {}
    with _writing(output, ""), staged_directory(output) as tmp:
        with _writing(output, SAFETENSORS_SINGLE_FILE):
            file_system().save_hf(
                model, tmp, model_config=model_config, safe_serialization=True, data_config=preprocessing
            )
        hf_config = json.loads((tmp / "config.json").read_text())
        exported = {
            "model_args": hf_config.get("model_args", {}),
            "pretrained_cfg": hf_config["pretrained_cfg"],
            "label_names": hf_config.get("label_names"),
            "provenance": _provenance(),
            "folder": output.name,
            "left_out": left_out,
        }
        with _writing(output, "README.md"):
            (tmp / "README.md").write_text(card(exported))
        for name, source in files.items():
            with _writing(output, name):
                if isinstance(source, str):
                    (tmp / name).write_text(source)
                else:
                    file_system().copy_file(source, tmp / name)
        for name, export in (("onnx", export_onnx), ("pt2", export_program)):
            if name in deploy:
                with _writing(output, f"model.{name}"):
                    checks[name] = export(model, example, tmp / f"model.{name}")
        _usual_modes(tmp)
    return checks


# ------------------------------------------------------------------------------------- timm's checkpoints
TIMM_RECIPE_KEYS = ("model", "model_kwargs", "epochs", "batch_size", "opt", "lr", "weight_decay", "sched",
                    "warmup_epochs", "drop_path", "smoothing", "mixup", "cutmix", "aa", "reprob", "model_ema", "seed")  # fmt: skip


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists, for YAML's safe dumper."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def timm_model_card(model: torch.nn.Module, checkpoint: Any, use_ema: bool, exported: dict[str, Any], license: str,
                    repo_id: str | None, families: Families) -> str:  # fmt: skip
    """README.md for a model exported from timm's training checkpoint: front matter, architecture, the recipe its
    args record, the metric timm's train.py saved with it, how to load it."""
    args, name = checkpoint.args, checkpoint.args["model"]
    family = _family(name)
    dataset = str(args.get("dataset") or "image folder")
    front = _front_matter(name, families.hub_tag(family), dataset, {}, license)
    cfg = exported["pretrained_cfg"]
    options = portable_options(_plain(args), families.initialization_kwargs)[0]  # without the machine's paths
    recipe = [(key, json.dumps(options[key])) for key in TIMM_RECIPE_KEYS if options.get(key) not in (None, {}, "")]
    metric = "not saved" if checkpoint.metric is None else f"{args.get('eval_metric', 'top1')} {checkpoint.metric:.4g}"
    provenance = exported["provenance"]
    lines = [
        *_card_top(front, name),
        "",
        f"`{name}` trained by timm's `train.py`; exported by `{PACKAGE}` from `{checkpoint.path.name}` (epoch "
        f"{checkpoint.epoch}, {'its EMA weights' if use_ema else 'the model weights'}).",
        "",
        "## Model details",
        f"- **Architecture:** `{name}`, {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M parameters",
        f"- **Constructor arguments (`model_args`):** `{json.dumps(exported['model_args'], sort_keys=True)}`",
        f"- **Input:** {describe_input(cfg)}",
        f"- **Classes:** {cfg['num_classes']}"
        + (f" ({', '.join(map(str, exported['label_names']))})" if exported.get("label_names") else ""),
        "",
        *_intended_use(f"its {cfg['num_classes']} classes", "timm's train.py saved with it (below)", cfg),
        "## Training recipe",
        markdown_table(["option", "value"], recipe).rstrip(),
        "",
        "The complete arguments are in `args.yaml` beside this card (timm's `train.py -c args.yaml`"
        + (
            f"; left out, as paths of the machine that trained it: {', '.join(exported['left_out'])}"
            if exported["left_out"]
            else ""
        )
        + ").",
        "",
        "## Results",
        f"Metric saved with the checkpoint by timm's train.py (the EMA's when its run evaluated one): {metric}.",
        "",
        *_usage_and_software(family, name, repo_id, exported["folder"], provenance),
    ]
    return "\n".join(lines)


def export_timm_checkpoint(
    path: str | Path,
    output: str | Path,
    families: Families,
    use_ema: bool = False,
    deploy: tuple[str, ...] = (),
    img_size: int | None = None,
    license: str = DEFAULT_LICENSE,
    repo_id: str | None = None,
) -> dict[str, Any]:
    """Write the Hub folder of timm's training checkpoint ``path`` (``use_ema``: its EMA's weights) to ``output``:
    the model its args name, the preprocessing ``resolve_data_config`` gives for them, label_names from its
    --class-map, a card, its args as args.yaml. Returns what was written, as export_run does."""
    output = Path(output)
    unknown = [f for f in deploy if f not in DEPLOY_FORMATS]
    if unknown:
        raise ConfigError(f"unknown deployment format {unknown[0]!r}; choices: {', '.join(DEPLOY_FORMATS)}")
    _check_output(output)
    if "onnx" in deploy:
        check_onnx_installed()
    checkpoint = read_timm_checkpoint(path)
    model = create_timm_model(checkpoint, use_ema)
    preprocessing = {key: value for key, value in timm_data_config(checkpoint, model).items() if key != "crop_mode"}
    example = deploy_input(model, preprocessing, img_size) if deploy else None
    labels, _ = timm_class_names(checkpoint, model.num_classes)
    model_config = {"label_names": labels} if labels else {}

    def card(exported: dict[str, Any]) -> str:
        return timm_model_card(model, checkpoint, use_ema, exported, license, repo_id, families)

    args, left_out = portable_options(_plain(checkpoint.args), families.initialization_kwargs)
    files = {TIMM_ARGS_FILE: yaml.safe_dump(args, sort_keys=False)}  # as timm's run folder has it, less the paths
    checks = write_export(output, model, model_config, preprocessing, card, files, deploy, example, license, left_out)
    return {
        "output": output,
        "model": checkpoint.args["model"],
        "checkpoint": f"{checkpoint.path} (epoch {checkpoint.epoch}{', EMA' if use_ema else ''})",
        "metrics": {},
        "checks": checks,
    }


# ----------------------------------------------------------------------------------------------- upload
def push_folder(folder: str | Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Upload an exported folder to the Hub (huggingface_hub: create the repo if needed, then one commit);
    returns the commit URL. ConfigError with one line when the Hub cannot be reached or refuses."""
    api = HfApi(token=token, library_name="timm")
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo.repo_id, folder_path=str(folder), commit_message=f"Upload {Path(folder).name}"
        )
    except OfflineModeIsEnabled:
        raise ConfigError(f"--push-to {repo_id}: HF_HUB_OFFLINE is set; the folder stays in {folder}") from None
    except Exception as error:  # HTTP errors, a missing token, and the transport's own (requests, httpx, httpx2
        # by huggingface_hub version): whatever stops the upload is reported in one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--push-to {repo_id}: cannot upload ({first}); the folder stays in {folder}") from None
    return str(getattr(commit, "commit_url", commit))
