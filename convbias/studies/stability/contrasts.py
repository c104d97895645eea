"""Analyses of a relative-stability study beyond `study`'s group summaries.

Paired contrasts: two groups of runs compared seed by seed (a seed fixes the initial weights and the
training subset, so pairing removes their spread): the geometric mean of the per-seed R_f ratios and the
mean of the test error differences, each with its 95% t-interval and its Bonferroni interval over all the
contrasts of the table, so that a table of many contrasts can be read jointly.

Trajectories: R_f logged during training (train.py --diagnostics writes init_rf and rf to log.jsonl),
per run and epoch, and per group of seeds with the geometric mean and its 95% t-interval.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from convbias.base import tables
from convbias.base.errors import ConfigError
from convbias.base.run_layout import LOG_FILE
from convbias.base.storage import save_figure, write_text
from convbias.base.tables import markdown_table, write_csv
from convbias.engine import RunDir, read_log

from ..intervals import CONFIDENCE, cell, interval

Group = tuple[str, float]  # (run-name prefix, training fraction)

# The contrasts of results/relative_stability (run-name prefixes of convbias.studies.stability.runs): models at the same
# training-set size, then each model at P = 4,000 against P = 1,000.
MODEL_PAIRS = [("efcn_r1", "fcn"), ("efcn_r2", "fcn"), ("efcn_r1", "efcn_r2"), ("convit", "deit"), ("tcnn", "fcn")]
MODELS = ["cnn", "efcn_r1", "efcn_r2", "fcn", "tcnn", "convit", "deit"]
FRACTIONS = (0.25, 1.0)
STUDY_PAIRS: list[tuple[Group, Group]] = [((m, f), (r, f)) for m, r in MODEL_PAIRS for f in FRACTIONS] + [
    ((m, 1.0), (m, 0.25)) for m in MODELS
]
CHECKPOINT, DELTA, CUT = "best", 1.0, 3  # the study's main point after training
MEASUREMENT = ("convention", "modes", "images", "draws")  # how R_f was measured, carried into every row


# -- paired contrasts ------------------------------------------------------------------------------
def by_name(rows: list[dict], checkpoint: str, delta: float, cut: int) -> dict[tuple[str, float, int], dict]:
    """(run-name prefix, training fraction, seed) -> the run's row at one checkpoint and (delta, c)."""
    return {
        (Path(r["run"]).name.split("_P")[0], r["train_fraction"], r["seed"]): r
        for r in rows
        if r["checkpoint"] == checkpoint and r["delta"] == delta and r["cut"] == cut
    }


def mean_with_intervals(values: list[float], comparisons: int, log: bool) -> dict[str, float]:
    """n, the (geometric) mean, its 95% t-interval and its Bonferroni interval over `comparisons` tests."""
    n, centre, low, high = interval(values, log=log)
    *_, wide_low, wide_high = interval(values, log=log, confidence=1 - (1 - CONFIDENCE) / comparisons)
    return dict(n=n, mean=centre, low=low, high=high, bonferroni_low=wide_low, bonferroni_high=wide_high)


def shared_seeds(runs: dict, group: Group, reference: Group) -> list[int]:
    """The seeds run in both groups, in order."""
    return sorted(s for (m, f, s) in runs if (m, f) == group and (*reference, s) in runs)


def pair_rows(
    rows: list[dict],
    pairs: list[tuple[Group, Group]] = STUDY_PAIRS,
    checkpoint: str = CHECKPOINT,
    delta: float = DELTA,
    cut: int = CUT,
) -> list[dict]:
    """One row per contrast (group, reference) with a shared seed, from stability.csv rows (`read_rows`):
    R_f ratio and test error gap paired by seed, Bonferroni-corrected over the contrasts present."""
    runs = by_name(rows, checkpoint, delta, cut)
    present = [pair for pair in pairs if shared_seeds(runs, *pair)]
    out = []
    for group, ref in present:
        seeds = shared_seeds(runs, group, ref)
        a, b = [runs[(*group, s)] for s in seeds], [runs[(*ref, s)] for s in seeds]
        (model, fraction), (reference, ref_fraction) = group, ref
        ratio = mean_with_intervals([x["R"] / y["R"] for x, y in zip(a, b)], len(present), log=True)
        gap = mean_with_intervals([x["test_error"] - y["test_error"] for x, y in zip(a, b)], len(present), log=False)
        out.append(
            dict(model=model, train_fraction=fraction, reference=reference, reference_fraction=ref_fraction)
            | {f"R_ratio_{k}" if k != "n" else k: v for k, v in ratio.items()}
            | {f"test_error_gap_{k}": v for k, v in gap.items() if k != "n"}
            | dict(comparisons=len(present), checkpoint=checkpoint, delta=delta, cut=cut)
            | {k: a[0][k] for k in MEASUREMENT}
        )
    return out


def _both_intervals(row: dict, key: str, digits: str) -> list[str]:
    return [
        cell(row[f"{key}_mean"], row[f"{key}_low"], row[f"{key}_high"], digits),
        cell(row[f"{key}_mean"], row[f"{key}_bonferroni_low"], row[f"{key}_bonferroni_high"], digits),
    ]


def pair_table(rows: list[dict]) -> str:
    """pairs.md: a title naming the measurement, then one line per contrast with both intervals."""
    body = [
        [r["model"], r["train_fraction"], r["reference"], r["reference_fraction"], r["n"]]
        + _both_intervals(r, "R_ratio", ".3g")
        + _both_intervals(r, "test_error_gap", "+.1f")
        for r in rows
    ]
    head = ["model", "P fraction", "reference", "ref P fraction", "n", "R_f model / reference [95%]"]
    head += ["[Bonferroni]", "test error gap, points [95%]", "[Bonferroni]"]
    first = rows[0]
    title = (
        f"Paired by seed, after training ({first['checkpoint']} checkpoint), R_f at delta = {first['delta']}, "
        f"c = {first['cut']} (convention {first['convention']}, modes {first['modes']}, {first['images']} test "
        f"images, {first['draws']} draws). An interval excluding 1 (ratio) or 0 (gap) is a supported difference; "
        f"the Bonferroni intervals hold jointly for the table's {first['comparisons']} comparisons."
    )
    return title + "\n\n" + markdown_table(head, body) + "\n"


def write_pairs(rows: list[dict], output: Path) -> tuple[list[Path], str]:
    """pairs.csv and pairs.md in `output`, from the paired contrasts of stability.csv rows; the paths and the
    markdown."""
    pairs = pair_rows(rows)
    if not pairs:
        raise ConfigError("no contrast of the study has a seed run in both groups: nothing to pair")
    markdown = pair_table(pairs)
    write_text(output / "pairs.md", markdown)
    return [write_csv(pairs, output / "pairs.csv"), output / "pairs.md"], markdown


# -- trajectories --------------------------------------------------------------------------------
def log_rows(runs: Path, convention: str, modes: str) -> list[dict]:
    """One row per run and epoch (epoch 0 = init_rf) of every run under `runs` whose log.jsonl has R_f
    diagnostics, read as every command reads a run's log and config (damaged log lines dropped; the config's
    values checked as its options'). The logs do not say how R_f was measured: `convention` and `modes` are
    the training code's, one draw per image."""
    rows = []
    for log in sorted(runs.glob(f"*/{LOG_FILE}")):
        records, _ = read_log(log)
        if not records or "init_rf" not in records[0]:
            continue
        images = RunDir(log.parent).config.get("diagnostics_images")
        label = dict(convention=convention, modes=modes, draws=1, images=images)
        name = log.parent.name
        rows.append(dict(run=name, epoch=0, rf=records[0]["init_rf"], eval_top1=None, **label))
        rows += [
            dict(run=name, epoch=r["epoch"], rf=r.get("rf", math.nan), eval_top1=r.get("eval_top1"), **label)
            for r in records
        ]
    return rows


# The columns of trajectories.csv (`log_rows`): no top-1 before training, no image count in an older log
TRAJECTORY_COLUMNS = {
    "run": tables.text,
    "epoch": tables.integer,
    "rf": tables.optional(tables.number, math.nan),
    "eval_top1": tables.optional(tables.finite),
    "convention": tables.text,
    "modes": tables.text,
    "draws": tables.optional(tables.integer),
    "images": tables.optional(tables.integer),
}


def read_trajectories(path: Path) -> list[dict]:
    """Rows of a trajectories.csv (`log_rows`), each column parsed as declared (``TRAJECTORY_COLUMNS``); a
    damaged one is one DamagedInputError naming the file (and the line and column)."""
    if not os.path.lexists(path):
        raise ConfigError(f"{path} not found: give the training runs (--runs) to read their logs")
    columns = TRAJECTORY_COLUMNS
    return tables.read_csv(path, "trajectories table", tables.by_column(columns), required=list(columns), rows=True)


def trajectory_summary(rows: list[dict]) -> list[dict]:
    """Per group (the run name without its seed) and epoch: n, R_f's geometric mean [95% t-interval on log
    R_f] and top-1's mean [95% t-interval] over the seeds (empty where no run logged a top-1)."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["run"].rsplit("_seed", 1)[0], r["epoch"]), []).append(r)
    summary = []
    for (group, epoch), members in cells.items():
        n, rf, rf_low, rf_high = interval([m["rf"] for m in members], log=True)
        top1 = [m["eval_top1"] for m in members if m["eval_top1"] is not None]
        _, acc, acc_low, acc_high = interval(top1) if top1 else (0, None, None, None)
        summary.append(
            dict(group=group, epoch=epoch, n=n, rf=rf, rf_low=rf_low, rf_high=rf_high)
            | dict(eval_top1=acc, eval_top1_low=acc_low, eval_top1_high=acc_high)
            | {k: members[0][k] for k in MEASUREMENT}
        )
    return summary


def trajectory_figure(summary: list[dict], path: Path) -> Path:
    """The group means over epochs with their shaded intervals; a color per model, solid P = 4,000, dotted
    P = 1,000."""
    groups = sorted({s["group"] for s in summary})
    families = sorted({g.split("_P")[0] for g in groups})
    colors = {f: matplotlib.colormaps["tab10"](i) for i, f in enumerate(families)}
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for group in groups:
        points = sorted((s for s in summary if s["group"] == group), key=lambda s: s["epoch"])
        epochs = [p["epoch"] for p in points]
        color = colors[group.split("_P")[0]]
        label = f"{group} (n = {min(p['n'] for p in points)})"
        style = "-" if "P1.0" in group else ":"
        ax.plot(epochs, [p["rf"] for p in points], style, color=color, marker="o", ms=2.5, label=label)
        low, high = [p["rf_low"] for p in points], [p["rf_high"] for p in points]
        ax.fill_between(epochs, low, high, color=color, alpha=0.15, lw=0)
    ax.axhline(1.0, color="gray", lw=0.5)
    first = summary[0]
    ax.set(
        yscale="log",
        xlabel="epoch (0 = initialization; eFCNs: epochs after the lift)",
        ylabel="R_f",
        title=f"R_f during training (delta = 1, c = 3, {first['convention']} convention, {first['modes']} modes, "
        "one draw)\ngeometric mean over seeds, shaded: 95% t-interval; solid: P = 4000, dotted: P = 1000",
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return save_figure(fig, path, dpi=120, bbox_inches="tight")


def write_trajectories(rows: list[dict[str, Any]], output: Path, figure: bool = True) -> list[Path]:
    """trajectories_summary.csv (and trajectories.png) in `output`, from per-run trajectory rows."""
    if not rows:
        raise ConfigError("no run logged R_f during training (train.py --diagnostics): no trajectory to summarize")
    summary = trajectory_summary(rows)
    files = [write_csv(summary, output / "trajectories_summary.csv")]
    return files + ([trajectory_figure(summary, output / "trajectories.png")] if figure else [])
