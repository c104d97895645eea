"""Lazy or feature training? The summary of a sweep over ``--output-scale`` (Geiger, Petrini & Wyart,
*Landscape and training regimes in deep learning*, Physics Reports 2021, Sec. 2).

For every complete run of a sweep directory (its runs.csv): the output scale alpha, the final top-1,
the tangent kernel's relative change ||Theta_end - Theta_0|| / ||Theta_0|| logged by the engine's
``ntk`` diagnostic at the last evaluation, and the local-energy curve of the final weights on the
training set (``convbias.evaluation.landscape.local_energy``: error under multiplicative weight noise).
`write` saves regimes.csv and regimes.png (top-1, kernel change and local energy against alpha, per
model); the console script is ``convbias-regimes SWEEP_DIR`` (`convbias.cli.regimes`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from convbias.evaluation.ensembles import load_run
from convbias.evaluation.landscape import Batches, local_energy
from convbias.tables import write_csv

SIGMAS = (0.0, 0.05, 0.1, 0.2, 0.3)
DRAWS = 5
CSV_NAME = "regimes.csv"
PNG_NAME = "regimes.png"


def last_evaluation(run_dir: Path) -> dict[str, Any]:
    """The last log.jsonl record that holds an evaluation (eval_top1)."""
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    evaluated = [r for r in records if "eval_top1" in r]
    if not evaluated:
        raise ValueError(f"{run_dir} has no evaluation in log.jsonl")
    return evaluated[-1]


def summarize(sweep_dir: Path, extensions=None) -> list[dict[str, Any]]:
    """One row per complete run: model, alpha, top-1, kernel change, local energy at SIGMAS."""
    with open(sweep_dir / "runs.csv", newline="") as f:
        runs = list(csv.DictReader(f))
    rows, data = [], None
    for run in runs:
        run_dir = sweep_dir / "runs" / run["run"]
        model, cfg, data = load_run(run_dir, extensions, data)
        if cfg.get("output_scale") is None:
            raise ValueError(f"{run_dir} was not trained with --output-scale")
        train = data.train
        train.transform = data.val.transform  # the training images as evaluated (no augmentation)
        images = torch.stack([train[i][0] for i in range(len(train))])
        labels = torch.tensor([train[i][1] for i in range(len(train))])
        curve = local_energy(model, Batches(images, labels, batch_size=500), SIGMAS, draws=DRAWS)
        last = last_evaluation(run_dir)
        rows.append(
            {
                "run": run["run"],
                "model": cfg.model,
                "alpha": cfg.output_scale,
                "lr": cfg.lr,
                "top1": last["eval_top1"],
                "ntk_change": last.get("ntk_relative_change"),
                **{f"train_error_sigma{s:g}": mean for s, mean, _ in curve},
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["alpha"])
        alphas = [r["alpha"] for r in mine]
        axes[0].plot(alphas, [r["top1"] for r in mine], "o-", label=model)
        axes[1].plot(alphas, [r["ntk_change"] for r in mine], "o-", label=model)
        for r in mine:
            axes[2].plot(
                SIGMAS, [r[f"train_error_sigma{s:g}"] for s in SIGMAS], "o-", label=f"{model}, alpha={r['alpha']:g}"
            )
    axes[0].set_ylabel("final top-1 (%)")
    axes[1].set_ylabel("||Theta_end - Theta_0|| / ||Theta_0||")
    axes[1].set_yscale("log")
    axes[1].axhline(1.0, color="gray", linestyle=":")
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xlabel("output scale alpha")
    axes[2].set_xlabel("relative weight noise sigma")
    axes[2].set_ylabel("training error (%)")
    axes[2].set_title("local energy", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def write(sweep_dir: Path, extensions=None) -> list[Path]:
    """Summarize the sweep in `sweep_dir` and write regimes.csv and regimes.png there."""
    rows = summarize(sweep_dir, extensions)
    return [write_csv(rows, sweep_dir / CSV_NAME), plot(rows, sweep_dir / PNG_NAME)]
