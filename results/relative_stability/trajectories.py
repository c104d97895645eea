"""R_f during training, from the runs' own logs: init_rf and rf (delta = 1, c = 3, one draw on the run's
diagnostics images) per epoch, as train.py's --diagnostics wrote them to log.jsonl. Writes trajectories.csv
(per run and epoch, with the convention and mode set the training code measured in, given on the command
line, since the logs do not record them), trajectories_summary.csv (per group and epoch: the geometric mean
of R_f over the group's seeds with its 95% t-interval, and the mean test top-1 with its interval) and
trajectories.png (the group means with their intervals).

    python results/relative_stability/trajectories.py RUNS_DIR OUTPUT_DIR CONVENTION MODES
"""

import json
import sys
from pathlib import Path

import matplotlib

from convbias.experiments.intervals import interval
from convbias.tables import write_csv

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def run_rows(runs: Path, label: dict) -> list[dict]:
    """One row per run and epoch (epoch 0 = init_rf), from every run whose log has R_f diagnostics."""
    rows = []
    for log in sorted(runs.glob("*/log.jsonl")):
        records = [json.loads(line) for line in log.read_text().splitlines()]
        if not records or "init_rf" not in records[0]:
            continue
        name = log.parent.name
        config = (log.parent / "config.yaml").read_text()
        images = next((line.split(":")[1].strip() for line in config.splitlines() if "diagnostics_images" in line), "")
        rows.append(dict(run=name, epoch=0, rf=records[0]["init_rf"], eval_top1="", **label, images=images))
        rows += [
            dict(run=name, epoch=r["epoch"], rf=r.get("rf"), eval_top1=r.get("eval_top1"), **label, images=images)
            for r in records
        ]
    return rows


def summary_rows(rows: list[dict]) -> list[dict]:
    """Per group (the run name without its seed) and epoch: n, R_f's geometric mean [95% t-interval on log
    R_f] and top-1's mean [95% t-interval] over the seeds."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["run"].rsplit("_seed", 1)[0], r["epoch"]), []).append(r)
    summary = []
    for (group, epoch), members in cells.items():
        n, rf, rf_low, rf_high = interval([m["rf"] for m in members], log=True)
        top1 = [m["eval_top1"] for m in members if m["eval_top1"] != ""]
        _, acc, acc_low, acc_high = interval(top1) if top1 else (0, "", "", "")
        summary.append(
            dict(
                group=group,
                epoch=epoch,
                n=n,
                rf=rf,
                rf_low=rf_low,
                rf_high=rf_high,
                eval_top1=acc,
                eval_top1_low=acc_low,
                eval_top1_high=acc_high,
                **{k: members[0][k] for k in ("convention", "modes", "images", "draws")},
            )
        )
    return summary


def main(runs: Path, output: Path, convention: str, modes: str) -> None:
    rows = run_rows(runs, dict(convention=convention, modes=modes, draws=1))
    write_csv(rows, output / "trajectories.csv")
    summary = summary_rows(rows)
    write_csv(summary, output / "trajectories_summary.csv")
    groups = sorted({s["group"] for s in summary})
    families = sorted({g.split("_P")[0] for g in groups})
    colors = {f: plt.cm.tab10(i) for i, f in enumerate(families)}
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for group in groups:
        points = sorted((s for s in summary if s["group"] == group), key=lambda s: s["epoch"])
        epochs = [p["epoch"] for p in points]
        family = group.split("_P")[0]
        ax.plot(
            epochs,
            [p["rf"] for p in points],
            "-" if "P1.0" in group else ":",
            color=colors[family],
            marker="o",
            ms=2.5,
            label=f"{group} (n = {min(p['n'] for p in points)})",
        )
        ax.fill_between(
            epochs,
            [p["rf_low"] for p in points],
            [p["rf_high"] for p in points],
            color=colors[family],
            alpha=0.15,
            lw=0,
        )
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set(
        yscale="log",
        xlabel="epoch (0 = initialization; eFCNs: epochs after the lift)",
        ylabel="R_f",
        title=f"R_f during training (delta = 1, c = 3, {convention} convention, {modes} modes, one draw)\n"
        "geometric mean over seeds, shaded: 95% t-interval; solid: P = 4000, dotted: P = 1000",
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(output / "trajectories.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4])
