"""Seed 0's accuracies (the run the figures are drawn from) with their 95% Wilson intervals over the test
images: the test-set sampling uncertainty of each network. The spread between seeds, and the deviation
delta with its interval, are in seeds.md (5 seeds). Writes single_seed.csv and single_seed.md next to this
script.

    python results/efcn/single_seed_intervals.py
"""

import csv
from pathlib import Path

from convbias.experiments.intervals import wilson
from convbias.tables import markdown_table, write_csv

HERE = Path(__file__).parent
TEST_IMAGES = 359  # the digits test split of configs/efcn_protocol/efcn_cpu.yaml (measure_test_samples: null)
ACCURACIES = ("final_test_acc", "local_only_test_acc", "off_local_only_test_acc")


def _read(name: str) -> list[dict]:
    with open(HERE / name) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def main() -> None:
    base = _read("baselines.csv")[0]
    rows = [dict(model="CNN", relax_time="", final_test_acc=base["cnn_final_test_acc"])]
    rows.append(dict(model="standard FCN", relax_time=""))
    rows[-1].update(final_test_acc=base["fcn_final_test_acc"], local_only_test_acc=base["fcn_local_only_test_acc"])
    rows[-1]["off_local_only_test_acc"] = base["fcn_off_local_only_test_acc"]
    for r in _read("relax_times.csv"):
        rows.append(dict(model="eFCN", relax_time=int(r["relax_time"])))
        rows[-1].update({k: r[k] for k in ACCURACIES})
    for row in rows:
        row.update(seeds=1, test_images=TEST_IMAGES)
        for key in ACCURACIES:
            if key in row:
                row[f"{key}_low"], row[f"{key}_high"] = wilson(row[key], TEST_IMAGES)
    write_csv(rows, HERE / "single_seed.csv")

    def acc(row: dict, key: str) -> str:
        return f"{row[key]:.2f} [{row[f'{key}_low']:.1f}, {row[f'{key}_high']:.1f}]" if key in row else ""

    body = [[r["model"], r["relax_time"], 1, acc(r, "final_test_acc"), acc(r, "off_local_only_test_acc")] for r in rows]
    head = ["model", "t_w", "seeds", "final test acc % [95% Wilson, 359 images]", "off-local only acc %"]
    text = (
        "Seed 0 (the figures' run): accuracies with their 95% Wilson interval over the 359 test images "
        "(test-set sampling only); the spread between seeds and the deviation delta: seeds.md (5 seeds).\n\n"
        + markdown_table(head, body)
    )
    (HERE / "single_seed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
