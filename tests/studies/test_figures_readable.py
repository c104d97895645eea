"""Every figure the package writes, drawn from small synthetic inputs of the shapes its callers pass, checked
on the drawn Figure: no two tick labels of an axis overlap, every labelled line and error bar has a legend
entry, and a figure with error bars says what they are; docs/figures/make_figures.py redraws the docs' figures."""

from __future__ import annotations

import ast
import itertools
import math
import re
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection
from matplotlib.container import ErrorbarContainer
from matplotlib.contour import ContourSet
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.text import Text
from support import REPO

from convbias.evaluation import figures
from convbias.studies.efcn_protocol import figures as efcn_figures
from convbias.studies.phase_diagram import study as phase_diagram
from convbias.studies.regimes import study as regimes
from convbias.studies.robustness import report as robustness_report
from convbias.studies.stability import contrasts as stability_contrasts
from convbias.studies.stability import figures as stability_figures
from convbias.studies.stability.study import Run, Settings, layer_summary
from convbias.studies.sweep import figures as sweep_figures

pytestmark = pytest.mark.slow

PACKAGE = Path(figures.__file__).resolve().parents[1]
LAYOUT_WARNINGS: dict[str, list[str]] = {}  # 'builder: file name' -> matplotlib's constrained-layout warnings
SEEDS = (0, 1, 2)


# -- synthetic inputs, shaped as the callers build them ----------------------------------------------
def _history(layers: int, heads: int, epochs: int, gated: int) -> list[dict]:
    """log.jsonl records as `convit.diagnostics.summary` logs them (layers and heads from 1)."""
    rng = np.random.default_rng(0)
    records = []
    for epoch in range(epochs):
        record: dict = {"epoch": epoch, "train_loss": 1 / (epoch + 1)}
        for layer in range(1, layers + 1):
            distance = 1 + layer * 0.3 + 0.05 * epoch * layer / layers
            record[f"nonlocality/layer{layer}"] = distance
            if layer > gated:
                continue
            for metric, start in (("gating", 0.9), ("span", 2.0)):
                values = start * np.exp(-np.linspace(0.0, 2.0, heads) * epoch / epochs) + rng.uniform(0, 0.05, heads)
                record[f"{metric}/layer{layer}"] = float(values.mean())
                for head, value in enumerate(values, start=1):
                    record[f"{metric}/layer{layer}/head{head}"] = float(value)
        records.append(record)
    # the values at initialization, logged with the first epoch (as the engine's loop logs them)
    records[0].update({f"init_{key}": value for key, value in records[0].items() if "/" in key})
    return records


def _deviation(layers: tuple[str, ...], epochs: int, start: float) -> list[dict]:
    """log.jsonl records as `efcn.diagnostics.summary` logs them: each embedded layer's deviation and the total."""
    records = []
    for epoch in range(1, epochs + 1):
        values = {layer: start + (1 - start) * (1 - math.exp(-epoch / (5 + i))) / 2 for i, layer in enumerate(layers)}
        record = {"epoch": epoch, **{f"deviation/{layer}": value for layer, value in values.items()}}
        record["deviation/total"] = sum(values.values()) / len(values)
        records.append(record)
    records[0].update({f"init_deviation/{layer}": start for layer in (*layers, "total")})
    return records


def _stability(r_range: tuple[float, float]) -> tuple[list[dict], list[dict], list[Run], Settings]:
    """`convbias.studies.stability.study.measure`'s rows for three groups of three seeds, R_f spread over `r_range`."""
    settings = Settings(
        checkpoints=["init", "last"],
        images=2,
        deltas=[0.5, 1.0],
        cuts=[3, 4],
        main_delta=1.0,
        convention="published",
        modes="published",
        draws=2,
        normalize=False,
        interpolation="bilinear",
        chunk_size=8,
        seed=0,
        device="cpu",
    )
    rng = np.random.default_rng(1)
    low, high = r_range
    rows, layer_rows = [], []
    for g, model in enumerate(("vanilla_cnn", "convit_tiny", "fcn_vanilla_cnn")):
        for seed in SEEDS:
            for c, checkpoint in enumerate(settings.checkpoints):
                centre = low * (high / low) ** ((g * 2 + c) / 5) * math.exp(rng.normal(0, 0.1))
                base = dict(
                    run=f"runs/{model}_seed{seed}",
                    group=f"{model} f=0.25",
                    model=model,
                    seed=seed,
                    train_fraction=0.25,
                    checkpoint=checkpoint,
                    test_error=90 - 30 * c - 10 * g + rng.normal(0, 2),
                    convention="published",
                    modes="published",
                    images=2,
                    draws=2,
                )
                for delta, cut in settings.grid:
                    R = centre * (1 + 0.2 * delta) * math.exp(rng.normal(0, 0.05))
                    rows.append(dict(base, delta=delta, cut=cut, T=0.01 * delta, R=R, R_se=0.1 * R, D=R, G=1.0))
                for depth in range(4):
                    R = centre * (0.5 + depth / 3)
                    layer_rows.append(dict(base, depth=depth, relative_depth=(depth + 1) / 4, R=R, R_se=0.1 * R))
    image = torch.linspace(0, 1, 16)[:, None] * torch.linspace(0, 1, 16)[None]
    runs = [Run(Path("runs/cnn"), {}, image.expand(2, 1, 16, 16), None, {})]
    return rows, layer_rows, runs, settings


def _sweep_rows(columns: dict[str, list], models: tuple[str, ...] = ("convit", "deit")) -> list[dict]:
    """Rows of a sweep's runs.csv: every model, setting of `columns` and seed, with top-1 and top-5."""
    rng = np.random.default_rng(2)
    rows = []
    for m, model in enumerate(models):
        for setting in itertools.product(*columns.values()):
            for seed in SEEDS:
                top1 = 60 + 10 * m + rng.normal(0, 3)
                where = dict(zip(columns, setting))
                rows.append(dict(run=f"{model}_{seed}", variant=model, model=f"{model}_tiny", **where, seed=seed))
                rows[-1].update(top1=top1, top5=top1 + 10)
    return rows


def _efcn(tmp_path: Path) -> None:
    """The relax-time protocol's tables (`efcn_protocol.run`), relax times log-spaced over 150 epochs."""
    times = [0, 1, 2, 5, 12, 28, 65, 150]
    curves = [
        dict(run=run, epoch=e, train_loss=2.3 / (1 + e), test_acc=min(99.0, 10 + 9 * e))
        for run in ("cnn", "fcn", *(f"efcn_tw{t}" for t in times))
        for e in range(0, 151, 10)
    ]
    rows = [
        dict(
            relax_time=t,
            final_test_acc=90 + math.log1p(t),
            initial_train_loss=2.3 / (1 + t),
            deviation_total=0.05 + 0.01 * i,
            local_only_test_acc=50 + 5 * i,
            off_local_only_test_acc=10 + 2 * i,
            grad_norm_start=1 + i,
            grad_norm_end=0.1 + i / 10,
            hessian_top_start=-1 + 3 * i,
            hessian_top_end=10 + i,
        )
        for i, t in enumerate(times)
    ]
    baselines = dict(
        cnn_best_test_acc=95.8,
        fcn_best_test_acc=96.4,
        fcn_initial_train_loss=2.31,
        fcn_deviation_total=0.97,
        fcn_final_test_acc=96.3,
    )
    rng = np.random.default_rng(3)
    filters = {f"eFCN t_w={t}": [("at relax time", rng.normal(size=(1, 8, 8)))] for t in (0, 12, 150)}
    filters["FCN"] = [(title, rng.normal(size=(1, 8, 8))) for title in ("initialization", "after 10", "difference")]
    interpolation = [
        dict(relax_time=t, method=method, alpha=a, train_loss=0.1 + a * (1 - a), test_acc=95 - 5 * a * (1 - a))
        for t in (0, 12, 150)
        for method in ("linear", "string", "output")
        for a in np.linspace(0, 1, 5)
    ]
    efcn_figures.training_curves(curves, times, tmp_path / "fig6_2.png")
    efcn_figures.accuracy_and_landscape(rows, baselines, tmp_path / "fig6_3.png")
    efcn_figures.deviation(rows, baselines, tmp_path / "fig6_4.png")
    efcn_figures.local_contributions(rows, tmp_path / "fig6_5.png")
    efcn_figures.filter_heatmaps(filters, tmp_path / "fig6_6.png")
    efcn_figures.interpolation(interpolation, tmp_path / "figE6.png")


def _diagnostics(tmp_path: Path) -> None:
    """`convbias-diagnostics`: ConViT-S-like logs (10 gated layers of 12, 9 heads), an eFCN's and an FCN's deviation
    (three embedded layers) and attention maps."""
    records = _history(layers=12, heads=9, epochs=30, gated=10)
    figures.plot_nonlocality({"DeiT-S": records, "ConViT-S": records}, tmp_path / "nonlocality.png")
    figures.plot_per_head(records, "gating", tmp_path / "gating_convit.png", title="convit")
    figures.plot_per_head(records, "span", tmp_path / "span_convit.png", title="convit")
    one_layer = _history(layers=2, heads=4, epochs=2, gated=1)  # a tiny ConViT's: one GPSA layer, spans 1e-5 from 1
    for record in one_layer:
        record.update(
            {key: 1 + 1e-5 * (value - 2.0) for key, value in record.items() if key.startswith(("span/", "init_span/"))}
        )
    figures.plot_per_head(one_layer, "span", tmp_path / "span_one_layer.png", title="tiny")
    layers = ("conv1", "conv2", "conv3")
    deviation = {"eFCN t_w=5": _deviation(layers, 30, 0.0), "FCN": _deviation(layers, 30, 0.9)}
    figures.plot_deviation(deviation, tmp_path / "deviation.png")
    maps = {f"layer {layer}": torch.rand(9, 14, 14).softmax(-1) for layer in (1, 10)}
    queries = {label: (7, 7) for label in maps}
    gates = {"layer 1": torch.linspace(0.05, 0.95, 9).tolist()}
    figures.plot_attention_maps(torch.rand(3, 224, 224), maps, queries, tmp_path / "attention_maps.png", gates)


def _stability_plots(r_range: tuple[float, float]) -> Callable[[Path], None]:
    def draw(tmp_path: Path) -> None:
        stability_figures.plots(*_stability(r_range), tmp_path)

    return draw


def _report(tmp_path: Path) -> None:
    """`convbias-sweep report`: sample efficiency (three models) and the three parameter-sweep forms."""
    fractions = [0.05, 0.1, 0.25, 0.5, 1.0]
    sweep_figures.plot_sample_efficiency(
        _sweep_rows({"train_fraction": fractions}, ("convit", "deit", "tcnn")), "deit", tmp_path / "se.png"
    )
    grid = {"train_fraction": [1.0], "width": [4, 6, 8, 12, 16, 24, 32, 48], "alpha_tilde": [0.1, 1, 10, 100, 1000]}
    sweep_figures.plot_parameter_sweep(_sweep_rows(grid, ("fc2",)), tmp_path / "heatmap.png")
    lines = {"train_fraction": [0.1, 1.0], "locality_strength": [0.1, 0.3, 1, 3, 10], "local_up_to_layer": [0, 5, 10]}
    sweep_figures.plot_parameter_sweep(_sweep_rows(lines, ("convit",)), tmp_path / "lines.png")
    named = {"train_fraction": [1.0], "init": ["convolutional", "random", "identity", "uniform"]}
    sweep_figures.plot_parameter_sweep(_sweep_rows(named, ("convit",)), tmp_path / "named.png")


def _regimes(tmp_path: Path) -> None:
    """`regimes.write`: one row per run (two models, four alphas, three seeds) and their summary over seeds."""
    rng = np.random.default_rng(4)
    rows = [
        dict(run=f"{model}_{alpha}_{seed}", seed=seed, model=model, alpha=alpha, lr=0.003)
        | dict(top1=80 + rng.normal(0, 5), ntk_change=10 / alpha * math.exp(rng.normal(0, 0.3)))
        | {f"train_error_sigma{s:g}": 5 + 100 * s * (1 + math.log10(alpha)) + rng.normal(0, 1) for s in regimes.SIGMAS}
        for model in ("convit_tiny", "deit_tiny_plus")
        for alpha in (0.1, 1.0, 10.0, 100.0)
        for seed in SEEDS
    ]
    regimes.plot(rows, regimes.over_seeds(rows), tmp_path / "regimes.png")


def _phase_diagram(tmp_path: Path) -> None:
    """`phase_diagram.run`'s cells.csv: widths 4..1024, alpha_tilde 0.1..1000, five seeds per cell."""
    cells = []
    for i, width in enumerate((4, 8, 16, 32, 64, 128, 256, 512, 1024)):
        for j, alpha in enumerate((0.1, 1.0, 10.0, 100.0, 1000.0)):
            cells.append(
                dict(width=width, alpha_tilde=alpha, params=12 * width + 1, seeds=5)
                | dict(ensemble_test_error=5 + j - 0.3 * i, mean_test_error=7 + j - 0.3 * i, fluctuation=1.0)
                | dict(converged_fraction=min(1.0, 0.2 * i), mean_train_error=0.0, ntk_change=10 ** (1 - j / 2))
                | dict(mean_steps=1000.0)
            )
    phase_diagram.plot(cells, tmp_path)


def _robustness(tmp_path: Path) -> None:
    """`robustness_report.plot_improvement`: ImageNet-C rows of two models, every category and severity."""
    from convbias.studies.robustness.corruptions import CATEGORIES, SEVERITIES

    rows = [
        dict(model=model, source="generated", corruption=name, category=category, severity=severity)
        | dict(top1=70 - 5 * severity + 3 * m)
        for m, model in enumerate(("deit", "convit"))
        for category, names in (*CATEGORIES.items(), ("other", ("speckle_noise",)))
        for name in names
        for severity in SEVERITIES
    ]
    robustness_report.plot_improvement(rows, "convit", "deit", tmp_path / "improvement.png")


def _trajectories(tmp_path: Path) -> None:
    """`convbias-stability-contrasts`: the committed study's R_f trajectories over training, summarized over seeds."""
    rows = stability_contrasts.read_trajectories(PACKAGE.parent / "results" / "relative_stability" / "trajectories.csv")
    stability_contrasts.trajectory_figure(stability_contrasts.trajectory_summary(rows), tmp_path / "trajectories.png")


STABILITY_RANGES = {  # R_f spreads: matplotlib's default log ticks overlap on the middle one
    "stability, R_f within a decade": (2.0, 6.0),
    "stability, R_f around a decade": (0.3, 3.0),
    "stability, R_f over decades": (0.03, 20.0),
}
BUILDERS: dict[str, Callable[[Path], None]] = {
    "diagnostics": _diagnostics,
    **{name: _stability_plots(r_range) for name, r_range in STABILITY_RANGES.items()},
    "efcn": _efcn,
    "report": _report,
    "regimes": _regimes,
    "phase diagram": _phase_diagram,
    "robustness": _robustness,
    "trajectories": _trajectories,
}


def _stack() -> set[tuple[str, str]]:
    """(file, function) of the package's frames on the stack."""
    frames = traceback.extract_stack()
    return {(f.filename, f.name) for f in frames if Path(f.filename).resolve().is_relative_to(PACKAGE)}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> tuple[dict[str, Figure], set[tuple[str, str]]]:
    """{'builder: file name': Figure} of every figure the builders save, drawn on the Agg canvas, and the
    package functions that were on the stack when a Figure was built.

    Each figure is drawn once, here: its savefig only records it and leaves an empty file where the image
    would go (the callers move it into place), since rendering the PNG would draw it again for no check.
    The draw lays out every artist and measures its text with the Agg renderer, whose pixel operations are
    left out (`draw_without_rendering`): no check reads a pixel."""
    saved: dict[str, Figure] = {}
    building: set[tuple[str, str]] = set()
    init = Figure.__init__

    def record_save(fig: Figure, fname, *args, **kwargs):
        # the file's own name: convbias.base.storage.save_figure writes it under its temporary name first
        name = re.sub(r"^[.](.+)[.]tmp[0-9]+$", r"\1", Path(fname).name)
        saved[f"{builder}: {name}"] = fig
        Path(fname).write_bytes(b"")

    def record_init(fig: Figure, *args, **kwargs):
        building.update(_stack())
        init(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", record_save)
        patch.setattr(Figure, "__init__", record_init)
        for builder, build in BUILDERS.items():  # noqa: B007 (record_save reads it)
            build(tmp_path_factory.mktemp("figures"))
    for name, fig in saved.items():
        FigureCanvasAgg(fig)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig.draw_without_rendering()
        LAYOUT_WARNINGS[name] = [str(w.message) for w in caught if "constrained_layout" in str(w.message)]
    return saved, building


@pytest.fixture(scope="module")
def figure(drawn) -> Callable[[str], Figure]:
    """The drawn Figure of 'builder: file name'."""
    return drawn[0].__getitem__


# -- checks on a drawn figure ------------------------------------------------------------------------
def _shown_tick_labels(axis: Axis) -> list[Text]:
    """The visible, non-empty tick labels of an axis, of the ticks inside its view."""
    low, high = sorted(axis.get_view_interval())
    slack = 1e-9 * max(abs(low), abs(high))
    labels = []
    for ticks, locs in (
        (axis.get_major_ticks, axis.get_majorticklocs()),
        (axis.get_minor_ticks, axis.get_minorticklocs()),
    ):
        for tick, loc in zip(ticks(len(locs)), locs):
            if low - slack <= loc <= high + slack:
                labels += [t for t in (tick.label1, tick.label2) if t.get_visible() and t.get_text().strip()]
    return labels


def overlapping_tick_labels(fig: Figure) -> list[tuple[str, str]]:
    """Pairs of tick labels of one axis whose drawn boxes overlap."""
    renderer = fig.canvas.get_renderer()
    clashes = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [(label.get_text(), label.get_window_extent(renderer)) for label in _shown_tick_labels(axis)]
            for i, (text, box) in enumerate(boxes):
                clashes += [(text, other) for other, other_box in boxes[i + 1 :] if box.overlaps(other_box)]
    return clashes


def _error_bars(ax: Axes) -> list[ErrorbarContainer]:
    return [c for c in ax.containers if isinstance(c, ErrorbarContainer)]


def _data_labels(ax: Axes) -> list[str]:
    """Labels of the data an Axes draws: its error bars, and its other lines and scatters labelled for a legend."""
    bars = _error_bars(ax)
    in_bars = {id(artist) for c in bars for artist in c.get_children()}
    labelled = [a for a in (*ax.lines, *ax.collections) if id(a) not in in_bars and not a.get_label().startswith("_")]
    return [c.get_label() for c in bars] + [a.get_label() for a in labelled if isinstance(a, Line2D | PathCollection)]


def _legend_texts(legends: list[Legend | None]) -> set[str]:
    return {text.get_text() for legend in legends if legend is not None for text in legend.get_texts()}


def unlegended_lines(fig: Figure) -> list[str]:
    """Labels of the lines, scatters and error bars with no legend entry, on the Axes that draw more than one."""
    figure_legend = _legend_texts(fig.legends)
    missing = []
    for ax in fig.axes:
        labels = _data_labels(ax)
        if len(labels) > 1:
            shown = _legend_texts([ax.get_legend()]) | figure_legend
            missing += [f"{ax.get_title()!r}: {label}" for label in labels if label not in shown]
    return missing


def _texts(fig: Figure) -> str:
    """The titles, and the legends' titles and entries, of a figure."""
    titles = [*([fig.get_suptitle()] if fig.get_suptitle() else []), *(ax.get_title() for ax in fig.axes)]
    legends = [legend for legend in (*fig.legends, *(ax.get_legend() for ax in fig.axes)) if legend is not None]
    texts = titles + [legend.get_title().get_text() for legend in legends]
    return "\n".join(texts + sorted(_legend_texts(legends)))


def _colour_bar_label(mappable) -> str:
    bar = mappable.colorbar
    return (bar.ax.get_ylabel() or bar.ax.get_xlabel()).strip() if bar is not None else ""


def unexplained_colours(fig: Figure) -> list[str]:
    """The panels whose colours encode a value with no labelled colour bar to read it on: an image drawn through a
    colour map (a grey one is a picture of an input), a mesh, a scatter of several colours (the colours of a
    legend's categories are separate collections, one colour each). A colour bar serves every mappable that
    shares its norm and colour map (one bar beside a row of attention maps)."""
    panels = [ax for ax in fig.axes if not hasattr(ax, "_colorbar")]
    mappables = [m for ax in panels for m in (*ax.images, *ax.collections) if not isinstance(m, ContourSet)]
    labelled = {(id(m.norm), m.get_cmap().name) for m in mappables if _colour_bar_label(m)}
    missing = []
    for ax in panels:
        for m in (*ax.images, *ax.collections):
            if isinstance(m, AxesImage):
                encodes = np.ndim(m.get_array()) == 2 and m.get_cmap().name not in ("gray", "Greys")
            elif isinstance(m, ContourSet):
                continue
            else:
                encodes = m.get_array() is not None or len({tuple(c) for c in m.get_facecolors()}) > 1
            if encodes and (m.get_array() is None or (id(m.norm), m.get_cmap().name) not in labelled):
                missing.append(f"{ax.get_title()!r}: {type(m).__name__}")
    return missing


def stacked_error_bars(fig: Figure) -> list[str]:
    """The x positions where two series of one panel draw their error bars on top of each other."""
    stacked = []
    for ax in fig.axes:
        positions = [np.asarray(c.lines[0].get_xdata(), dtype=float) for c in _error_bars(ax)]
        for a, b in itertools.combinations(positions, 2):
            stacked += [f"{ax.get_title()!r}: {x:g}" for x in a if np.isclose(b, x, rtol=1e-9, atol=0).any()]
    return stacked


STABILITY_FILES = ("rf_vs_delta.png", "rf_per_layer.png", "rf_vs_error.png", "deformed_examples.png")
FIGURES = [
    f"{builder}: {name}"
    for builder, names in {
        "diagnostics": (
            "nonlocality.png",
            "gating_convit.png",
            "span_convit.png",
            "span_one_layer.png",
            "deviation.png",
            "attention_maps.png",
        ),
        **dict.fromkeys((b for b in BUILDERS if b.startswith("stability")), STABILITY_FILES),
        "efcn": ("fig6_2.png", "fig6_3.png", "fig6_4.png", "fig6_5.png", "fig6_6.png", "figE6.png"),
        "report": ("se.png", "heatmap.png", "lines.png", "named.png"),
        "regimes": ("regimes.png",),
        "phase diagram": ("phase_diagram.png", "double_descent.png"),
        "robustness": ("improvement.png",),
        "trajectories": ("trajectories.png",),
    }.items()
    for name in names
]


def _figure_builders() -> set[tuple[str, str]]:
    """(file, function) of every function of the package that builds a Figure, itself or through a private
    helper of its module (such as `efcn_figures._figure`)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if "Figure" not in source:  # a module that never names Figure builds none
            continue
        functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
        calls = {
            f.name: {c.func.id for c in ast.walk(f) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            for f in functions
        }
        direct = {name for name, called in calls.items() if "Figure" in called}
        helpers = {name for name in direct if name.startswith("_")}
        users = {name for name, called in calls.items() if called & helpers}
        found |= {(str(path), name) for name in direct | users}
    return found


def test_every_figure_of_the_package_is_drawn(drawn):
    """Each function of the package that builds a Figure ran under a builder: a new plot needs one here."""
    saved, building = drawn
    builders = _figure_builders()
    assert len(builders) >= 15  # the ast scan finds them
    assert builders - building == set()
    assert sorted(saved) == sorted(FIGURES)


@pytest.mark.parametrize("name", FIGURES)
def test_the_layout_fits_the_figure(figure, name):
    """matplotlib's constrained layout found room for every panel, its labels and legends (no collapsed axes)."""
    figure(name)
    assert LAYOUT_WARNINGS[name] == []


@pytest.mark.parametrize("name", FIGURES)
def test_tick_labels_do_not_overlap(figure, name):
    assert overlapping_tick_labels(figure(name)) == []


@pytest.mark.parametrize("name", FIGURES)
def test_every_line_has_a_legend_entry(figure, name):
    assert unlegended_lines(figure(name)) == []


@pytest.mark.parametrize("name", FIGURES)
def test_error_bars_say_what_they_are(figure, name):
    fig = figure(name)
    if any(_error_bars(ax) for ax in fig.axes):
        note = r"error bars: (none|95% t interval[^;]*? over \d+(-\d+)? seeds)"
        assert re.search(note, " ".join(_texts(fig).split()))


@pytest.mark.parametrize("name", FIGURES)
def test_every_colour_encoding_has_a_labelled_colour_bar(figure, name):
    assert unexplained_colours(figure(name)) == []


@pytest.mark.parametrize("name", FIGURES)
def test_error_bars_at_one_point_are_shifted_apart(figure, name):
    assert stacked_error_bars(figure(name)) == []


@pytest.mark.parametrize("builder", [b for b in BUILDERS if b.startswith("stability")])
def test_deformed_examples_are_at_the_deltas_measured(figure, builder):
    """One row per delta of the grid (--deltas 0.5 1 with --main-delta 1), one panel per cut."""
    titles = [ax.get_title() for ax in figure(f"{builder}: deformed_examples.png").axes]
    shown = [re.match(r"delta=(\S+), c=(\d+)\n", t) for t in titles if t != "original"]
    assert sorted((float(m[1]), int(m[2])) for m in shown) == [(0.5, 3), (0.5, 4), (1.0, 3), (1.0, 4)]


@pytest.mark.parametrize("builder", [b for b in BUILDERS if b.startswith("stability")])
def test_rf_error_bars_are_the_summary_intervals(figure, builder):
    """rf_per_layer draws, per group and checkpoint, `layer_summary`'s geometric means and 95% intervals."""
    _, layer_rows, _, _ = _stability(STABILITY_RANGES[builder])
    (ax,) = figure(f"{builder}: rf_per_layer.png").axes
    bars = {c.get_label(): c for c in _error_bars(ax)}
    assert len(bars) == 3 * 2
    for (group, checkpoint), points in itertools.groupby(
        sorted(layer_summary(layer_rows), key=lambda s: (s["group"], s["checkpoint"], s["depth"])),
        key=lambda s: (s["group"], s["checkpoint"]),
    ):
        points = list(points)
        line, _, (vertical,) = bars[f"{group}, {checkpoint}"].lines
        x, R = line.get_xydata().T
        np.testing.assert_allclose(x, [p["relative_depth"] for p in points], atol=0.15 * 0.25)  # shifted apart
        np.testing.assert_allclose(R, [p["R"] for p in points])
        np.testing.assert_allclose(
            vertical.get_segments(), [[(u, p["R_low"]), (u, p["R_high"])] for u, p in zip(x, points)]
        )


def test_per_head_lines_are_distinct_and_over_the_mean(figure):
    """Gating per head: the nine heads in nine colors, drawn above a thinner dashed mean, all in the legend."""
    fig = figure("diagnostics: gating_convit.png")
    for ax in fig.axes:
        heads = [line for line in ax.lines if line.get_label().startswith("head")]
        (mean,) = [line for line in ax.lines if line.get_label() == "mean over heads"]
        assert len(heads) == 9 and len({line.get_color() for line in heads}) == 9
        assert all(line.get_zorder() > mean.get_zorder() for line in heads)
        assert mean.get_linestyle() == "--" and mean.get_linewidth() < min(line.get_linewidth() for line in heads)


@pytest.mark.slow
def test_the_docs_figures_script_redraws_every_docs_figure_from_the_committed_tables(tmp_path, monkeypatch, capsys):
    """docs/figures/make_figures.py reads results/ through the studies' checked readers and draws each PNG of
    docs/figures (here into a scratch folder)."""
    import importlib.util

    here = REPO / "docs" / "figures"
    spec = importlib.util.spec_from_file_location("make_figures", here / "make_figures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "HERE", tmp_path)
    script.main()
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(p.name for p in here.glob("*.png"))
