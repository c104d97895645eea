"""Empirical NTK: against the full Jacobian (torch.func.jacrev) and a linear model's closed form; the
kernel's change in the lazy (large alpha) and feature (small alpha) regimes; the memory budget."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from convbias.engine.model.output_scale import OutputScale, ScaledLoss
from convbias.evaluation.ntk import NTKChange, buffer_bytes, empirical_ntk, relative_change, top_eigenvalues

pytestmark = pytest.mark.usefixtures("single_thread")


def mlp(width: int = 32, d: int = 6, k: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, k))


def test_kernel_matches_the_full_jacobian():
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(7, 6)
    params = {name: p.detach() for name, p in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)  # {name: (n, K, *shape)}
    flat = torch.cat([j.reshape(7, 3, -1) for j in jac.values()], dim=2).double()  # (n, K, params)
    expected = torch.einsum("ikp,jkp->ij", flat, flat)  # trace over the logits
    torch.testing.assert_close(empirical_ntk(model, x), expected, rtol=1e-5, atol=1e-6)
    eig = torch.linalg.eigvalsh(expected).flip(0)[:3].tolist()
    assert top_eigenvalues(empirical_ntk(model, x), 3) == pytest.approx(eig, rel=1e-5)


def test_linear_model_has_a_constant_kernel_equal_to_its_closed_form():
    torch.manual_seed(0)
    model, x, y = nn.Linear(5, 4), torch.randn(12, 5), torch.randint(0, 4, (12,))
    theta0 = empirical_ntk(model, x)
    # f_k = w_k . x + b_k: grad of f_k is (x, 1) in the k-th row only, so Theta = K (x . x' + 1)
    torch.testing.assert_close(theta0, 4 * (x.double() @ x.double().T + 1), rtol=1e-5, atol=1e-5)  # float32 rows
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(5):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert torch.equal(empirical_ntk(model, x), theta0)
    assert relative_change(empirical_ntk(model, x), theta0) == 0.0


def kernel_change_after_training(alpha: float) -> float:
    """Relative kernel change of an output-scaled MLP after 50 full-batch SGD steps at one lr."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    model = OutputScale(mlp(64), alpha)
    loss = ScaledLoss(nn.CrossEntropyLoss(), alpha)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    record = NTKChange()
    for _ in range(50):
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()
    return record(model, x[:8])["ntk_relative_change"]


def test_kernel_moves_little_at_large_alpha_and_a_lot_at_small_alpha():
    lazy, lazier, feature = (kernel_change_after_training(a) for a in (10.0, 100.0, 0.1))
    assert lazier < lazy < 0.1  # lazy regime: small, and shrinking as alpha grows (~ 1/alpha)
    assert lazier < lazy / 5
    assert feature > 1.0  # feature regime: the kernel changes by more than its initial norm


def test_ntk_diagnostic_applies_to_output_scaled_models_only():
    assert NTKChange()(mlp(), torch.randn(3, 6)) == {}
    record = NTKChange(eigenvalues=2)(OutputScale(mlp(), 3.0), torch.randn(3, 6))
    assert record["ntk_relative_change"] == 0.0  # untrained: the network is its initial copy
    assert record["ntk_eigenvalue_1"] >= record["ntk_eigenvalue_2"] > 0


def test_memory_budget_is_checked_before_any_work():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.calls = nn.Linear(1000, 10), 0

        def forward(self, x):
            self.calls += 1
            return self.linear(x)

    model = Counting()
    assert buffer_bytes(model, 64) == 64 * 10010 * 4
    with pytest.raises(ValueError, match=r"64 samples .* max_memory_gb=0\.001; use at most 26 samples"):
        empirical_ntk(model, torch.randn(64, 1000), max_memory_gb=0.001)
    assert model.calls == 0
    empirical_ntk(model, torch.randn(26, 1000), max_memory_gb=0.001)
