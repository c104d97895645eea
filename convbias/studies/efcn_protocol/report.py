"""The protocol's report.md, beside its tables and figures, as a sweep has its own (convbias.studies.sweep.report):
what was run, the baselines and each relax time as markdown tables, the interpolations' barriers, the figures
with what each shows, and what the command cost in time and disk.

One protocol output is one seed: each accuracy carries its 95% Wilson interval over the test images (test-set
sampling only); the spread between seeds is `--stage summarize`'s (seeds.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convbias.base.run_layout import CHECKPOINTS_DIR
from convbias.base.storage import write_text
from convbias.base.tables import markdown_table

from ..intervals import CONFIDENCE, cell, wilson
from ..sweep.report import REPORT_NAME

# (file, what it shows), in the order of the thesis
FIGURES = (
    (
        "fig6_2_training_curves.png",
        "Fig. 6.2: train loss and test accuracy over epochs, CNN, standard FCN and each eFCN",
    ),
    (
        "fig6_3_accuracy_gradient_hessian.png",
        "Fig. 6.3: the eFCNs' final accuracy against t_w, and their gradient norm and top Hessian eigenvalue at the "
        "start and end of their training",
    ),
    (
        "fig6_4_deviation.png",
        "Fig. 6.4: the off-local weight fraction delta against t_w, the initial loss and accuracy",
    ),
    ("fig6_5_local_offlocal.png", "Fig. 6.5: test accuracy with the local blocks only, the off-local ones only, both"),
    ("fig6_6_6_7_first_layer_filters.png", "Figs. 6.6, 6.7: one first-layer unit's weights on the input image"),
    ("figE6_interpolation.png", "Fig. E.6: train loss and test accuracy along the paths from the CNN to the eFCN"),
)
MEGABYTE = 1e6


def _accuracy(value: float, images: int) -> str:
    """An accuracy (%) with its 95% Wilson interval over ``images`` test images."""
    return cell(value, *wilson(value, images), ".2f")


def duration(seconds: float) -> str:
    """A stage's time as the protocol's lines and report say it."""
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _size(path: Path) -> int:
    """Bytes of the files under ``path``, links not followed (a run's last and best name points it holds)."""
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(folder, name)).st_size for name in files)
    return total


def _setup(cfg: dict[str, Any], times: Sequence[int], images: int) -> str:
    kwargs = ", ".join(f"{k}={v}" for k, v in cfg["model_kwargs"].items())
    lr = (cfg["cnn_lr"], cfg["efcn_lr"]) if cfg["optimizer"] == "sgd" else (cfg["adam_lr"], cfg["adam_lr"])
    size = f" at {cfg['img_size']} px" if cfg.get("img_size") else ""
    return (
        f"{cfg['model']}{f' ({kwargs})' if kwargs else ''} on {cfg['dataset']}{size}, seed {cfg['seed']}, batch "
        f"{cfg['batch_size']}, {cfg['optimizer']}: the CNN trained {cfg['cnn_epochs']} epochs at lr {lr[0]:g}, each "
        f"eFCN and the standard FCN {cfg['efcn_epochs']} epochs at lr {lr[1]:g}; relax times t_w = "
        f"{', '.join(map(str, times))}. One protocol run (one seed): each accuracy is measured on {images} test "
        f"images and shown with its {CONFIDENCE:.0%} Wilson interval (test-set sampling only; the spread over seeds "
        "is `--stage summarize`'s)."
    )


def _baselines(baselines: dict[str, Any], images: int) -> str:
    body = [
        ["CNN", _accuracy(baselines["cnn_final_test_acc"], images), f"{baselines['cnn_best_test_acc']:.2f}", "0"],
        [
            "standard FCN",
            _accuracy(baselines["fcn_final_test_acc"], images),
            f"{baselines['fcn_best_test_acc']:.2f}",
            f"{baselines['fcn_deviation_total']:.3g}",
        ],
    ]
    head = ["model", f"final test acc % [{CONFIDENCE:.0%} Wilson]", "best test acc %", "deviation delta"]
    return markdown_table(head, body)


def _relax_times(rows: list[dict[str, Any]], images: int) -> str:
    head = [
        "t_w",
        "CNN at t_w: test acc %",
        f"eFCN final test acc % [{CONFIDENCE:.0%} Wilson]",
        "eFCN - CNN at t_w (points)",
        "deviation delta",
        "weight-sharing violation",
        "local blocks only %",
        "off-local blocks only %",
        "|grad L| start -> end",
        "lambda_max start -> end",
    ]
    body = [
        [
            r["relax_time"],
            f"{r['cnn_test_acc_at_relax_time']:.2f}",
            _accuracy(r["final_test_acc"], images),
            f"{r['final_test_acc'] - r['cnn_test_acc_at_relax_time']:+.2f}",
            f"{r['deviation_total']:.3g}",
            f"{r['weight_sharing_total']:.3g}",
            f"{r['local_only_test_acc']:.2f}",
            f"{r['off_local_only_test_acc']:.2f}",
            f"{r['grad_norm_start']:.3g} -> {r['grad_norm_end']:.3g}",
            f"{r['hessian_top_start']:.3g} -> {r['hessian_top_end']:.3g}",
        ]
        for r in rows
    ]
    return markdown_table(head, body)


def _interpolations(points: list[dict[str, Any]]) -> str:
    """Per relax time and path: the highest train loss on the path above the higher of its two ends (a barrier
    when positive), and the lowest test accuracy on it."""
    body = []
    for t in sorted({p["relax_time"] for p in points}):
        for method in dict.fromkeys(p["method"] for p in points):
            path = sorted(
                (p for p in points if p["relax_time"] == t and p["method"] == method), key=lambda p: p["alpha"]
            )
            if not path:
                continue
            ends = max(path[0]["train_loss"], path[-1]["train_loss"])
            highest = max(path, key=lambda p: p["train_loss"])
            lowest = min(p["test_acc"] for p in path)
            above = highest["train_loss"] - ends
            barrier = f"{above:+.3g} (alpha {highest['alpha']:.2g})" if above > 0 else "none"
            body.append([t, method, barrier, f"{lowest:.2f}"])
    return markdown_table(["t_w", "path", "train loss above its ends, at most", "lowest test acc %"], body)


def _cost(out: Path, stages: Sequence[Any]) -> str:
    """The stages of this command with their time, and the folder's size with what its runs' checkpoints hold."""
    lines = []
    if stages:
        body = [
            [i + 1, s.what, "already complete" if s.seconds is None else duration(s.seconds)]
            for i, s in enumerate(stages)
        ]
        total = sum(s.seconds or 0.0 for s in stages)
        lines.append(
            f"This command ran {len(stages)} stages in {duration(total)}:\n\n"
            + markdown_table(["stage", "what", "time"], body)
        )
    held = sum(_size(run / CHECKPOINTS_DIR) for run in sorted(out.iterdir()) if (run / CHECKPOINTS_DIR).is_dir())
    lines.append(
        f"The folder holds {_size(out) / MEGABYTE:.1f} MB, {held / MEGABYTE:.1f} MB of them the runs' checkpoints (each "
        "run's --save-epochs snapshots that the analysis reads, and one resume point, which holds the final weights, "
        "with its best when that is another)."
    )
    return "\n".join(lines)


def write_report(
    out: Path,
    cfg: dict[str, Any],
    times: Sequence[int],
    rows: list[dict[str, Any]],
    baselines: dict[str, Any],
    interpolation_rows: list[dict[str, Any]],
    test_images: int,
    stages: Sequence[Any] = (),
) -> Path:
    """report.md in ``out`` from the protocol's rows (as written to its CSVs), the figures there and the
    command's ``stages`` (protocol.Stage: what, seconds; None where there was nothing to do)."""
    sections = [
        "# eFCN relax-time protocol report\n\n" + _setup(cfg, times, test_images),
        "## Baselines\n\n" + _baselines(baselines, test_images),
        "## Relax times (Figs. 6.3-6.5)\n\n" + _relax_times(rows, test_images),
        "## Interpolations from the CNN to the eFCN (App. E.3)\n\n" + _interpolations(interpolation_rows),
        "## Figures\n\n"
        + "\n\n".join(f"{caption}\n\n![{name}]({name})" for name, caption in FIGURES if (out / name).is_file()),
        "## Cost\n\n" + _cost(out, stages),
    ]
    write_text(out / REPORT_NAME, "\n\n".join(s.rstrip("\n") for s in sections) + "\n", owner=out)
    return out / REPORT_NAME
