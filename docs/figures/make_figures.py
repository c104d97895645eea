"""Redraw the PNGs of docs/figures.md with the package's own plotting functions.

    python docs/figures/make_figures.py          # from the repository root; about 20 s on one CPU core

Real data where the repository holds it (the committed tables under results/), small synthetic inputs of
the same shapes elsewhere (the attention maps come from an untrained ConViT's real attention). Everything
is seeded, so a rerun gives the same figures. The package saves at 110-130 dpi; the copies here are saved
at DPI to keep the repository small.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import timm
import torch
from matplotlib.figure import Figure
from sklearn.datasets import load_digits

from convbias.evaluation import figures
from convbias.studies.efcn_protocol import figures as efcn_figures
from convbias.studies.phase_diagram import study as phase_diagram
from convbias.studies.regimes import study as regimes
from convbias.studies.robustness import report as robustness_report
from convbias.studies.robustness.corruptions import CATEGORIES, SEVERITIES
from convbias.studies.stability import figures as stability_figures
from convbias.studies.stability import study
from convbias.studies.sweep import figures as sweep_figures
from convbias.studies.sweep import runs as sweep_runs
from convit import diagnostics

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[1] / "results"
DPI = 80


@contextmanager
def docs_dpi() -> Iterator[None]:
    """Every figure saved inside is saved at DPI (the plotting functions choose their own dpi)."""
    save = Figure.savefig

    def at_docs_dpi(fig: Figure, path, *args, **kwargs):
        return save(fig, path, *args, **(kwargs | {"dpi": DPI}))

    Figure.savefig = at_docs_dpi
    try:
        yield
    finally:
        Figure.savefig = save


def _keep(scratch: Path, names: dict[str, str]) -> None:
    """Copy the figures of a function that writes into a folder (with its own file names) from scratch."""
    for source, target in names.items():
        shutil.copyfile(scratch / source, HERE / target)


def stability(scratch: Path) -> None:
    """The committed (delta, c) grid of results/relative_stability (35 runs, 5 seeds per group)."""
    grid = RESULTS / "relative_stability" / "grid"
    rows, layer_rows = (
        study.read_rows(grid / "stability.csv"),
        study.read_rows(grid / "stability_layers.csv", study.LAYER_COLUMNS),
    )
    first = rows[0]
    settings = study.Settings(
        checkpoints=list(dict.fromkeys(r["checkpoint"] for r in rows)),
        images=first["images"],
        deltas=sorted({r["delta"] for r in rows}),
        cuts=sorted({r["cut"] for r in rows}),
        main_delta=1.0,
        convention=first["convention"],
        modes=first["modes"],
        draws=first["draws"],
        normalize=False,
        interpolation="bilinear",
        chunk_size=64,
        seed=0,
        device="cpu",
    )
    digit = torch.tensor(load_digits().images[0], dtype=torch.float32)[None, None] / 16
    image = torch.nn.functional.interpolate(digit, size=28, mode="bilinear", align_corners=False)
    runs = [study.Run(grid, {}, image, None, {})]
    stability_figures.plots(rows, layer_rows, runs, settings, scratch)
    _keep(
        scratch,
        {name: name for name in ("rf_vs_delta.png", "rf_per_layer.png", "rf_vs_error.png", "deformed_examples.png")},
    )


def efcn(scratch: Path) -> None:
    """results/efcn (one protocol run); the first-layer filters, which need the trained weights, are synthetic."""
    tables = {name: sweep_runs.read_runs_like(RESULTS / "efcn" / f"{name}.csv") for name in ("curves", "relax_times")}
    baselines = sweep_runs.read_runs_like(RESULTS / "efcn" / "baselines.csv")[0]
    rows = tables["relax_times"]
    times = [r["relax_time"] for r in rows]
    efcn_figures.training_curves(tables["curves"], times, HERE / "efcn_training_curves.png")
    efcn_figures.accuracy_and_landscape(rows, baselines, HERE / "efcn_accuracy_gradient_hessian.png")
    efcn_figures.deviation(rows, baselines, HERE / "efcn_deviation.png")
    efcn_figures.local_contributions(rows, HERE / "efcn_local_offlocal.png")
    efcn_figures.interpolation(
        sweep_runs.read_runs_like(RESULTS / "efcn" / "interpolation.csv"), HERE / "efcn_interpolation.png"
    )
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[:28, :28]
    local = np.exp(-((ys - 14) ** 2 + (xs - 14) ** 2) / 4.0)[None]  # a 3x3-ish receptive field at the centre
    start = local + 1e-3 * rng.normal(size=(1, 28, 28))
    trained = start + 2e-2 * rng.normal(size=(1, 28, 28))
    noise = 0.05 * rng.normal(size=(1, 28, 28))
    filters = {
        "eFCN t_w=12": [("at relax time", start), ("after 100 epochs", trained)],
        "FCN": [("initialization", noise), ("after 100 epochs", noise + 0.3 * local), ("difference", 0.3 * local)],
    }
    efcn_figures.filter_heatmaps(filters, HERE / "efcn_first_layer_filters.png")


def sweeps(scratch: Path) -> None:
    """The sweep report of results/sample_efficiency_mnist and of the phase diagram's grid, regimes.png of
    results/regimes, and the phase diagram of results/phase_diagram."""
    runs = sweep_runs.read_runs(RESULTS / "sample_efficiency_mnist" / "runs.csv")
    sweep_figures.plot_sample_efficiency(runs, sweep_runs.choose_baseline(runs), HERE / "sample_efficiency.png")
    sweep_figures.plot_parameter_sweep(
        sweep_runs.read_runs(RESULTS / "phase_diagram" / "runs.csv"), HERE / "parameter_sweep.png"
    )
    rows = sweep_runs.read_runs_like(RESULTS / "regimes" / "regimes.csv")
    regimes.plot(rows, regimes.over_seeds(rows), HERE / "regimes.png")
    phase_diagram.plot(phase_diagram.read_cells(RESULTS / "phase_diagram" / "cells.csv"), scratch)
    _keep(scratch, {name: name for name in ("phase_diagram.png", "double_descent.png")})


def _gating_log(layers: int = 6, heads: int = 9, epochs: int = 30) -> list[dict]:
    """A synthetic log.jsonl of a ConViT-S-like run: heads leave position for content at their own pace; the
    first epoch's record holds the values at initialization too (init_<key>), as train.py logs them."""
    rng = np.random.default_rng(1)
    pace = np.linspace(0.2, 3.0, heads)
    records = []
    for epoch in range(epochs + 1):
        record: dict = {}
        for layer in range(1, layers + 1):
            record[f"nonlocality/layer{layer}"] = 1.5 + 0.2 * layer + 0.04 * epoch * layer / layers
            decay = np.exp(-pace * (epoch / epochs) * (1 + layer / layers))
            for metric, values in (("gating", 0.95 * decay), ("span", 1.0 + 3.0 * (1 - decay))):
                values = values + rng.normal(0, 0.01, heads)
                record[f"{metric}/layer{layer}"] = float(values.mean())
                record.update({f"{metric}/layer{layer}/head{h}": float(v) for h, v in enumerate(values, start=1)})
        if epoch == 0:
            initial = {f"init_{key}": value for key, value in record.items()}
        else:
            records.append({"epoch": epoch, **(initial if epoch == 1 else {}), **record})
    return records


def _deviation_log(start: float, epochs: int = 30) -> list[dict]:
    """A synthetic log.jsonl of an eFCN (`start` 0: at its embedding) or of its FCN (`start` near 1)."""
    layers = ("conv1", "conv2", "conv3")
    value = {layer: start * (0.9 + 0.05 * i) for i, layer in enumerate(layers)}
    records = []
    for epoch in range(1, epochs + 1):
        grown = {layer: v + (1 - v) * 0.02 * (3 - i) * epoch / epochs for i, (layer, v) in enumerate(value.items())}
        record = {"epoch": epoch, **{f"deviation/{layer}": v for layer, v in grown.items()}}
        record["deviation/total"] = float(np.mean(list(grown.values())))
        if epoch == 1:
            record |= {f"init_deviation/{layer}": v for layer, v in value.items()}
            record["init_deviation/total"] = float(np.mean(list(value.values())))
        records.append(record)
    return records


def locality(scratch: Path) -> None:
    """`convbias-diagnostics` figures: synthetic logs, and an untrained ConViT's attention of one query."""
    records = _gating_log()
    deit = [
        {
            "epoch": r["epoch"],
            **{k: 1.3 * v for k, v in r.items() if k.removeprefix("init_").startswith("nonlocality/")},
        }
        for r in records
    ]
    figures.plot_nonlocality({"DeiT": deit, "ConViT": records}, HERE / "nonlocality.png")
    figures.plot_per_head(records, "gating", HERE / "gating.png", title="ConViT (synthetic log)")
    figures.plot_per_head(records, "span", HERE / "span.png", title="ConViT (synthetic log)")
    figures.plot_deviation({"eFCN": _deviation_log(0.0), "FCN": _deviation_log(0.9)}, HERE / "deviation.png")
    torch.manual_seed(0)
    model = timm.create_model("convit_tiny", img_size=32, patch_size=4, num_classes=10).eval()
    digit = torch.tensor(load_digits().images[3], dtype=torch.float32)[None, None] / 16
    image = torch.nn.functional.interpolate(digit, size=32, mode="bilinear", align_corners=False)[0].expand(3, -1, -1)
    maps, queries, gates = diagnostics.query_maps(model, image, layers=[1, 10, 11])
    figures.plot_attention_maps(image, maps, queries, HERE / "attention_maps.png", gates=gates)


def corruptions(scratch: Path) -> None:
    """improvement.png of `convbias-robustness --compare-model`, from synthetic corruption accuracies."""
    rng = np.random.default_rng(2)
    rows = [
        dict(model=model, source="generated", corruption=name, category=category, severity=severity)
        | dict(top1=float(80 - 8 * severity + gain * math.sqrt(severity) + rng.normal(0, 1)))
        for model, gain in (("deit_tiny", 0.0), ("convit_tiny", 3.0))
        for category, names in CATEGORIES.items()
        for name in names
        for severity in SEVERITIES
    ]
    robustness_report.plot_improvement(rows, "convit_tiny", "deit_tiny", HERE / "improvement.png")


PARTS: tuple[Callable[[Path], None], ...] = (stability, efcn, sweeps, locality, corruptions)


def main() -> None:
    with docs_dpi(), tempfile.TemporaryDirectory() as scratch:
        for part in PARTS:
            part(Path(scratch))
    print("\n".join(f"{p.name}: {p.stat().st_size // 1024} KiB" for p in sorted(HERE.glob("*.png"))))


if __name__ == "__main__":
    main()
