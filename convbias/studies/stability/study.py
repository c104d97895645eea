"""Relative stability R_f of trained runs: measurement, per-run tables and the summary over seeds.

Each run is a train.py output folder read through ``RunDir``: its config.yaml rebuilds the model (reparametrized,
output-scaled, as train.py built it) and the test (validation) set, its checkpoints give the weights (`best`,
`last`, `epoch_N` from --save-epochs, `init` = epoch_0), each verified before it is read. For every run
and checkpoint: R_f, D_f, G_f and their standard errors over `draws` diffeomorphism-and-noise draws at every
(delta, c) of the grid, R_f of every block at (main delta, first cut), and the test error on the whole test
set. Every row carries the convention, the mode set, the number of images and of draws it was measured with.

Runs that differ only by seed form a group; `seed_summary` gives per group, checkpoint and grid point the
number of runs n, the geometric mean of R_f (D_f, G_f) over seeds with its 95% Student-t interval (on log
R_f), and the mean test error with its 95% interval: the seeds' spread, which includes the draws' spread.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from convbias.base import tables
from convbias.base.errors import ConfigError
from convbias.base.tables import markdown_table
from convbias.engine import RunDir, build_datasets, build_run_model, check_model_name
from convbias.evaluation import diffeo
from convbias.evaluation.stability import relative_stability

from ..intervals import cell, interval, ratio_interval

CHECKPOINT_FORMS = "best, last, init (= epoch_0) or epoch_N (a --save-epochs snapshot)"


@dataclass
class Settings:
    """What a measurement is: the grid, the convention and the sample sizes (images, draws)."""

    checkpoints: list[str]
    images: int
    deltas: list[float]
    cuts: list[int]
    main_delta: float
    convention: str
    modes: str
    draws: int
    normalize: bool
    interpolation: str
    chunk_size: int
    seed: int
    device: str

    @property
    def grid(self) -> list[tuple[float, int]]:
        return [(delta, cut) for cut in self.cuts for delta in sorted(set(self.deltas) | {self.main_delta})]

    def describe(self) -> str:
        return (
            f"convention {self.convention}, modes {self.modes}, {self.images} test images, {self.draws} draws"
            f"{', normalized' if self.normalize else ''}"
        )


@dataclass
class Run:
    path: Path
    cfg: dict
    images: torch.Tensor
    test: Any
    models: dict[str, torch.nn.Module]  # checkpoint name -> model with its weights

    @property
    def group(self) -> str:
        """What runs averaged over seeds share: the model (an eFCN with the name of the CNN snapshot it was
        lifted from, epoch_E, not its run) and the training fraction; the other kwargs are in the CSV."""
        checkpoint = (self.cfg.get("model_kwargs") or {}).get("cnn_checkpoint")
        lifted = f" @{Path(checkpoint).stem}" if checkpoint else ""
        return f"{self.cfg['model']}{lifted} f={self.cfg.get('train_fraction', 1.0):g}"


def load_run(path: Path, settings: Settings, extensions: Any = None) -> Run:
    """The run's test images and one model per checkpoint, each rebuilt as train.py built it (reparametrized,
    output-scaled) with weights verified against their manifest: bad input and damaged files stop the study
    before any measurement."""
    run = RunDir(path)
    cfg = run.config
    check_model_name(cfg["model"], f"{path}/config.yaml: model")
    bundle = build_datasets(run.run_config().replace(no_aug=True))
    if len(bundle.val) == 0:
        raise ConfigError(f"run {path}: its test set ({cfg['dataset']}) is empty")
    count = min(settings.images, len(bundle.val))
    images = torch.stack([bundle.val[i][0] for i in range(count)])
    for delta, cut in settings.grid:
        diffeo.temperature(delta, cut, images.shape[-2:])  # the whole grid is checked before any work
    models = {name: build_run_model(run, name, extensions)[0].to(settings.device) for name in settings.checkpoints}
    return Run(path, cfg, images, bundle.val, models)


@torch.no_grad()
def test_error(model: torch.nn.Module, dataset, device: str, batch_size: int) -> float:
    """Top-1 error (%) on the whole test set."""
    wrong = total = 0
    for start in range(0, len(dataset), batch_size):
        batch = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        images = torch.stack([b[0] for b in batch]).to(device)
        labels = torch.tensor([b[1] for b in batch], device=device)
        wrong += int((model(images).argmax(1) != labels).sum())
        total += len(batch)
    return 100.0 * wrong / total


def measure(runs: list[Run], settings: Settings) -> tuple[list[dict], list[dict]]:
    """Rows of (run, checkpoint, delta, c) and, at the main point, of (run, checkpoint, depth)."""
    rows, layer_rows = [], []
    main_cut = settings.cuts[0]
    for run in runs:
        for name, model in run.models.items():
            base = dict(
                run=str(run.path),
                group=run.group,
                model=run.cfg["model"],
                seed=run.cfg.get("seed"),
                train_fraction=run.cfg.get("train_fraction"),
                checkpoint=name,
                test_error=test_error(model, run.test, settings.device, settings.chunk_size),
                convention=settings.convention,
                modes=settings.modes,
                images=run.images.shape[0],
                draws=settings.draws,
            )
            for delta, cut in settings.grid:
                main = delta == settings.main_delta and cut == main_cut
                result = relative_stability(
                    model,
                    run.images,
                    delta=delta,
                    cut=cut,
                    convention=settings.convention,
                    modes=settings.modes,
                    draws=settings.draws,
                    normalize=settings.normalize,
                    per_layer=main,
                    chunk_size=settings.chunk_size,
                    seed=settings.seed,
                    interpolation=settings.interpolation,
                )
                rows.append(
                    dict(
                        base,
                        delta=delta,
                        cut=cut,
                        T=result.T,
                        D=result.D,
                        D_se=result.D_se,
                        G=result.G,
                        G_se=result.G_se,
                        R=result.R,
                        R_se=result.R_se,
                    )
                )
                if main:
                    depth = len(result.layers) + 1
                    values = result.layers + [(result.D, result.G, result.R)]
                    errors = result.layers_se + [(result.D_se, result.G_se, result.R_se)]
                    for i, ((d, g, r), (d_se, g_se, r_se)) in enumerate(zip(values, errors)):
                        layer_rows.append(
                            dict(
                                base,
                                depth=i,
                                relative_depth=(i + 1) / depth,
                                D=d,
                                D_se=d_se,
                                G=g,
                                G_se=g_se,
                                R=r,
                                R_se=r_se,
                            )
                        )
                    print(
                        f"{run.path} [{name}]: test error {base['test_error']:.2f}%, R_f(delta={delta}, c={cut}) = "
                        f"{result.R:.3g} +/- {result.R_se:.2g} ({settings.describe()})"
                    )
    return rows, layer_rows


# The columns of the rows `measure` writes (stability.csv) and of its per-layer rows (stability_layers.csv), each
# with how a reader parses it: what identifies a measurement is finite, a measured value may be NaN (undefined)
IDENTIFYING = {
    **dict.fromkeys(("run", "group", "model", "checkpoint", "convention", "modes"), tables.text),
    **dict.fromkeys(("seed", "images", "draws"), tables.integer),
    **dict.fromkeys(("train_fraction", "test_error"), tables.finite),
}
MEASURED = dict.fromkeys(("D", "D_se", "G", "G_se", "R", "R_se"), tables.number)
ROW_COLUMNS = {**IDENTIFYING, "delta": tables.finite, "cut": tables.integer, "T": tables.finite, **MEASURED}
LAYER_COLUMNS = {**IDENTIFYING, "depth": tables.integer, "relative_depth": tables.finite, **MEASURED}


def read_rows(path: Path, columns: dict[str, tables.Cell] = ROW_COLUMNS) -> list[dict]:
    """Rows of a stability.csv (``columns``: ``ROW_COLUMNS``) or stability_layers.csv (``LAYER_COLUMNS``) written by
    `measure`, each column parsed as declared; a table without them, without rows or with a value out of its
    column's type is one DamagedInputError naming the file (and the line and column)."""
    if not os.path.lexists(path):
        raise ConfigError(f"{path} not found: measure the runs with convbias-stability first")
    return tables.read_csv(path, "stability table", tables.by_column(columns), required=list(columns), rows=True)


def check_combinable(rows: list[dict]) -> None:
    """Rows measured apart can be summarized together only if they were measured the same way."""
    for key in ("convention", "modes", "images", "draws"):
        values = sorted({str(r[key]) for r in rows})
        if len(values) > 1:
            raise ConfigError(f"the measurements differ in {key} ({', '.join(values)}): summarize them apart")


def check_combined_settings(rows: list[dict], settings: Settings) -> None:
    """ConfigError unless the rows of earlier outputs hold what ``settings`` summarizes: the main point
    (``--main-delta`` at the first of ``--cuts``) and every run there at each of ``--checkpoints``."""
    main = [r for r in rows if (r["delta"], r["cut"]) == (settings.main_delta, settings.cuts[0])]
    if not main:
        held = ", ".join(sorted({f"delta {r['delta']:g} at cut {r['cut']}" for r in rows}))
        raise ConfigError(
            f"--combine: the tables hold no measurement at --main-delta {settings.main_delta:g} and cut "
            f"{settings.cuts[0]} (the first of --cuts); they hold {held}: give --main-delta and --cuts as measured"
        )
    by_run: dict[str, set[str]] = defaultdict(set)
    for r in main:
        by_run[r["run"]].add(r["checkpoint"])
    for run, held in by_run.items():
        missing = [name for name in settings.checkpoints if name not in held]
        if missing:
            raise ConfigError(
                f"--combine: run {run} has no measurement of checkpoint {', '.join(missing)} (it has "
                f"{', '.join(sorted(held))}): give --checkpoints as measured"
            )


def _fmt(value: float) -> str:
    return "undefined" if value != value else f"{value:.3g}"


def _pm(value: float, se: float) -> str:
    return _fmt(value) if se != se else f"{_fmt(value)} ± {se:.2g}"


def run_table(rows: list[dict], settings: Settings) -> str:
    """One line per run: test error and R_f, D_f, G_f (mean ± standard error over draws) at the main point."""
    main = [r for r in rows if r["delta"] == settings.main_delta and r["cut"] == settings.cuts[0]]
    by_run: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in main:
        by_run[r["run"]][r["checkpoint"]] = r
    names = list(settings.checkpoints)
    head = ["run", "model", "P", "seed"] + [f"{k} {n}" for n in names for k in ("error %", "R_f", "D_f", "G_f")]
    body = []
    for run, per in by_run.items():
        first = next(iter(per.values()))
        cells = [Path(run).name, first["model"], f"{first['train_fraction']:g}", str(first["seed"])]
        for n in names:
            r = per[n]
            cells += [f"{r['test_error']:.1f}", _pm(r["R"], r["R_se"]), _pm(r["D"], r["D_se"]), _pm(r["G"], r["G_se"])]
        body.append(cells)
    title = (
        f"R_f at delta = {settings.main_delta}, c = {settings.cuts[0]}, per run ({settings.describe()}; "
        f"mean ± standard error over the draws; test error on the whole test set)\n\n"
    )
    return title + markdown_table(head, body)


def seed_summary(rows: list[dict]) -> list[dict]:
    """Per group, checkpoint and (delta, c): n runs, geometric means of R_f, D_f, G_f with their 95% intervals
    over seeds, the mean test error with its interval, and the mean standard error of R_f over draws."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["group"], r["checkpoint"], r["delta"], r["cut"])].append(r)
    out = []
    for (group, checkpoint, delta, cut), members in groups.items():
        first = members[0]
        row = dict(
            group=group,
            model=first["model"],
            train_fraction=first["train_fraction"],
            checkpoint=checkpoint,
            delta=delta,
            cut=cut,
            convention=first["convention"],
            modes=first["modes"],
            images=first["images"],
            draws=first["draws"],
            seeds=" ".join(str(m["seed"]) for m in members),
        )
        n, err, err_lo, err_hi = interval([m["test_error"] for m in members])
        row.update(n=n, test_error=err, test_error_low=err_lo, test_error_high=err_hi)
        for key in ("R", "D", "G"):
            _, centre, low, high = interval([m[key] for m in members], log=True)
            row.update({key: centre, f"{key}_low": low, f"{key}_high": high})
        draws_se = [m["R_se"] / m["R"] for m in members if m["R"] > 0 and math.isfinite(m["R_se"])]
        row["R_draw_rel_se"] = sum(draws_se) / len(draws_se) if draws_se else float("nan")
        out.append(row)
    return out


def layer_summary(layer_rows: list[dict]) -> list[dict]:
    """Per group, checkpoint and depth: n runs and the geometric mean of R_f over seeds with its 95% interval."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in layer_rows:
        groups[(r["group"], r["checkpoint"], r["depth"])].append(r)
    out = []
    for (group, checkpoint, depth), members in groups.items():
        n, centre, low, high = interval([m["R"] for m in members], log=True)
        first = members[0]
        out.append(
            dict(group=group, checkpoint=checkpoint, depth=depth, relative_depth=first["relative_depth"], n=n)
            | dict(R=centre, R_low=low, R_high=high, convention=first["convention"], modes=first["modes"])
            | dict(images=first["images"], draws=first["draws"])
        )
    return out


def contrasts(rows: list[dict], delta: float, cut: int, before: str, after: str, reference: str) -> list[dict]:
    """Per group at (delta, c): R_f after / before training (paired by run: the geometric mean of the per-run
    ratios with its t-interval), and R_f after training against the `reference` group of the same training
    fraction (independent seeds: ratio of geometric means with its Welch interval); the reference group has
    no such contrast (with itself it would be 1 by construction, not a measurement)."""
    point = [r for r in rows if r["delta"] == delta and r["cut"] == cut]
    by_group: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in point:
        by_group[r["group"]][r["checkpoint"]][r["run"]] = r["R"]
    fraction = {r["group"]: r["train_fraction"] for r in point}
    out = []
    for group, per in by_group.items():
        runs = sorted(set(per[before]) & set(per[after]))
        ratios = [per[after][r] / per[before][r] if per[before][r] > 0 else math.nan for r in runs]  # R_f 0: none
        n, ratio, low, high = interval(ratios, log=True)
        row = dict(group=group, delta=delta, cut=cut, n=n, trained_over_init=ratio)
        row.update(trained_over_init_low=low, trained_over_init_high=high)
        ref = next(
            (g for g in by_group if g != group and g.startswith(reference + " ") and fraction[g] == fraction[group]),
            None,
        )
        versus = (
            ratio_interval(list(per[after].values()), list(by_group[ref][after].values())) if ref else [math.nan] * 3
        )
        row.update(reference=ref, n_reference=len(by_group[ref][after]) if ref else 0)
        row.update(dict(zip(("over_reference", "over_reference_low", "over_reference_high"), versus)))
        out.append(row)
    return out


def contrast_table(rows: list[dict]) -> str:
    body = [
        [r["group"], r["n"], _ci(r, "trained_over_init")]
        + ([r["reference"], r["n_reference"], _ci(r, "over_reference")] if r["reference"] else ["", "", ""])
        for r in rows
    ]
    head = ["group", "n", "R_f trained / init [95%]", "reference", "n ref", "R_f trained / reference [95% Welch]"]
    return "Contrasts at the main point (ratios of geometric means; an interval excluding 1 is a supported gap)\n\n" + (
        markdown_table(head, body)
    )


def layer_table(summary: list[dict]) -> str:
    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for s in summary:
        by_key[(s["group"], s["checkpoint"])].append(s)
    body = [
        [group, checkpoint, members[0]["n"], "; ".join(_ci(m, "R") for m in sorted(members, key=lambda m: m["depth"]))]
        for (group, checkpoint), members in by_key.items()
    ]
    return "R_f per layer, input side first, logits last: geometric mean over n seeds [95% interval]\n\n" + (
        markdown_table(["group", "checkpoint", "n", "R_f per depth"], body)
    )


def _ci(row: dict, key: str, digits: str = ".3g") -> str:
    return cell(row[key], row[f"{key}_low"], row[f"{key}_high"], digits)


def summary_table(summary: list[dict], delta: float, cut: int, checkpoints: list[str]) -> str:
    """Markdown: per group, n and, per checkpoint, R_f (geometric mean [95% interval]) and the test error."""
    point = [s for s in summary if s["delta"] == delta and s["cut"] == cut]
    by_group: dict[str, dict[str, dict]] = defaultdict(dict)
    for s in point:
        by_group[s["group"]][s["checkpoint"]] = s
    head = ["group", "n"] + [f"{k} {c}" for c in checkpoints for k in ("test error %", "R_f")]
    body = []
    for group, per in by_group.items():
        cells = [group, str(next(iter(per.values()))["n"])]
        for c in checkpoints:
            s = per.get(c)
            cells += [_ci(s, "test_error", ".1f"), _ci(s, "R")] if s else ["", ""]
        body.append(cells)
    first = point[0] if point else {}
    title = (
        f"R_f at delta = {delta}, c = {cut}: geometric mean over n seeds [95% t-interval on log R_f]; test error: "
        f"mean [95% t-interval] (convention {first.get('convention')}, modes {first.get('modes')}, "
        f"{first.get('images')} test images, {first.get('draws')} draws per image)\n\n"
    )
    return title + markdown_table(head, body)
