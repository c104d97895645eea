"""The empirical neural tangent kernel on a fixed batch, and how far it moves during training.

    Theta(x, x') = sum_k  grad_w f_k(x) . grad_w f_k(x')        (contraction over logits: the trace)

over the trainable parameters w; for a scalar output it is the usual NTK (Jacot et al. 2018). The trace
is the contraction Geiger, Petrini & Wyart (*Landscape and training regimes in deep learning*, Physics
Reports 2021) use for multi-class outputs; it is basis-independent over logits and gives a kernel with
the same units as the scalar one.

Memory: the per-sample gradients are computed one logit at a time into an (n, params) buffer, whose
Gram product is added to Theta; no (n * K, params) Jacobian is ever held. The buffer is the peak:
n * params * 4 bytes (64 samples of ConViT-Ti: 1.4 GB), checked against ``max_memory_gb`` before any
work. Gradients come from ``torch.autograd.grad`` per sample (model in eval mode): this works for any
module, including custom autograd Functions that torch.func's vmap cannot batch (the GPSA hot path).

The relative change ||Theta_t - Theta_0||_F / ||Theta_0||_F (Frobenius norm over the batch, as in their
Sec. 5) is small (<< 1) in the lazy regime and of order one or larger in the feature regime.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from convbias.base.errors import ConfigError
from convbias.engine import OutputScale

BYTES_PER_VALUE = 4  # per-sample gradients are kept in float32


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def buffer_bytes(model: nn.Module, num_samples: int, names: Sequence[str] | None = None) -> int:
    """Peak extra memory of `empirical_ntk`: one float32 gradient row per sample."""
    names = set(trainable_names(model) if names is None else names)
    count = sum(p.numel() for name, p in model.named_parameters() if name in names)
    return num_samples * count * BYTES_PER_VALUE


@contextlib.contextmanager
def _differentiable(params: list[torch.Tensor]) -> Iterator[None]:
    """Temporarily let autograd reach `params` (the frozen copy of a model at initialization has none)."""
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in zip(params, before):
            p.requires_grad_(flag)


def empirical_ntk(
    model: nn.Module, images: torch.Tensor, names: Sequence[str] | None = None, max_memory_gb: float | None = None
) -> torch.Tensor:
    """Theta on `images` as an (n, n) float64 tensor, trace-contracted over the output's logits.

    names: the parameters to differentiate (default: the trainable ones); max_memory_gb: refuse, before
    any work, a batch whose per-sample gradient buffer would exceed this many GiB."""
    if not isinstance(images, torch.Tensor) or images.ndim < 1 or len(images) == 0:
        raise ValueError(f"images must be a non-empty batch tensor, got {type(images).__name__}")
    names = trainable_names(model) if names is None else list(names)
    named = dict(model.named_parameters())
    missing = [name for name in names if name not in named]
    if missing or not names:
        raise ValueError(f"NTK parameters not in the model: {missing[:3] or 'none selected'}")
    n = len(images)
    need = buffer_bytes(model, n, names)
    if max_memory_gb is not None and need > max_memory_gb * 2**30:
        raise ConfigError(
            f"NTK of {n} samples over {need // (n * BYTES_PER_VALUE)} parameters needs "
            f"{need / 2**30:.2f} GiB of per-sample gradients, over max_memory_gb={max_memory_gb}; "
            f"use at most {int(max_memory_gb * 2**30 // (need // n))} samples"
        )
    params = [named[name] for name in names]
    was_training = model.training
    model.eval()
    theta = torch.zeros(n, n, dtype=torch.float64, device=images.device)
    rows = torch.empty(n, need // (n * BYTES_PER_VALUE), dtype=torch.float32, device=images.device)
    try:
        with torch.enable_grad(), _differentiable(params):
            logits = model(images[:1]).reshape(-1).numel()
            for k in range(logits):
                for i in range(n):
                    output = model(images[i : i + 1]).reshape(-1)[k]
                    grads = torch.autograd.grad(output, params, allow_unused=True)
                    torch.cat(
                        [
                            torch.zeros(p.numel(), device=p.device) if g is None else g.reshape(-1)
                            for p, g in zip(params, grads)
                        ],
                        out=rows[i],
                    )
                theta += (rows @ rows.T).double()
    finally:
        model.train(was_training)
    return theta


def relative_change(theta: torch.Tensor, theta0: torch.Tensor) -> float:
    """||Theta - Theta_0||_F / ||Theta_0||_F."""
    if theta.shape != theta0.shape:
        raise ValueError(f"kernels of different batches: {tuple(theta.shape)} vs {tuple(theta0.shape)}")
    return (torch.linalg.matrix_norm(theta - theta0) / torch.linalg.matrix_norm(theta0)).item()


def top_eigenvalues(theta: torch.Tensor, k: int = 5) -> list[float]:
    """The k largest eigenvalues of the (symmetric, positive semi-definite) kernel, largest first."""
    values = torch.linalg.eigvalsh(0.5 * (theta + theta.T))
    return values.flip(0)[:k].tolist()


class NTKChange:
    """Engine diagnostic `ntk` for models trained with ``--output-scale``: the kernel of the current
    network against that of its frozen copy at initialization (both over the trainable parameters).

    Returns {} for any other model (there is no initial network to compare with). Theta_0 is computed
    once per run and cached."""

    def __init__(self, max_memory_gb: float | None = None, eigenvalues: int = 1):
        self.max_memory_gb = max_memory_gb
        self.eigenvalues = eigenvalues
        self._initial: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, model: nn.Module, images: torch.Tensor) -> dict[str, float]:
        if not isinstance(model, OutputScale):
            return {}
        names = trainable_names(model.model)
        theta = empirical_ntk(model.model, images, names, self.max_memory_gb)
        theta0 = self._initial.get(model.initial)
        if theta0 is None or theta0.shape != theta.shape:
            theta0 = self._initial[model.initial] = empirical_ntk(model.initial, images, names, self.max_memory_gb)
        record = {"ntk_relative_change": relative_change(theta, theta0)}
        for i, value in enumerate(top_eigenvalues(theta, self.eigenvalues)):
            record[f"ntk_eigenvalue_{i + 1}"] = value
        return record
