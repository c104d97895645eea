"""The phase-diagram reproduction's pieces: the stacked FC nets against the source's formula, one width
trained to zero loss in both regimes (kernel change small when lazy, large when learning features),
the data, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from convbias.studies.phase_diagram import command as phase_cli
from convbias.studies.phase_diagram import study as pd

pytestmark = pytest.mark.usefixtures("single_thread")


def test_stacked_nets_follow_the_ntk_parametrization():
    model = pd.FullyConnected.initialize([3, 7], d=5, h=6, beta=5.0)
    x = torch.randn(4, 5)
    for b, seed in enumerate([3, 7]):
        g = torch.Generator().manual_seed(seed)
        w0, w1, w2 = torch.randn(6, 5, generator=g), torch.randn(6, 6, generator=g), torch.randn(6, generator=g)
        act = lambda z: model.gain * F.softplus(z, beta=5.0)  # noqa: E731
        expected = act(act(x @ w0.T / math.sqrt(5)) @ w1.T / math.sqrt(6)) @ w2 / math.sqrt(6)
        torch.testing.assert_close(model(x)[b], expected)
    # the gain gives unit second moment at unit-variance input: E[(gain softplus(z))^2], z ~ N(0, 1), by quadrature
    z = torch.linspace(-12, 12, 240_001, dtype=torch.float64)
    density = torch.exp(-(z**2) / 2) / math.sqrt(2 * math.pi)
    moment = torch.trapezoid((model.gain * F.softplus(z, beta=5.0)).pow(2) * density, z).item()
    assert moment == pytest.approx(1.0, rel=0.005)


def test_one_width_reaches_zero_loss_lazily_and_with_features():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    x = x * 2 / x.norm(dim=1, keepdim=True)
    y = torch.sign(x[:, 0] * x[:, 1] + 0.1)  # a non-linear rule
    data = (x[:40], y[:40], x[40:], y[40:])
    cfg = pd.PhaseDiagramConfig(
        widths=[32], alpha_tildes=[0.1, 1000.0], seeds=[0, 1], max_steps=3000, ntk_samples=10
    ).validated()
    rows, outputs = pd.train_width(cfg, 32, data)
    assert outputs.shape == (2, 2, 20) and all(r["converged"] == 1 and r["train_error"] == 0 for r in rows)
    feature = [r["ntk_change"] for r in rows if r["alpha_tilde"] == 0.1]
    lazy = [r["ntk_change"] for r in rows if r["alpha_tilde"] == 1000.0]
    assert max(lazy) < 0.1 < 1.0 < min(feature)
    cells = pd.cell_rows(cfg, 32, rows, outputs, data[3])
    assert [c["converged_fraction"] for c in cells] == [1.0, 1.0] and cells[0]["seeds"] == 2


def test_odd_even_digits_on_the_sphere():
    x_train, y_train, x_test, y_test = pd.odd_even_digits(1000, 10, 0)
    assert x_train.shape == (1000, 10) and x_test.shape == (797, 10)
    torch.testing.assert_close(x_train.pow(2).sum(1), torch.full((1000,), 10.0))
    assert set(y_train.tolist()) == {-1.0, 1.0} and 0.4 < (y_test > 0).float().mean() < 0.6


def test_bad_grid_is_refused_before_any_work(tmp_path, capsys):
    """One line naming the file, the line and the key (each key's checks: test_study_modules.py), nothing written."""
    config = tmp_path / "grid.yaml"
    for text, message in (
        ("widths: [4]\nalpha_tildes: [1.0, -2.0]\n", "line 2: alpha_tildes must be a list of positive numbers"),
        ("widths: [4]\nsteps: 3\n", "line 2: steps: unknown key (did you mean max_steps, seeds?); known: widths, "),
        ("train_size: abc\n", "line 1: train_size expects int, got 'abc'"),
        ("widths: 4\n", "line 1: widths expects a list of int values, got 4"),
        ("activation_beta: .nan\n", "line 1: activation_beta must be a finite number, got nan"),
    ):
        config.write_text(text)
        assert phase_cli.main(["-c", str(config), "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: phase-diagram config {config}, {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_report_csvs_give_the_ensembles_their_test_set_and_member_spread(tmp_path, repo):
    """From the committed grid: each ensemble row carries the size of the test split the nets were scored on
    and the sample std of its members' top-1 (nets.csv), the inputs of the sweep report's intervals."""
    import csv
    import shutil
    import statistics

    for name in ("nets.csv", "cells.csv", "config.yaml"):
        shutil.copy(repo / "results" / "phase_diagram" / name, tmp_path / name)
    pd.write_report_csvs(tmp_path)
    with open(tmp_path / "ensembles.csv") as f:
        ensembles = list(csv.DictReader(f))
    with open(tmp_path / "nets.csv") as f:
        nets = list(csv.DictReader(f))
    test_split = pd.odd_even_digits(pd.PhaseDiagramConfig.from_yaml(tmp_path / "config.yaml").train_size, 10, 0)[2]
    assert len(ensembles) == 40 and {int(e["images"]) for e in ensembles} == {len(test_split)}
    for e in ensembles:
        members = [float(n["top1"]) for n in nets if (n["width"], n["alpha_tilde"]) == (e["width"], e["alpha_tilde"])]
        assert float(e["member_top1_std"]) == pytest.approx(statistics.stdev(members), rel=1e-9)
        assert float(e["member_top1"]) == pytest.approx(statistics.mean(members), rel=1e-9)
