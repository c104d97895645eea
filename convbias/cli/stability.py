"""Relative stability to diffeomorphisms R_f of trained runs, per layer and against test error (issue 12).

    convbias-stability runs/cnn runs/convit runs/fcn --checkpoints init best --images 500 \\
        --deltas 0.5 0.75 1 1.5 --cuts 3 5 --output stability/

Each RUN is a train.py output folder: its config.yaml rebuilds the model and the test (validation) set,
its checkpoints give the weights (`best`, `last`, `epoch_N` from --save-epochs, `init` = epoch_0). For
every run and checkpoint: R_f (and D_f, G_f) at every (delta, c) of the grid, R_f of every block at
(--main-delta, first cut), and the test error on the whole test set. Writes OUTPUT/stability.csv (one
row per run, checkpoint, delta, c), stability_layers.csv, stability.md (the table at the main point),
rf_vs_delta.png, rf_per_layer.png, rf_vs_error.png (log-log, with the eps = 0.2 sqrt(R_f) line of
Petrini et al. 2021) and deformed_examples.png. Runs that differ only by seed are averaged
geometrically in the plots, as in the paper. Bad input prints one `error: ...` line and exits 2.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from convbias.engine.config import OptionParser
from convbias.engine.data import build_datasets
from convbias.engine.modeling import check_model_name, create_model
from convbias.engine.run_dir import WHICH, choose_checkpoint, read_run_config
from convbias.evaluation import diffeo
from convbias.evaluation.stability import STATISTICS, Stability, relative_stability
from convbias.families import load_families
from convbias.weights import load_weights

CHECKPOINT_FORMS = "best, last, init (= epoch_0) or epoch_N (a --save-epochs snapshot)"
ERROR_LAW = 0.2  # Petrini et al. 2021, CIFAR-10 across 15 architectures: test error ~ 0.2 sqrt(R_f)
EXAMPLE_TEMPERATURES = 3  # rows of deformed_examples.png: T_min, their geometric middle, T_max


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(
        prog="convbias-stability",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="train.py output folders (config.yaml + checkpoints/)")
    p.add_argument("--checkpoints", nargs="+", default=["init", "last"], metavar="NAME", help=CHECKPOINT_FORMS)
    p.add_argument("--images", type=int, default=500, help="test images R_f is measured on (the first N)")
    p.add_argument(
        "--deltas", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.5], help="typical displacements, pixels"
    )
    p.add_argument("--cuts", type=int, nargs="+", default=[3, 5], help="high-frequency cut-offs c")
    p.add_argument(
        "--main-delta", type=float, default=1.0, help="delta of the table, the per-layer curve and the error plot"
    )
    p.add_argument("--statistic", default="median", choices=STATISTICS)
    p.add_argument("--normalize", action="store_true", help="divide D_f and G_f by <||f(x) - f(z)||^2> over test pairs")
    p.add_argument("--interpolation", default="bilinear", choices=diffeo.INTERPOLATIONS)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="diffeomorphisms and noise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--output", default="stability", help="output folder")
    return p


@dataclass
class Run:
    path: Path
    cfg: dict
    images: torch.Tensor
    targets: torch.Tensor
    test: Any
    models: dict[str, torch.nn.Module]  # checkpoint name -> model with its weights

    @property
    def group(self) -> str:
        """What runs averaged over seeds share: the model (an eFCN with the name of the CNN snapshot it was
        lifted from, epoch_E, not its run) and the training fraction; the other kwargs are in the CSV."""
        checkpoint = (self.cfg.get("model_kwargs") or {}).get("cnn_checkpoint")
        lifted = f" @{Path(checkpoint).stem}" if checkpoint else ""
        return f"{self.cfg['model']}{lifted} f={self.cfg.get('train_fraction', 1.0):g}"


def _checkpoint_path(run: Path, name: str) -> Path:
    """last / best through the engine's run_dir (as every command that reuses a run), else a snapshot."""
    if name in WHICH:
        return choose_checkpoint(run, name).weights
    path = run / "checkpoints" / f"epoch_{0 if name == 'init' else int(name[6:])}.safetensors"
    if not path.is_file():
        hint = " (train with --save-epochs 0)" if name == "init" else ""
        raise ValueError(f"run {run} has no checkpoint {name!r}: {path} not found{hint}")
    return path


def _load_run(path: Path, args) -> Run:
    cfg = read_run_config(path)
    check_model_name(cfg["model"], f"{path}/config.yaml: model")
    bundle = build_datasets(dict(cfg, no_aug=True))
    if len(bundle.val) == 0:
        raise ValueError(f"run {path}: its test set ({cfg['dataset']}) is empty")
    count = min(args.images, len(bundle.val))
    images = torch.stack([bundle.val[i][0] for i in range(count)])
    for cut in args.cuts:
        for delta in sorted(set(args.deltas) | {args.main_delta}):
            diffeo.temperature(delta, cut, images.shape[-2:])  # the whole grid is checked before any work
    models = {}
    for name in args.checkpoints:
        weights = _checkpoint_path(path, name)
        model = create_model(cfg, bundle.num_classes, bundle.in_chans)
        models[name] = load_weights(model, weights).to(args.device).eval()
    targets = torch.tensor([bundle.val[i][1] for i in range(count)])
    return Run(path, cfg, images, targets, bundle.val, models)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.images < 1:
        raise ValueError(f"--images must be >= 1, got {args.images}")
    if args.chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    for name in args.checkpoints:
        if name not in (*WHICH, "init") and not re.fullmatch(r"epoch_\d+", name):
            raise ValueError(f"--checkpoints {name}: expected {CHECKPOINT_FORMS}")
    return args


@torch.no_grad()
def test_error(model: torch.nn.Module, dataset, device: str, batch_size: int) -> float:
    """Top-1 error (%) on the whole test set."""
    wrong = total = 0
    for start in range(0, len(dataset), batch_size):
        batch = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        images = torch.stack([b[0] for b in batch]).to(device)
        labels = torch.tensor([b[1] for b in batch], device=device)
        wrong += int((model(images).argmax(1) != labels).sum())
        total += len(batch)
    return 100.0 * wrong / total


def measure(runs: list[Run], args) -> tuple[list[dict], list[dict]]:
    rows, layer_rows = [], []
    main_cut = args.cuts[0]
    for run in runs:
        for name, model in run.models.items():
            error = test_error(model, run.test, args.device, args.chunk_size)
            base = dict(
                run=str(run.path),
                group=run.group,
                model=run.cfg["model"],
                seed=run.cfg.get("seed"),
                train_fraction=run.cfg.get("train_fraction"),
                checkpoint=name,
                test_error=error,
            )
            for cut in args.cuts:
                for delta in sorted(set(args.deltas) | {args.main_delta}):
                    main = delta == args.main_delta and cut == main_cut
                    result: Stability = relative_stability(
                        model,
                        run.images,
                        delta=delta,
                        cut=cut,
                        statistic=args.statistic,
                        normalize=args.normalize,
                        per_layer=main,
                        chunk_size=args.chunk_size,
                        seed=args.seed,
                        interpolation=args.interpolation,
                    )
                    rows.append(dict(base, delta=delta, cut=cut, T=result.T, D=result.D, G=result.G, R=result.R))
                    if main:
                        depth = len(result.layers) + 1
                        for i, (d, g, r) in enumerate(result.layers + [(result.D, result.G, result.R)]):
                            layer_rows.append(dict(base, depth=i, relative_depth=(i + 1) / depth, D=d, G=g, R=r))
            print(
                f"{run.path} [{name}]: test error {error:.2f}%, R_f(delta={args.main_delta}, c={main_cut}) = "
                f"{next(r['R'] for r in reversed(rows) if r['delta'] == args.main_delta and r['cut'] == main_cut):.3g}"
            )
    return rows, layer_rows


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _geomean(values: list[float]) -> float:
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, finite)) / len(finite)) if finite else float("nan")


def _fmt(value: float) -> str:
    return "undefined" if value != value else f"{value:.3g}"


def markdown(rows: list[dict], args) -> str:
    """One line per run: test error and R_f, D_f, G_f at the main point for every checkpoint."""
    main = [r for r in rows if r["delta"] == args.main_delta and r["cut"] == args.cuts[0]]
    by_run: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in main:
        by_run[r["run"]][r["checkpoint"]] = r
    names = list(args.checkpoints)
    head = ["run", "model", "P", "seed"] + [f"{k} {n}" for n in names for k in ("error %", "R_f", "D_f", "G_f")]
    lines = [
        f"R_f at delta = {args.main_delta}, c = {args.cuts[0]} ({args.statistic}, {args.images} test images"
        f"{', normalized' if args.normalize else ''})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for run, per in by_run.items():
        first = next(iter(per.values()))
        cells = [Path(run).name, first["model"], f"{first['train_fraction']:g}", str(first["seed"])]
        for n in names:
            r = per[n]
            cells += [f"{r['test_error']:.1f}", _fmt(r["R"]), _fmt(r["D"]), _fmt(r["G"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], layer_rows: list[dict], runs: list[Run], args, output: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in rows))
    colors = {g: plt.cm.tab20(i % 20) for i, g in enumerate(groups)}
    styles = {name: ("--" if name == "init" else "-") for name in args.checkpoints}
    files = []

    fig, axes = plt.subplots(1, len(args.cuts), figsize=(5 * len(args.cuts), 4), squeeze=False)
    for ax, cut in zip(axes[0], args.cuts):
        for g in groups:
            for name in args.checkpoints:
                points = defaultdict(list)
                for r in rows:
                    if r["group"] == g and r["checkpoint"] == name and r["cut"] == cut:
                        points[r["delta"]].append(r["R"])
                deltas = sorted(points)
                ax.plot(
                    deltas,
                    [_geomean(points[d]) for d in deltas],
                    styles[name],
                    color=colors[g],
                    marker="o",
                    ms=3,
                    label=_label(g, name, args),
                )
        ax.set(xlabel="delta (pixels)", ylabel="R_f", yscale="log", title=f"c = {cut}")
        ax.axhline(1.0, color="gray", lw=0.5)
    _legend(axes[0][-1], args)
    files.append(_save(fig, output / "rf_vs_delta.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for g in groups:
        for name in args.checkpoints:
            points = defaultdict(list)
            for r in layer_rows:
                if r["group"] == g and r["checkpoint"] == name:
                    points[r["relative_depth"]].append(r["R"])
            depths = sorted(points)
            ax.plot(
                depths,
                [_geomean(points[d]) for d in depths],
                styles[name],
                color=colors[g],
                marker="o",
                ms=3,
                label=_label(g, name, args),
            )
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set(
        xlabel="relative depth (block / number of blocks; 1 = logits)",
        ylabel="R_f",
        yscale="log",
        title=f"R_f per layer, delta = {args.main_delta}, c = {args.cuts[0]}",
    )
    _legend(ax, args)
    files.append(_save(fig, output / "rf_per_layer.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    main = [
        r
        for r in rows
        if r["delta"] == args.main_delta and r["cut"] == args.cuts[0] and r["R"] > 0 and r["test_error"] > 0
    ]
    markers = dict(zip(sorted({r["train_fraction"] for r in main}), "os^Dv<>"))
    for g in groups:
        for name in args.checkpoints:
            pts = [r for r in main if r["group"] == g and r["checkpoint"] == name]
            if pts:
                ax.scatter(
                    [p["R"] for p in pts],
                    [p["test_error"] / 100 for p in pts],
                    color=colors[g],
                    marker=markers[pts[0]["train_fraction"]],
                    facecolors="none" if name == "init" else None,
                    label=_label(g, name, args),
                    s=25,
                )
    if main:
        lo, hi = min(r["R"] for r in main), max(r["R"] for r in main)
        grid = [lo * (hi / lo) ** (i / 20) for i in range(21)] if hi > lo else [lo]
        ax.plot(grid, [ERROR_LAW * math.sqrt(x) for x in grid], "k--", lw=0.8, label="0.2 sqrt(R_f) (CIFAR-10, paper)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=f"R_f (delta = {args.main_delta}, c = {args.cuts[0]})",
        ylabel="test error",
        title="test error vs relative stability",
    )
    _legend(ax, args)
    files.append(_save(fig, output / "rf_vs_error.png"))

    image = runs[0].images[0]
    fig, axes = plt.subplots(
        EXAMPLE_TEMPERATURES,
        len(args.cuts) + 1,
        figsize=(2 * (len(args.cuts) + 1), 2 * EXAMPLE_TEMPERATURES),
        squeeze=False,
    )
    generator = torch.Generator().manual_seed(args.seed)
    for row in range(EXAMPLE_TEMPERATURES):
        _show(axes[row][0], image, "original" if row == 0 else "")
        for col, cut in enumerate(args.cuts, start=1):
            t_min, t_max = diffeo.temperature_range(cut, image.shape[-2:])
            T = t_min * (t_max / t_min) ** (row / (EXAMPLE_TEMPERATURES - 1))
            delta = diffeo.typical_displacement(T, cut, image.shape[-2:])
            _show(
                axes[row][col],
                diffeo.deform(image, T, cut, generator=generator, interpolation=args.interpolation),
                f"c={cut} T={T:.2g}\ndelta={delta:.2f}",
            )
    files.append(_save(fig, output / "deformed_examples.png"))
    return files


def _label(group: str, checkpoint: str, args) -> str | None:
    """One legend entry per group (its last checkpoint); the others differ by line style / open markers."""
    return group if checkpoint == args.checkpoints[-1] else None


def _legend(ax, args) -> None:
    others = ", ".join(f"{name}: {'dashed / open' if name == 'init' else 'solid'}" for name in args.checkpoints)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), title=others, title_fontsize=6)


def _show(ax, image: torch.Tensor, title: str) -> None:
    pixels = image.float().cpu()
    pixels = (pixels - pixels.min()) / (pixels.max() - pixels.min()).clamp_min(1e-12)
    ax.imshow(pixels[0] if pixels.shape[0] == 1 else pixels.permute(1, 2, 0), cmap="gray")
    ax.set_title(title, fontsize=7)
    ax.axis("off")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        load_families()
        runs = [_load_run(Path(path), args) for path in args.runs]
    except (ValueError, FileNotFoundError) as error:  # options, run configs, data, weights, (delta, c) grid
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    rows, layer_rows = measure(runs, args)
    _write_csv(output / "stability.csv", rows)
    _write_csv(output / "stability_layers.csv", layer_rows)
    table = markdown(rows, args)
    (output / "stability.md").write_text(table)
    files = plots(rows, layer_rows, runs, args, output)
    print(table, end="")
    print(
        "wrote "
        + ", ".join(
            str(p) for p in [output / "stability.csv", output / "stability_layers.csv", output / "stability.md", *files]
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
