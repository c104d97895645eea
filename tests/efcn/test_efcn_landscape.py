"""Landscape measurements against exact oracles on a tiny eFCN (full Hessian, autograd gradient)."""

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.func import functional_call

import efcn
from convbias.evaluation import landscape


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    digits = load_digits()
    images = torch.tensor(digits.images[:60], dtype=torch.float32).unsqueeze(1) / 16
    images = F.avg_pool2d(images, 2)  # 4x4 digits keep the full Hessian small
    data = landscape.Batches(images, torch.tensor(digits.target[:60]), batch_size=25)
    cnn = efcn.VanillaCNN(channels=2, in_chans=1, img_size=4, depth=1).eval()
    return efcn.embed(cnn, (1, 4, 4)).eval(), data


def _loss_of(model, data):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]

    def loss(flat):
        params, start = {}, 0
        for name, shape in zip(names, shapes):
            params[name] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return F.cross_entropy(functional_call(model, params, (data.images,)), data.labels)

    return loss, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_gradient_norm_and_top_hessian_eigenvalue_match_exact_values(tiny):
    model, data = tiny
    loss, flat = _loss_of(model, data)
    exact_grad = torch.autograd.functional.jacobian(loss, flat)
    assert landscape.gradient_norm(model, data) == pytest.approx(exact_grad.norm().item(), rel=1e-4)
    hessian = torch.autograd.functional.hessian(loss, flat)
    eigenvalues = torch.linalg.eigvalsh(hessian.double())
    top = eigenvalues[eigenvalues.abs().argmax()].item()
    estimate = landscape.top_hessian_eigenvalue(model, data, iterations=300, tolerance=1e-7)
    assert estimate == pytest.approx(top, rel=2e-2)


def test_interpolation_paths(tiny):
    model, data = tiny
    start = landscape.parameters_of(model)
    end = {k: v + 0.05 * torch.randn_like(v) for k, v in start.items()}
    alphas = [0.0, 0.5, 1.0]
    linear = landscape.linear_path(start, end, alphas)
    torch.testing.assert_close(
        linear[1]["layers.conv1.weight"], (start["layers.conv1.weight"] + end["layers.conv1.weight"]) / 2
    )
    # a very stiff string stays on the straight line; a slack one lowers the loss of its interior point
    stiff = landscape.string_path(model, start, end, alphas, data, stiffness=1e4, steps=5, lr=1e-5)
    torch.testing.assert_close(stiff[1]["layers.conv1.weight"], linear[1]["layers.conv1.weight"], atol=1e-4, rtol=0)
    slack = landscape.string_path(model, start, end, alphas, data, stiffness=0.0, steps=10, lr=0.5)
    assert landscape.evaluate(model, data, slack[1])[0] < landscape.evaluate(model, data, linear[1])[0]
    for path in (stiff, slack):
        assert all(torch.equal(path[i][k], linear[i][k]) for i in (0, -1) for k in start)
    # output-space interpolation at the endpoints is the model itself
    other = efcn.embed(efcn.VanillaCNN(channels=2, in_chans=1, img_size=4, depth=1), (1, 4, 4))
    loss, acc = landscape.evaluate(model, data)
    mixed_loss, mixed_acc = landscape.evaluate_output_mixture(model, other, 0.0, data)
    assert mixed_loss == pytest.approx(loss, rel=1e-5) and mixed_acc == pytest.approx(acc)
