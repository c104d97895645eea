"""R_f during training, from the runs' own logs: init_rf and rf (delta = 1, c = 3, one draw on the run's
diagnostics images) per epoch, as train.py's --diagnostics wrote them to log.jsonl. Writes trajectories.csv
(with the convention and mode set the training code measured in, given on the command line, since the logs
do not record them) and trajectories.png.

    python results/relative_stability/trajectories.py RUNS_DIR OUTPUT_DIR CONVENTION MODES
"""

import json
import sys
from pathlib import Path

import matplotlib

from convbias.tables import write_csv

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(runs: Path, output: Path, convention: str, modes: str) -> None:
    rows = []
    for log in sorted(runs.glob("*/log.jsonl")):
        records = [json.loads(line) for line in log.read_text().splitlines()]
        if not records or "init_rf" not in records[0]:
            continue
        name = log.parent.name
        config = (log.parent / "config.yaml").read_text()
        images = next((line.split(":")[1].strip() for line in config.splitlines() if "diagnostics_images" in line), "")
        label = dict(convention=convention, modes=modes, images=images, draws=1)
        rows.append(dict(run=name, epoch=0, rf=records[0]["init_rf"], eval_top1="", **label))
        rows += [
            dict(run=name, epoch=r["epoch"], rf=r.get("rf"), eval_top1=r.get("eval_top1"), **label) for r in records
        ]
    write_csv(rows, output / "trajectories.csv")
    runs_by_name = {}
    for r in rows:
        runs_by_name.setdefault(r["run"], []).append(r)
    families = sorted({name.split("_P")[0] for name in runs_by_name})
    colors = {f: plt.cm.tab10(i) for i, f in enumerate(families)}
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labelled: set[str] = set()  # one legend entry per family
    for name, points in runs_by_name.items():
        family = name.split("_P")[0]
        ax.plot(
            [p["epoch"] for p in points],
            [p["rf"] for p in points],
            "-" if "P1.0" in name else ":",
            color=colors[family],
            marker="o",
            ms=2.5,
            label=family if family not in labelled and not labelled.add(family) else None,
        )
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set(
        yscale="log",
        xlabel="epoch (0 = initialization; eFCNs: epochs after the lift)",
        ylabel="R_f",
        title=f"R_f during training (delta = 1, c = 3, {convention} convention, {modes} modes, one draw)\n"
        "solid: P = 4000, dotted: P = 1000",
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(output / "trajectories.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4])
