"""The relax-time protocol of Sec. 6.2.2 (eFCN), end to end.

1. Train the CNN (SGD lr 0.1, batch 250, no momentum / weight decay / augmentation), keeping
   `snapshots` checkpoints at log-spaced epochs (0 = the initialization; the last: its final resume point).
2. Lift each snapshot to its eFCN and train it (SGD lr 0.01, or Adam as in App. E).
3. Train the standard FCN of the same architecture from PyTorch's default init.
4. Measure, for each eFCN at the start and end of its training, the gradient norm and the top
   Hessian eigenvalue; at the end, delta, the weight-sharing violation and the accuracy of the
   local / off-local blocks alone; interpolate CNN -> eFCN (linear, string, output space).
5. Write CSVs and the figures 6.2-6.7 and E.6 into --output.

All training goes through the engine (`convbias.engine.run`), so the train stage runs on one CPU or under
`accelerate launch` on many GPUs; the analyze stage runs in one process:

    convbias-efcn-protocol -c configs/efcn_protocol/efcn_cpu.yaml --output results/efcn
    accelerate launch -m convbias.studies.efcn_protocol.command -c configs/efcn_protocol/efcn_cifar10.yaml --stage train --output runs/efcn
    convbias-efcn-protocol -c configs/efcn_protocol/efcn_cifar10.yaml --stage analyze --output runs/efcn

Finished runs (with results.json) are not retrained, so an interrupted protocol resumes. The outputs of several
seeds are summarized by `convbias.studies.efcn_protocol.seeds`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import timm
import torch

from convbias import engine
from convbias.base.errors import Interrupted, Preempted
from convbias.base.run_layout import BASELINES_TABLE, LAST_LINK, RELAX_TIMES_TABLE, SUMMARY_FILE, snapshot_name
from convbias.base.tables import write_csv
from convbias.base.weights import load_weights
from convbias.engine import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    Check,
    Config,
    ConfigError,
    Declared,
    RunDir,
    build_datasets,
    declared_value,
    read_declared_yaml,
    read_summary,
    train_option,
)
from convbias.evaluation import landscape
from convbias.families import Families

from . import figures as plots
from .report import duration, write_report

DEFAULTS = dict(
    model="vanilla_cnn",  # the CNN; efcn_<model> and fcn_<model> must be registered
    model_kwargs={},
    dataset="digits",
    data_dir=None,
    img_size=None,
    num_classes=None,
    batch_size=250,
    workers=2,
    seed=0,
    cnn_epochs=150,
    cnn_lr=0.1,
    snapshots=8,  # k relax times, log-spaced in [0, cnn_epochs], 0 and cnn_epochs included
    efcn_epochs=100,
    efcn_lr=0.01,
    optimizer="sgd",  # sgd (no momentum) or adam (App. E)
    adam_lr=1e-4,  # lr of CNN, eFCNs and FCN when optimizer is adam
    max_params=None,  # refuse eFCNs above this many parameters
    measure_train_samples=1000,  # train images for losses, |grad L|, lambda_max and the string method
    measure_test_samples=None,  # test images for accuracies (None = all)
    power_iterations=20,
    interpolate_relax_times=3,  # how many relax times (spread over the k) get the App. E.3 interpolations
    interpolation_points=11,
    string_points=7,
    string_steps=30,
    string_lr=0.01,
    string_stiffness=1.0,
)


# ------------------------------------------------------------------------------------- configuration
OPTIMIZERS = ("sgd", "adam")
SNAPSHOTS = Check(lambda v: v >= 2, ">= 2 (the initialization and the trained CNN)")
PATH_POINTS = Check(lambda v: v >= 2, ">= 2 (the two ends of the path)")
# Each key of DEFAULTS with its type and check; a key that is train.py's option too is declared as that option
DECLARED: dict[str, Declared] = dict(
    model=Declared(str),
    **{key: train_option(key) for key in ("model_kwargs", "dataset", "data_dir", "img_size", "num_classes")},
    **{key: train_option(key) for key in ("batch_size", "workers", "seed")},
    cnn_epochs=Declared(int, POSITIVE_INT),
    cnn_lr=Declared(float, POSITIVE),
    snapshots=Declared(int, SNAPSHOTS),
    efcn_epochs=Declared(int, POSITIVE_INT),
    efcn_lr=Declared(float, POSITIVE),
    optimizer=Declared(str, choices=OPTIMIZERS),
    adam_lr=Declared(float, POSITIVE),
    max_params=Declared(int | None, POSITIVE_INT),
    measure_train_samples=Declared(int, POSITIVE_INT),
    measure_test_samples=Declared(int | None, POSITIVE_INT),
    power_iterations=Declared(int, POSITIVE_INT),
    interpolate_relax_times=Declared(int, NON_NEGATIVE),
    interpolation_points=Declared(int, PATH_POINTS),
    string_points=Declared(int, PATH_POINTS),
    string_steps=Declared(int, NON_NEGATIVE),
    string_lr=Declared(float, POSITIVE),
    string_stiffness=Declared(float, NON_NEGATIVE),
)


def load_config(path: str | None, overrides: dict) -> dict:
    """DEFAULTS, then the keys of the file ``path``, then the ``overrides`` that are not None, each value as
    DECLARED (a ConfigError naming the file, line and key, or the override); its CNN, eFCN and FCN registered
    (the command loads the families first)."""
    cfg = dict(DEFAULTS)
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"config file not found: {path}")
        cfg.update(read_declared_yaml(path, "protocol config", DECLARED))
    cfg.update({k: declared_value(DECLARED[k], v, k) for k, v in overrides.items() if v is not None})
    for family in ("efcn_", "fcn_", ""):
        if not timm.is_model(family + cfg["model"]):
            raise ConfigError(
                f"model {family + cfg['model']} is not registered (import efcn registers "
                f"vanilla_cnn, alexnet_cifar and their efcn_/fcn_ variants)"
            )
    return cfg


def relax_times(epochs: int, k: int) -> list[int]:
    """0 and k-1 log-spaced epochs in [1, epochs] (rounded, duplicates moved up by one)."""
    times = [0]
    for t in np.geomspace(1, epochs, k - 1) if k > 2 else [epochs]:
        times.append(min(epochs, max(round(t), times[-1] + 1)))
    return sorted(set(times))


# The protocol's resize and center crop, fixed here rather than taken from the model's pretrained config
EVAL_TRANSFORM = dict(interpolation="bicubic", crop_pct=0.875)


def train_recipe(cfg: dict) -> Config:
    """The train.py options shared by every run of the protocol (Sec. 6.2.2); each run's config.yaml records
    them with its own. A run keeps one resume point (and its best, when that is another), to continue it when it
    is interrupted: the analysis reads the --save-epochs snapshots and, for the final weights, that point (no
    snapshot repeats it), so the other points would be weights kept for nothing.

    Plain SGD is timm's "momentum" optimizer with momentum 0 (timm's "sgd" is Nesterov SGD, which
    refuses momentum 0)."""
    return Config(
        dataset=cfg["dataset"],
        batch_size=cfg["batch_size"],
        seed=cfg["seed"],
        workers=cfg["workers"],
        opt="momentum" if cfg["optimizer"] == "sgd" else "adam",
        momentum=0.0,
        weight_decay=0.0,
        sched="constant",
        warmup_epochs=0,
        no_aug=True,
        repeated_aug=1,
        drop_path=0.0,
        resume="auto",  # a run interrupted mid-way continues from its resume point when the protocol is rerun
        keep_checkpoints=1,  # the newest resume point (and the best): the final weights the analysis reads
        checkpoint_hist=1,
        **EVAL_TRANSFORM,
        **{k: cfg[k] for k in ("data_dir", "img_size", "num_classes") if cfg[k] is not None},
        **({"first_classes": cfg["num_classes"]} if cfg["num_classes"] is not None else {}),
    )


def _train_config(
    recipe: Config, model: str, epochs: int, lr: float, output: Path, save_epochs: list[int], model_kwargs: dict
) -> Config:
    return recipe.replace(
        model=model, epochs=epochs, lr=lr, output=str(output), save_epochs=save_epochs, model_kwargs=dict(model_kwargs)
    )


def _lr(cfg: dict, sgd_lr: float) -> float:
    return sgd_lr if cfg["optimizer"] == "sgd" else cfg["adam_lr"]


def _efcn_kwargs(cfg: dict, **extra) -> dict:
    kwargs = dict(cfg["model_kwargs"], **extra)
    if cfg["max_params"] is not None:
        kwargs["max_params"] = cfg["max_params"]
    return kwargs


# ------------------------------------------------------------------------------------------ progress
@dataclass
class Stage:
    """One stage of the protocol: a training run or a measurement. Stages of one ``kind`` take about the same time
    per unit (an epoch of a training, one measurement), which is what the time left is estimated from."""

    kind: str
    what: str
    units: float = 1.0
    seconds: float | None = None  # measured, once the stage did its work (not when it was already complete)


class Progress:
    """The stages of one protocol command, said as they start ("stage k of n") with the time left: the remaining
    stages at the pace (seconds per unit) that this command measured for their kind, and, for a kind not yet
    timed, a lower bound that names it."""

    def __init__(self, stages: list[Stage]):
        self.stages, self.done = stages, 0

    @contextmanager
    def stage(self) -> Iterator[Stage]:
        """The next stage, said as it starts, and timed; the body sets its ``seconds`` to None when there was
        nothing to do (an already complete run)."""
        stage = self.stages[self.done]
        _say(f"stage {self.done + 1} of {len(self.stages)}: {stage.what}; {self.left()}")
        started = time.perf_counter()
        stage.seconds = 0.0
        yield stage
        if stage.seconds is not None:
            stage.seconds = time.perf_counter() - started
        self.done += 1

    def pace(self) -> dict[str, float]:
        """Seconds per unit of each kind of stage done in this command."""
        timed: dict[str, list[Stage]] = {}
        for stage in self.stages[: self.done]:
            if stage.seconds is not None:
                timed.setdefault(stage.kind, []).append(stage)
        return {kind: sum(s.seconds for s in done) / sum(s.units for s in done) for kind, done in timed.items()}

    def left(self) -> str:
        pace, remaining = self.pace(), self.stages[self.done :]
        known = sum(s.units * pace[s.kind] for s in remaining if s.kind in pace)
        untimed = ", ".join(dict.fromkeys(s.kind for s in remaining if s.kind not in pace))
        if not untimed:
            return f"about {duration(known)} left"
        if not known:
            return f"time left: known once these are timed: {untimed}"
        return f"about {duration(known)} left, plus what is not timed yet: {untimed}"


def _say(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # under accelerate launch: once, not once per process
        print(f"[efcn_protocol] {line}", flush=True)


TRAINING, FCN_TRAINING, MEASUREMENT, INTERPOLATION = (
    "the CNN's training",
    "the eFCN and FCN trainings",
    "the measurements",
    "the interpolations",
)


def protocol_stages(cfg: dict, train: bool, analyze: bool) -> Progress:
    """The stages of a command that trains and/or analyzes: the CNN, one eFCN per relax time and the FCN; then
    one measurement per relax time, the FCN's, and the interpolations (App. E.3)."""
    times = relax_times(cfg["cnn_epochs"], cfg["snapshots"])
    stages = []
    if train:
        stages.append(Stage(TRAINING, f"training the CNN for {cfg['cnn_epochs']} epochs", cfg["cnn_epochs"]))
        stages += [Stage(FCN_TRAINING, f"training the eFCN of t_w={t}", cfg["efcn_epochs"]) for t in times]
        stages.append(Stage(FCN_TRAINING, "training the standard FCN", cfg["efcn_epochs"]))
    if analyze:
        stages += [Stage(MEASUREMENT, f"measuring the eFCN of t_w={t}") for t in times]
        stages.append(Stage(MEASUREMENT, "measuring the CNN and the standard FCN"))
        stages += [
            Stage(INTERPOLATION, f"interpolating from the CNN to the eFCN of t_w={t}")
            for t in _pick(times, cfg["interpolate_relax_times"])
        ]
    return Progress(stages)


# ------------------------------------------------------------------------------------------ training
def _run_once(config: Config, stage: Stage, families: Families) -> dict:
    """The run of ``config`` (with the loaded ``families``' extensions), trained unless it is complete (then its
    ``stage`` did no work)."""
    output = Path(config.output)
    if output.is_dir() and RunDir(output).status() == "done":
        _say(f"{output} already complete, kept")
        stage.seconds = None
        return RunDir(output).results()
    _say(f"training {config.model} for {config.epochs} epochs into {output}")
    try:
        return engine.run(config, families)
    except (Interrupted, Preempted):  # the engine's line follows, naming the resume point
        _say("stopped; rerun this command to continue: each run resumes from its point (the next line names this one)")
        raise


def train_stage(cfg: dict, out: Path, families: Families, progress: Progress | None = None) -> None:
    times = relax_times(cfg["cnn_epochs"], cfg["snapshots"])
    progress = progress or protocol_stages(cfg, train=True, analyze=False)
    recipe = train_recipe(cfg)
    with progress.stage() as stage:
        _run_once(
            _train_config(
                recipe,
                cfg["model"],
                cfg["cnn_epochs"],
                _lr(cfg, cfg["cnn_lr"]),
                out / "cnn",
                sorted(set(times) - {cfg["cnn_epochs"]}),  # the final weights: its last resume point
                cfg["model_kwargs"],
            ),
            stage,
            families,
        )
    middle = cfg["efcn_epochs"] // 2
    for t in times:
        snapshot = _snapshot(out / "cnn", t).resolve()
        with progress.stage() as stage:
            _run_once(
                _train_config(
                    recipe,
                    "efcn_" + cfg["model"],
                    cfg["efcn_epochs"],
                    _lr(cfg, cfg["efcn_lr"]),
                    out / f"efcn_tw{t}",
                    sorted({0, middle} - {cfg["efcn_epochs"]}),
                    _efcn_kwargs(cfg, cnn_checkpoint=str(snapshot)),
                ),
                stage,
                families,
            )
    with progress.stage() as stage:
        _run_once(
            _train_config(
                recipe,
                "fcn_" + cfg["model"],
                cfg["efcn_epochs"],
                _lr(cfg, cfg["efcn_lr"]),
                out / "fcn",
                sorted({0, middle} - {cfg["efcn_epochs"]}),
                _efcn_kwargs(cfg),
            ),
            stage,
            families,
        )


# ------------------------------------------------------------------------------------------ analysis
def _tensors(dataset, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(dataset) if limit is None else min(limit, len(dataset))
    items = [dataset[i] for i in range(n)]
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items])


def _first_filter(model: torch.nn.Module, efcn: SimpleNamespace) -> np.ndarray:
    """First layer's row for output channel 0 at the central output pixel, as (C_in, H, W).

    (The paper shows the top-left pixel; on digits its unit sits on the blank border and often gets
    no gradient, so its off-local weights stay exactly zero.)"""
    layer = next(iter(efcn.local_layers(model).values()))
    _, height, width = layer.out_shape
    row = (height // 2) * width + width // 2
    return layer.weight[row].detach().reshape(layer.in_shape).cpu().numpy().copy()  # weights get reloaded in place


def _read_summary(run: Path, name: str, initial: tuple[float, float] | None) -> list[dict]:
    rows = [] if initial is None else [dict(run=name, epoch=0, train_loss=initial[0], test_acc=initial[1])]
    for r in read_summary(run / SUMMARY_FILE)[0]:
        rows.append(
            dict(run=name, epoch=int(r["epoch"]), train_loss=float(r["train_loss"]), test_acc=float(r["eval_top1"]))
        )
    return rows


def _snapshot(run: Path, epoch: int) -> Path:
    """The run's weights after ``epoch`` epochs, verified: its newest resume point's when that is at the end of
    ``epoch`` (a finished run's final weights, which no snapshot repeats), else its --save-epochs snapshot."""
    folder = RunDir(run)
    last = folder.checkpoint(LAST_LINK)
    return last.weights if (last.epoch, last.step) == (epoch, 0) else folder.checkpoint(snapshot_name(epoch)).weights


def _pick(items: list, n: int) -> list:
    if n >= len(items):
        return list(items)
    return [items[i] for i in sorted({round(j * (len(items) - 1) / max(1, n - 1)) for j in range(n)})]


@dataclass
class _Analysis:
    """What the analyze stage measures every model on (fixed train and test images), how it rebuilds the
    protocol's models from the snapshots in `out`, and the eFCN's measurements and masks (its family's tools)."""

    efcn: SimpleNamespace
    cfg: dict
    out: Path
    train: landscape.Batches
    test: landscape.Batches
    cnn_kwargs: dict
    build_kwargs: dict

    @classmethod
    def prepare(cls, cfg: dict, out: Path, families: Families) -> _Analysis:
        """The measurement images (the dataset as train.py builds it, unaugmented), the models' arguments and the
        eFCN family's tools, from the loaded ``families``."""
        bundle = build_datasets(
            Config(
                dataset=cfg["dataset"],
                data_dir=cfg["data_dir"],
                img_size=cfg["img_size"],
                first_classes=cfg["num_classes"],
                seed=cfg["seed"],
                no_aug=True,
                **EVAL_TRANSFORM,
            )
        )
        train = landscape.Batches(*_tensors(bundle.train, cfg["measure_train_samples"]), cfg["batch_size"])
        test = landscape.Batches(*_tensors(bundle.val, cfg["measure_test_samples"]), cfg["batch_size"])
        cnn_kwargs = dict(num_classes=bundle.num_classes, in_chans=bundle.in_chans, **cfg["model_kwargs"])
        if cfg["img_size"] is not None:
            cnn_kwargs["img_size"] = cfg["img_size"]
        return cls(families.tools("efcn"), cfg, out, train, test, cnn_kwargs, _efcn_kwargs(cfg, **cnn_kwargs))

    def build(self, family: str, path: Path) -> torch.nn.Module:
        """The `family` ("", "efcn_" or "fcn_") model with the weights at `path`, in eval mode."""
        model = timm.create_model(family + self.cfg["model"], **(self.build_kwargs if family else self.cnn_kwargs))
        return load_weights(model, path).eval()

    def point(self, t: int, method: str, alpha: float, evaluate: Callable[[landscape.Batches], tuple]) -> dict:
        """A row of interpolation.csv: the train loss and test accuracy that `evaluate` gives (loss, accuracy)."""
        return dict(
            relax_time=t,
            method=method,
            alpha=alpha,
            train_loss=evaluate(self.train)[0],
            test_acc=evaluate(self.test)[1],
        )

    def landscape_at(self, model: torch.nn.Module) -> dict:
        """|grad L| and the top Hessian eigenvalue on the train images."""
        return dict(
            grad_norm=landscape.gradient_norm(model, self.train),
            hessian_top=landscape.top_hessian_eigenvalue(
                model, self.train, self.cfg["power_iterations"], self.cfg["seed"]
            ),
        )


Filters = list[tuple[str, np.ndarray]]  # (when, first-layer filter) of one model


def _relax_time(analysis: _Analysis, t: int) -> tuple[dict, Filters, list[dict]]:
    """The eFCN lifted at relax time t: its row of relax_times.csv (the CNN snapshot it starts from, its start and
    end of training, its distance to the CNN subspace and its local / off-local parts), its first-layer filters
    through training and its training curve."""
    out, train, test, E = analysis.out, analysis.train, analysis.test, analysis.cfg["efcn_epochs"]
    efcn = analysis.efcn
    run = out / f"efcn_tw{t}"
    started = time.perf_counter()
    model = analysis.build("efcn_", _snapshot(run, 0))
    row = dict(relax_time=t)
    snapshot = analysis.build("", _snapshot(out / "cnn", t))
    row["cnn_train_loss_at_relax_time"] = landscape.evaluate(snapshot, train)[0]
    row["cnn_test_acc_at_relax_time"] = landscape.evaluate(snapshot, test)[1]
    row["initial_train_loss"], row["initial_train_acc"] = landscape.evaluate(model, train)
    row["initial_test_acc"] = landscape.evaluate(model, test)[1]
    start = analysis.landscape_at(model)
    filters = [("at relax time", _first_filter(model, efcn))]
    for epoch in sorted({E // 2, E} - {0}):
        load_weights(model, _snapshot(run, epoch)).eval()
        filters.append((f"after {epoch} epochs", _first_filter(model, efcn)))
    row["final_train_loss"], row["final_train_acc"] = landscape.evaluate(model, train)
    row["final_test_acc"] = landscape.evaluate(model, test)[1]
    row["best_test_acc"] = RunDir(run).results()["best_top1"]
    for key, value in efcn.deviation(model).items():
        row[f"deviation_{key}"] = value
    row["weight_sharing_total"] = efcn.weight_sharing_violation(model)["total"]
    for keep in ("local", "off_local"):
        with efcn.masked(model, keep):
            row[f"{keep}_only_test_acc"] = landscape.evaluate(model, test)[1]
    end = analysis.landscape_at(model)
    row.update({f"{k}_start": v for k, v in start.items()})
    row.update({f"{k}_end": v for k, v in end.items()})
    curves = _read_summary(run, f"efcn_tw{t}", (row["initial_train_loss"], row["initial_test_acc"]))
    print(
        f"[efcn_protocol] t_w={t}: final test acc {row['final_test_acc']:.2f}%, delta "
        f"{row['deviation_total']:.4f} ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return row, filters, curves


def _fcn_baselines(analysis: _Analysis, cnn_results: dict) -> tuple[dict, Filters, list[dict]]:
    """baselines.csv's row (the trained CNN, and the standard FCN with its distance to the CNN subspace and its
    local / off-local parts), the FCN's first-layer filters and its training curve."""
    out, train, test, E = analysis.out, analysis.train, analysis.test, analysis.cfg["efcn_epochs"]
    efcn = analysis.efcn
    fcn = analysis.build("fcn_", _snapshot(out / "fcn", 0))
    fcn_initial = landscape.evaluate(fcn, train)[0], landscape.evaluate(fcn, test)[1]
    filters = [("initialization", _first_filter(fcn, efcn))]
    load_weights(fcn, _snapshot(out / "fcn", E)).eval()
    filters.append((f"after {E} epochs", _first_filter(fcn, efcn)))
    filters.append((plots.DIFFERENCE, filters[1][1] - filters[0][1]))
    curves = _read_summary(out / "fcn", "fcn", fcn_initial)
    fcn_local = {}
    for keep in ("local", "off_local"):
        with efcn.masked(fcn, keep):
            fcn_local[keep] = landscape.evaluate(fcn, test)[1]
    baselines = dict(
        cnn_final_test_acc=cnn_results["final_top1"],
        cnn_best_test_acc=cnn_results["best_top1"],
        fcn_final_test_acc=landscape.evaluate(fcn, test)[1],
        fcn_best_test_acc=RunDir(out / "fcn").results()["best_top1"],
        fcn_initial_train_loss=fcn_initial[0],
        fcn_deviation_total=efcn.deviation(fcn)["total"],
        fcn_local_only_test_acc=fcn_local["local"],
        fcn_off_local_only_test_acc=fcn_local["off_local"],
    )
    return baselines, filters, curves


def _interpolations(analysis: _Analysis, times: list[int], progress: Progress) -> list[dict]:
    """App. E.3: from the lifted final CNN to the eFCNs trained from a few relax times, along the straight line
    and the string method's path in parameter space, and by mixing the two models' outputs."""
    cfg, rows = analysis.cfg, []
    cnn_final = _snapshot(analysis.out / "cnn", cfg["cnn_epochs"]).resolve()
    lifted_cnn = timm.create_model(
        "efcn_" + cfg["model"], **analysis.build_kwargs, cnn_checkpoint=str(cnn_final)
    ).eval()
    start_params = landscape.parameters_of(lifted_cnn)
    for t in _pick(times, cfg["interpolate_relax_times"]):
        with progress.stage():
            rows += _interpolation(analysis, t, lifted_cnn, start_params)
    return rows


def _interpolation(
    analysis: _Analysis, t: int, lifted_cnn: torch.nn.Module, start_params: landscape.Params
) -> list[dict]:
    """interpolation.csv's rows of relax time t: along each path from the lifted final CNN to its trained eFCN."""
    cfg, train, rows = analysis.cfg, analysis.train, []
    started = time.perf_counter()
    trained = analysis.build("efcn_", _snapshot(analysis.out / f"efcn_tw{t}", cfg["efcn_epochs"]))
    end_params = landscape.parameters_of(trained)
    alphas = np.linspace(0, 1, cfg["interpolation_points"]).tolist()
    for alpha, params in zip(alphas, landscape.linear_path(start_params, end_params, alphas)):
        rows.append(analysis.point(t, "linear", alpha, partial(landscape.evaluate, trained, params=params)))
    string_alphas = np.linspace(0, 1, cfg["string_points"]).tolist()
    string = (cfg["string_stiffness"], cfg["string_steps"], cfg["string_lr"])
    path = landscape.string_path(trained, start_params, end_params, string_alphas, train, *string)
    for alpha, params in zip(string_alphas, path):
        rows.append(analysis.point(t, "string", alpha, partial(landscape.evaluate, trained, params=params)))
    for alpha in alphas:
        mixture = partial(landscape.evaluate_output_mixture, lifted_cnn, trained, alpha)
        rows.append(analysis.point(t, "output", alpha, mixture))
    print(f"[efcn_protocol] interpolation t_w={t} ({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def analyze_stage(cfg: dict, out: Path, families: Families, progress: Progress | None = None) -> None:
    """Steps 4-5: measure the trained CNN, eFCNs and FCN in one process (with the eFCN family's tools, from the
    loaded ``families``), then write the CSVs, the figures and report.md."""
    torch.manual_seed(cfg["seed"])
    times = relax_times(cfg["cnn_epochs"], cfg["snapshots"])
    progress = progress or protocol_stages(cfg, train=False, analyze=True)
    analysis = _Analysis.prepare(cfg, out, families)
    cnn_results = RunDir(out / "cnn").results()
    cnn_init = analysis.build("", _snapshot(out / "cnn", 0))
    initial = landscape.evaluate(cnn_init, analysis.train)[0], landscape.evaluate(cnn_init, analysis.test)[1]
    curves = _read_summary(out / "cnn", "cnn", initial)
    rows, filters = [], {}
    for t in times:
        with progress.stage():
            row, filters[f"eFCN t_w={t}"], efcn_curves = _relax_time(analysis, t)
        rows.append(row)
        curves += efcn_curves
    with progress.stage():
        baselines, filters["FCN"], fcn_curves = _fcn_baselines(analysis, cnn_results)
    curves += fcn_curves
    interpolation_rows = _interpolations(analysis, times, progress)

    write_csv(rows, out / RELAX_TIMES_TABLE, owner=out)
    write_csv([baselines], out / BASELINES_TABLE, owner=out)
    write_csv(curves, out / "curves.csv")
    write_csv(interpolation_rows, out / "interpolation.csv")
    plots.training_curves(curves, times, out / "fig6_2_training_curves.png")
    plots.accuracy_and_landscape(rows, baselines, out / "fig6_3_accuracy_gradient_hessian.png")
    plots.deviation(rows, baselines, out / "fig6_4_deviation.png")
    plots.local_contributions(rows, out / "fig6_5_local_offlocal.png")
    plots.filter_heatmaps(filters, out / "fig6_6_6_7_first_layer_filters.png")
    plots.interpolation(interpolation_rows, out / "figE6_interpolation.png")
    report = write_report(
        out, cfg, times, rows, baselines, interpolation_rows, len(analysis.test.labels), progress.stages
    )
    _say(f"wrote the CSVs, the figures and {report.name} to {out}")
