"""PNG figures of the locality diagnostics (Figs. 7.6-7.8 and 8.4-8.5), drawn with matplotlib.

Figures are built as `matplotlib.figure.Figure` objects and saved with the Agg canvas, without
pyplot: nothing here changes the caller's matplotlib backend or leaves figures open.

- `plot_nonlocality`: nonlocality per layer over epochs, one panel per run (Fig. 7.6: DeiT | ConViT), the
  layer's depth in color with its color bar.
- `plot_per_head`: gating sigma(lambda_h) (Fig. 7.7) or attention span 1/alpha_h (Fig. 8.4B) per
  head over epochs, one panel per layer on shared axes, heads in color and their mean in black.
- `plot_deviation`: an eFCN's deviation from the CNN subspace per embedded layer over epochs, one panel per
  run on shared axes (Sec. 6.3.3).
- `plot_attention_maps`: an image with its query boxed in red, then one panel per head and a row per
  layer with the query's attention on a log color scale; each title gives sigma(lambda_h), its color
  going from light (content) to dark red (position), read on the gating color bar (Figs. 7.8, 8.5). The maps
  come from `convit.diagnostics.query_maps` (ViT layers) or `transformed_cnn.diagnostics.query_maps` (T-CNN
  layers).
The history plots read the engine's `log.jsonl` (one JSON object per epoch, with `epoch` and keys
`<metric>/layer<l>[/head<h>]`, as `convit.diagnostics.summary` logs them, or `deviation/<layer>`, as
`efcn.diagnostics.summary` does); the first epoch's record also holds the values at initialization
(`init_<key>`), drawn at epoch 0.

Every module of the package that draws uses the helpers below, so that all its figures read alike:
`qualitative_colors` (series that must be told apart), `log_ticks` (plain, non-overlapping labels on log
axes), `shared_legend` (one legend for panels drawing the same series) and `error_bar_note` (what the
error bars are, said in a legend or title).
"""

from __future__ import annotations

import itertools
import math
import re
import textwrap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, ListedColormap, LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from convbias.base.errors import ConfigError
from convbias.base.storage import output_folder, save_figure

__all__ = [
    "displayable",
    "error_bar_note",
    "log_ticks",
    "metric_history",
    "plot_attention_maps",
    "plot_deviation",
    "plot_nonlocality",
    "plot_per_head",
    "qualitative_colors",
    "shared_legend",
]

METRICS = ("nonlocality", "gating", "span")
HISTORY_METRICS = (*METRICS, "deviation")  # what the history figures draw: the metrics above and an eFCN's deviation
INIT_PREFIX = "init_"  # the values at initialization, logged with the first epoch (drawn at epoch 0)
LOG_SCALE_RANGE = 1e-4  # attention maps show at most four decades below their maximum
GATE_COLOR_RANGE = (0.3, 1.0)  # the part of matplotlib's Reds a head's title takes for sigma 0..1 (0: still legible)
LEGEND_TITLE_WIDTH = 44  # characters per line of a shared legend's title
PER_HEAD_MIN_WIDTH = 4.8  # inches: a per-head figure's one panel with its axis labels and the legend of its heads
_KEY = re.compile(r"^(?P<metric>\w+)/layer(?P<layer>\d+)(?:/head(?P<head>\d+))?$")
_METRIC_LABELS = {  # the quantity and its unit (token positions are in patches, or pixels of a T-CNN layer's map)
    "nonlocality": "nonlocality: mean attention distance (patches)",
    "gating": r"gating $\sigma(\lambda_h)$ (0-1)",
    "span": r"attention span $1/\alpha_h$ (patches$^2$)",
    "deviation": r"deviation $\delta$ from the CNN subspace (0-1)",
}
_METRIC_TITLES = {
    "nonlocality": "nonlocality per layer",
    "gating": "gating per head (weight on position)",
    "span": "attention span per head",
}


# -- shared by every figure of the package ------------------------------------------------------
def qualitative_colors(count: int) -> list[tuple[float, float, float, float]]:
    """`count` colors told apart at a glance: tab10 up to ten; beyond, tab20 with its dark shades first
    (tab20 in order pairs a dark and a light shade of one hue, which read as one color side by side)."""
    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    return [colormaps["tab20"](order[i % 20]) for i in range(count)]


def _number(value: float, _position: float | None = None) -> str:
    """A tick label as a plain number (0.3, 1, 20), in powers of ten only far from 1."""
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:g}"
    exponent = math.floor(math.log10(abs(value)))
    mantissa = value / 10**exponent
    return rf"$10^{{{exponent}}}$" if round(mantissa, 6) == 1 else rf"${mantissa:.2g}\times10^{{{exponent}}}$"


def log_ticks(axis: Axis) -> None:
    """Label a log (or symlog) axis with plain numbers, call after plotting: decades when the view spans two or
    more, 1-2-5 when it spans less, every integer multiple under 0.6 decade. Matplotlib's default labels
    the minor ticks of an axis spanning about a decade as '3x10^-1', '4x10^-1', and they overlap."""
    axis.set_major_formatter(FuncFormatter(_number))
    axis.set_minor_formatter(NullFormatter())
    if axis.get_scale() != "log":
        return
    low, high = sorted(axis.get_view_interval())
    span = math.log10(high / low) if low > 0 else math.inf
    axis.set_major_locator(LogLocator(subs=(1.0,) if span >= 2 else (1.0, 2.0, 5.0) if span >= 0.6 else range(1, 10)))


def shared_legend(fig: Figure, axes: Iterable[Axes], title: str = "", **kwargs) -> Legend:
    """One figure legend, outside on the right, for panels drawing the same series: each label once, under
    a title wrapped to the legend's width (the error bar note goes there). The figure needs
    layout="constrained" to make room for it."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    title = "\n".join(textwrap.fill(line, LEGEND_TITLE_WIDTH) for line in title.splitlines())
    options = dict(loc="outside right center", fontsize="x-small", title_fontsize="x-small", alignment="left")
    return fig.legend(list(entries.values()), list(entries), title=title or None, **(options | kwargs))


DODGE = 0.3  # series drawn at the same grid points spread over this fraction of the grid's smallest step


def dodged(xs: Sequence[float], index: int, count: int, grid: Iterable[float], log: bool = False) -> list[float]:
    """``xs`` of series ``index`` of ``count`` drawn at the same ``grid`` points, shifted by its part of DODGE of the
    grid's smallest step (in decades on a log axis), so that their error bars stay apart."""
    if count < 2:
        return list(xs)
    points = sorted({math.log10(x) if log else x for x in grid})
    step = min((b - a for a, b in itertools.pairwise(points)), default=1.0)
    shift = DODGE * step * (index / (count - 1) - 0.5)
    return [x * 10**shift if log else x + shift for x in xs]


def error_bar_note(counts: Iterable[int], interval: str = "95% t interval of the mean", over: str = "seeds") -> str:
    """What the error bars of a figure are, with the number of runs behind each, e.g. 'error bars: 95% t
    interval of the mean over 5 seeds' (or 'over 2-5 seeds'); a single run has none, and the note says so."""
    counts = sorted(set(counts))
    if not counts or counts[-1] < 2:
        return f"error bars: none (one run per point, no {interval})"
    many = [n for n in counts if n > 1]
    number = str(many[0]) if len(many) == 1 else f"{many[0]}-{many[-1]}"
    return f"error bars: {interval} over {number} {over}" + (" (none for a single run)" if counts[0] < 2 else "")


History = dict[int, dict[int | None, tuple[list[float], list[float]]]]


def _logged(records: Sequence[dict]) -> Iterator[tuple[float, str, float]]:
    """(epoch, key, value) of every value the records log, in epoch order: the first epoch's `init_<key>` values
    as (0, key), since they were measured before training."""
    found = []
    for record in records:
        for key, value in record.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or key == "epoch":
                continue
            initial = key.startswith(INIT_PREFIX)
            epoch = 0.0 if initial else float(record["epoch"])
            found.append((epoch, key.removeprefix(INIT_PREFIX) if initial else key, float(value)))
    return iter(sorted(found, key=lambda item: item[0]))


def metric_history(records: Sequence[dict], metric: str) -> History:
    """{layer: {head or None for the layer mean: (epochs, values)}} of one metric over the records, from
    initialization (epoch 0) on."""
    if metric not in METRICS:
        raise ConfigError(f"metric must be one of {METRICS}, got {metric!r}")
    history: History = {}
    for epoch, key, value in _logged(records):
        match = _KEY.match(key)
        if match is None or match["metric"] != metric:
            continue
        head = int(match["head"]) if match["head"] else None
        epochs, values = history.setdefault(int(match["layer"]), {}).setdefault(head, ([], []))
        epochs.append(epoch)
        values.append(value)
    return history


def deviation_history(records: Sequence[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """{embedded layer or "total": (epochs, deviation)} of an eFCN's log (`deviation/<layer>` keys), from
    initialization (epoch 0) on."""
    history: dict[str, tuple[list[float], list[float]]] = {}
    for epoch, key, value in _logged(records):
        metric, _, layer = key.partition("/")
        if metric == "deviation" and layer:
            epochs, values = history.setdefault(layer, ([], []))
            epochs.append(epoch)
            values.append(value)
    return history


def logs_metric(records: Sequence[dict], metric: str) -> bool:
    """Whether the records hold values that the history figure of `metric` (one of HISTORY_METRICS) draws."""
    return bool(deviation_history(records) if metric == "deviation" else metric_history(records, metric))


def _require(history: Mapping, metric: str, what: str) -> None:
    if not history:
        key = f"{metric}/*" if metric == "deviation" else f"{metric}/layer*"
        raise ConfigError(f"no '{key}' values in {what}: its model logs none (or it was trained with --no-diagnostics)")


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    output_folder(path.parent)
    FigureCanvasAgg(fig)
    return save_figure(fig, path, dpi=120)


def _grid(count: int) -> tuple[int, int]:
    cols = min(count, 5)
    return math.ceil(count / cols), cols


# -- history figures ----------------------------------------------------------------------------
def plot_nonlocality(runs: Mapping[str, Sequence[dict]], path: str | Path) -> Path:
    """Fig. 7.6: nonlocality of each layer (mean over heads) over epochs from initialization, one panel per run on
    shared axes, the layer's depth in color (its color bar: layer 1 to the deepest of the runs).

    runs: {panel title: log records}, e.g. {"DeiT-S": deit_log, "ConViT-S": convit_log}."""
    histories = {name: metric_history(records, "nonlocality") for name, records in runs.items()}
    if not histories:
        raise ConfigError("no runs to plot")
    for name, history in histories.items():
        _require(history, "nonlocality", f"run {name!r}")
    deepest = max(max(history) for history in histories.values())
    layer_colors = colormaps["viridis"].resampled(deepest)  # one color per layer 1..deepest
    norm = BoundaryNorm(np.arange(0.5, deepest + 1), deepest)
    fig = Figure(figsize=(4.5 * len(histories) + 0.8, 3.6), layout="constrained")
    axes = fig.subplots(1, len(histories), sharex=True, sharey=True, squeeze=False)[0]
    for ax, (name, history) in zip(axes, histories.items()):
        for layer in sorted(history):
            epochs, values = history[layer][None]
            ax.plot(epochs, values, color=layer_colors(layer - 1), label=f"_layer {layer}")  # read on the color bar
        ax.set_title(f"{name}: {_METRIC_TITLES['nonlocality']}")
        ax.set_xlabel("epoch (0: initialization)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel(_METRIC_LABELS["nonlocality"])
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=layer_colors), ax=list(axes), label="layer (line color)")
    bar.set_ticks(range(1, deepest + 1) if deepest <= 12 else MaxNLocator(integer=True).tick_values(1, deepest))
    return _save(fig, path)


def plot_deviation(runs: Mapping[str, Sequence[dict]], path: str | Path) -> Path:
    """An eFCN's deviation from the CNN subspace, delta = ||W (1 - mask)|| / ||W|| (Sec. 6.3.3), of each embedded
    layer and in total over epochs from initialization, one panel per run on shared axes (0 for an eFCN at its
    embedding; an FCN of the same architecture starts far from it).

    runs: {panel title: log records of an eFCN or FCN run}."""
    histories = {name: deviation_history(records) for name, records in runs.items()}
    if not histories:
        raise ConfigError("no runs to plot")
    for name, history in histories.items():
        _require(history, "deviation", f"run {name!r}")
    fig = Figure(figsize=(4.5 * len(histories), 3.6), layout="constrained")
    axes = fig.subplots(1, len(histories), sharex=True, sharey=True, squeeze=False)[0]
    for ax, (name, history) in zip(axes, histories.items()):
        layers = [layer for layer in history if layer != "total"]
        for color, layer in zip(qualitative_colors(len(layers)), layers):
            ax.plot(*history[layer], color=color, linewidth=1.3, label=layer)
        if "total" in history:
            ax.plot(*history["total"], "k--", linewidth=1.0, label="all layers")
        ax.set_title(f"{name}: deviation per layer", fontsize="small")
        ax.set_xlabel("epoch (0: initialization)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel(_METRIC_LABELS["deviation"])
    shared_legend(fig, axes, title="embedded layer")
    return _save(fig, path)


def plot_per_head(records: Sequence[dict], metric: str, path: str | Path, title: str = "") -> Path:
    """Fig. 7.7 (metric="gating") or Fig. 8.4B (metric="span"): one panel per layer on shared axes, from
    initialization (epoch 0) on, one line per head in colors told apart, drawn over the mean over heads (thin,
    dashed, black) so that no head hides under it; one legend for all panels."""
    history = metric_history(records, metric)
    _require(history, metric, "the log")
    layers = sorted(history)
    rows, cols = _grid(len(layers))
    # at least the width of a panel, its labels and the legend beside it (one layer: a small model)
    fig = Figure(figsize=(max(2.6 * cols, PER_HEAD_MIN_WIDTH), 2.2 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).flatten()
    axes[0].yaxis.get_major_formatter().set_useOffset(False)  # values as logged (1.00001), not an offset's digits
    for ax, layer in zip(axes, layers):
        heads = sorted(h for h in history[layer] if h is not None)
        for color, head in zip(qualitative_colors(len(heads)), heads):
            ax.plot(*history[layer][head], color=color, linewidth=1.3, zorder=3, label=f"head {head}")
        if None in history[layer]:
            ax.plot(*history[layer][None], "k--", linewidth=1.0, zorder=2, label="mean over heads")
        ax.set_title(f"layer {layer}", fontsize="small")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if metric == "gating":
            ax.set_ylim(-0.03, 1.03)
    for ax in axes[len(layers) :]:
        ax.set_visible(False)
    fig.supxlabel("epoch (0: initialization)")
    fig.supylabel(_METRIC_LABELS[metric])
    fig.suptitle(f"{title}: {_METRIC_TITLES[metric]}" if title else _METRIC_TITLES[metric])
    shared_legend(fig, axes[: len(layers)])
    return _save(fig, path)


# -- attention maps -----------------------------------------------------------------------------
def displayable(image: torch.Tensor) -> np.ndarray:
    """(C, H, W) normalized image -> (H, W) or (H, W, 3) array in [0, 1] (min-max per image)."""
    image = image.detach().float().cpu()
    image = (image - image.min()) / (image.max() - image.min()).clamp_min(1e-12)
    return image[0].numpy() if image.shape[0] == 1 else image[:3].permute(1, 2, 0).numpy()


def _box(ax, row: int, col: int, height: float, width: float) -> None:
    ax.add_patch(
        Rectangle((col * width - 0.5, row * height - 0.5), width, height, fill=False, edgecolor="red", linewidth=1.5)
    )


def plot_attention_maps(
    image: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    queries: Mapping[str, tuple[float, float]],
    path: str | Path,
    gates: Mapping[str, Sequence[float]] | None = None,
) -> Path:
    """Figs. 7.8 and 8.5: the attention of one query position, one row per layer, one panel per head.

    image: (C, H, W), normalized as the model saw it. maps: {row label: (heads, h, w)} attention over
    each layer's grid; queries: {row label: (row, col)} of the query on that grid (drawn as a red box);
    gates: {row label: sigma(lambda_h) per head} for gated layers (in the panel titles, the color going
    from light (content) to dark red (position)). The heads of a row share one log color scale over four
    decades below the row's maximum, drawn as the row's color bar."""
    if not isinstance(image, torch.Tensor) or image.dim() != 3:
        raise ValueError(f"image must be one (C, H, W) tensor, got {getattr(image, 'shape', type(image).__name__)}")
    if not maps:
        raise ConfigError("no attention maps to plot")
    gates = gates or {}
    heads = max(layer_maps.shape[0] for layer_maps in maps.values())
    fig = Figure(figsize=(1.9 * (heads + 1), 2.0 * len(maps) + 0.3 + 0.5 * bool(gates)), layout="constrained")
    axes = fig.subplots(len(maps), heads + 1, squeeze=False)
    shown = displayable(image)
    reds = ListedColormap(colormaps["Reds"](np.linspace(*GATE_COLOR_RANGE, 256)))  # sigma 0..1: light to dark red
    for row_axes, (label, layer_maps) in zip(axes, maps.items()):
        layer_maps = layer_maps.detach().float().cpu().numpy()
        grid = layer_maps.shape[1:]
        row, col = queries[label]
        layer_gates = gates.get(label)
        ax = row_axes[0]
        ax.imshow(shown, cmap="gray" if shown.ndim == 2 else None)
        _box(ax, row, col, shown.shape[0] / grid[0], shown.shape[1] / grid[1])
        ax.set_ylabel(label)
        ax.set_title("input, query boxed", fontsize="small")
        vmax = float(layer_maps.max())
        vmin = max(float(layer_maps.min()), vmax * LOG_SCALE_RANGE)
        norm = LogNorm(vmin=vmin if vmin < vmax else vmax / 10, vmax=vmax)  # vmin = vmax: uniform maps
        for head, ax in enumerate(row_axes[1:], start=1):
            if head > layer_maps.shape[0]:
                ax.set_visible(False)
                continue
            shown_map = ax.imshow(np.clip(layer_maps[head - 1], norm.vmin, None), cmap="viridis", norm=norm)
            _box(ax, row, col, 1, 1)
            if layer_gates is None:
                ax.set_title(f"head {head}", fontsize="small")
            else:
                gate = float(layer_gates[head - 1])
                ax.set_title(rf"head {head}  $\sigma$={gate:.2f}", fontsize="small", color=reds(gate))
        for ax in row_axes:
            ax.set_xticks([])
            ax.set_yticks([])
        fig.colorbar(shown_map, ax=list(row_axes[1:]), shrink=0.9, label="attention weight\n(log scale)")
    if gates:
        fig.colorbar(
            ScalarMappable(norm=Normalize(0, 1), cmap=reds),
            ax=list(axes.flat),
            location="bottom",
            shrink=0.5,
            aspect=40,
            label=r"title color: gating $\sigma(\lambda_h)$ (0 content, 1 position)",
        )
    fig.suptitle(
        r"attention of the boxed query, per head ($\sigma$: gating, weight on position)"
        if gates
        else "attention of the boxed query, per head"
    )
    return _save(fig, path)
