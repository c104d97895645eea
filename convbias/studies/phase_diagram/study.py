"""The (width, alpha~) phase diagram of Geiger, Petrini & Wyart, *Landscape and training regimes in deep learning* (Physics
Reports, 2021; Sec. 3, Figs. 4-5), at CPU scale.

Fully connected nets with two hidden layers in the paper's NTK parametrization (no biases,
N(0, 1) weights, z1 = s(W0 x / sqrt(d)), z2 = s(W1 z1 / sqrt(h)), f = W2 z2 / sqrt(h), s = a softplus
of sharpness 5 scaled to unit second moment) learn odd/even on scikit-learn's digits projected on their
first 10 principal components (inputs normalized to |x|^2 = d). Each net trains
F = alpha (f_w - f_w0) with alpha = alpha~ / sqrt(h), on the soft hinge loss softplus_20(1 - F y) / alpha^2,
by full-batch gradient descent with the paper's adaptive step (a step is accepted when no training
output moves by more than 0.1, then dt grows by 10%; otherwise it is undone and dt halves) until every
training point has margin F y > 1 (zero hinge loss) or `max_steps` is reached.

Per cell (h, alpha~) over the seeds: ensemble test error (error of the mean output), mean single-net
test error, output fluctuation, the fraction of nets that reached zero training loss (jamming: the
cell is under-parametrized when one does not), and the relative change of the tangent kernel
||Theta_end - Theta_0|| / ||Theta_0|| on a fixed set of test points (lazy < 1 < feature).

Why not one train.py run per net: the grid has hundreds of nets of a few thousand parameters trained
by full-batch GD to convergence (thousands of steps). train.py is a minibatch engine (epochs, image
transforms, checkpoints, a process per run); here one process trains all seeds and alphas of a width
as one batched module (independent nets stacked along a leading axis), which is what makes the default
grid fit in minutes on two cores. The measurements are the package's own: `convbias.evaluation.ntk`
for the kernel, `convbias.evaluation.ensembles` for ensembles, and the grid is also written as a sweep's
runs.csv and ensembles.csv, which `convbias-sweep report` turns into tables and a width x alpha~ heatmap.

Files in OUTPUT: config.yaml, nets.csv (every net), cells.csv (every cell), runs.csv and ensembles.csv
(the sweep report's schemas), phase_diagram.png (Fig. 4), double_descent.png (Fig. 5).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from sklearn.datasets import load_digits
from sklearn.decomposition import PCA
from torch import nn

from convbias.base import tables
from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.run_layout import (
    CONFIG_FILE,
    PHASE_CELLS_TABLE,
    PHASE_DIAGRAM_FOLDER,
    PHASE_NETS_TABLE,
    SWEEP_ENSEMBLES_TABLE,
    SWEEP_RUNS_TABLE,
)
from convbias.base.storage import output_folder, save_figure, write_text
from convbias.base.tables import write_csv
from convbias.engine import (
    POSITIVE,
    POSITIVE_INT,
    Check,
    dataclass_declarations,
    declaration,
    declared_value,
    option,
    read_declared_yaml,
)
from convbias.evaluation.ensembles import evaluate_ensemble
from convbias.evaluation.figures import log_ticks, shared_legend
from convbias.evaluation.ntk import empirical_ntk, relative_change

NETS_CSV = PHASE_NETS_TABLE  # one row per net, every measurement
CELLS_CSV = PHASE_CELLS_TABLE  # one row per (width, alpha~): the figures' data
RUNS_CSV = SWEEP_RUNS_TABLE  # the sweep report's schema (convbias-sweep report --csv ...)
ENSEMBLES_CSV = SWEEP_ENSEMBLES_TABLE  # the sweep report's ensemble schema
REPORT_COLUMNS = ("model", "width", "alpha_tilde", "seed", "top1", "train_seconds")
DIGITS_IMAGES = 1797  # scikit-learn's digits: train_size of them train, the rest test


SEED = declaration("seed").metadata["check"]  # train.py's: numpy and torch take it
TRAIN_SIZES = (10, 1700)  # the rest of the digits (97 images at least) is the test set
PCA_COMPONENTS = (1, 64)  # the digits are 8x8 images


@dataclass
class PhaseDiagramConfig:
    """The grid and the training protocol (defaults: the committed reproduction); each field declared with its
    check, applied to a config file's values (naming the file, line and key) and by ``validated``."""

    widths: list[int] = option(
        [4, 6, 8, 12, 16, 24, 32, 48],
        "hidden widths h",
        check=Check(lambda v: bool(v) and min(v) >= 1, "a list of positive integers"),
    )
    alpha_tildes: list[float] = option(
        [0.1, 1.0, 10.0, 100.0, 1000.0],
        "rescaled output scales",
        check=Check(lambda v: bool(v) and min(v) > 0, "a list of positive numbers (the rescaled output scale)"),
    )
    seeds: list[int] = option(
        [0, 1, 2, 3, 4],
        "the nets of a cell, one per seed",
        check=Check(
            lambda v: len(v) >= 2 and all(SEED.valid(s) for s in v),
            f"at least 2 seeds (an ensemble), each {SEED.expected}",
        ),
    )
    train_size: int = option(
        1000,
        "training images (the rest of the digits is the test set)",
        check=Check(lambda v: TRAIN_SIZES[0] <= v <= TRAIN_SIZES[1], "in {}..{}".format(*TRAIN_SIZES)),
    )
    pca_components: int = option(
        10,
        "principal components the inputs are projected on",
        check=Check(lambda v: PCA_COMPONENTS[0] <= v <= PCA_COMPONENTS[1], "in {}..{}".format(*PCA_COMPONENTS)),
    )
    data_seed: int = option(0, "the split and the PCA", check=SEED)
    activation_beta: float = option(5.0, "softplus sharpness of the hidden units (paper: 5)", check=POSITIVE)
    loss_beta: float = option(20.0, "soft-hinge sharpness (paper: 20)", check=POSITIVE)
    max_output_change: float = option(0.1, "adaptive step: max |F_new - F_old| over the training set", check=POSITIVE)
    initial_dt: float = option(1.0, "the first step", check=POSITIVE)
    max_steps: int = option(2000, "gradient-descent steps at most", check=POSITIVE_INT)
    ntk_samples: int = option(
        100, "test points on which the kernel change is measured", check=Check(lambda v: v >= 2, ">= 2")
    )

    @classmethod
    def from_yaml(cls, path: str | Path, error: type[Exception] = ConfigError) -> PhaseDiagramConfig:
        """The config of the file ``path``: every key a field, every value as its field declares it; ``error``
        naming the file, line and key otherwise (DamagedInputError for the copy the study wrote and reads back, a plain
        file: ``inputs.check_plain_file``)."""
        path = Path(path)
        if not os.path.lexists(path):
            raise ConfigError(f"phase-diagram config not found: {path}")
        declared = dataclass_declarations(cls)
        return cls(
            **read_declared_yaml(path, "phase-diagram config", declared, error, plain=error is DamagedInputError)
        )

    def validated(self) -> PhaseDiagramConfig:
        """This config with each field as declared (a ConfigError naming the field otherwise)."""
        for name, spec in dataclass_declarations(type(self)).items():
            setattr(self, name, declared_value(spec, getattr(self, name), name))
        return self


# ----------------------------------------------------------------------------------------------- data
def odd_even_digits(train_size: int, components: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): digits projected on the train set's first principal
    components, each input rescaled to |x|^2 = d, labels +1 (even) / -1 (odd)."""
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    train, test = order[:train_size], order[train_size:]
    pca = PCA(n_components=components, random_state=seed).fit(digits.data[train])
    x = pca.transform(digits.data)
    x = x * math.sqrt(components) / np.linalg.norm(x, axis=1, keepdims=True)
    y = np.where(digits.target % 2 == 0, 1.0, -1.0)
    as_tensor = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    return as_tensor(x[train]), as_tensor(y[train]), as_tensor(x[test]), as_tensor(y[test])


# ---------------------------------------------------------------------------------------------- model
class FullyConnected(nn.Module):
    """`members` independent two-hidden-layer nets of width h, stacked: forward (n, d) -> (members, n)."""

    def __init__(self, weights: list[torch.Tensor], beta: float):
        super().__init__()
        self.w0, self.w1, self.w2 = (nn.Parameter(w) for w in weights)  # (B, h, d), (B, h, h), (B, h)
        self.beta = beta
        self.gain = float(
            F.softplus(torch.randn(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64), beta=beta)
            .pow(2)
            .mean()
            .rsqrt()
        )

    @classmethod
    def initialize(cls, seeds: list[int], d: int, h: int, beta: float) -> FullyConnected:
        """Standard Gaussian weights; member i is drawn from seeds[i] (same seed, same init)."""
        draws = []
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            draws.append([torch.randn(h, d, generator=g), torch.randn(h, h, generator=g), torch.randn(h, generator=g)])
        return cls([torch.stack(ws) for ws in zip(*draws)], beta)

    def member(self, index: int) -> FullyConnected:
        """A detached copy of one member, as a one-member module (for the kernel)."""
        return FullyConnected([w[index : index + 1].detach().clone() for w in (self.w0, self.w1, self.w2)], self.beta)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * F.softplus(x, beta=self.beta)

    def forward(self, x: torch.Tensor, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Outputs (members, n); `weights` replaces the parameters (a subset of members, say)."""
        w0, w1, w2 = weights or (self.w0, self.w1, self.w2)
        h, d = w0.shape[1:]
        z1 = self.activation(torch.einsum("bhd,nd->bnh", w0, x) / math.sqrt(d))
        z2 = self.activation(torch.bmm(z1, w1.transpose(1, 2)) / math.sqrt(h))
        return torch.einsum("bnh,bh->bn", z2, w2) / math.sqrt(h)


def soft_hinge(scaled_outputs: torch.Tensor, labels: torch.Tensor, alpha: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-member loss  mean_mu softplus_beta(1 - F y) / alpha^2, F = alpha (f - f0): shape (members,)."""
    return F.softplus(1 - scaled_outputs * labels, beta=beta).mean(dim=1) / alpha**2


# ------------------------------------------------------------------------------------------- training
def train_width(cfg: PhaseDiagramConfig, width: int, data: tuple[torch.Tensor, ...]) -> tuple[list[dict], torch.Tensor]:
    """Train every (alpha~, seed) net of one width together. Returns one row per net and the test
    outputs F, shaped (alphas, seeds, test points)."""
    x_train, y_train, x_test, y_test = data
    pairs = [(a, s) for a in cfg.alpha_tildes for s in cfg.seeds]
    alpha = torch.tensor([a / math.sqrt(width) for a, _ in pairs])
    model = FullyConnected.initialize([s for _, s in pairs], x_train.shape[1], width, cfg.activation_beta)
    initial = [model.member(i) for i in range(len(pairs))]
    with torch.no_grad():
        f0_train, f0_test = model(x_train), model(x_test)

    params = [p.detach() for p in model.parameters()]  # updated in place; the module sees them

    def outputs_and_gradients(members: torch.Tensor, weights: list[torch.Tensor]):
        """Scaled training outputs and loss gradients of a subset of members (the others are done)."""
        weights = [w.requires_grad_(True) for w in weights]
        scaled = alpha[members, None] * (model(x_train, weights) - f0_train[members])
        loss = soft_hinge(scaled, y_train, alpha[members], cfg.loss_beta).sum()  # members are independent
        return scaled.detach(), [g.detach() for g in torch.autograd.grad(loss, weights)]

    everyone = torch.arange(len(pairs))
    scaled, grads = outputs_and_gradients(everyone, [p.clone() for p in params])
    dt = torch.full((len(pairs),), cfg.initial_dt)
    done = (scaled * y_train > 1).all(dim=1)
    steps = torch.zeros(len(pairs), dtype=torch.long)
    started = time.perf_counter()
    for _ in range(cfg.max_steps):
        active = everyone[~done]
        if len(active) == 0:
            break
        step = dt[active]
        proposal = [p[active] - step.view(-1, *[1] * (p.ndim - 1)) * g[active] for p, g in zip(params, grads)]
        new_scaled, new_grads = outputs_and_gradients(active, [w.clone() for w in proposal])
        ok = (new_scaled - scaled[active]).abs().amax(dim=1) < cfg.max_output_change
        accepted = active[ok]
        for p, g, w, ng in zip(params, grads, proposal, new_grads):
            p[accepted], g[accepted] = w[ok], ng[ok]
        scaled[accepted] = new_scaled[ok]
        dt[active] = torch.where(ok, step * 1.1, step * 0.5)
        steps[accepted] += 1
        done = done | (scaled * y_train > 1).all(dim=1)
    seconds = time.perf_counter() - started

    with torch.no_grad():
        test_scaled = alpha[:, None] * (model(x_test) - f0_test)
    kernel_points = x_test[: cfg.ntk_samples]
    rows = []
    for i, (alpha_tilde, seed) in enumerate(pairs):
        theta0 = empirical_ntk(initial[i], kernel_points)
        theta = empirical_ntk(model.member(i), kernel_points)
        rows.append(
            {
                "model": "fc2",
                "width": width,
                "alpha_tilde": alpha_tilde,
                "seed": seed,
                "params": sum(p[i].numel() for p in params),
                "train_error": 100.0 * (scaled[i] * y_train <= 0).double().mean().item(),
                "unfit": int((scaled[i] * y_train < 1).sum()),
                "converged": int(bool(done[i])),
                "steps": int(steps[i]),
                "test_error": 100.0 * (test_scaled[i] * y_test <= 0).double().mean().item(),
                "top1": 100.0 - 100.0 * (test_scaled[i] * y_test <= 0).double().mean().item(),
                "ntk_change": relative_change(theta, theta0),
                "train_seconds": seconds / len(pairs),
            }
        )
    return rows, test_scaled.view(len(cfg.alpha_tildes), len(cfg.seeds), -1)


def geometric_mean(values: list[float]) -> float:
    """The geometric mean; 0 when a value is 0 (a network whose kernel did not move)."""
    with np.errstate(divide="ignore"):
        return float(np.exp(np.mean(np.log(values))))


def cell_rows(
    cfg: PhaseDiagramConfig, width: int, rows: list[dict], test_outputs: torch.Tensor, y_test: torch.Tensor
) -> list[dict]:
    """One row per (width, alpha~): ensemble over seeds, jamming and kernel-change summaries."""
    cells = []
    for a, alpha_tilde in enumerate(cfg.alpha_tildes):
        members = [r for r in rows if r["alpha_tilde"] == alpha_tilde]
        ensemble = evaluate_ensemble(test_outputs[a], y_test)
        cells.append(
            {
                "width": width,
                "alpha_tilde": alpha_tilde,
                "params": members[0]["params"],
                "seeds": len(members),
                "ensemble_test_error": ensemble.ensemble_error,
                "mean_test_error": ensemble.mean_member_error,
                "fluctuation": ensemble.fluctuation,
                "converged_fraction": sum(r["converged"] for r in members) / len(members),
                "mean_train_error": float(np.mean([r["train_error"] for r in members])),
                "ntk_change": geometric_mean([r["ntk_change"] for r in members]),
                "mean_steps": float(np.mean([r["steps"] for r in members])),
            }
        )
    return cells


def run(cfg: PhaseDiagramConfig, output: Path, log=print) -> list[dict]:
    """Train the whole grid, write nets.csv (one row per net) and cells.csv; return the cells."""
    torch.manual_seed(0)
    data = odd_even_digits(cfg.train_size, cfg.pca_components, cfg.data_seed)
    output_folder(output, owned=PHASE_DIAGRAM_FOLDER)
    write_text(output / CONFIG_FILE, yaml.safe_dump(asdict(cfg), sort_keys=False), owner=output)
    all_rows, all_cells = [], []
    for width in cfg.widths:
        started = time.perf_counter()
        rows, test_outputs = train_width(cfg, width, data)
        cells = cell_rows(cfg, width, rows, test_outputs, data[3])
        all_rows += rows
        all_cells += cells
        write_csv(all_rows, output / NETS_CSV, owner=output)  # after every width: a partial grid is readable
        write_csv(all_cells, output / CELLS_CSV, owner=output)
        log(
            f"h={width:4d}  {time.perf_counter() - started:6.1f}s  "
            + "  ".join(
                f"a~={c['alpha_tilde']:g}: ens {c['ensemble_test_error']:.1f}% single {c['mean_test_error']:.1f}% "
                f"fit {c['converged_fraction']:.1f} dTheta {c['ntk_change']:.2g}"
                for c in cells
            )
        )
    return all_cells


def report_tables(output: Path) -> tuple[list[dict], list[dict]]:
    """The rows of runs.csv and ensembles.csv in the sweep report's schemas, from the folder's nets.csv, cells.csv
    and config.yaml (each read back as written, checked), so that `convbias-sweep report --csv OUTPUT/runs.csv`
    tabulates and plots this grid like any sweep (an ensemble with its test-set interval, its members with
    their spread)."""
    nets = read_nets(output / NETS_CSV)
    test_images = DIGITS_IMAGES - PhaseDiagramConfig.from_yaml(output / CONFIG_FILE, DamagedInputError).train_size
    member_top1: dict[tuple[int, float], list[float]] = {}
    for r in nets:
        member_top1.setdefault((r["width"], r["alpha_tilde"]), []).append(r["top1"])
    runs = [
        {"run": f"fc2__h{r['width']}__a{r['alpha_tilde']:g}__seed{r['seed']}", **{k: r[k] for k in REPORT_COLUMNS}}
        for r in nets
    ]
    ensembles = [
        {
            "model": "fc2",
            "width": c["width"],
            "alpha_tilde": c["alpha_tilde"],
            "members": c["seeds"],
            "ensemble_top1": 100 - c["ensemble_test_error"],
            "member_top1": 100 - c["mean_test_error"],
            "member_top1_std": float(np.std(member_top1[(c["width"], c["alpha_tilde"])], ddof=1)),
            "fluctuation": c["fluctuation"],
            "images": test_images,
        }
        for c in read_cells(output / CELLS_CSV)
    ]
    return runs, ensembles


def write_report_csvs(output: Path, tables: tuple[list[dict], list[dict]] | None = None) -> list[Path]:
    """runs.csv and ensembles.csv of ``report_tables`` (given, or read from ``output`` now) in ``output``."""
    runs, ensembles = tables if tables is not None else report_tables(output)
    write_csv(runs, output / RUNS_CSV, owner=output)
    write_csv(ensembles, output / ENSEMBLES_CSV, owner=output)
    return [output / RUNS_CSV, output / ENSEMBLES_CSV]


# The columns of nets.csv (``train_width``'s rows) and cells.csv (``cell_rows``'), each with how it is read back
NET_COLUMNS = {
    "model": tables.text,
    **dict.fromkeys(("width", "seed", "params", "unfit", "converged", "steps"), tables.integer),
    **dict.fromkeys(("alpha_tilde", "train_error", "test_error", "top1", "train_seconds"), tables.finite),
    "ntk_change": tables.number,
}
CELL_COLUMNS = {
    **dict.fromkeys(("width", "params", "seeds"), tables.integer),
    **dict.fromkeys(("alpha_tilde", "ensemble_test_error", "mean_test_error", "fluctuation"), tables.finite),
    **dict.fromkeys(("converged_fraction", "mean_train_error", "mean_steps"), tables.finite),
    "ntk_change": tables.number,
}


def read_nets(path: Path, required: tuple[str, ...] = tuple(NET_COLUMNS)) -> list[dict]:
    """nets.csv as written (``NET_COLUMNS``); the ``required`` columns must be there."""
    return tables.read_csv(path, "phase diagram nets", tables.by_column(NET_COLUMNS), required, rows=True)


def read_cells(path: Path, required: tuple[str, ...] = tuple(CELL_COLUMNS)) -> list[dict]:
    """cells.csv as written (``CELL_COLUMNS``); the ``required`` columns must be there."""
    return tables.read_csv(path, "phase diagram cells", tables.by_column(CELL_COLUMNS), required, rows=True)


# ------------------------------------------------------------------------------------------- figures


def plot(cells: list[dict], output: Path, curves: tuple[float, ...] | None = None) -> list[Path]:
    """phase_diagram.png (Fig. 4) and double_descent.png (Fig. 5) from cells.csv's rows."""
    widths = sorted({c["width"] for c in cells})
    alphas = sorted({c["alpha_tilde"] for c in cells})
    cell = {(c["width"], c["alpha_tilde"]): c for c in cells}
    grid = lambda key: np.array([[cell[(h, a)][key] for h in widths] for a in alphas])  # noqa: E731
    error, fitted, change = grid("ensemble_test_error"), grid("converged_fraction"), grid("ntk_change")

    fig = Figure(figsize=(7.2, 4.8))
    ax = fig.subplots()
    mesh = ax.pcolormesh(np.arange(len(widths) + 1), np.arange(len(alphas) + 1), error, cmap="viridis", shading="flat")
    fig.colorbar(mesh, ax=ax, label="ensemble test error (%)")
    for i, j in zip(*np.nonzero(fitted < 1)):  # some net of the cell did not reach zero training loss
        ax.add_patch(Rectangle((j, i), 1, 1, fill=False, hatch="//", edgecolor="black", linewidth=0))
        ax.text(j + 0.5, i + 0.5, f"{fitted[i, j]:.0%}", ha="center", va="center", fontsize=7, color="white")
    for i in range(len(alphas)):  # jamming line: from this width on, every net of every wider cell fits
        fits = [all(fitted[i, k:] == 1) for k in range(len(widths))]
        if any(fits):
            ax.plot([fits.index(True)] * 2, [i, i + 1], color="red", linewidth=2.5)
    centers_x, centers_y = np.arange(len(widths)) + 0.5, np.arange(len(alphas)) + 0.5
    for level, style in ((1.0, "-"), (0.3, "--"), (3.0, "--")):
        if change.min() < level < change.max():
            contour = ax.contour(
                centers_x,
                centers_y,
                np.log10(change),
                levels=[np.log10(level)],
                colors="white",
                linestyles=style,
                linewidths=2 if level == 1 else 1,
            )
            ax.clabel(contour, fmt={np.log10(level): f"|dTheta|/|Theta0|={level:g}"}, fontsize=7)
    ax.set_xticks(centers_x, [f"{int(h)}" for h in widths])
    ax.set_yticks(centers_y, [f"{a:g}" for a in alphas])
    ax.set_xlabel("width h")
    ax.set_ylabel(r"$\tilde\alpha = \sqrt{h}\,\alpha$")
    ax.set_title(
        "odd/even digits, 10 PCA, FC L=2. Hatched: not every net reached zero training loss\n"
        "(% that did); red: jamming line (every wider net fits); white: lazy/feature cross-over",
        fontsize=8,
    )
    fig.tight_layout()
    paths = [output / "phase_diagram.png"]
    save_figure(fig, paths[0], dpi=130)

    curves = curves or tuple(alphas[i] for i in sorted({0, len(alphas) // 2, len(alphas) - 1}))
    fig = Figure(figsize=(4 * len(curves) + 1.6, 3.4), layout="constrained")
    axes = fig.subplots(1, len(curves), sharey=True, squeeze=False)[0]
    for ax, a in zip(axes, curves):
        params = [cell[(h, a)]["params"] for h in widths]
        ax.plot(params, [cell[(h, a)]["mean_test_error"] for h in widths], "o-", label="single net (mean)")
        ax.plot(params, [cell[(h, a)]["ensemble_test_error"] for h in widths], "s-", label="ensemble average")
        jammed = [p for h, p in zip(widths, params) if cell[(h, a)]["converged_fraction"] < 1]
        if jammed:
            ax.axvline(max(jammed), color="gray", linestyle=":", label="widest with a net not fitting")
        ax.set_xscale("log")
        ax.set_xlabel("parameters N")
        ax.set_title(rf"$\tilde\alpha$ = {a:g}")
        log_ticks(ax.xaxis)
    axes[0].set_ylabel("test error (%)")
    nets = "-".join(f"{n:g}" for n in sorted({min(c["seeds"] for c in cells), max(c["seeds"] for c in cells)}))
    shared_legend(fig, axes, title=f"single net: mean over {nets} seeds; ensemble: their average output; no error bars")
    paths.append(output / "double_descent.png")
    save_figure(fig, paths[1], dpi=130)
    return paths
