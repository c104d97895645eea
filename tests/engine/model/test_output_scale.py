"""The alpha-trick wrapper: zero output at initialization, gradients of alpha (f_w - f_w0) with the loss
divided by alpha^2 (autograd of the explicit formula, and a linear model's closed form), bad alpha."""

import copy
import csv
import functools
import json
import math
from importlib.metadata import entry_points

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from convbias.engine.model.output_scale import OutputScale, ScaledLoss, check_alpha
from convbias.evaluation.ensembles import load_run
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_vit() -> nn.Module:
    return timm.create_model(
        "deit_tiny_patch16_224", img_size=8, patch_size=2, embed_dim=24, depth=2, num_heads=2, num_classes=5, in_chans=1
    )


@pytest.mark.parametrize("alpha", [1e-3, 1.0, 1e3])
def test_output_is_exactly_zero_at_initialization(alpha):
    torch.manual_seed(0)
    model = OutputScale(tiny_vit(), alpha).eval()
    out = model(torch.randn(4, 1, 8, 8))
    assert out.shape == (4, 5) and torch.equal(out, torch.zeros_like(out))


def perturbed(model: nn.Module) -> None:
    """Move the trainable weights off their initialization, so that f_w != f_w0."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("alpha", [0.1, 30.0])
def test_gradients_match_the_explicit_formula(alpha):
    torch.manual_seed(0)
    network = tiny_vit().eval()
    at_init = copy.deepcopy(network)
    wrapped = OutputScale(network, alpha).eval()
    perturbed(network)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 5, (6,))

    ScaledLoss(nn.CrossEntropyLoss(), alpha)(wrapped(x), y).backward()
    got = {name: p.grad.clone() for name, p in network.named_parameters()}
    network.zero_grad()
    explicit = alpha * (network(x) - at_init(x).detach())  # F = alpha (f_w - f_w0), loss / alpha^2
    (F.cross_entropy(explicit, y) / alpha**2).backward()
    for name, p in network.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)
    assert all(p.grad is None for p in wrapped.initial.parameters())


@pytest.mark.parametrize("alpha", [0.5, 8.0])
def test_linear_model_gradient_closed_form(alpha):
    # f = W x, F = alpha (W - W0) x, L = CE(F, y) / alpha^2  =>  dL/dW = (softmax(F) - onehot(y))^T x / (n alpha)
    torch.manual_seed(0)
    linear = nn.Linear(4, 3, bias=False)
    wrapped = OutputScale(linear, alpha)
    perturbed(linear)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    out = wrapped(x)
    ScaledLoss(nn.CrossEntropyLoss(), alpha)(out, y).backward()
    delta = linear.weight.detach() - wrapped.initial.weight
    torch.testing.assert_close(out, alpha * x @ delta.T)
    expected = (out.detach().softmax(1) - F.one_hot(y, 3)).T @ x / (10 * alpha)
    torch.testing.assert_close(linear.weight.grad, expected)


def test_initial_copy_is_frozen_in_eval_mode_and_saved():
    wrapped = OutputScale(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)), 2.0).train()
    assert wrapped.model.training and not wrapped.initial.training
    assert not any(p.requires_grad for p in wrapped.initial.parameters())
    assert set(wrapped.state_dict()) == {"model.0.weight", "model.0.bias", "initial.0.weight", "initial.0.bias"}


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "2"])
def test_non_positive_alpha_is_refused(bad):
    with pytest.raises(ValueError, match="--output-scale must be a positive finite number"):
        check_alpha(bad)
    with pytest.raises(ValueError, match="--output-scale"):
        OutputScale(nn.Linear(2, 2), bad)


# ------------------------------------------------------------------------------ the engine's --output-scale
TINY_DEIT = dict(
    model="deit_tiny_patch16_224",
    model_kwargs=dict(patch_size=2, embed_dim=32, depth=1, num_heads=2),
    img_size=8,
    batch_size=128,
    opt="sgd",
    lr=0.05,
    weight_decay=0,
    drop_path=0,
    diagnostics_images=2,
)


@pytest.fixture(scope="module")
def deit_argv(cli_argv):
    """`deit_argv(**options)`: a one-block DeiT on the digits, trained with SGD."""
    return functools.partial(cli_argv, cli_argv.DEIT_RECIPE, cli_argv.PLAIN_DIGITS, TINY_DEIT)


def test_train_with_output_scale_logs_the_kernel_change_and_reloads(tmp_path, deit_argv):
    from convbias.base.weights import read_state_dict, weights_metadata
    from convbias.cli import train

    output = tmp_path / "run"
    results = train.run(deit_argv(epochs=2, output_scale=100, output=output))
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    changes = [r["ntk_relative_change"] for r in records]
    assert 0 < changes[0] <= changes[1] < 0.2  # large alpha: the kernel barely moves (lazy)
    assert records[-1]["ntk_eigenvalue_1"] > 0
    weights = output / "checkpoints" / "last" / "model.safetensors"
    assert weights_metadata(weights)["output_scale"] == "100.0"
    state = read_state_dict(weights)
    assert any(key.startswith("initial.") for key in state) and any(key.startswith("model.") for key in state)
    evaluated = train.run(deit_argv(eval_only=True, checkpoint=output, which="best", output=tmp_path / "eval"))
    assert evaluated["eval_top1"] == pytest.approx(results["best_top1"])  # the wrapper is rebuilt from metadata


@pytest.mark.parametrize("value", ["0", "-3", "inf"])
def test_train_refuses_a_non_positive_output_scale(tmp_path, capsys, deit_argv, value):
    from convbias.cli import train

    assert train.main(deit_argv(output_scale=value, output=tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --output-scale must be a") and "finite number" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_regimes_summarizes_a_sweep_of_output_scale_runs(tmp_path, deit_argv):
    """convbias-regimes on a one-run sweep directory: the run's own final top-1 and logged kernel change,
    and the local-energy curve, whose sigma = 0 point is the run's training error.

    The installed command's entry point runs in this process: a child would only import torch and timm again."""
    from convbias.cli import train

    sweep = tmp_path / "sweep"
    run = sweep / "runs" / "a10"
    results = train.run(deit_argv(epochs=1, output_scale=10, output=run))
    (sweep / "runs.csv").write_text("run,model\na10,convit_tiny\n")
    (command,) = entry_points(group="console_scripts", name="convbias-regimes")
    assert command.load()([str(sweep)]) == 0
    with open(sweep / "regimes.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    last = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()][-1]
    assert float(row["alpha"]) == 10 and float(row["top1"]) == pytest.approx(results["final_top1"])
    assert float(row["ntk_change"]) == pytest.approx(last["ntk_relative_change"])
    curve = [float(row[f"train_error_sigma{s:g}"]) for s in (0.0, 0.05, 0.1, 0.2, 0.3)]
    assert all(0 <= error <= 100 for error in curve)
    model, _, data = load_run(run, load_families(), which="last")
    data.train.transform = data.val.transform
    images, labels = zip(*(data.train[i] for i in range(len(data.train))))
    images, labels = torch.stack(images), torch.tensor(labels)
    with torch.no_grad():
        error = 100 * (model(images).argmax(1) != labels).double().mean().item()
    assert curve[0] == pytest.approx(error, abs=1e-6)  # no noise: the training error itself
    assert (sweep / "regimes.png").stat().st_size > 0


def test_regimes_without_a_sweep_is_one_error_line(tmp_path, capsys):
    from convbias.studies.regimes import command as regimes

    assert regimes.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'runs.csv'} not found; run the sweep first (convbias-sweep run ...)"
    )
    assert list(tmp_path.iterdir()) == []


def test_regimes_over_seeds_matches_student_t_intervals():
    """Each (model, alpha) over seeds: the mean and scipy's 95% t interval of top-1 and training error,
    the kernel change's geometric mean (t interval of the logs), and top-1 minus the same model at
    alpha = 1 paired by seed."""
    from scipy import stats

    from convbias.studies.regimes.study import markdown, over_seeds

    top1 = {1.0: [90.0, 92.0, 95.0], 10.0: [80.0, 85.0, 83.0]}
    ntk = {1.0: [1.0, 2.0, 4.0], 10.0: [0.1, 0.2, 0.3]}
    rows = [
        {
            "run": f"a{alpha:g}__seed{seed}",
            "seed": seed,
            "model": "convit_tiny",
            "alpha": alpha,
            "top1": top1[alpha][seed],
            "ntk_change": ntk[alpha][seed],
            "train_error_sigma0": 100 - top1[alpha][seed],
            "train_error_sigma0.1": 50.0 + seed,
        }
        for alpha in (10.0, 1.0)
        for seed in (2, 0, 1)  # order-free: pairs are formed by seed
    ]
    summary = {row["alpha"]: row for row in over_seeds(rows)}

    def t_interval(values):
        values = torch.tensor(values, dtype=torch.float64)
        sem = values.std() / math.sqrt(len(values))
        return stats.t.interval(0.95, len(values) - 1, loc=values.mean().item(), scale=sem.item())

    lazy = summary[10.0]
    assert lazy["n"] == 3 and lazy["top1"] == pytest.approx(sum(top1[10.0]) / 3)
    assert (lazy["top1_low"], lazy["top1_high"]) == pytest.approx(t_interval(top1[10.0]))
    gaps = [a - b for a, b in zip(top1[10.0], top1[1.0])]
    assert lazy["top1_gap"] == pytest.approx(sum(gaps) / 3)
    assert (lazy["top1_gap_low"], lazy["top1_gap_high"]) == pytest.approx(t_interval(gaps))
    low, high = t_interval([math.log(v) for v in ntk[10.0]])
    assert lazy["ntk_change"] == pytest.approx((0.1 * 0.2 * 0.3) ** (1 / 3))
    assert (lazy["ntk_change_low"], lazy["ntk_change_high"]) == pytest.approx((math.exp(low), math.exp(high)))
    assert summary[1.0]["top1_gap"] == 0  # the reference point against itself
    table = markdown(list(summary.values()))
    assert f"| convit_tiny | 10 | 3 | {lazy['top1']:.1f} [{lazy['top1_low']:.1f}, {lazy['top1_high']:.1f}] |" in table
