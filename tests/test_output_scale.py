"""The alpha-trick wrapper: zero output at initialization, gradients of alpha (f_w - f_w0) with the loss
divided by alpha^2 (autograd of the explicit formula, and a linear model's closed form), bad alpha."""

import copy
import csv
import json
import math
import subprocess

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from convbias.engine.output_scale import OutputScale, ScaledLoss, check_alpha
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
TINY = [
    "--model",
    "deit_tiny_patch16_224",
    "--model-kwargs",
    "patch_size=2",
    "embed_dim=32",
    "depth=1",
    "num_heads=2",
    "--dataset",
    "digits",
    "--img-size",
    "8",
    "--crop-pct",
    "1",
    "--no-aug",
    "--repeated-aug",
    "1",
    "--batch-size",
    "128",
    "--opt",
    "sgd",
    "--lr",
    "0.05",
    "--weight-decay",
    "0",
    "--drop-path",
    "0",
    "--warmup-epochs",
    "0",
    "--workers",
    "0",
    "--diagnostics-images",
    "2",
]


def test_train_with_output_scale_logs_the_kernel_change_and_reloads(tmp_path):
    from convbias.cli import train
    from convbias.weights import read_state_dict, weights_metadata

    output = tmp_path / "run"
    results = train.run(TINY + ["--epochs", "2", "--output-scale", "100", "--output", str(output)])
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    changes = [r["ntk_relative_change"] for r in records]
    assert 0 < changes[0] <= changes[1] < 0.2  # large alpha: the kernel barely moves (lazy)
    assert records[-1]["ntk_eigenvalue_1"] > 0
    weights = output / "checkpoints" / "last" / "model.safetensors"
    assert weights_metadata(weights)["output_scale"] == "100.0"
    state = read_state_dict(weights)
    assert any(key.startswith("initial.") for key in state) and any(key.startswith("model.") for key in state)
    evaluated = train.run(
        TINY + ["--eval-only", "--checkpoint", str(output), "--which", "best", "--output", str(tmp_path / "eval")]
    )
    assert evaluated["eval_top1"] == pytest.approx(results["best_top1"])  # the wrapper is rebuilt from metadata


@pytest.mark.parametrize("value", ["0", "-3", "inf"])
def test_train_refuses_a_non_positive_output_scale(tmp_path, capsys, value):
    from convbias.cli import train

    assert train.main(TINY + ["--output-scale", value, "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --output-scale must be a") and "finite number" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_regimes_summarizes_a_sweep_of_output_scale_runs(tmp_path, console_script):
    """convbias-regimes on a one-run sweep directory: the run's own final top-1 and logged kernel change,
    and the local-energy curve, whose sigma = 0 point is the run's training error."""
    from convbias.cli import train

    sweep = tmp_path / "sweep"
    run = sweep / "runs" / "a10"
    results = train.run(TINY + ["--epochs", "1", "--output-scale", "10", "--output", str(run)])
    (sweep / "runs.csv").write_text("run,model\na10,convit_tiny\n")
    done = subprocess.run([console_script("convbias-regimes"), str(sweep)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with open(sweep / "regimes.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    last = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()][-1]
    assert float(row["alpha"]) == 10 and float(row["top1"]) == pytest.approx(results["final_top1"])
    assert float(row["ntk_change"]) == pytest.approx(last["ntk_relative_change"])
    curve = [float(row[f"train_error_sigma{s:g}"]) for s in (0.0, 0.05, 0.1, 0.2, 0.3)]
    assert all(0 <= error <= 100 for error in curve)
    model, _, data = load_run(run, load_families())
    data.train.transform = data.val.transform
    images = torch.stack([data.train[i][0] for i in range(len(data.train))])
    labels = torch.tensor([data.train[i][1] for i in range(len(data.train))])
    with torch.no_grad():
        error = 100 * (model(images).argmax(1) != labels).double().mean().item()
    assert curve[0] == pytest.approx(error, abs=1e-6)  # no noise: the training error itself
    assert (sweep / "regimes.png").stat().st_size > 0


def test_regimes_without_a_sweep_is_one_error_line(tmp_path, capsys):
    from convbias.cli import regimes

    assert regimes.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'runs.csv'} not found; run the sweep first (convbias-sweep run ...)"
    )
    assert list(tmp_path.iterdir()) == []
