"""Loss-landscape measurements of Sec. 6.3.2, the CNN -> eFCN interpolations of App. E.3, and the
local-energy curve around a solution (flatness under multiplicative weight noise, Baldassi et al.).

All functions take the data as a fixed (images, labels) pair of tensors and go through it in
batches, so the numbers are those of the full loss on that subset (no sampling noise). Models are
evaluated in eval mode (dropout off). Parameters are handled as {name: tensor} dicts and applied
with torch.func.functional_call, so a path of many points needs no model copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from convbias.base.errors import ConfigError

Params = dict[str, torch.Tensor]


@dataclass
class Batches:
    """A fixed labelled subset, iterated in batches."""

    images: torch.Tensor
    labels: torch.Tensor
    batch_size: int = 250

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        """(images, labels, fraction of the subset in this batch)."""
        n = len(self.labels)
        for start in range(0, n, self.batch_size):
            stop = min(n, start + self.batch_size)
            yield self.images[start:stop], self.labels[start:stop], (stop - start) / n


def parameters_of(model: nn.Module) -> Params:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def evaluate(model: nn.Module, data: Batches, params: Params | None = None) -> tuple[float, float]:
    """(mean cross-entropy, top-1 accuracy in %) of `model` (or `params` on its architecture)."""
    model.eval()
    loss = correct = 0.0
    for images, labels, weight in data:
        logits = model(images) if params is None else functional_call(model, params, (images,))
        loss += F.cross_entropy(logits, labels).item() * weight
        correct += (logits.argmax(1) == labels).float().mean().item() * weight
    return loss, 100.0 * correct


def _full_gradient(model: nn.Module, data: Batches, create_graph: bool = False) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for images, labels, weight in data:
        loss = F.cross_entropy(model(images), labels) * weight
        grads = torch.autograd.grad(loss, params, create_graph=create_graph)
        total = [t + g for t, g in zip(total, grads)]
    return total


def gradient_norm(model: nn.Module, data: Batches) -> float:
    """|grad L| of the mean training loss on `data`."""
    model.eval()
    grads = _full_gradient(model, data)
    return torch.sqrt(sum(g.double().square().sum() for g in grads)).item()


def top_hessian_eigenvalue(
    model: nn.Module, data: Batches, iterations: int = 20, seed: int = 0, tolerance: float = 1e-3
) -> float:
    """Largest-magnitude eigenvalue of the Hessian of the mean loss, by power iteration on
    Hessian-vector products (double backward through each batch)."""
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    vector = [torch.randn(p.shape, generator=generator).to(p) for p in params]
    eigenvalue = 0.0
    for _ in range(iterations):
        norm = torch.sqrt(sum(v.square().sum() for v in vector))
        vector = [v / norm for v in vector]
        product = [torch.zeros_like(p) for p in params]
        for images, labels, weight in data:
            loss = F.cross_entropy(model(images), labels) * weight
            grads = torch.autograd.grad(loss, params, create_graph=True)
            dot = sum((g * v).sum() for g, v in zip(grads, vector))
            product = [acc + h for acc, h in zip(product, torch.autograd.grad(dot, params))]
        new_eigenvalue = sum((h * v).sum() for h, v in zip(product, vector)).item()
        vector = product
        converged = abs(new_eigenvalue - eigenvalue) <= tolerance * abs(new_eigenvalue)
        eigenvalue = new_eigenvalue
        if converged:
            break
    return eigenvalue


def linear_path(start: Params, end: Params, alphas: list[float]) -> list[Params]:
    return [{k: torch.lerp(start[k], end[k], alpha) for k in start} for alpha in alphas]


def string_path(
    model: nn.Module,
    start: Params,
    end: Params,
    alphas: list[float],
    data: Batches,
    stiffness: float,
    steps: int,
    lr: float,
) -> list[Params]:
    """The string method of App. E.3: start from the linear path, then let the interior points
    descend sum_i L(x_i) + (k/2) sum_i ||x_{i+1} - x_i||^2 (Eq. E.1) by gradient descent, the
    endpoints fixed. One step = one pass over `data` (batches accumulated)."""
    model.eval()
    points = linear_path(start, end, alphas)
    interior = [{k: v.clone().requires_grad_(True) for k, v in p.items()} for p in points[1:-1]]
    optimizer = torch.optim.SGD([t for p in interior for t in p.values()], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        path = [points[0], *interior, points[-1]]
        elastic = (
            0.5 * stiffness * sum(sum((b[k] - a[k]).square().sum() for k in a) for a, b in itertools.pairwise(path))
        )
        elastic.backward()
        for images, labels, weight in data:
            loss = sum(F.cross_entropy(functional_call(model, p, (images,)), labels) for p in interior) * weight
            loss.backward()
        optimizer.step()
    return [points[0], *[{k: v.detach() for k, v in p.items()} for p in interior], points[-1]]


@torch.no_grad()
def evaluate_output_mixture(model_a: nn.Module, model_b: nn.Module, alpha: float, data: Batches) -> tuple[float, float]:
    """Interpolation in output space: the ensemble (1 - alpha) p_a + alpha p_b of the two models'
    predicted probabilities; returns (its cross-entropy, its top-1 accuracy in %)."""
    model_a.eval(), model_b.eval()
    loss = correct = 0.0
    for images, labels, weight in data:
        probs = torch.lerp(model_a(images).softmax(1), model_b(images).softmax(1), alpha)
        loss += F.nll_loss(probs.clamp_min(1e-12).log(), labels).item() * weight
        correct += (probs.argmax(1) == labels).float().mean().item() * weight
    return loss, 100.0 * correct


@torch.no_grad()
def local_energy(
    model: nn.Module, data: Batches, sigmas: Sequence[float], draws: int = 10, seed: int = 0
) -> list[tuple[float, float, float]]:
    """The local-energy curve around the solution `model` (Baldassi et al.; Geiger, Petrini & Wyart 2021, Sec. 5): training
    error (%) after multiplicative Gaussian weight noise w -> w (1 + sigma eps), eps ~ N(0, 1) drawn
    independently per weight, averaged over `draws` draws, for each sigma: [(sigma, mean, std)].

    A wide flat minimum keeps a low error up to larger sigma; the noise being relative, the curve does
    not depend on how each layer's weights are scaled. sigma = 0 gives the solution's own error. Only
    trainable parameters are perturbed (a frozen copy, as in `--output-scale` runs, stays as it is)."""
    if draws < 1 or any(not s >= 0 for s in sigmas):
        raise ConfigError(f"local_energy needs draws >= 1 and sigmas >= 0, got draws={draws}, sigmas={list(sigmas)}")
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}  # not a frozen f_w0
    generator = torch.Generator().manual_seed(seed)
    curve = []
    for sigma in sigmas:
        errors = []
        for _ in range(draws if sigma > 0 else 1):
            noisy = {k: v * (1 + sigma * torch.randn(v.shape, generator=generator).to(v)) for k, v in params.items()}
            errors.append(100.0 - evaluate(model, data, noisy)[1])
        curve.append((float(sigma), float(np.mean(errors)), float(np.std(errors))))
    return curve
