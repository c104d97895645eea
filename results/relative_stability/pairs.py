"""Paired contrasts after training between two groups of this study: two models at the same training-set
size, or one model at P = 4,000 against P = 1,000. Per seed (which fixes the initial weights and the
training subset) the ratio of their R_f and the difference of their test errors, then the geometric mean of
the ratios and the mean of the differences over the seeds, each with its 95% t-interval and with the
interval Bonferroni-corrected for all the comparisons of the table. Writes pairs.csv and pairs.md beside
stability.csv.

    python results/relative_stability/pairs.py results/relative_stability
"""

import sys
from pathlib import Path

from convbias.experiments.intervals import CONFIDENCE, cell, interval
from convbias.experiments.stability_study import read_rows
from convbias.tables import markdown_table, write_csv

# run-name prefixes of run_study.sh
MODEL_PAIRS = [("efcn_r1", "fcn"), ("efcn_r2", "fcn"), ("efcn_r1", "efcn_r2"), ("convit", "deit"), ("tcnn", "fcn")]
MODELS = ["cnn", "efcn_r1", "efcn_r2", "fcn", "tcnn", "convit", "deit"]
FRACTIONS = (0.25, 1.0)  # P = 1,000 and 4,000
PAIRS = [((m, f), (r, f)) for m, r in MODEL_PAIRS for f in FRACTIONS] + [((m, 1.0), (m, 0.25)) for m in MODELS]
CHECKPOINT, DELTA, CUT = "best", 1.0, 3


def by_name(rows: list[dict]) -> dict[tuple[str, float, int], dict]:
    """(run-name prefix, training fraction, seed) -> the run's row at the study's main point after training."""
    return {
        (Path(r["run"]).name.split("_P")[0], r["train_fraction"], r["seed"]): r
        for r in rows
        if r["checkpoint"] == CHECKPOINT and r["delta"] == DELTA and r["cut"] == CUT
    }


def mean_with_intervals(values: list[float], comparisons: int, log: bool) -> dict:
    """n, the (geometric) mean, its 95% t-interval and its Bonferroni interval over `comparisons` tests."""
    n, centre, low, high = interval(values, log=log)
    *_, wide_low, wide_high = interval(values, log=log, confidence=1 - (1 - CONFIDENCE) / comparisons)
    return dict(n=n, mean=centre, low=low, high=high, bonferroni_low=wide_low, bonferroni_high=wide_high)


def shared_seeds(runs: dict, group: tuple[str, float], reference: tuple[str, float]) -> list[int]:
    return sorted(s for (m, f, s) in runs if (m, f) == group and (*reference, s) in runs)


def pair_rows(rows: list[dict]) -> list[dict]:
    runs = by_name(rows)
    present = [pair for pair in PAIRS if shared_seeds(runs, *pair)]
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
            | dict(comparisons=len(present), checkpoint=CHECKPOINT, delta=DELTA, cut=CUT)
            | {k: a[0][k] for k in ("convention", "modes", "images", "draws")}
        )
    return out


def main(folder: Path) -> None:
    rows = pair_rows(read_rows(folder / "stability.csv"))
    write_csv(rows, folder / "pairs.csv")

    def cells(r: dict, key: str, digits: str) -> list[str]:
        return [
            cell(r[f"{key}_mean"], r[f"{key}_low"], r[f"{key}_high"], digits),
            cell(r[f"{key}_mean"], r[f"{key}_bonferroni_low"], r[f"{key}_bonferroni_high"], digits),
        ]

    body = [
        [r["model"], r["train_fraction"], r["reference"], r["reference_fraction"], r["n"]]
        + cells(r, "R_ratio", ".3g")
        + cells(r, "test_error_gap", "+.1f")
        for r in rows
    ]
    head = ["model", "P fraction", "reference", "ref P fraction", "n", "R_f model / reference [95%]"]
    head += ["[Bonferroni]", "test error gap, points [95%]", "[Bonferroni]"]
    first = rows[0]
    title = (
        f"Paired by seed, after training ({CHECKPOINT} checkpoint), R_f at delta = {DELTA}, c = {CUT} "
        f"(convention {first['convention']}, modes {first['modes']}, {first['images']} test images, "
        f"{first['draws']} draws). An interval excluding 1 (ratio) or 0 (gap) is a supported difference; "
        f"the Bonferroni intervals hold jointly for the table's {first['comparisons']} comparisons."
    )
    (folder / "pairs.md").write_text(title + "\n\n" + markdown_table(head, body) + "\n")
    print((folder / "pairs.md").read_text(), end="")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
