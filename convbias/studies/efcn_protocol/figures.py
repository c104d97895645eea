"""Figures 6.2-6.7 and E.6 of the relax-time protocol, drawn from the protocol's tables.

Figures are `matplotlib.figure.Figure` objects saved with the Agg canvas, without pyplot (as in
`convbias.evaluation.figures`). Every function takes plain rows (lists of dicts, as written to the CSVs) and a path, so the
figures can be redrawn from the committed CSVs without retraining. They show one protocol run (one seed), so
they have no error bars; the spread over seeds is in the protocol's seed tables.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure

from convbias.base.storage import save_figure
from convbias.evaluation.figures import log_ticks, shared_legend


def _colors(n: int):
    return colormaps["viridis"](np.linspace(0.0, 0.9, max(n, 1)))


def _relax_time_colours(relax_times: list[int]) -> tuple[ListedColormap, BoundaryNorm]:
    """The colours of the relax times (``_colors``, one per t_w in order) as a colour map and a norm over their
    indices, for a scatter coloured by t_w and its colour bar."""
    n = len(relax_times)
    return ListedColormap(_colors(n)), BoundaryNorm(np.arange(n + 1) - 0.5, n)


def _relax_time_bar(fig: Figure, points, axes, relax_times: list[int]) -> None:
    """The colour bar of a scatter coloured by relax time: one tick per t_w, labelled."""
    bar = fig.colorbar(points, ax=axes, ticks=range(len(relax_times)), label="relax time t_w (epochs)")
    bar.ax.set_yticklabels([str(t) for t in relax_times])


def _figure(width: float, height: float) -> Figure:
    """Constrained layout: it makes room for the legends drawn outside the panels."""
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig, path: Path) -> None:
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() in ("log", "symlog"):
                log_ticks(axis)
    save_figure(fig, path, dpi=110)


def _symlog_epochs(ax) -> None:
    """Epochs on a log axis that still shows epoch 0 (call after plotting)."""
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(left=-0.2)
    ax.set_xlabel("epoch (symlog)")


def training_curves(curves: list[dict], relax_times: list[int], path: Path) -> None:
    """Fig. 6.2: train loss and test accuracy vs epoch; CNN black, FCN red, eFCNs by relax time."""
    fig = _figure(11, 4)
    (ax_loss, ax_acc) = fig.subplots(1, 2)
    runs = [("cnn", "CNN", "black"), ("fcn", "FCN", "red")] + [
        (f"efcn_tw{t}", f"eFCN t_w={t}", c) for t, c in zip(relax_times, _colors(len(relax_times)))
    ]
    for run, label, color in runs:
        rows = [r for r in curves if r["run"] == run]
        epochs = [r["epoch"] for r in rows]
        ax_loss.plot(epochs, [r["train_loss"] for r in rows], color=color, label=label)
        ax_acc.plot(epochs, [r["test_acc"] for r in rows], color=color, label=label)
    for ax, name in ((ax_loss, "train loss"), (ax_acc, "test accuracy (%)")):
        _symlog_epochs(ax)
        ax.set_ylabel(name)
    ax_loss.set_yscale("log")
    shared_legend(fig, (ax_loss, ax_acc))
    _save(fig, path)


def accuracy_and_landscape(rows: list[dict], baselines: dict, path: Path) -> None:
    """Fig. 6.3: final eFCN accuracy vs t_w (CNN and FCN lines), |grad L| and lambda_max at start/end."""
    tw = [r["relax_time"] for r in rows]
    fig = _figure(13, 4)
    axes = fig.subplots(1, 3)
    axes[0].plot(tw, [r["final_test_acc"] for r in rows], "rx", markersize=9, label="eFCN (final)")
    axes[0].axhline(baselines["cnn_best_test_acc"], color="black", label="CNN (best)")
    axes[0].axhline(baselines["fcn_best_test_acc"], color="black", linestyle="--", label="FCN (best)")
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].legend(fontsize=8)
    for ax, key, name in ((axes[1], "grad_norm", "|grad L|"), (axes[2], "hessian_top", "top Hessian eigenvalue")):
        ax.plot(tw, [r[f"{key}_start"] for r in rows], "o-", label="start of eFCN training")
        ax.plot(tw, [r[f"{key}_end"] for r in rows], "s-", label="end of eFCN training")
        # lambda_max is the largest-magnitude eigenvalue and can be negative early on
        ax.set_yscale("log" if key == "grad_norm" else "symlog")
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    for ax in axes:
        _symlog_epochs(ax)
        ax.set_xlabel("relax time t_w (epochs, symlog)")
    _save(fig, path)


def deviation(rows: list[dict], baselines: dict, path: Path) -> None:
    """Fig. 6.4: delta vs t_w, vs the initial loss, vs the final accuracy (standard FCN in blue); the eFCNs of the
    last two panels are coloured by t_w, read on their colour bar."""
    fig = _figure(14, 4)
    axes = fig.subplots(1, 3)
    delta = [r["deviation_total"] for r in rows]
    times = [r["relax_time"] for r in rows]
    cmap, norm = _relax_time_colours(times)
    by_time = dict(c=range(len(rows)), cmap=cmap, norm=norm)
    axes[0].plot(times, delta, "o-")
    _symlog_epochs(axes[0])
    axes[0].set_xlabel("relax time t_w (epochs, symlog)")
    points = axes[1].scatter([r["initial_train_loss"] for r in rows], delta, **by_time, label="eFCN")
    axes[1].scatter(
        [baselines["fcn_initial_train_loss"]],
        [baselines["fcn_deviation_total"]],
        color="blue",
        marker="s",
        label="standard FCN",
    )
    axes[1].set_xlabel("initial train loss")
    axes[2].scatter([r["final_test_acc"] for r in rows], delta, **by_time, label="eFCN")
    axes[2].scatter(
        [baselines["fcn_final_test_acc"]],
        [baselines["fcn_deviation_total"]],
        color="blue",
        marker="s",
        label="standard FCN",
    )
    axes[2].set_xlabel("final test accuracy (%)")
    for ax in axes:
        ax.set_ylabel("delta = |W_off-local| / |W|")
        ax.set_yscale("log")
    for ax in axes[1:]:
        ax.legend(fontsize=8)
    _relax_time_bar(fig, points, list(axes[1:]), times)
    _save(fig, path)


def local_contributions(rows: list[dict], path: Path) -> None:
    """Fig. 6.5: test accuracy with local blocks only, off-local blocks only, and both."""
    tw = [r["relax_time"] for r in rows]
    fig = _figure(5.5, 4)
    ax = fig.subplots()
    ax.plot(tw, [r["local_only_test_acc"] for r in rows], "o-", color="tab:orange", label="local blocks only")
    ax.plot(tw, [r["off_local_only_test_acc"] for r in rows], "o-", color="tab:blue", label="off-local blocks only")
    ax.plot(tw, [r["final_test_acc"] for r in rows], "o-", color="tab:green", label="both (eFCN)")
    _symlog_epochs(ax)
    ax.set_xlabel("relax time t_w (epochs, symlog)")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8)
    _save(fig, path)


DIFFERENCE = "difference"  # the title of a filter panel that shows the change of the weights, not the weights


def filter_heatmaps(filters: dict[str, list[tuple[str, np.ndarray]]], path: Path) -> None:
    """Figs. 6.6/6.7: log|w| of one row of the first layer (one output unit), unflattened to the
    input image (channels averaged). One row of panels per model, each panel with its labelled colour bar."""
    names = list(filters)
    columns = max(len(v) for v in filters.values())
    fig = _figure(3 * columns, 2.8 * len(names))
    axes = fig.subplots(len(names), columns, squeeze=False)
    for i, name in enumerate(names):
        for j in range(columns):
            ax = axes[i][j]
            ax.axis("off")
            if j >= len(filters[name]):
                continue
            title, row = filters[name][j]
            image = np.log(np.abs(row).mean(axis=0) + 1e-12)
            shown = ax.imshow(image, cmap="viridis")
            ax.set_title(f"{name}\n{title}", fontsize=8)
            what = "|change of w|" if title == DIFFERENCE else "|w|"
            fig.colorbar(shown, ax=ax, fraction=0.046, label=f"log {what} (channels averaged)")
    _save(fig, path)


def interpolation(rows: list[dict], path: Path) -> None:
    """Fig. E.6: train loss and test accuracy along the CNN (alpha=0) -> eFCN (alpha=1) paths."""
    relax_times = sorted({r["relax_time"] for r in rows})
    fig = _figure(3.6 * len(relax_times) + 1.2, 6.5)
    axes = fig.subplots(2, len(relax_times), squeeze=False)
    styles = {"linear": "tab:orange", "string": "tab:blue", "output": "tab:green"}
    for j, tw in enumerate(relax_times):
        for method, color in styles.items():
            points = [r for r in rows if r["relax_time"] == tw and r["method"] == method]
            alphas = [r["alpha"] for r in points]
            axes[0][j].plot(alphas, [r["train_loss"] for r in points], "o-", color=color, label=method)
            axes[1][j].plot(alphas, [r["test_acc"] for r in points], "o-", color=color, label=method)
        axes[0][j].set_title(f"t_w = {tw}")
        axes[1][j].set_xlabel("alpha (0 = CNN, 1 = eFCN)")
    axes[0][0].set_ylabel("train loss")
    axes[1][0].set_ylabel("test accuracy (%)")
    shared_legend(fig, axes.flat, title="path")
    _save(fig, path)
