"""Robustness tables and the Fig. 8.3 plot from measured accuracies (`measure`): the
Table G.1-style table with what its attacks measured, the corruption errors per category (Hendrycks &
Dietterich) and the relative improvement of one model over a baseline per corruption category and severity.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from convbias.base import tables
from convbias.base.run_layout import ROBUSTNESS_FOLDER
from convbias.base.storage import output_folder, save_figure, write_text

from .corruptions import CATEGORIES, CATEGORY_OF

TABLE_COLUMNS = ("model", "checkpoint", "img_size", "params_m", "clean", "C", "A", "R", "FGSM", "PGD")
PERCENT_COLUMNS = ("clean", "C", "A", "R", "FGSM", "PGD")
# what FGSM / PGD measured: eps on the 0-255 scale and as a fraction of the pixel range, PGD's steps
ATTACK_COLUMNS = ("eps_255", "eps_fraction", "pgd_steps", "pgd_step_255", "pgd_random_start")


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def corruption_summary(rows: Sequence[dict], model: str) -> float:
    """The 'C' column: mean top-1 (percent) over all corruptions and severities of `model`."""
    return _mean(row["top1"] for row in rows if row["model"] == model)


def corruption_errors(rows: Sequence[dict], baseline: str | None = None) -> list[dict]:
    """Corruption errors per category (and 'all'), as in Hendrycks & Dietterich: for each corruption
    the error (100 - top1) averaged over severities, then averaged over the category's corruptions.
    With `baseline`, also the relative CE: sum over severities of the model's errors divided by the
    baseline's, averaged the same way (their mCE with the baseline in place of AlexNet), x100."""
    errors: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        errors[row["model"], row["corruption"]].append(100.0 - row["top1"])
    models = list(dict.fromkeys(row["model"] for row in rows))
    corruptions = list(dict.fromkeys(row["corruption"] for row in rows))
    groups = {
        category: [c for c in corruptions if CATEGORY_OF.get(c, "other") == category]
        for category in (*CATEGORIES, "other")
    }
    groups = {category: names for category, names in groups.items() if names}
    groups["all"] = corruptions
    out = []
    for model in models:
        for category, names in groups.items():
            row = dict(model=model, category=category, ce=_mean(_mean(errors[model, c]) for c in names))
            if baseline is not None:
                ratios = [
                    sum(errors[model, c]) / sum(errors[baseline, c]) if sum(errors[baseline, c]) else float("nan")
                    for c in names
                ]
                row.update(baseline=baseline, relative_ce=100.0 * _mean(ratios))
            out.append(row)
    return out


def relative_improvement(rows: Sequence[dict], model: str, baseline: str) -> tuple[dict[str, float], dict[int, float]]:
    """Fig. 8.3: relative top-1 improvement (percent) of `model` over `baseline`,
    100 * (acc_model - acc_baseline) / acc_baseline, per corruption category and per severity
    (accuracies first averaged over the other axis)."""

    def mean_top1(name: str, keep: Callable[[dict], bool]) -> float:
        return _mean(row["top1"] for row in rows if row["model"] == name and keep(row))

    def gain(keep: Callable[[dict], bool]) -> float:
        base = mean_top1(baseline, keep)
        return 100.0 * (mean_top1(model, keep) - base) / base if base else float("nan")

    categories = [c for c in (*CATEGORIES, "other") if any(row["category"] == c for row in rows)]
    severities = sorted({row["severity"] for row in rows})
    return (
        {c: gain(lambda row, c=c: row["category"] == c) for c in categories},
        {s: gain(lambda row, s=s: row["severity"] == s) for s in severities},
    )


def plot_improvement(rows: Sequence[dict], model: str, baseline: str, path: str | os.PathLike) -> Path:
    """Save the two panels of Fig. 8.3 (per category, per severity) as a PNG."""
    per_category, per_severity = relative_improvement(rows, model, baseline)
    fig = Figure(figsize=(8, 3))
    left, right = fig.subplots(1, 2, sharey=True)
    left.bar(list(per_category), list(per_category.values()), color="tab:blue")
    left.set_xlabel("corruption category")
    left.set_ylabel("relative improvement (%)")
    right.bar([str(s) for s in per_severity], list(per_severity.values()), color="tab:orange")
    right.set_xlabel("corruption severity")
    for axis in (left, right):
        axis.axhline(0, color="black", linewidth=0.8)
    fig.suptitle(f"top-1 of {model} relative to {baseline}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=150)


def attack_settings(
    eps: float, attacks: Sequence[str], pgd_steps: int, pgd_step_size: float, random_start: bool = True
) -> dict:
    """A table row's record of what its FGSM / PGD accuracies measured (ATTACK_COLUMNS), so that an accuracy
    is never read without its budget; eps and pgd_step_size on the 0-255 scale."""
    settings = dict(eps_255=float(eps), eps_fraction=eps / 255)
    if "pgd" in attacks:
        settings.update(pgd_steps=pgd_steps, pgd_step_255=float(pgd_step_size), pgd_random_start=random_start)
    return settings


def _budget(eps_255: float) -> str:
    """'1/255 (0.003922)': an L-inf budget in grey levels and as a fraction of the pixel range."""
    return f"{eps_255:g}/255 ({eps_255 / 255:.4g})"


def _attack_description(rows: Sequence[dict]) -> tuple[dict[str, str], str] | None:
    """The FGSM / PGD headers and the sentence that say what the rows' attacks measured; None when the rows
    were attacked differently (the settings then get columns of their own)."""
    measured = {tuple(row.get(c) for c in ATTACK_COLUMNS) for row in rows if row.get("eps_255") is not None}
    if len(measured) > 1:
        return None
    if not measured:
        return {}, ""
    setting = dict(zip(ATTACK_COLUMNS, measured.pop()))
    eps = _budget(setting["eps_255"])
    headers = {"FGSM": f"FGSM eps {eps}"} if any(row.get("FGSM") is not None for row in rows) else {}
    sentence = f" FGSM, PGD: white-box L-inf attacks on the clean evaluation images, eps {eps}"
    if setting["pgd_steps"] is not None:
        headers["PGD"] = f"PGD eps {eps}, {setting['pgd_steps']} steps"
        start = "a random point of the eps-ball" if setting["pgd_random_start"] else "the clean image"
        sentence += f"; PGD takes {setting['pgd_steps']} steps of {setting['pgd_step_255']:g}/255 from {start}"
    return headers, sentence + "."


def _cell(value, column: str = "") -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}" if column in ATTACK_COLUMNS else f"{value:.2f}"
    return "" if value is None else str(value)


def _cells(rows: Sequence[dict], columns: Sequence[str]) -> list[dict]:
    return [{column: _cell(row.get(column), column) for column in columns} for row in rows]


def table_markdown(rows: Sequence[dict]) -> str:
    """The Table G.1-style table in markdown: the checkpoint column names the weights evaluated, the FGSM and
    PGD headers their eps and PGD's steps (columns of their own when the rows differ)."""
    described = _attack_description(rows)
    columns = TABLE_COLUMNS if described else TABLE_COLUMNS + ATTACK_COLUMNS
    headers = described[0] if described else {}
    body = ([_cell(row.get(c), c) or "-" for c in columns] for row in rows)
    return tables.markdown_table([headers.get(c, c) for c in columns], body)


def write_report(
    table: Sequence[dict], corruption_rows: Sequence[dict], output: str | os.PathLike, baseline: str | None = None
) -> dict[str, Path]:
    """Write the Table G.1-style table (robustness.csv / .md), the per-corruption accuracies
    (corruptions.csv), the corruption errors per category (corruption_errors.csv) and, with a
    baseline among the models, the Fig. 8.3 plot (improvement.png) of the first other model."""
    output = output_folder(output, owned=ROBUSTNESS_FOLDER)
    columns = TABLE_COLUMNS + ATTACK_COLUMNS
    files = dict(table_csv=tables.write_csv(_cells(table, columns), output / "robustness.csv"))
    described = _attack_description(table)
    notes = (
        "\nAccuracies are top-1 in percent. checkpoint: the weights evaluated (a run's checkpoint with its "
        "epoch); C: mean over the corruptions and severities evaluated; A, R: ImageNet-A/-R with the logits "
        "restricted to their 200 classes."
        + (described[1] if described else " FGSM, PGD: white-box L-inf attacks, eps and steps in their columns.")
        + "\n"
    )
    write_text(output / "robustness.md", table_markdown(table) + notes)
    files["table_md"] = output / "robustness.md"
    if corruption_rows:
        columns = ("model", "source", "corruption", "category", "severity", "top1")
        files["corruptions_csv"] = tables.write_csv(_cells(corruption_rows, columns), output / "corruptions.csv")
        errors = corruption_errors(corruption_rows, baseline)
        columns = ("model", "category", "ce") + (("baseline", "relative_ce") if baseline else ())
        files["errors_csv"] = tables.write_csv(_cells(errors, columns), output / "corruption_errors.csv")
        others = [row["model"] for row in table if row["model"] != baseline]
        if baseline is not None and others:
            files["plot"] = plot_improvement(corruption_rows, others[0], baseline, output / "improvement.png")
    return files
