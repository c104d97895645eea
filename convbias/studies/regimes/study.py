"""Lazy or feature training? The summary of a sweep over ``--output-scale`` (Geiger, Petrini & Wyart,
*Landscape and training regimes in deep learning*, Physics Reports 2021, Sec. 2).

For every complete run of a sweep directory (its runs.csv): the output scale alpha, the final top-1,
the tangent kernel's relative change ||Theta_end - Theta_0|| / ||Theta_0|| logged by the engine's
``ntk`` diagnostic at the last evaluation, and the local-energy curve of the final weights on the
training set (``convbias.evaluation.landscape.local_energy``: error under multiplicative weight noise).
With several seeds per point, `over_seeds` gives each (model, alpha) its n and 95% t intervals: top-1,
its gap to the same model at alpha = 1 paired by seed (a seed fixes the initial weights and the data order),
the kernel change as a geometric mean (it spans orders of magnitude) and the training error with and
without weight noise. `write` saves regimes.csv (one row per run), regimes_seeds.csv and regimes.md (per
point over seeds) and regimes.png (the means with their intervals against alpha, per model); the console
script is ``convbias-regimes SWEEP_DIR`` (`convbias.studies.regimes.command`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from convbias.base.errors import ConfigError
from convbias.base.run_layout import LOG_FILE, REGIMES_COMMAND, SWEEP_RUNS_DIR, SWEEP_RUNS_TABLE
from convbias.base.storage import check_output, output_folder, save_figure, write_text
from convbias.base.tables import markdown_table, write_csv
from convbias.engine import read_log
from convbias.evaluation.ensembles import load_run
from convbias.evaluation.figures import dodged, error_bar_note, log_ticks
from convbias.evaluation.landscape import Batches, local_energy

from ..intervals import cell, error_bar, interval, per_seed_gaps
from ..sweep.runs import read_runs

SIGMAS = (0.0, 0.05, 0.1, 0.2, 0.3)
DRAWS = 5
CSV_NAME = "regimes.csv"
SEEDS_CSV_NAME = "regimes_seeds.csv"
MARKDOWN_NAME = "regimes.md"
PNG_NAME = "regimes.png"
REFERENCE_ALPHA = 1.0  # the standard network: each alpha's top-1 gap is taken against it
# Per-run columns summarized over seeds: (column, geometric mean?)
SUMMARIZED = (
    ("top1", False),
    ("ntk_change", True),
    ("train_error_sigma0", False),
    ("train_error_sigma0.1", False),
)


def last_evaluation(run_dir: Path) -> dict[str, Any]:
    """The last log.jsonl record that holds an evaluation (eval_top1); lines a kill or a foreign writer
    damaged are skipped (``read_log``), so a damaged log names the run instead of failing to parse."""
    records, dropped = read_log(run_dir / LOG_FILE)
    evaluated = [r for r in records if "eval_top1" in r]
    if not evaluated:
        skipped = f" ({dropped} damaged line{'s' if dropped != 1 else ''} skipped)" if dropped else ""
        raise ConfigError(f"{run_dir / LOG_FILE} holds no evaluation (no record with eval_top1){skipped}")
    return evaluated[-1]


def summarize(sweep_dir: Path, extensions=None) -> list[dict[str, Any]]:
    """One row per complete run: model, alpha, top-1, kernel change, local energy at SIGMAS."""
    runs = read_runs(sweep_dir / SWEEP_RUNS_TABLE, required=("run",))  # the sweep's table, its columns checked
    rows, data = [], None
    for run in runs:
        run_dir = sweep_dir / SWEEP_RUNS_DIR / run["run"]
        model, cfg, data = load_run(run_dir, extensions, data, which="last")  # the final weights
        if cfg.output_scale is None:
            raise ConfigError(f"{run_dir} was not trained with --output-scale")
        train = data.train
        train.transform = data.val.transform  # the training images as evaluated (no augmentation)
        images, labels = zip(*(train[i] for i in range(len(train))))  # one pass: indexing runs the transform
        images, labels = torch.stack(images), torch.tensor(labels)
        curve = local_energy(model, Batches(images, labels, batch_size=500), SIGMAS, draws=DRAWS)
        last = last_evaluation(run_dir)
        rows.append(
            {
                "run": run["run"],
                "seed": run.get("seed"),
                "model": cfg.model,
                "alpha": cfg.output_scale,
                "lr": cfg.lr,
                "top1": last["eval_top1"],
                "ntk_change": last.get("ntk_relative_change"),
                **{f"train_error_sigma{s:g}": mean for s, mean, _ in curve},
            }
        )
    return rows


def over_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, alpha): n, and for each SUMMARIZED column its mean (geometric for the kernel
    change) with the 95% t interval over seeds; `top1_gap` is top-1 minus the same model's at alpha = 1,
    paired by seed. Bounds are NaN below 2 seeds."""
    points: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        points.setdefault((row["model"], float(row["alpha"])), []).append(row)
    summary = []
    for (model, alpha), runs in sorted(points.items()):
        out: dict[str, Any] = {"model": model, "alpha": alpha, "n": len(runs)}
        for column, log in SUMMARIZED:
            values = [r[column] for r in runs if r[column] is not None]
            _, out[column], out[f"{column}_low"], out[f"{column}_high"] = interval(values, log)
        reference = points.get((model, REFERENCE_ALPHA), [])
        n_pairs, out["top1_gap"], out["top1_gap_low"], out["top1_gap_high"] = interval(
            per_seed_gaps(runs, reference, "top1") if all(r["seed"] is not None for r in runs) else []
        )
        out["n_pairs"] = n_pairs
        summary.append(out)
    return summary


def markdown(summary: list[dict[str, Any]]) -> str:
    """The over-seeds table: every cell 'mean [95% low, high]' with the point's n."""
    header = [
        "model",
        "alpha",
        "n",
        "final top-1 %",
        f"top-1 minus alpha = {REFERENCE_ALPHA:g} (paired)",
        "||Theta_end - Theta_0|| / ||Theta_0|| (geo. mean)",
        "training error %",
        "training error % at sigma = 0.1",
    ]

    def values(row: dict[str, Any], column: str, digits: str) -> str:
        return cell(row[column], row[f"{column}_low"], row[f"{column}_high"], digits)

    body = [
        [
            row["model"],
            f"{row['alpha']:g}",
            row["n"],
            values(row, "top1", ".1f"),
            "" if row["alpha"] == REFERENCE_ALPHA else values(row, "top1_gap", "+.1f"),
            values(row, "ntk_change", ".3g"),
            values(row, "train_error_sigma0", ".1f"),
            values(row, "train_error_sigma0.1", ".1f"),
        ]
        for row in summary
    ]
    return markdown_table(header, body)


def plot(rows: list[dict[str, Any]], summary: list[dict[str, Any]], path: Path) -> Path:
    """Top-1 and kernel change against alpha (mean and 95% interval over seeds), and each point's mean
    local-energy curve (`rows`: one per run; `summary`: their `over_seeds`)."""
    fig = Figure(figsize=(13, 3.9))
    axes = fig.subplots(1, 3)
    models = list(dict.fromkeys(r["model"] for r in summary))
    for index, model in enumerate(models):
        mine = [r for r in summary if r["model"] == model]
        alphas = dodged([r["alpha"] for r in mine], index, len(models), [r["alpha"] for r in summary], log=True)
        for ax, column in zip(axes[:2], ("top1", "ntk_change")):
            centre = [r[column] for r in mine]
            spread = [
                [error_bar(r[column] - r[f"{column}_low"]) for r in mine],
                [error_bar(r[f"{column}_high"] - r[column]) for r in mine],
            ]
            ax.errorbar(alphas, centre, yerr=spread, fmt="o-", capsize=3, label=f"{model} (n = {mine[0]['n']})")
        for point in mine:
            runs = [r for r in rows if r["model"] == model and float(r["alpha"]) == point["alpha"]]
            curve = [sum(r[f"train_error_sigma{s:g}"] for r in runs) / len(runs) for s in SIGMAS]
            axes[2].plot(SIGMAS, curve, "o-", label=f"{model}, alpha={point['alpha']:g}")
    axes[0].set_ylabel("final top-1 (%)")
    axes[1].set_ylabel("||Theta_end - Theta_0|| / ||Theta_0||")
    axes[1].set_yscale("log")
    axes[1].axhline(1.0, color="gray", linestyle=":")
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xlabel("output scale alpha" + (" (series shifted apart)" if len(models) > 1 else ""))
    axes[2].set_xlabel("relative weight noise sigma")
    axes[2].set_ylabel("training error (%)")
    axes[2].set_title("local energy: mean over seeds, no error bars", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for axis in (axes[0].xaxis, axes[1].xaxis, axes[1].yaxis):
        log_ticks(axis)
    note = error_bar_note((r["n"] for r in summary), "95% t interval") + " (kernel change: of its geometric mean)"
    fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def write(sweep_dir: Path, extensions=None) -> list[Path]:
    """Summarize the sweep in `sweep_dir`: regimes.csv, regimes_seeds.csv, regimes.md and regimes.png there."""
    check_output(sweep_dir, "SWEEP_DIR", writer=REGIMES_COMMAND)  # a link or FIFO among its files: before any work
    rows = summarize(sweep_dir, extensions)
    summary = over_seeds(rows)
    output_folder(sweep_dir, "SWEEP_DIR", writer=REGIMES_COMMAND)
    markdown_path = sweep_dir / MARKDOWN_NAME
    write_text(markdown_path, markdown(summary))
    return [
        write_csv(rows, sweep_dir / CSV_NAME),
        write_csv(summary, sweep_dir / SEEDS_CSV_NAME),
        markdown_path,
        plot(rows, summary, sweep_dir / PNG_NAME),
    ]
